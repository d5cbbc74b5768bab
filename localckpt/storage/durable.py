"""The durable tier: a directory on a shared file system (Lustre, GPFS, NFS) that every rank sees.

It holds shards in the same layout and format as a node root (a zarr v3 group per shard, each
chunk checksummed, committed by rename), written by the same :class:`ShardStore`, plus one file
per iteration that commits the whole job's copy::

    <durable root>/<session>/iter_<iteration>/rank_<owner>_of_<world>/   each rank's shard
    <durable root>/<session>/iter_<iteration>/COMMITTED-<world>.json     written last, by rank 0

An iteration is complete in the durable tier only once its commit file exists; the file names
the digest of every shard's manifest, so a shard replaced after the commit is not taken for the
committed one. Copies in either direction are read back and verified chunk by chunk (CRC-32C)
before they are committed: a shard is read from its source (verified), then written to its
destination (every chunk's CRC checked against the manifest on the way).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CorruptShardError
from .fsutil import fsync_dir
from .layout import ShardRef, iteration_dir, list_iterations
from .manifest import ShardManifest
from .shard_reader import parse_manifest_file
from .store import ShardStore

COMMIT_FORMAT = 1
PROGRESS_DIR = ".persisting"  # per rank: the iteration it copies (rank 0 reads it)
_SHARD_OF = re.compile(r"rank_([0-9]{5})_of_([0-9]{5})")


def _names(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []


def commit_name(world_size: int) -> str:
    return f"COMMITTED-{world_size:05d}.json"


def commit_path(root: Path, session_id: str, iteration: int, world_size: int) -> Path:
    """Where the commit file of ``iteration`` at ``world_size`` lives under a durable root."""
    return iteration_dir(root, session_id, iteration) / commit_name(world_size)


def read_with_digest(ref: ShardRef) -> tuple[int, ShardManifest]:
    """The CRC-32 of a shard's manifest file and the manifest parsed from those same bytes
    (one read: a shard replaced meanwhile cannot pair one's digest with the other's
    manifest). CorruptShardError or OSError."""
    path = ref.path / "zarr.json"
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
        data = f.read()
    manifest = parse_manifest_file(data, str(path))
    if (manifest.iteration, manifest.owner_rank, manifest.world_size) != (
            ref.iteration, ref.owner_rank, ref.world_size):
        raise CorruptShardError(f"{path}: manifest of another shard")
    return zlib.crc32(data), manifest


class DurableStore:
    """One rank's view of the durable tier. Thread-safe for distinct shards (as ShardStore).

    Every method does file I/O on the shared file system and may raise OSError (unreachable,
    permission, full) or CorruptShardError; none is collective.
    """

    def __init__(self, root: str | os.PathLike[str], session_id: str, rank: int,
                 io_threads: int = 2) -> None:
        self.root = Path(root)
        self.store = ShardStore(self.root, session_id, writer_rank=rank, io_threads=io_threads,
                                fault_points=False)
        self.session_id = session_id

    def close(self) -> None:
        self.store.close()

    # ------------------------------------------------------------------ copies

    def put(self, local: ShardStore, iteration: int, owner: int,
            world_size: int) -> ShardManifest:
        """Copy the committed local shard (``iteration``, ``owner``) here, verified; returns its
        manifest. Holds the shard in memory meanwhile."""
        manifest, payload = local.read(local.ref(iteration, owner, world_size))
        self.store.session_path.mkdir(parents=True, exist_ok=True)
        self.store.write(manifest, payload)
        return manifest

    def committed_manifest(self, iteration: int, owner: int, world_size: int) -> ShardManifest:
        """The manifest of the durable shard (``iteration``, ``owner``), after checking it is the
        one the iteration's commit names (CorruptShardError otherwise)."""
        ref = self.store.ref(iteration, owner, world_size)
        expected = self.commit_record(iteration, world_size)["shards"].get(str(owner))
        digest, manifest = read_with_digest(ref)
        if expected is None or digest != expected:
            raise CorruptShardError(f"{ref.path}: not the shard the commit of iteration "
                                    f"{iteration} names")
        return manifest

    def get(self, local: ShardStore, iteration: int, owner: int, world_size: int) -> bool:
        """Copy the committed durable shard (``iteration``, ``owner``) into ``local``, verified,
        unless ``local`` already holds that very shard (another copy, e.g. from another save
        of the same iteration number, is replaced). Whether it copied."""
        manifest = self.committed_manifest(iteration, owner, world_size)
        mine = local.ref(iteration, owner, world_size)
        if mine.path.is_dir():
            with contextlib.suppress(Exception):  # unreadable here: copied again
                if local.read_manifest(mine) == manifest:
                    return False
        read, payload = self.store.read(self.store.ref(iteration, owner, world_size))
        if read != manifest:  # replaced since the check above
            raise CorruptShardError(f"shard {owner} of iteration {iteration} in {self.root} "
                                    "changed while it was read")
        local.write(read, payload)
        return True

    def holds(self, iteration: int, owner: int, world_size: int, save_id: Any) -> bool:
        """Whether the shard (``iteration``, ``owner``) of the save ``save_id`` is here."""
        with contextlib.suppress(OSError, CorruptShardError):
            _, manifest = read_with_digest(self.store.ref(iteration, owner, world_size))
            return bool(manifest.metadata.get("save_id") == save_id)
        return False

    # ------------------------------------------------------------------ the job's commit

    def shards_present(self, iteration: int, world_size: int) -> list[int]:
        """Owners whose shard of ``iteration`` is committed here (one directory listed)."""
        directory = iteration_dir(self.root, self.session_id, iteration)
        return sorted(int(m[1]) for name in _names(directory)
                      if (m := _SHARD_OF.fullmatch(name)) and int(m[2]) == world_size)

    def mark_progress(self, rank: int, run: str, iteration: int) -> None:
        """Record that ``rank`` of the job run ``run`` now copies ``iteration`` (each rank
        copies in order): rank 0 stops waiting for a copy a rank has gone past."""
        directory = self.store.session_path / PROGRESS_DIR
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".tmp-{rank}-{uuid.uuid4().hex}"
        tmp.write_text(json.dumps({"run": run, "iteration": iteration}))
        os.rename(tmp, directory / f"rank_{rank:05d}.json")

    def progress(self, rank: int, run: str) -> int:
        """The iteration ``rank`` of the job run ``run`` copies or copied last; -1 if unknown
        (no record, or another run's)."""
        path = self.store.session_path / PROGRESS_DIR / f"rank_{rank:05d}.json"
        try:
            doc = json.loads(path.read_bytes())
        except (OSError, ValueError):
            return -1
        ok = isinstance(doc, dict) and doc.get("run") == run and type(doc.get("iteration")) is int
        return int(doc["iteration"]) if ok else -1

    def commit(self, iteration: int, world_size: int, save_id: str | None, wait: float,
               poll: float = 0.05, before: Callable[[], None] | None = None,
               gone_past: Callable[[int], bool] = lambda rank: False) -> None:
        """Rank 0: once every owner's shard of ``iteration`` from the save ``save_id`` is here
        (a shard of another save of that iteration number does not count), write the
        iteration's commit file atomically (written, fsynced, renamed, directory fsynced).
        TimeoutError naming the missing ranks after ``wait`` seconds, or as soon as a missing
        rank has ``gone_past(rank)`` this iteration (it will never deliver it)."""
        deadline = time.monotonic() + wait
        digests: dict[int, int] = {}  # owner -> digest of its shard of this save
        while True:
            # Progress first, then the listing: a rank records a newer iteration only after its
            # copy of this one, so a copy made before that record is seen by the listing.
            missing = sorted(set(range(world_size)) - set(digests))
            past = {r for r in missing[:64] if gone_past(r)}
            for owner in self.shards_present(iteration, world_size):
                if owner in digests:  # confirmed: within a run no rank copies it again
                    continue
                ref = self.store.ref(iteration, owner, world_size)
                with contextlib.suppress(OSError, CorruptShardError):  # being replaced
                    digest, manifest = read_with_digest(ref)
                    if manifest.metadata.get("save_id") == save_id:
                        digests[owner] = digest
            if len(digests) == world_size:
                break
            missing = sorted(set(range(world_size)) - set(digests))
            past = {r for r in missing if r in past}
            if past:
                raise TimeoutError(f"durable copy of iteration {iteration} given up: ranks "
                                   f"{sorted(past)[:8]} went on to a newer one without it")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"durable copy of iteration {iteration}: shards of ranks "
                                   f"{missing[:8]} not there after {wait:g}s")
            time.sleep(poll)
        doc = {"format": COMMIT_FORMAT, "session": self.session_id, "iteration": iteration,
               "world_size": world_size, "save_id": save_id,
               "shards": {str(o): d for o, d in sorted(digests.items())}}
        directory = iteration_dir(self.root, self.session_id, iteration)
        if before is not None:
            before()  # a fault point
        tmp = directory / f".tmp-commit-{uuid.uuid4().hex}"
        with open(tmp, "x") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, directory / commit_name(world_size))
        fsync_dir(directory)

    def commit_record(self, iteration: int, world_size: int) -> dict[str, Any]:
        """The commit file of ``iteration``; CorruptShardError if it is not a valid one."""
        path = iteration_dir(self.root, self.session_id, iteration) / commit_name(world_size)
        try:
            doc = json.loads(path.read_bytes())
        except (OSError, ValueError) as exc:
            raise CorruptShardError(f"{path}: unreadable commit file: {exc}") from exc
        if not (isinstance(doc, dict) and doc.get("format") == COMMIT_FORMAT
                and doc.get("iteration") == iteration and doc.get("world_size") == world_size
                and isinstance(doc.get("shards"), dict)):
            raise CorruptShardError(f"{path}: not a commit file of iteration {iteration} at "
                                    f"world size {world_size}")
        return doc

    def complete(self, world_size: int) -> list[int]:
        """Iterations whose commit file for ``world_size`` exists, oldest first."""
        name = commit_name(world_size)
        return [it for it in list_iterations(self.root, self.session_id)
                if (iteration_dir(self.root, self.session_id, it) / name).is_file()]

    def uncommitted(self) -> list[int]:
        """Iterations with a directory here but no commit file of any world size."""
        return [it for it in list_iterations(self.root, self.session_id)
                if not self.committed_by_any(it)]

    def committed_by_any(self, iteration: int) -> bool:
        """Whether ``iteration`` has a commit file of some world size."""
        return any(iteration_dir(self.root, self.session_id, iteration).glob("COMMITTED-*"))

    def remove_uncommitted(self, iteration: int) -> None:
        """Rank 0: remove the directory of an iteration no commit file names, with whatever
        copies (and crash leftovers of copies) it holds. Only once no rank writes there."""
        directory = iteration_dir(self.root, self.session_id, iteration)
        if self.committed_by_any(iteration):
            raise ValueError(f"{directory} is committed")
        trash = directory.with_name(f".trash-durable-{uuid.uuid4().hex}")
        os.rename(directory, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def discard_newer(self, iteration: int, world_size: int) -> None:
        """Rank 0, in a rollback to ``iteration``: remove every newer iteration of
        ``world_size`` (commit file first) and every newer uncommitted one."""
        committed = set(self.complete(world_size))
        for it in list_iterations(self.root, self.session_id):
            if it > iteration:
                if it in committed:
                    self.delete(it, world_size)
                elif not self.committed_by_any(it):
                    self.remove_uncommitted(it)

    def delete(self, iteration: int, world_size: int) -> None:
        """Rank 0: the commit file first (the iteration is no longer complete), then the
        shards of ``world_size``, each hidden by a rename, then the directory if empty."""
        directory = iteration_dir(self.root, self.session_id, iteration)
        (directory / commit_name(world_size)).unlink(missing_ok=True)
        fsync_dir(directory)
        for ref in self.store.committed():
            if ref.iteration == iteration and ref.world_size == world_size:
                self.store.delete(ref)
        with contextlib.suppress(OSError):
            directory.rmdir()
