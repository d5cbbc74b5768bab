"""Writing one shard: chunk files, metadata, fsync, atomic rename.

Chunks may be handed over in any order and while others are still arriving (from the staging
buffer, or piece by piece from the network), so a replica is checksummed and written while the
rest of it is still being received.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import CorruptShardError, InsufficientSpaceError
from ..ops.faults import fault_point
from . import fsutil
from .checksum import crc32c
from .fsutil import DIR_MODE, FILE_MODE, fsync_dir, make_private_dirs
from .layout import save_marker, trash_name
from .manifest import GROUP_PREFIX, GROUP_SUFFIX, ShardManifest
from .recycle import FilePool

logger = logging.getLogger(__name__)

_WRITE_BLOCK = 1 << 30  # one os.write stays under the kernel's 2 GiB per-call cap
_CRC_WINDOW = 1 << 20  # bytes checksummed then written at a time (inside a core's L2 cache)


def array_metadata(chunk_nbytes: int, chunk_count: int) -> dict[str, Any]:
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [chunk_nbytes * chunk_count],
        "data_type": "uint8",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [chunk_nbytes]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0,
        "codecs": [{"name": "bytes"}, {"name": "crc32c"}],
        "attributes": {},
        "storage_transformers": [],
    }


def group_metadata(manifest: ShardManifest) -> bytes:
    """The group's zarr.json: the manifest under ``attributes["localckpt"]``."""
    return GROUP_PREFIX + manifest.encoded + GROUP_SUFFIX


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        written = os.write(fd, view[:_WRITE_BLOCK])
        view = view[written:]


def _write_file(path: Path, data: bytes | memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        _write_all(fd, memoryview(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_chunk(path: Path, chunk: memoryview, files: FilePool | None) -> int:
    """Write ``chunk`` and its CRC-32C trailer to a new file at ``path``, or over a retired
    chunk file taken from ``files``; returns the CRC. A block at a time, checksummed just before
    it is written: the write then reads it from the cache, not a second time from memory (a
    tenth of a fresh tmpfs write for the whole chunk at once)."""
    crc = 0
    reused = files is not None and files.take(path)
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | (0 if reused else os.O_CREAT | os.O_EXCL),
                 FILE_MODE)
    try:
        for start in range(0, len(chunk), _CRC_WINDOW):
            block = chunk[start: start + _CRC_WINDOW]
            crc = crc32c(block, crc)
            _write_all(fd, block)
        _write_all(fd, memoryview(crc.to_bytes(4, "little")))
        if reused:  # a retired file may have been longer
            os.ftruncate(fd, len(chunk) + 4)
        os.fsync(fd)
    finally:
        os.close(fd)
    return int(crc)


def chunk_files_off(chunk_dir: Path, count: int) -> tuple[list[str], list[str]]:
    """The names missing from a shard's chunk directory of ``count`` chunks, and those in it
    that are no chunk of the shard."""
    names, want = set(os.listdir(chunk_dir)), {str(i) for i in range(count)}
    return sorted(want - names, key=int), sorted(names - want)


class ShardWriter:
    """A shard being written into ``.tmp-*`` next to its final path.

    ``submit_chunk`` queues a chunk (checksum + write on the I/O threads; the view must stay valid
    until ``commit`` or ``abort`` returns). ``commit`` waits for every chunk, checks the checksums
    against ``manifest.chunk_crc32c`` when the manifest carries them (a received replica),
    writes the metadata last, fsyncs and renames. ``abort`` removes the temporary directory.
    Raises InsufficientSpaceError on ENOSPC and CorruptShardError on a checksum mismatch.
    """

    def __init__(self, manifest: ShardManifest, final: Path, writer_rank: int,
                 pool: ThreadPoolExecutor, files: FilePool | None = None,
                 fault_points: bool = True, stopped: threading.Event | None = None,
                 instance: str = "") -> None:
        self.manifest = manifest
        self._stopped = stopped  # set: the owner closed, nothing may be committed any more
        self._fault_points = fault_points  # the node root's writes (not the durable tier's)
        self.final = final
        self._writer_rank = writer_rank
        self._pool = pool
        self._files = files  # retired chunk files to write over (see recycle.py)
        self._futures: dict[int, Future[int]] = {}
        # <writer rank>-<the store's instance><random>: see store._LIVE_WRITERS
        self.tmp = final.parent / (f".tmp-{final.name}-w{writer_rank:05d}-"
                                   f"{(instance + uuid.uuid4().hex)[:12]}")
        try:
            self._make_dirs()
        except OSError as exc:
            shutil.rmtree(self.tmp, ignore_errors=True)  # made before a later mkdir failed
            raise self._translate(exc, False) from exc

    def _make_dirs(self) -> None:
        """The iteration directory (durable, 0700) and the temporary shard directory in it. A
        node mate's cleanup may remove a new iteration directory while it is still empty: then
        it is created again."""
        for attempt in range(5):
            make_private_dirs(self.final.parent)
            try:
                os.mkdir(self.tmp, DIR_MODE)
                break
            except FileNotFoundError:
                if attempt == 4:
                    raise
        os.mkdir(self.tmp / "data", DIR_MODE)
        os.mkdir(self.tmp / "data" / "c", DIR_MODE)

    def submit_chunk(self, index: int, chunk: memoryview) -> None:
        if not 0 <= index < self.manifest.chunk_count or len(chunk) != self.manifest.chunk_nbytes:
            raise ValueError(f"chunk {index} of {len(chunk)} bytes: expected index < "
                             f"{self.manifest.chunk_count} and {self.manifest.chunk_nbytes} bytes")
        path = self.tmp / "data" / "c" / str(index)
        own = self.manifest.owner_rank == self._writer_rank

        def write() -> int:
            if index == 0 and self._fault_points:
                fault_point("local_write" if own else "replica_receive", self._writer_rank,
                            self.manifest.iteration)
            return _write_chunk(path, chunk, self._files)

        try:
            self._futures[index] = self._pool.submit(write)
        except RuntimeError:
            # The interpreter is shutting down (pools refuse new work before atexit handlers
            # run) while a pending save is being drained: write in this thread instead.
            done: Future[int] = Future()
            try:
                done.set_result(write())
            except BaseException as exc:
                done.set_exception(exc)
            self._futures[index] = done

    def wait_chunk(self, index: int) -> None:
        """Block until chunk ``index`` is written (its buffer may then be reused); re-raises a
        write error."""
        self._futures[index].result()

    def commit(self) -> Path:
        """Wait for every chunk, verify, write metadata, fsync and rename; the final path."""
        manifest = self.manifest
        try:
            if sorted(self._futures) != list(range(manifest.chunk_count)):
                raise ValueError(f"{self.final}: {len(self._futures)} of {manifest.chunk_count} "
                                 "chunks were submitted")
            crcs = tuple(self._futures[i].result() for i in range(manifest.chunk_count))
            if manifest.chunk_crc32c and crcs != manifest.chunk_crc32c:
                bad = next(i for i, (a, b) in enumerate(zip(crcs, manifest.chunk_crc32c,
                                                            strict=True)) if a != b)
                raise CorruptShardError(
                    f"{self.final}: received chunk {bad} has crc32c {crcs[bad]:#010x}, its "
                    f"manifest says {manifest.chunk_crc32c[bad]:#010x}; not committed")
            if crcs != manifest.chunk_crc32c:
                manifest = replace(manifest, chunk_crc32c=crcs)
            tmp = self.tmp
            self._check_chunk_files()
            _write_file(tmp / "data" / "zarr.json",
                        json.dumps(array_metadata(manifest.chunk_nbytes,
                                                  manifest.chunk_count)).encode())
            _write_file(tmp / "zarr.json", group_metadata(manifest))
            if (marker := save_marker(manifest.metadata.get("save_id"))) is not None:
                # empty: the directory's fsync below makes its name durable; in the array's
                # directory, which zarr never lists (in the group's, a reader would warn)
                os.close(os.open(tmp / "data" / marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                 FILE_MODE))
            for d in (tmp / "data" / "c", tmp / "data", tmp):
                fsync_dir(d)
            if manifest.owner_rank == self._writer_rank and self._fault_points:
                fault_point("before_commit", self._writer_rank, manifest.iteration)
            if self._stopped is not None and self._stopped.is_set():
                raise RuntimeError(f"{self.final}: not committed: its store was closed (a "
                                   "thread that outlived close() must not replace a shard)")
            self._rename_into_place()
            fsync_dir(self.final.parent)
        except BaseException as exc:
            gone = not os.path.lexists(self.tmp)  # before abort removes it
            self.abort()
            if isinstance(exc, OSError) and not isinstance(exc, CorruptShardError):
                raise self._translate(exc, gone) from exc
            raise
        self.manifest = manifest
        return self.final

    def _check_chunk_files(self) -> None:
        """Every chunk file written is still there, and nothing else: another process's cleanup
        (a second manager of the session on this node) must never make a shard with holes."""
        count = self.manifest.chunk_count
        missing, extra = chunk_files_off(self.tmp / "data" / "c", count)
        if missing or extra:
            raise CorruptShardError(
                f"{self.final}: {count - len(missing)} of {count} chunk files are in "
                f"{self.tmp / 'data' / 'c'} (removed while written?); not committed")

    def abort(self) -> None:
        for f in self._futures.values():
            f.exception()  # wait: no thread may still write into the directory we remove
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _rename_into_place(self) -> None:
        try:
            os.rename(self.tmp, self.final)
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        # The same id is already committed (a save of this iteration that failed elsewhere):
        # swap the two in one step, so a crash leaves the old or the new shard, never neither.
        if fsutil.rename_exchange(self.tmp, self.final):
            fsync_dir(self.final.parent)
            shutil.rmtree(self.tmp, ignore_errors=True)  # the old shard, now under tmp's name
            return
        # No RENAME_EXCHANGE here (an old kernel, NFS): old aside first, then the new one in.
        # Listing never sees a half-deleted shard, but a crash between the renames leaves none.
        logger.debug("%s: no atomic exchange on this file system; replacing in two renames",
                     self.final)
        trash = trash_name(self.final, self._writer_rank)
        os.rename(self.final, trash)
        try:
            os.rename(self.tmp, self.final)
        except BaseException:  # the old shard back: that id must not be left with no copy
            with contextlib.suppress(OSError):
                os.rename(trash, self.final)
            raise
        shutil.rmtree(trash, ignore_errors=True)

    def _translate(self, exc: OSError, gone: bool) -> OSError:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return InsufficientSpaceError(
                f"no space left writing shard {self.final}: {exc.strerror}. Enlarge the file "
                "system (Docker: --shm-size) or lower keep_last.")
        if exc.errno == errno.ENOENT and gone:
            return FileNotFoundError(
                errno.ENOENT, f"{self.final}: not committed: its temporary directory "
                f"{self.tmp.name} was removed while it was written (another process cleaning "
                "up this session's leftovers on this node: a second job or manager of the "
                f"session writing as rank {self._writer_rank}?)")
        return exc
