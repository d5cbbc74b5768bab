"""The durable tier: a second copy of the job's checkpoints that outlives its nodes.

It lives on a shared file system every rank sees (Lustre, GPFS, NFS:
:mod:`~localckpt.storage.durable_dir`) or in object storage (S3:
:mod:`~localckpt.storage.durable_object`), and holds shards in the same layout and format as a
node root (a zarr v3 group per shard, each chunk checksummed), plus one record per iteration that
commits the whole job's copy::

    <durable root>/<session>/iter_<iteration>/rank_<owner>_of_<world>/   each rank's shard
    <durable root>/<session>/iter_<iteration>/COMMITTED-<world>.json     written last, by rank 0

An iteration is complete in the durable tier only once its commit record exists; the record names
the digest of every shard's manifest, so a shard replaced after the commit is not taken for the
committed one. Copies in either direction are verified chunk by chunk (CRC-32C): a shard is read
from its source (verified), then written to its destination (every chunk's CRC checked against the
manifest on the way).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Protocol

import torch

from ..errors import CorruptShardError
from .durable_dir import DirectoryBackend
from .durable_object import ObjectBackend, is_object_url, shard_key
from .layout import ShardRef, iteration_dir, parse_shard_name
from .manifest import ShardManifest
from .rollback_fence import Fence, hidden, lowest
from .shard_reader import parse_manifest_file
from .store import ShardStore
from .views import byte_view

logger = logging.getLogger(__name__)

COMMIT_FORMAT = 1
PROGRESS_DIR = ".persisting"  # per rank: the iteration it copies (rank 0 reads it)
_COMMIT = re.compile(r"COMMITTED-([0-9]{5})\.json")


def commit_name(world_size: int) -> str:
    return f"COMMITTED-{world_size:05d}.json"


def commit_path(root: Path, session_id: str, iteration: int, world_size: int) -> Path:
    """Where the commit file of ``iteration`` at ``world_size`` lives under a durable root."""
    return iteration_dir(root, session_id, iteration) / commit_name(world_size)


def _commit_key(iteration: int, world_size: int) -> str:
    return f"{shard_key(iteration, 0, 1).split('/')[0]}/{commit_name(world_size)}"


#: ``fill(i, out)``: chunk i of a shard into the uint8 tensor ``out``, verified (CRC-32C).
ChunkFill = Callable[[int, torch.Tensor], None]
#: ``each_chunk(manifest, work, extra)``: ``work(i, buf)`` for every chunk of ``manifest`` on the
#: tier's threads, each thread with a buffer of its own (``chunk_nbytes + extra`` bytes).
EachChunk = Callable[[ShardManifest, ChunkFill, int], None]


class Backend(Protocol):
    """What a durable store is made of: keys are relative to the session. Every method may
    raise OSError; a missing key reads as FileNotFoundError."""

    where: str
    poll_s: float  # how often rank 0 looks for the ranks' copies while it waits to commit

    def close(self) -> None: ...
    def iterations(self) -> list[int]: ...
    def names(self, iteration: int) -> list[str]: ...
    def read(self, key: str) -> bytes: ...
    def write(self, key: str, data: bytes) -> None: ...
    def remove(self, key: str) -> None: ...
    threads: int  # chunks copied at once
    def put_shard(self, manifest: ShardManifest, fill: ChunkFill,
                  each_chunk: EachChunk) -> None: ...
    def fill_chunk(self, manifest: ShardManifest, index: int, out: torch.Tensor) -> None: ...
    def delete_shards(self, iteration: int, world_size: int) -> None: ...
    def remove_iteration(self, iteration: int) -> None: ...
    def remove_if_empty(self, iteration: int) -> None: ...
    def remove_trash(self) -> None: ...


def _check_chunks(store: ShardStore, ref: ShardRef, manifest: ShardManifest) -> None:
    """Read every chunk of ``ref`` (one buffer, chunk by chunk) and check it against
    ``manifest``; CorruptShardError naming the first bad file."""
    buf = torch.empty(manifest.chunk_nbytes, dtype=torch.uint8)
    for i in range(manifest.chunk_count):
        store.read_range(ref, manifest, i * manifest.chunk_nbytes, buf)


class GiveUp:
    """Lets a caller that stopped waiting for a copy into a node root stop it: the copy checks
    between chunks, and its commit runs entirely before :meth:`give_up` returns or not at all
    (a copy committed after its fetch was given up could replace a newer save's shard)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._given_up = False

    def give_up(self, wait: float = 30.0) -> None:
        """From now on the copy stops. Waits up to ``wait`` seconds for a commit in progress
        (one rename and a few fsyncs); a commit hung longer than that on the node's own file
        system cannot be stopped, and is logged."""
        if self._lock.acquire(timeout=wait):
            self._given_up = True
            self._lock.release()
        else:
            self._given_up = True
            logger.error("a copy from the durable tier was given up while its commit into the "
                         "node root hung for %gs: it may still complete", wait)

    def check(self) -> None:
        if self._given_up:
            raise TimeoutError("the copy was given up by its caller")

    @contextlib.contextmanager
    def committing(self) -> Iterator[None]:
        with self._lock:
            self.check()
            yield


class DurableStore:
    """One rank's view of the durable tier. Thread-safe for distinct shards.

    ``root``: a directory, or ``s3://bucket[/prefix]`` with obstore's S3 ``options``. Every
    method does I/O on the shared store and may raise OSError (unreachable, permission, full) or
    CorruptShardError; none is collective. A request to an object store gives up after
    ``timeout`` seconds.
    """

    def __init__(self, root: str | os.PathLike[str], session_id: str, rank: int,
                 io_threads: int = 2, timeout: float = 60.0,
                 options: Mapping[str, Any] | None = None) -> None:
        self.session_id = session_id
        self.backend: Backend
        if is_object_url(root):
            self.backend = ObjectBackend(str(root), session_id, io_threads, timeout, options)
        else:
            self.backend = DirectoryBackend(Path(root), session_id, rank, io_threads)
        self.root = self.backend.where  # for messages
        self._pool = ThreadPoolExecutor(self.backend.threads,
                                        thread_name_prefix="localckpt-durable")
        self._abandoned = False

    def abandon(self) -> None:
        """A copy was given up (a hung mount): :meth:`close` will not wait for its threads."""
        self._abandoned = True

    def close(self) -> None:
        """Wait for the copies running, but not for one given up (its threads stay blocked in
        the store; queued chunks are dropped)."""
        self._pool.shutdown(wait=not self._abandoned, cancel_futures=self._abandoned)
        self.backend.close()

    def _each_chunk(self, manifest: ShardManifest, work: ChunkFill, extra: int = 0) -> None:
        """``work(i, buf)`` for every chunk of ``manifest``, on this tier's threads, each with a
        buffer of its own: a copy holds threads x chunks in memory, not the shard. Every call
        is over before this returns; the first error is raised and the other threads stop
        taking chunks."""
        chunks = iter(range(manifest.chunk_count))
        lock, failed = threading.Lock(), threading.Event()

        def worker() -> None:
            buf = torch.empty(manifest.chunk_nbytes + extra, dtype=torch.uint8)
            while not failed.is_set():
                with lock:
                    index = next(chunks, None)
                if index is None:
                    return
                try:
                    work(index, buf)
                except BaseException:
                    failed.set()
                    raise

        futures = [self._pool.submit(worker)
                   for _ in range(min(self.backend.threads, manifest.chunk_count))]
        wait(futures)
        for future in futures:
            future.result()

    # ------------------------------------------------------------------ copies

    def put(self, local: ShardStore, iteration: int, owner: int,
            world_size: int) -> ShardManifest:
        """Copy the committed local shard (``iteration``, ``owner``) here, chunk by chunk, each
        read and verified, then written; returns its manifest."""
        ref = local.ref(iteration, owner, world_size)
        manifest = local.read_manifest(ref)
        size = manifest.chunk_nbytes
        self._uncommit_other_save(manifest)

        def fill(index: int, out: torch.Tensor) -> None:
            local.read_range(ref, manifest, index * size, out)
        self.backend.put_shard(manifest, fill, self._each_chunk)
        return manifest

    def _uncommit_other_save(self, manifest: ShardManifest) -> None:
        """Before a shard of an iteration committed by another save is written over: remove
        that commit record, so the tier says the iteration is incomplete while it is, instead of
        naming shards of which some are replaced (a bucket's object by object; a directory's one
        rank at a time, each by a rename)."""
        world = manifest.world_size
        try:
            record = self.commit_record(manifest.iteration, world)
        except CorruptShardError:  # none (or not valid): nothing claims the iteration
            return
        if record.get("save_id") != manifest.metadata.get("save_id"):
            logger.warning("durable tier %s: iteration %d, committed by another save, is "
                           "written over by save %s: no longer complete there until that one "
                           "is committed", self.root, manifest.iteration,
                           manifest.metadata.get("save_id"))
            self.backend.remove(_commit_key(manifest.iteration, world))

    def read_with_digest(self, iteration: int, owner: int,
                         world_size: int) -> tuple[int, ShardManifest]:
        """The CRC-32 of a shard's manifest file and the manifest parsed from those same bytes
        (one read: a shard replaced meanwhile cannot pair one's digest with the other's
        manifest). CorruptShardError or OSError."""
        key = f"{shard_key(iteration, owner, world_size)}/zarr.json"
        data = self.backend.read(key)
        manifest = parse_manifest_file(data, f"{self.root}/{key}")
        if (manifest.iteration, manifest.owner_rank, manifest.world_size) != (
                iteration, owner, world_size):
            raise CorruptShardError(f"{self.root}/{key}: manifest of another shard")
        return zlib.crc32(data), manifest

    def committed_manifest(self, iteration: int, owner: int, world_size: int) -> ShardManifest:
        """The manifest of the durable shard (``iteration``, ``owner``), after checking it is the
        one the iteration's commit names (CorruptShardError otherwise)."""
        expected = self.commit_record(iteration, world_size)["shards"].get(str(owner))
        digest, manifest = self.read_with_digest(iteration, owner, world_size)
        if expected is None or digest != expected:
            raise CorruptShardError(f"{self.root}: shard {owner} is not the shard the commit "
                                    f"of iteration {iteration} names")
        return manifest

    def read_shard(self, iteration: int, owner: int,
                   world_size: int) -> tuple[ShardManifest, torch.Tensor]:
        """The committed shard (``iteration``, ``owner``): its manifest and packed data, every
        chunk verified."""
        manifest = self.committed_manifest(iteration, owner, world_size)
        return manifest, self.read_data(manifest)

    def read_data(self, manifest: ShardManifest) -> torch.Tensor:
        """The packed data of the shard ``manifest`` describes, every chunk checked against
        it."""
        size = manifest.chunk_nbytes
        data = torch.empty(manifest.chunk_count * size, dtype=torch.uint8)
        futures = [self._pool.submit(self.backend.fill_chunk, manifest, i,
                                     data[i * size: (i + 1) * size])
                   for i in range(manifest.chunk_count)]
        wait(futures)
        for future in futures:
            future.result()
        return data

    def get(self, local: ShardStore, iteration: int, owner: int, world_size: int,
            stop: GiveUp | None = None) -> bool:
        """Copy the committed durable shard (``iteration``, ``owner``) into ``local``, verified,
        unless ``local`` already holds that very shard (another copy, e.g. from another save
        of the same iteration number, is replaced). Whether it copied. ``stop``: the caller
        may give the copy up (TimeoutError here then; nothing committed after)."""
        manifest = self.committed_manifest(iteration, owner, world_size)
        mine = local.ref(iteration, owner, world_size)
        if mine.path.is_dir():
            try:
                if local.read_manifest(mine) == manifest:
                    _check_chunks(local, mine, manifest)  # what the load will read
                    return False
            except Exception:  # unreadable or damaged here: copied again
                pass
        # Every chunk is checked against the committed manifest's CRCs: a shard replaced since
        # the check above does not pass. Chunk by chunk: read here, then written there.
        writer = local.begin_write(manifest)
        try:
            def copy(index: int, buf: torch.Tensor) -> None:
                if stop is not None:
                    stop.check()
                self.backend.fill_chunk(manifest, index, buf)
                writer.submit_chunk(index, byte_view(buf))
                writer.wait_chunk(index)  # the buffer is then free for the next chunk
            self._each_chunk(manifest, copy)
            with stop.committing() if stop is not None else contextlib.nullcontext():
                local.commit(writer)
        except BaseException:
            writer.abort()
            raise
        return True

    def holds(self, iteration: int, owner: int, world_size: int, save_id: Any) -> bool:
        """Whether the shard (``iteration``, ``owner``) of the save ``save_id`` is here; OSError
        when the store cannot tell (a copy is not written over a shard that may be there)."""
        try:
            _, manifest = self.read_with_digest(iteration, owner, world_size)
        except (FileNotFoundError, CorruptShardError):  # not there: another error is raised
            return False
        return bool(manifest.metadata.get("save_id") == save_id)

    # ------------------------------------------------------------------ the job's commit

    def shards_present(self, iteration: int, world_size: int) -> list[int]:
        """Owners with a shard of ``iteration`` here (one listing; possibly still written)."""
        return sorted(shard[0] for name in self.backend.names(iteration)
                      if (shard := parse_shard_name(name)) and shard[1] == world_size)

    def mark_progress(self, rank: int, run: str, iteration: int) -> None:
        """Record that ``rank`` of the job run ``run`` now copies ``iteration`` (each rank
        copies in order): rank 0 stops waiting for a copy a rank has gone past."""
        self.backend.write(f"{PROGRESS_DIR}/rank_{rank:05d}.json",
                           json.dumps({"run": run, "iteration": iteration}).encode())

    def progress(self, rank: int, run: str) -> int:
        """The iteration ``rank`` of the job run ``run`` copies or copied last; -1 if unknown
        (no record, or another run's)."""
        try:
            doc = json.loads(self.backend.read(f"{PROGRESS_DIR}/rank_{rank:05d}.json"))
        except (OSError, ValueError, RecursionError):  # nesting deeper than the parser's stack
            return -1
        ok = isinstance(doc, dict) and doc.get("run") == run and type(doc.get("iteration")) is int
        return int(doc["iteration"]) if ok else -1

    def commit(self, iteration: int, world_size: int, save_id: str | None, wait: float,
               poll: float | None = None, before: Callable[[], None] | None = None,
               gone_past: Callable[[int], bool] = lambda rank: False) -> None:
        """Rank 0: once every owner's shard of ``iteration`` from the save ``save_id`` is here
        (a shard of another save of that iteration number does not count), write the
        iteration's commit record atomically. TimeoutError naming the missing ranks after
        ``wait`` seconds, or as soon as a missing rank has ``gone_past(rank)`` this iteration
        (it will never deliver it)."""
        deadline = time.monotonic() + wait
        poll = self.backend.poll_s if poll is None else poll
        digests: dict[int, int] = {}  # owner -> digest of its shard of this save
        while True:
            # Progress first, then the listing: a rank records a newer iteration only after its
            # copy of this one, so a copy made before that record is seen by the listing.
            missing = sorted(set(range(world_size)) - set(digests))
            past = {r for r in missing[:64] if gone_past(r)}
            for owner in self.shards_present(iteration, world_size):
                if owner in digests:  # confirmed: within a run no rank copies it again
                    continue
                if time.monotonic() >= deadline:  # each read may take a request's timeout
                    break
                try:  # not there yet, or being replaced
                    digest, manifest = self.read_with_digest(iteration, owner, world_size)
                except (OSError, CorruptShardError):
                    continue
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
        if before is not None:
            before()  # a fault point
        self.backend.write(_commit_key(iteration, world_size), json.dumps(doc).encode())

    def commit_record(self, iteration: int, world_size: int) -> dict[str, Any]:
        """The commit record of ``iteration``; CorruptShardError if there is no valid one,
        OSError if the store cannot be read."""
        key = _commit_key(iteration, world_size)
        try:
            doc = json.loads(self.backend.read(key))
        except (FileNotFoundError, ValueError, RecursionError) as exc:  # others: as they are
            raise CorruptShardError(f"{self.root}/{key}: no valid commit record: "
                                    f"{exc}") from exc
        if not (isinstance(doc, dict) and doc.get("format") == COMMIT_FORMAT
                and doc.get("iteration") == iteration and doc.get("world_size") == world_size
                and isinstance(doc.get("shards"), dict)):
            raise CorruptShardError(f"{self.root}/{key}: not a commit record of iteration "
                                    f"{iteration} at world size {world_size}")
        return doc

    def complete(self, world_size: int) -> list[int]:
        """Iterations with a commit record for ``world_size``, oldest first."""
        name = commit_name(world_size)
        return [it for it in self.backend.iterations() if name in self.backend.names(it)]

    def complete_any(self) -> list[tuple[int, int]]:
        """(iteration, world size) of every commit record, oldest first."""
        out = []
        for it in self.backend.iterations():
            for name in self.backend.names(it):
                if (m := _COMMIT.fullmatch(name)) and int(m[1]) >= 1:
                    out.append((it, int(m[1])))
        return sorted(out)

    def uncommitted(self) -> list[int]:
        """Iterations with something here but no commit record of any world size."""
        return [it for it in self.backend.iterations() if not self.committed_by_any(it)]

    def committed_by_any(self, iteration: int) -> bool:
        """Whether ``iteration`` has a commit record of some world size."""
        return any(name.startswith("COMMITTED-") for name in self.backend.names(iteration))

    def remove_uncommitted(self, iteration: int) -> None:
        """Rank 0: remove an iteration no commit record names, with whatever copies (and crash
        leftovers of copies) it holds. Only once no rank writes there."""
        if self.committed_by_any(iteration):
            raise ValueError(f"iteration {iteration} in {self.root} is committed")
        self.backend.remove_iteration(iteration)

    def discard_newer(self, iteration: int) -> None:
        """Rank 0, in a rollback to ``iteration``: remove every newer iteration, of any world
        size (commit records first; a job restarted with ``reshard=True`` would load them),
        and every newer uncommitted one."""
        self.discard_hidden(((iteration, None, None),))

    def remove_trash(self) -> None:
        """Rank 0: what deletions a crash interrupted left hidden (a directory tier's)."""
        self.backend.remove_trash()

    def discard_hidden(self, fence: Fence) -> None:
        """Rank 0, in a rollback or finishing one a failure interrupted: remove the iterations
        ``fence`` hides (commit records first), and the uncommitted ones newer than its
        oldest."""
        for it, world in self.complete_any():
            if hidden(fence, it, world):
                self.delete(it, world)
        for it in self.backend.iterations():
            if it > lowest(fence) and not self.committed_by_any(it):
                self.remove_uncommitted(it)

    def delete(self, iteration: int, world_size: int) -> None:
        """Rank 0: the commit record first (the iteration is no longer complete), then the
        shards of ``world_size``, each made invisible first, then the iteration if empty."""
        self.backend.remove(_commit_key(iteration, world_size))
        self.backend.delete_shards(iteration, world_size)
        self.backend.remove_if_empty(iteration)
