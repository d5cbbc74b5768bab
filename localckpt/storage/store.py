"""Shard store: committed shards on node-local storage, one zarr v3 group per (iteration, owner).

Layout (see docs/format.md)::

    <root>/<session>/iter_<iteration:010d>/rank_<owner:05d>_of_<world:05d>/
        zarr.json          group metadata; attributes["localckpt"] = manifest (written last)
        data/zarr.json     uint8 array, regular chunks, codecs [bytes, crc32c]
        data/c/<i>         chunk i: chunk_nbytes of packed tensor bytes + CRC-32C (little endian)

The chunk files are exactly what zarr's ``bytes`` + ``crc32c`` codec pipeline produces, so plain
``zarr.open_group(path)`` reads the data (and checks the checksums), but they are written and read
here directly from the staging buffer: no per-chunk copies, checksum and write overlapped across
threads. Commit = write into ``.tmp-*`` in the iteration directory, fsync files and directories,
rename. Listing looks only at committed names; anything else is a leftover that never blocks a
later save and is removed by :func:`localckpt.storage.layout.remove_leftovers`.

Several ranks of one node share a root. A rank only ever writes, replaces or deletes shard
directories it was asked to (its own shards, later the replicas it keeps) and only removes its own
leftovers (their names carry the writer's rank).

A shard that fails verification on load is *quarantined*: renamed to
``<session>/.quarantine-<iteration>-<shard>-w<writer>-<id>`` (listing no longer sees it, an
operator still can) and removed when the next save of the session starts. Directories are 0700,
files 0600; listing never follows a symbolic link.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial
from pathlib import Path

import torch

from ..errors import CorruptShardError
from .device_reader import SPARE_SLOTS
from .host_memory import empty_host
from .layout import (
    ShardRef,
    find_leftovers,
    find_quarantined,
    list_shards,
    remove_if_empty,
    remove_paths,
    session_dir,
    shard_path,
    trash_name,
)
from .manifest import ShardManifest
from .recycle import FilePool
from .shard_reader import check_chunk_files, parse_manifest_file, read_chunks_into, unreadable
from .shard_writer import ShardWriter
from .space import DEFAULT_CHUNK_NBYTES
from .store_rollback import RollbackOps
from .tensor_reads import read_shard_tensors
from .views import byte_view

logger = logging.getLogger(__name__)

_MANIFESTS_KEPT = 8


# The open stores of this process by (session directory, writer rank): each one's id, which
# its temporary directories carry, so that one's retention never takes another's write in
# progress for a crash leftover (a job may load with a second manager while saving).
_LIVE_WRITERS: dict[tuple[str, int], set[str]] = {}
_LIVE_LOCK = threading.Lock()


class ShardStore(RollbackOps):
    """Writes, reads, lists and deletes shards of one session under one node-local root.

    Thread-safe for distinct shards. ``writer_rank`` names this process's leftovers.
    """

    def __init__(self, root: str | os.PathLike[str], session_id: str, writer_rank: int,
                 io_threads: int = 2, chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
                 recycle: bool = False, fault_points: bool = True) -> None:
        self.root = Path(root)
        self.session_id = session_id
        self.session_path = session_dir(self.root, session_id)
        self.writer_rank = writer_rank
        self._tag = f"w{writer_rank:05d}"  # this writer's temporary files
        self._instance = uuid.uuid4().hex[:6]  # this store's, within them (see _LIVE_WRITERS)
        # the same session however its root is spelled (relative, through a link)
        self._live_key = (os.path.realpath(self.session_path), writer_rank)
        with _LIVE_LOCK:
            _LIVE_WRITERS.setdefault(self._live_key, set()).add(self._instance)
        self.chunk_nbytes = chunk_nbytes
        self.fault_points = fault_points  # False: the chaos fault points of a save never fire
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="localckpt-io")
        # Freeing tmpfs pages costs about as much as writing them (~0.4 s per GiB here), so
        # retention hands hidden shards to one thread instead of blocking a finalize on it.
        self._reaper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="localckpt-reaper")
        self._reaping: list[Future[None]] = []
        # With ``recycle``, deleted shards' chunk files are written over by later saves.
        self.files = FilePool(self.session_path) if recycle else None
        # Manifests this process committed or parsed lately: find_latest and load read the same
        # one, and a restore reads back what it just received. A committed file never changes in
        # place (a commit renames a new directory), so (path, inode, mtime, size) names content.
        self._manifests: dict[tuple[str, int, int, int], ShardManifest] = {}
        self._manifests_lock = threading.Lock()  # the save thread commits while others read
        self._commits_stopped = threading.Event()
        # Copies found bad that could not be moved aside (a file system gone read-only after an
        # I/O error): hidden from this process's listings until a commit replaces them.
        self._set_aside: set[Path] = set()

    def stop_commits(self) -> None:
        """From now on no shard is committed through this store (a write still running
        aborts at its commit): a thread that outlived its manager's close() must not replace
        what a later manager committed."""
        self._commits_stopped.set()

    def close(self, wait: bool = True) -> None:
        """Stops commits, waits for background deletions (and removes the recycled files this
        process pooled and nobody took: their pages are of no use once it saves no more), then
        releases the threads. ``wait=False`` (a save or write-back thread outlived its bound:
        a write in the pool may be stuck on the disk) waits for none of that: the threads end
        when their work does, and the next start removes what they leave."""
        self.stop_commits()
        try:
            if wait:
                self.wait_for_deletions()
                if self.files is not None:
                    self.files.drain_own()
            self._reaper.shutdown(wait=wait)
            self._pool.shutdown(wait=wait)
        finally:
            with _LIVE_LOCK:
                _LIVE_WRITERS.get(self._live_key, set()).discard(self._instance)

    def wait_for_deletions(self, timeout: float | None = None) -> None:
        """Block until every ``background=True`` deletion so far is done (free space is then
        what ``statvfs`` reports), or raise TimeoutError after ``timeout`` seconds (those still
        running stay pending). Deletion errors are logged by the reaper, never raised."""
        pending, self._reaping = self._reaping, []
        _, not_done = wait(pending, timeout)
        if not_done:
            self._reaping = [f for f in pending if f in not_done] + self._reaping
            raise TimeoutError(f"{len(not_done)} deletions of older shards still running after "
                               f"{timeout:g}s")

    def drain_recycled(self, before_ns: int) -> None:
        """Delete, on the reaper thread, the recycled files that arrived before ``before_ns``
        (the start of the save being finalized): those it did not write over."""
        if self.files is not None:
            self._in_background(partial(self.files.drain, before_ns))

    def holds_recycled(self) -> bool:
        """Whether recycled files hold space (never without recycling)."""
        return self.files is not None and self.files.holds_any()

    def drain_all_recycled(self, deadline: float | None = None) -> None:
        """Delete every recycled file now (space is short; no rank of the node writes), until
        ``deadline`` (time.monotonic()) if given."""
        if self.files is not None:
            self.files.drain(deadline=deadline)

    def deletions_pending(self) -> bool:
        """Whether a ``background=True`` deletion is still running or queued (the space it
        frees is not in ``statvfs`` yet)."""
        return any(not f.done() for f in self._reaping)

    def _in_background(self, fn: Callable[[], None]) -> None:
        def run() -> None:
            try:
                fn()
            except Exception:  # a leftover is removed at the next start; never fail a save
                logger.exception("background deletion under %s failed", self.session_path)

        self._reaping = [f for f in self._reaping if not f.done()]
        self._reaping.append(self._reaper.submit(run))

    def committed(self) -> list[ShardRef]:
        """Committed shards under this root (see :func:`list_shards`), but those set aside in
        memory by :meth:`quarantine`."""
        refs = list_shards(self.root, self.session_id)
        if self._set_aside:
            refs = [r for r in refs if r.path not in self._set_aside]
        return refs

    def path_of(self, iteration: int, owner: int, world_size: int) -> Path:
        return shard_path(self.root, self.session_id, iteration, owner, world_size)

    def ref(self, iteration: int, owner: int, world_size: int) -> ShardRef:
        """The shard (``iteration``, ``owner``) of a world of ``world_size`` under this root
        (committed or not)."""
        return ShardRef(iteration, owner, world_size, self.path_of(iteration, owner, world_size))

    # ---------------------------------------------------------------- write

    def begin_write(self, manifest: ShardManifest) -> ShardWriter:
        """Start writing the shard ``manifest`` describes; see :class:`ShardWriter`."""
        final = self.path_of(manifest.iteration, manifest.owner_rank, manifest.world_size)
        return ShardWriter(manifest, final, self.writer_rank, self._pool, self.files,
                           self.fault_points, self._commits_stopped, self._instance)

    def commit(self, writer: ShardWriter) -> Path:
        """``writer.commit()``, remembering the committed manifest for :meth:`read_manifest`."""
        final = writer.commit()
        self._set_aside.discard(final)
        with contextlib.suppress(OSError):
            meta = final / "zarr.json"
            self._remember(_content_key(meta, meta.stat()), writer.manifest)
        return final

    def _remember(self, key: tuple[str, int, int, int], manifest: ShardManifest) -> None:
        with self._manifests_lock:
            self._manifests[key] = manifest
            while len(self._manifests) > _MANIFESTS_KEPT:
                del self._manifests[next(iter(self._manifests))]

    def write(self, manifest: ShardManifest,
              payload: torch.Tensor) -> tuple[ShardRef, ShardManifest]:
        """Write and commit one shard from the packed uint8 ``payload`` of
        ``manifest.chunk_count * manifest.chunk_nbytes`` bytes. Checksums are computed here (or,
        when ``manifest.chunk_crc32c`` is set, verified). Replaces an existing shard with the same
        id (a leftover of a failed save). Returns the shard and its committed manifest.

        Blocks until the shard is durable and visible. Raises InsufficientSpaceError on ENOSPC,
        CorruptShardError on a checksum mismatch; on any failure the temporary directory is
        removed and nothing committed is touched.
        """
        expected = manifest.chunk_count * manifest.chunk_nbytes
        if payload.numel() != expected:
            raise ValueError(f"payload: expected {expected} bytes, got {payload.numel()}")
        writer = self.begin_write(manifest)
        try:
            view = byte_view(payload)
            size = manifest.chunk_nbytes
            for i in range(manifest.chunk_count):
                writer.submit_chunk(i, view[i * size : (i + 1) * size])
            path = self.commit(writer)
        except BaseException:
            writer.abort()
            raise
        ref = ShardRef(manifest.iteration, manifest.owner_rank, manifest.world_size, path)
        return ref, writer.manifest

    # ---------------------------------------------------------------- read

    def read_manifest(self, ref: ShardRef) -> ShardManifest:
        """Parse and verify the manifest of ``ref``; CorruptShardError names the file."""
        path = ref.path / "zarr.json"
        try:
            with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
                key = _content_key(path, os.fstat(f.fileno()))
                manifest = self._manifests.get(key)
                if manifest is None:
                    manifest = parse_manifest_file(f.read(), str(path))
                    self._remember(key, manifest)
        except OSError as exc:
            raise unreadable(path, exc, "manifest") from exc
        # The session may differ: a session directory copied or renamed on purpose (the load
        # path warns). The shard's id must match its name.
        ids = (manifest.iteration, manifest.owner_rank, manifest.world_size)
        if ids != (ref.iteration, ref.owner_rank, ref.world_size):
            raise CorruptShardError(
                f"{path}: manifest says (iteration, owner, world size) = {ids}, expected "
                f"{(ref.iteration, ref.owner_rank, ref.world_size)}")
        check_chunk_files(ref.path / "data" / "c", manifest)
        return manifest

    def read(self, ref: ShardRef,
             allocate: Callable[[int], torch.Tensor] | None = None
             ) -> tuple[ShardManifest, torch.Tensor]:
        """Read ``ref`` into one uint8 buffer (fresh, or from ``allocate(nbytes)``), verified as
        in :meth:`read_into`."""
        manifest = self.read_manifest(ref)
        total = manifest.chunk_count * manifest.chunk_nbytes
        buf = allocate(total) if allocate else empty_host(total)
        self.read_into(ref, manifest, [(0, byte_view(buf))] if total else [])
        return manifest, buf

    def verify(self, ref: ShardRef) -> None:
        """Read every chunk of ``ref`` and check its CRC-32C, one chunk's memory at a time on the
        calling thread (a second look at a copy after a failed read: it must not need the
        memory of the whole shard). Raises CorruptShardError naming the first bad file."""
        manifest = self.read_manifest(ref)
        size = manifest.chunk_nbytes
        buf = torch.empty(size, dtype=torch.uint8)
        for c in range(manifest.chunk_count):
            self.read_range(ref, manifest, c * size, buf)

    def read_tensors(self, ref: ShardRef,
                     into: Callable[[ShardManifest], Sequence[torch.Tensor | None]] | None = None,
                     device_of: Callable[[ShardManifest], torch.device | None] | None = None
                     ) -> tuple[ShardManifest, list[torch.Tensor]]:
        """Read ``ref`` straight into a tensor per entry (a scatter read, verified as in
        :meth:`read_into`): fresh ones, or those ``into(manifest)`` names (contiguous, of the
        entry's dtype and shape, not overlapping; None: a fresh one). The manifest is checked
        first (:meth:`read_manifest`), so nothing is allocated from an inconsistent one.

        Fresh tensors are on the CPU, except with ``device_of``: then the entries saved from
        the CUDA device ``device_of(manifest)`` names (e.g. :func:`cuda_destination`) are
        allocated there and read through pinned memory, as are the given tensors on that
        device; every copy is complete on return. Tensors on other devices are returned on the
        CPU."""
        manifest = self.read_manifest(ref)
        device = device_of(manifest) if device_of is not None else None
        given = into(manifest) if into is not None else None
        return manifest, read_shard_tensors(ref.path / "data" / "c", manifest, given, device,
                                            self._pool, self._pool._max_workers + SPARE_SLOTS)

    def read_into(self, ref: ShardRef, manifest: ShardManifest,
                  targets: Sequence[tuple[int, memoryview]]) -> None:
        """Scatter-read the data of ``ref`` into ``targets``: (offset in the packed data,
        byte buffer), in any order, not overlapping. Bytes no target covers (alignment
        and chunk padding) are read into scratch space, so every chunk's CRC-32C is still checked
        against both the file trailer and ``manifest``; tensors land in their own storage with no
        extra copy.

        Raises CorruptShardError naming the first bad file (truncated, missing, mismatching).
        """
        read_chunks_into(ref.path / "data" / "c", manifest, targets, self._pool)

    def read_range(self, ref: ShardRef, manifest: ShardManifest, start: int,
                   out: torch.Tensor) -> None:
        """Read bytes [start, start + len(out)) of the packed data of ``ref`` (whole chunks)
        into the uint8 tensor ``out``, each chunk verified as in :meth:`read_into`, on the
        calling thread (not queued behind reads on the I/O pool)."""
        size = manifest.chunk_nbytes
        if start % size or out.numel() % size:
            raise ValueError(f"read_range: expected whole {size}-byte chunks, got "
                             f"[{start}, {start + out.numel()})")
        read_chunks_into(ref.path / "data" / "c", manifest, [(start, byte_view(out))],
                         None, range(start // size, (start + out.numel()) // size))

    # ---------------------------------------------------------------- delete

    def quarantine(self, ref: ShardRef) -> Path | None:
        """Move a shard that failed verification out of sight, atomically (listing no longer
        sees it; an operator still can). Returns where it went, None if it was gone already or
        could not be moved: then this process's listings leave it out (logged; a read-only file
        system must not stop a load that has another copy). Quarantined shards are removed when
        the next save starts (:meth:`remove_quarantined`)."""
        target = self.session_path / (f".quarantine-{ref.path.parent.name}-{ref.path.name}-"
                                      f"{self._tag}-{uuid.uuid4().hex[:12]}")
        try:
            os.rename(ref.path, target)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._set_aside.add(ref.path)
            logger.error("%s failed its checks and cannot be moved aside (%s): this process "
                         "no longer lists it; remove it by hand or with localckpt gc", ref.path,
                         exc)
            return None
        remove_if_empty(ref.path.parent)
        return target

    def remove_quarantined(self) -> list[Path]:
        """Delete every quarantined shard of the session (any writer's); returns them."""
        found = find_quarantined(self.session_path)
        for path in found:
            shutil.rmtree(path, ignore_errors=True)
        return found

    def delete(self, ref: ShardRef, background: bool = False) -> None:
        """Remove a committed shard: hidden atomically by a rename (from then on no listing
        sees it), then deleted, by the reaper thread when ``background``. Missing is ok."""
        trash = trash_name(ref.path, self.writer_rank)
        try:
            os.rename(ref.path, trash)
        except FileNotFoundError:
            return

        remove_if_empty(ref.path.parent)

        def remove() -> None:
            if self.files is not None:
                with contextlib.suppress(OSError):  # what is not recycled is removed below
                    self.files.add_chunks_of(trash)
            shutil.rmtree(trash, ignore_errors=True)

        if background:
            self._in_background(remove)
        else:
            remove()

    def remove_leftovers(self, background: bool = False) -> list[Path]:
        """Delete this writer's temporary and trash directories (crash leftovers) and empty
        iteration directories; returns the leftovers. They are listed now, whatever
        ``background`` says: a write this process starts later (a load's write-back) is never
        taken for a leftover by the reaper thread."""
        with _LIVE_LOCK:
            others = [f"-{self._tag}-{i}" for i in _LIVE_WRITERS.get(self._live_key, ())
                      if i != self._instance]
        found = [p for p in find_leftovers(self.session_path, self.writer_rank)
                 if not any(o in p.name for o in others)]  # another open store's write
        if not background:
            remove_paths(self.session_path, found)
        else:
            self._in_background(partial(remove_paths, self.session_path, found))
        return found


def _content_key(path: Path, st: os.stat_result) -> tuple[str, int, int, int]:
    return (str(path), st.st_ino, st.st_mtime_ns, st.st_size)


