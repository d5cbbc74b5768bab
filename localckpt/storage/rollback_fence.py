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
from pathlib import Path

from ..errors import CorruptShardError
from .fsutil import fsync_dir

FENCE_NAME = "rollback-fence.json"  # no iteration, leftover or session directory looks so

Fence = tuple[int, int | None]  # (rollback's iteration, world size or None: every one)


def read_fence(session_path: Path) -> Fence | None:
    """(N, world size or None for every world size) of the fence in ``session_path``, or None.
    CorruptShardError naming the file when it exists but cannot be read or is malformed."""
    path = session_path / FENCE_NAME
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
            data = f.read(4096)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CorruptShardError(f"{path}: the fence of an unfinished rollback cannot be read "
                                f"({exc}); until it is, no listing of this root is safe") from exc
    try:
        doc = json.loads(data)
        iteration, world = doc["rollback_to"], doc["world_size"]
        if doc.get("version") != 1 or type(iteration) is not int or iteration < 0 or not (
                world is None or (type(world) is int and world >= 1)):
            raise ValueError(f"unexpected fields {doc!r}")
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptShardError(
            f"{path}: malformed fence of an unfinished rollback ({exc}); remove it only once "
            "every shard newer than the rollback's iteration is gone from this root") from None
    return iteration, world


def hidden(fence: Fence | None, iteration: int, world_size: int) -> bool:
    """Whether ``fence`` hides a shard of (iteration, world size)."""
    return fence is not None and iteration > fence[0] and fence[1] in (None, world_size)


def merged(a: Fence | None, b: Fence) -> Fence:
    """One fence hiding at least what ``a`` and ``b`` hide (the lower iteration; every world
    size unless both name the same)."""
    if a is None:
        return b
    return min(a[0], b[0]), a[1] if a[1] == b[1] else None


def write_fence(session_path: Path, iteration: int, world_size: int | None, tag: str) -> None:
    """Write the fence of a rollback to ``iteration`` durably, merged with one already there
    (an earlier rollback not finished: it still hides what it hid); ranks sharing a root
    write the same one, ``tag`` keeps their temporary files apart."""
    session_path.mkdir(parents=True, exist_ok=True)
    iteration, world_size = merged(read_fence(session_path), (iteration, world_size))
    tmp = session_path / f".tmp-fence-{tag}"
    body = json.dumps({"version": 1, "rollback_to": iteration, "world_size": world_size})
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
