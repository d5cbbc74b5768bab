"""A rollback's fence: what makes ``load(iteration=N, discard_newer=True)`` all or nothing.

A rollback deletes every newer iteration on every node, one root at a time; a node that dies
part way would keep newer shards, and a restart would take the discarded iteration back. So
before any rank deletes anything, every rank writes this fence into its root's session
directory (agreed: all ranks wrote theirs, or none deletes), and from then on no listing of that
root shows a shard newer than N (of the fence's world size, or of any). A root's fence goes
once the shards it hides are deleted, which every rank tries again before its next save writes
anything (the save's own shards are newer than N: they must not be hidden). A root on which a
rollback stopped half way therefore shows no newer shard, whatever happened to the others.

The fence is a small JSON file written atomically (temporary file, fsync, rename, fsync of the
directory); one that cannot be read back is an error naming it, never a fence ignored.

A stale fence: a node away while the rest of the job finished the rollback and saved newer
iterations comes back with its fence. Each rollback has an id (its time first: ids sort by
age), in its fence's entries; a root that finished it records it with its N and W
(:data:`DONE_NAME`, the newest :data:`DONE_KEPT`), and a fence never hides the shards of a
root that finished its rollback: they were saved after it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import CorruptShardError
from .fsutil import fsync_dir

FENCE_NAME = "rollback-fence.json"  # no iteration, leftover or session directory looks so
DONE_NAME = "rollbacks-done.json"  # ids of the rollbacks this root finished
DONE_KEPT = 8  # ids kept (every inventory carries them): a fence of an older rollback
# hides as if no root finished it

# One (N, W, id) per world size and rollback, W None for every world size (a resharding job's
# lineage), id None for a fence written before rollbacks had ids: a shard of (iteration, world
# size) is hidden when one entry hides it. Sorted, one entry per (W, id) (the lowest N): fences
# of rollbacks at different world sizes never widen.
Fence = tuple[tuple[int, int | None, str | None], ...]
# A rollback a root finished: (id, N, W).
Done = tuple[str, int, int | None]


def new_rollback_id() -> str:
    """A rollback's id: milliseconds since the epoch (fixed width: ids sort by age), then
    random hex."""
    return f"{int(time.time() * 1000):012x}{uuid.uuid4().hex[:8]}"


def read_fence(session_path: Path) -> Fence | None:
    """The fence in ``session_path``, or None. CorruptShardError naming the file when it exists
    but cannot be read or is malformed."""
    path = session_path / FENCE_NAME
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
            data = f.read(1 << 16)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CorruptShardError(f"{path}: the fence of an unfinished rollback cannot be read "
                                f"({exc}); until it is, no listing of this root is safe") from exc
    try:
        doc = json.loads(data)
        if type(doc) is not dict or doc.get("version") not in (1, 2):
            raise ValueError(f"unexpected document {str(doc)[:200]}")
        return fence_of(doc["rollback_to"])
    except (ValueError, KeyError, TypeError, RecursionError) as exc:  # Recursion: deep nesting
        raise CorruptShardError(
            f"{path}: malformed fence of an unfinished rollback ({exc}); remove it only once "
            "every shard newer than the rollback's iteration is gone from this root") from None


def fence_of(entries: Any) -> Fence:
    """The fence of JSON ``[[N, W or null, id or null], ...]`` (or ``[N, W]``, written before
    rollbacks had ids; ValueError, TypeError otherwise)."""
    out: list[tuple[int, int | None, str | None]] = []
    for entry in entries:
        n, w, rid = (*entry, None) if len(entry) == 2 else entry
        if type(n) is not int or n < 0 or not (w is None or (type(w) is int and w >= 1)) \
                or not (rid is None or (type(rid) is str and 0 < len(rid) <= 64)):
            raise ValueError(f"fence entry {entry!r}")
        out.append((n, w, rid))
    if not out:
        raise ValueError("a fence with no entry")
    return merged(None, tuple(out))


def hidden(fence: Fence | None, iteration: int, world_size: int) -> bool:
    """Whether ``fence`` hides a shard of (iteration, world size)."""
    return fence is not None and any(iteration > n and w in (None, world_size)
                                     for n, w, _ in fence)


def merged(a: Fence | None, b: Fence) -> Fence:
    """One fence hiding exactly what ``a`` or ``b`` hides."""
    lowest: dict[tuple[int | None, str | None], int] = {}
    for n, w, rid in (*(a or ()), *b):
        lowest[(w, rid)] = min(n, lowest.get((w, rid), n))
    return tuple(sorted(((n, w, rid) for (w, rid), n in lowest.items()),
                        key=lambda e: (e[1] or 0, e[0], e[2] or "")))


def unfinished(fence: Fence | None, done: Iterable[Done]) -> Fence | None:
    """``fence`` without the entries of rollbacks in ``done`` (finished on the root whose
    shards are looked at: what it holds above N was saved after), or None."""
    if fence is None:
        return None
    finished = {d[0] for d in done}
    left = tuple(e for e in fence if e[2] is None or e[2] not in finished)
    return left or None


def ids_of(fence: Fence | None) -> list[str]:
    """The ids of the rollbacks ``fence`` holds."""
    return sorted({rid for _, _, rid in fence or () if rid is not None})


def lowest(fence: Fence) -> int:
    """The iteration of the oldest rollback ``fence`` holds (for messages)."""
    return min(n for n, _, _ in fence)


def write_fence(session_path: Path, fence: Fence, tag: str, merge: bool = True) -> None:
    """Write ``fence`` durably, merged with one already there unless ``merge`` is False (an
    earlier rollback not finished: it still hides what it hid); ranks sharing a root write
    the same one, ``tag`` keeps their temporary files apart."""
    session_path.mkdir(parents=True, exist_ok=True)
    if merge:
        fence = merged(read_fence(session_path), fence)
    version = 2 if ids_of(fence) else 1  # as an older reader expects, where it can
    entries = [list(e) if e[2] is not None else list(e[:2]) for e in fence]
    _write_atomically(session_path, FENCE_NAME, {"version": version, "rollback_to": entries},
                      f"fence-{tag}")


def _write_atomically(session_path: Path, name: str, doc: dict[str, Any], tag: str) -> None:
    # a writer's crash leftover (find_leftovers), if it is killed before the rename
    tmp = session_path / f".trash-{tag}-{uuid.uuid4().hex}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, json.dumps(doc).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, session_path / name)
    fsync_dir(session_path)


def remove_fence(session_path: Path) -> None:
    """Remove the fence (gone already is fine), durably."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(session_path / FENCE_NAME)
        fsync_dir(session_path)


def _done_entries(doc: Any) -> list[Done]:
    """The entries of a record (ValueError for anything else)."""
    if type(doc) is not dict or doc.get("version") != 1 or type(doc.get("done")) is not list:
        raise ValueError(f"unexpected document {str(doc)[:200]}")
    out = []
    for e in doc["done"]:
        if not (type(e) is list and len(e) == 3 and type(e[0]) is str and 0 < len(e[0]) <= 64
                and type(e[1]) is int and e[1] >= 0
                and (e[2] is None or (type(e[2]) is int and e[2] >= 1))):
            raise ValueError(f"entry {str(e)[:100]}")
        out.append((e[0], e[1], e[2]))
    return out


def read_done(session_path: Path) -> frozenset[Done]:
    """The rollbacks finished on this root (none without a record). CorruptShardError naming
    the file when it exists but cannot be read or is malformed: taken for no record, a fence
    of one of them would hide, and the next save delete, what this root saved after it."""
    path = session_path / DONE_NAME
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
            data = f.read(1 << 16)
    except FileNotFoundError:
        return frozenset()
    except OSError as exc:
        raise CorruptShardError(f"{path}: the record of the rollbacks this root finished "
                                f"cannot be read ({exc})") from exc
    try:
        return frozenset(_done_entries(json.loads(data)))
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CorruptShardError(
            f"{path}: malformed record of the rollbacks this root finished ({exc}); remove "
            "it only once no node holds a rollback fence of this session") from None


def record_done(session_path: Path, done: Iterable[Done], tag: str) -> None:
    """Add ``done`` to this root's finished rollbacks, keeping the newest :data:`DONE_KEPT`
    (by id: by age), durably; nothing is written when that changes nothing (an older one
    than those kept included). OSError when it cannot be written."""
    before = read_done(session_path)
    by_id = {d[0]: d for d in (*before, *done)}
    kept = frozenset(by_id[i] for i in sorted(by_id)[-DONE_KEPT:])
    if kept == before:
        return
    session_path.mkdir(parents=True, exist_ok=True)
    _write_atomically(session_path, DONE_NAME,
                      {"version": 1, "done": [list(d) for d in sorted(kept)]}, f"done-{tag}")


def finished_by(fence: Fence | None) -> list[Done]:
    """What finishing the rollbacks of ``fence`` records."""
    return sorted({(rid, n, w) for n, w, rid in fence or () if rid is not None})
