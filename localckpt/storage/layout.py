"""Where shards live under a node-local root, and what a listing sees (see docs/format.md)::

    <root>/<session>/iter_<iteration:010d>/rank_<owner:05d>_of_<world:05d>/
    <root>/<session>/iter_<iteration:010d>/parity_<stripe:05d>_<block:02d>_of_<world:05d>/

A parity block of an erasure-coded stripe is stored like a shard and listed under its slot
(:func:`replication.parity_slot`, an owner id below zero).

Only these fixed-width names are committed shards; ``.tmp-*`` and ``.trash-*`` are crash
leftovers of a writer, ``.quarantine-*`` copies that failed verification. Listing never opens a
file and never follows a symbolic link.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from replication import parity_of_slot, parity_slot

from ..errors import ConfigurationError
from .rollback_fence import DONE_NAME, FENCE_NAME, hidden, read_done, read_fence, unfinished

_SESSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# ASCII digits only: \d and int() also take other scripts' digits, which would list a directory
# under a number whose own path (path_of) is another name.
_ITER_RE = re.compile(r"iter_([0-9]{10})")
_SHARD_RE = re.compile(r"rank_([0-9]{5})_of_([0-9]{5})")
_PARITY_RE = re.compile(r"parity_([0-9]{5})_([0-9]{2})_of_([0-9]{5})")
#: The directory names have fixed widths (listing matches them exactly): 10 digits of iteration,
#: 5 of rank and world size.
MAX_ITERATION = 10**10 - 1
RECYCLE_DIR = ".recycle"  # a session's pool of retired chunk files (see storage/recycle.py)
MAX_WORLD_SIZE = 10**5 - 1
_DEFAULT_SESSION_DIR = "_default"  # session "" (a leading '_' is not a valid session id)


@dataclass(frozen=True, order=True)
class ShardRef:
    """A committed shard (or parity block: ``owner_rank`` is its slot, below zero) on this node:
    checkpoint id plus where it lives."""

    iteration: int
    owner_rank: int
    world_size: int
    path: Path


def parse_shard_name(name: str) -> tuple[int, int] | None:
    """(owner, world size) of a shard directory's (or object prefix's) name as a job writes it,
    ``rank_<owner:05d>_of_<world:05d>`` with ASCII digits and owner < world; else None."""
    if (m := _SHARD_RE.fullmatch(name)) and int(m[1]) < int(m[2]):
        return int(m[1]), int(m[2])
    return None


def session_dir(root: Path, session_id: str) -> Path:
    """``root/<session>``; raises ConfigurationError for a session id that is not a safe name."""
    if session_id == "":
        return root / _DEFAULT_SESSION_DIR
    if not _SESSION_RE.fullmatch(session_id):
        raise ConfigurationError(
            "session_id: expected 1-128 characters of [A-Za-z0-9._-] not starting with '.', "
            f"'-' or '_', got {session_id!r}"
        )
    return root / session_id


# An empty file in a committed shard's data directory naming the save that wrote it (its
# manifest's save_id): a load compares the saves of every copy without parsing manifests.
_SAVE_MARKER_RE = re.compile(r"save-([0-9a-f]{1,64})")


def save_marker(save_id: object) -> str | None:
    """The name of the marker of save ``save_id`` (None for one that cannot name a file)."""
    if type(save_id) is str and _SAVE_MARKER_RE.fullmatch(f"save-{save_id}"):
        return f"save-{save_id}"
    return None


def saves_marked(shard: Path) -> list[str]:
    """The saves the markers in the directory of ``shard`` name (none for a shard written
    before markers, or gone)."""
    return sorted(m[1] for e in _scandir(shard / "data")
                  if (m := _SAVE_MARKER_RE.fullmatch(e.name)))


def drop_other_markers(shard: Path, save_id: str) -> list[str]:
    """Remove from the directory of ``shard`` the markers of saves other than ``save_id`` (its
    manifest's): what a copy restored by hand into a directory that held another save's copy
    leaves (``cp -a``). Returns the saves whose markers went; raises OSError when one cannot
    be removed."""
    dropped = [s for s in saves_marked(shard) if s != save_id]
    for save in dropped:
        (shard / "data" / f"save-{save}").unlink(missing_ok=True)
    return dropped


def shard_path(root: Path, session_id: str, iteration: int, owner: int, world_size: int) -> Path:
    """Where shard (iteration, owner, world_size) lives, or the parity block whose slot
    ``owner`` is; raises ValueError for numbers that do not fit the fixed-width names (a
    directory nothing would list, or ever remove)."""
    if not 0 <= iteration <= MAX_ITERATION:
        raise ValueError(f"iteration: expected 0 <= iteration <= {MAX_ITERATION} (10 digits in "
                         f"the directory name), got {iteration}")
    if owner < 0 and 1 <= world_size <= MAX_WORLD_SIZE:
        stripe, block = parity_of_slot(owner)
        if stripe < world_size:
            return (session_dir(root, session_id) / f"iter_{iteration:010d}"
                    / f"parity_{stripe:05d}_{block:02d}_of_{world_size:05d}")
    if not (1 <= world_size <= MAX_WORLD_SIZE and 0 <= owner < world_size):
        raise ValueError(f"rank {owner} of world size {world_size}: expected 0 <= rank < world "
                         f"size <= {MAX_WORLD_SIZE} (5 digits in the directory name)")
    return (session_dir(root, session_id) / f"iter_{iteration:010d}"
            / f"rank_{owner:05d}_of_{world_size:05d}")


def iteration_dir(root: Path, session_id: str, iteration: int) -> Path:
    """The directory of ``iteration``'s shards (see :func:`shard_path`)."""
    return shard_path(root, session_id, iteration, 0, 1).parent


def list_iterations(root: Path, session_id: str) -> list[int]:
    """Iterations with a directory under ``root`` (committed shards or not), sorted."""
    return sorted(int(m[1]) for e in _scandir(session_dir(root, session_id))
                  if (m := _ITER_RE.fullmatch(e.name)) and e.is_dir(follow_symlinks=False))


def list_shards(root: Path, session_id: str, fenced: bool = True) -> list[ShardRef]:
    """Committed shards and parity blocks of ``session_id`` under ``root``, sorted, but for
    those the fence of an unfinished rollback hides (see :mod:`.rollback_fence`; all of them
    with ``fenced=False``). Never raises for a missing root or stray files (CorruptShardError
    for a fence that cannot be read); ignores temporary and trash directories, and names no
    job writes (a rank not below its world size: nothing could address, or remove, it)."""
    out = []
    base = session_dir(root, session_id)
    fence = read_fence(base) if fenced else None
    if fence is not None:  # not the shards saved after a rollback this root finished
        fence = unfinished(fence, read_done(base))
    for it_entry in _scandir(base):
        m = _ITER_RE.fullmatch(it_entry.name)
        if not m or not it_entry.is_dir(follow_symlinks=False):
            continue
        for entry in _scandir(Path(it_entry.path)):
            if not entry.is_dir(follow_symlinks=False):
                continue
            if shard := parse_shard_name(entry.name):
                out.append(ShardRef(int(m[1]), *shard, Path(entry.path)))
            elif (p := _PARITY_RE.fullmatch(entry.name)) and int(p[1]) < int(p[3]):
                out.append(ShardRef(int(m[1]), parity_slot(int(p[1]), int(p[2])), int(p[3]),
                                    Path(entry.path)))
    if fence is not None:
        out = [r for r in out if not hidden(fence, r.iteration, r.world_size)]
    return sorted(out)


def _real_dir(path: Path) -> bool:
    """Whether ``path`` is a directory itself, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _scandir(path: Path) -> Iterator[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            yield from it
    except (FileNotFoundError, NotADirectoryError):
        return


def holds_checkpoints(session_path: Path) -> bool:
    """Whether ``session_path`` holds anything localckpt writes: an iteration directory, a
    rollback fence or record, a leftover of its own naming, or a pool of recycled files."""
    return any(_ITER_RE.fullmatch(e.name) or e.name in (FENCE_NAME, DONE_NAME)
               or _SESSION_TRASH_RE.fullmatch(e.name) or _QUARANTINE_RE.fullmatch(e.name)
               for e in _scandir(session_path)) or (
                   _real_dir(session_path / RECYCLE_DIR) and any(
                       _POOL_FILE_RE.fullmatch(e.name)
                       for e in _scandir(session_path / RECYCLE_DIR)))


def list_sessions(root: Path) -> list[str]:
    """Session ids with a directory under ``root`` ("" for the default session). Other entries
    (``lost+found`` on a file system's root, stray files, symbolic links) are skipped."""
    out = []
    for e in _scandir(root):
        if not e.is_dir(follow_symlinks=False):
            continue
        if e.name == _DEFAULT_SESSION_DIR:
            out.append("")
        elif _SESSION_RE.fullmatch(e.name):
            out.append(e.name)
    return sorted(out)


# What localckpt hides in a session directory: a shard's, a fence's or a durable iteration's
# deletion, a shard set aside. Only these names are ever removed there: an operator command
# given the wrong directory must not take a Samba ``.recycle`` or someone's ``.trash-old``.
_SESSION_TRASH_RE = re.compile(
    r"\.trash-(?:iter_[0-9]{10}-.+-w[0-9]{5}-[0-9a-f]{12}"
    r"|(?:fence|done)-w[0-9]{5}-[0-9a-f]{32}|durable-[0-9a-f]{32})")
_WRITER_RE = re.compile(r"-w([0-9]{5})-")
_QUARANTINE_RE = re.compile(r"\.quarantine-iter_[0-9]{10}-.+-w[0-9]{5}-[0-9a-f]{12}")
_POOL_FILE_RE = re.compile(r"[0-9]{20}-[0-9a-f]{12}|\.part-[0-9a-f]{32}")


def _pool_of_ours(session_path: Path) -> bool:
    """Whether the session's ``.recycle`` is a directory itself holding only pool files."""
    pool_dir = session_path / RECYCLE_DIR
    return _real_dir(pool_dir) and all(_POOL_FILE_RE.fullmatch(e.name)
                                       for e in _scandir(pool_dir))


def find_leftovers(session_path: Path, writer_rank: int | None = None,
                   keep_recycled: bool = False) -> list[Path]:
    """The temporary and trash directories (crash leftovers) of ``writer_rank`` (None: of every
    writer, and the pool of recycled chunk files unless ``keep_recycled``) under
    ``session_path``."""
    tag = "" if writer_rank is None else f"-w{writer_rank:05d}-"
    pool_dir = session_path / RECYCLE_DIR
    in_session = [Path(e.path) for e in _scandir(session_path)
                  if tag in e.name and _SESSION_TRASH_RE.fullmatch(e.name)]
    if writer_rank is None and not keep_recycled and _real_dir(pool_dir):  # never via a link
        # the pool whole, or its files where it holds something else too (not ours to take)
        in_session += [pool_dir] if _pool_of_ours(session_path) else [
            Path(e.path) for e in _scandir(pool_dir) if _POOL_FILE_RE.fullmatch(e.name)]
    if writer_rank is None and keep_recycled and _real_dir(pool_dir):
        # files a crash left half-made in the pool (never through a link: not ours)
        in_session += [Path(e.path) for e in _scandir(pool_dir) if e.name.startswith(".part-")]
    return in_session + [Path(entry.path) for it_entry in _scandir(session_path)
                         if _ITER_RE.fullmatch(it_entry.name)
                         and it_entry.is_dir(follow_symlinks=False)  # never out of the root
                         for entry in _scandir(Path(it_entry.path))
                         if entry.name.startswith((".tmp-", ".trash-")) and tag in entry.name]


def find_quarantined(session_path: Path) -> list[Path]:
    """Quarantined shards (see :meth:`ShardStore.quarantine`) under ``session_path``."""
    return sorted(Path(e.path) for e in _scandir(session_path)
                  if _QUARANTINE_RE.fullmatch(e.name))


def remove_leftovers(session_path: Path, writer_rank: int | None,
                     keep_recycled: bool = False) -> list[Path]:
    """Delete :func:`find_leftovers` and then empty iteration directories. Every writer's are
    only safe to remove while no rank of the job can be writing (before the manager's first
    collective completes). Tolerates ranks of one node doing this at the same time."""
    removed = find_leftovers(session_path, writer_rank, keep_recycled)
    remove_paths(session_path, removed)
    return removed


def trash_name(path: Path, writer_rank: int) -> Path:
    """Where a shard directory ``<session>/<iteration>/<shard>`` is renamed to before it is
    deleted: the session directory, so its iteration directory can go at once."""
    return path.parent.parent / (f".trash-{path.parent.name}-{path.name}-w{writer_rank:05d}-"
                                 f"{uuid.uuid4().hex[:12]}")


def remove_paths(session_path: Path, paths: list[Path]) -> None:
    """Delete ``paths``, then the session's empty iteration directories (a writer that loses
    its new, still empty iteration directory to this retries: see ShardWriter).

    A shard's temporary directory is claimed by a rename before anything in it is deleted: a
    deletion works through an open handle, so one that began before its writer (another
    process of the session on this node) renamed it into place would go on inside the
    committed shard. Claimed first, the writer's commit fails loudly instead, or, committed
    first, the directory is not this call's to delete."""
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            if path.name.startswith(".tmp-"):
                writer = _WRITER_RE.search(path.name)
                claimed = trash_name(path, int(writer.group(1)) if writer else 0)
                try:
                    os.rename(path, claimed)
                except OSError:  # committed, or claimed by another cleanup meanwhile
                    continue
                path = claimed
            shutil.rmtree(path, ignore_errors=True)
        else:  # a file (a rollback fence half written)
            with contextlib.suppress(OSError):
                path.unlink()
    for it_entry in _scandir(session_path):
        if _ITER_RE.fullmatch(it_entry.name):
            remove_if_empty(Path(it_entry.path))


def remove_if_empty(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not empty, or already gone
        directory.rmdir()
