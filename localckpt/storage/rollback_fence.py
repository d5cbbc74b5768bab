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
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

from ..errors import CorruptShardError
from .fsutil import fsync_dir

FENCE_NAME = "rollback-fence.json"  # no iteration, leftover or session directory looks so

# One (N, W) per world size a rollback ran at, W None for every world size (a resharding job's
# lineage): a shard of (iteration, world size) is hidden when one entry hides it. Sorted, one
# entry per W (the lowest N): fences of rollbacks at different world sizes never widen.
Fence = tuple[tuple[int, int | None], ...]


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
        if type(doc) is not dict or doc.get("version") != 1:
            raise ValueError(f"unexpected document {str(doc)[:200]}")
        return fence_of(doc["rollback_to"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptShardError(
            f"{path}: malformed fence of an unfinished rollback ({exc}); remove it only once "
            "every shard newer than the rollback's iteration is gone from this root") from None


def fence_of(entries: Any) -> Fence:
    """The fence of JSON ``[[N, W or null], ...]`` (ValueError, TypeError otherwise)."""
    out: list[tuple[int, int | None]] = []
    for n, w in entries:
        if type(n) is not int or n < 0 or not (w is None or (type(w) is int and w >= 1)):
            raise ValueError(f"fence entry {[n, w]!r}")
        out.append((n, w))
    if not out:
        raise ValueError("a fence with no entry")
    return merged(None, tuple(out))


def hidden(fence: Fence | None, iteration: int, world_size: int) -> bool:
    """Whether ``fence`` hides a shard of (iteration, world size)."""
    return fence is not None and any(iteration > n and w in (None, world_size)
                                     for n, w in fence)


def merged(a: Fence | None, b: Fence) -> Fence:
    """One fence hiding exactly what ``a`` or ``b`` hides."""
    lowest: dict[int | None, int] = {}
    for n, w in (*(a or ()), *b):
        lowest[w] = min(n, lowest.get(w, n))
    return tuple(sorted(((n, w) for w, n in lowest.items()), key=lambda e: (e[1] or 0, e[0])))


def lowest(fence: Fence) -> int:
    """The iteration of the oldest rollback ``fence`` holds (for messages)."""
    return min(n for n, _ in fence)


def write_fence(session_path: Path, fence: Fence, tag: str, merge: bool = True) -> None:
    """Write ``fence`` durably, merged with one already there unless ``merge`` is False (an
    earlier rollback not finished: it still hides what it hid); ranks sharing a root write
    the same one, ``tag`` keeps their temporary files apart."""
    session_path.mkdir(parents=True, exist_ok=True)
    if merge:
        fence = merged(read_fence(session_path), fence)
    # a writer's crash leftover (find_leftovers), if it is killed before the rename
    tmp = session_path / f".trash-fence-{tag}-{uuid.uuid4().hex}"
    body = json.dumps({"version": 1, "rollback_to": [list(e) for e in fence]})
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, body.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, session_path / FENCE_NAME)
    fsync_dir(session_path)


def remove_fence(session_path: Path) -> None:
    """Remove the fence (gone already is fine), durably."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(session_path / FENCE_NAME)
        fsync_dir(session_path)
