"""Reading one shard: the manifest, and the chunks scattered straight into tensors, verified.

The counterpart of :mod:`localckpt.storage.shard_writer`;
:class:`localckpt.storage.store.ShardStore` decides which shard and where the bytes go.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import json
import os
import stat
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

from ..errors import CorruptShardError
from .checksum import crc32c
from .device_reader import DeviceScatter
from .manifest import GROUP_PREFIX, GROUP_SUFFIX, ShardManifest
from .views import SmallTarget, address_of, copy_out

_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)  # buffers per preadv call
_WINDOW = 1 << 20  # bytes read and checksummed at a time (well inside a core's L2 cache)
# ... except into a pinned slot: there a whole chunk at a time. Loading 4 GiB onto an H100
# (16 cores, 2 MiB of L2 each, 300 MiB of L3), 1 / 4 / 16 MiB windows took 367 / 289 / 280 ms
# on 8 threads, 338 / 251 / 215 ms on 12: between small windows the readers wait for the GIL.
_DEVICE_WINDOW = 16 << 20


def read_chunks_into(chunk_dir: Path, manifest: ShardManifest,
                     targets: Sequence[tuple[int, memoryview]], pool: ThreadPoolExecutor | None,
                     chunks: range | None = None, device: DeviceScatter | None = None,
                     small: Sequence[SmallTarget] = ()) -> None:
    """Read the chunks under ``chunk_dir`` (all, or ``chunks``) into ``targets`` (see
    ShardStore.read_into) and ``small`` (memory this process allocated, up to
    COPY_OUT_MAX_NBYTES each: read with the bytes around them into scratch memory and copied
    out), one chunk per task on ``pool`` (None: on this thread); with ``device``, the bytes of
    the tensors it holds go through its pinned slots to the device (bytes no target covers land
    there too), and every copy is complete on return. Raises CorruptShardError naming the first
    bad file."""
    reads = ChunkReads(chunk_dir, manifest, pool, device)
    try:
        # State-dict order is not offset order: small CUDA tensors are packed first (staging.py).
        ordered = sorted(targets, key=lambda target: target[0])
        in_order = sorted(small)
        into = (ordered, [off for off, _ in ordered], in_order, [off for off, _, _ in in_order])
        for i in range(manifest.chunk_count) if chunks is None else chunks:
            reads.submit(i, into)
    finally:
        reads.wait()


# Where a chunk's bytes go: targets read into (offset in the packed data, buffer) sorted by
# offset, their offsets, small targets copied out of the window (sorted), their offsets. A
# target covering other chunks too, or only those, is skipped over.
ChunkTargets = tuple[Sequence[tuple[int, memoryview]], Sequence[int], Sequence[SmallTarget],
                     Sequence[int]]


class ChunkReads:
    """The reads of one shard's chunks, each queued once the memory its bytes go to is known
    (a load allocates its tensors while the first chunks are read: :mod:`.tensor_reads`).

    :meth:`submit` and :meth:`wait` are called by one thread; each read runs on ``pool`` (None:
    inside :meth:`submit`, which then raises its error)."""

    def __init__(self, chunk_dir: Path, manifest: ShardManifest, pool: ThreadPoolExecutor | None,
                 device: DeviceScatter | None = None) -> None:
        self.chunk_dir, self.manifest, self.pool, self.device = chunk_dir, manifest, pool, device
        self._futures: list[Future[None]] = []
        self.failed = False  # a read raised: what is still to be queued is of no use

    def submit(self, i: int, into: ChunkTargets) -> None:
        """Queue the read of chunk ``i`` into ``into``'s targets (those of other chunks
        are skipped over)."""
        if self.pool is None:
            self._one(i, into)
        else:
            self._futures.append(self.pool.submit(self._one, i, into))

    def wait(self) -> None:
        """Block until every queued read returned and, with a device, every copy is complete;
        then raise the error of the first chunk queued that failed. Every read is over before
        this returns or raises, failed or not, also when interrupted (a KeyboardInterrupt drops
        the reads not started yet): a read still running after would go on writing into buffers
        the caller reuses or frees."""
        try:
            try:
                wait(self._futures)
            except BaseException:  # Ctrl-C: the reads not started are dropped, the rest end
                for f in self._futures:
                    f.cancel()
                _wait_through_interrupts(self._futures)
                raise
            for f in self._futures:
                f.result()
        finally:
            if self.device is not None:
                self.device.finish()

    def _one(self, i: int, into: ChunkTargets) -> None:
        try:
            device = self.device
            if device is None or not device.holds(i):
                self._read(i, None, into)
                return
            slot = device.take()
            try:
                self._read(i, slot.host, into)
                device.copy_out(slot, i)
            finally:
                device.give(slot)
        except BaseException:
            self.failed = True
            raise

    def _read(self, i: int, fill: memoryview | None, into: ChunkTargets) -> None:
        manifest = self.manifest
        size = manifest.chunk_nbytes
        path = self.chunk_dir / str(i)
        targets, starts, small, small_starts = into
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise unreadable(path, exc, "chunk file") from exc
        crc, got = 0, 0
        if fill is None:  # bytes no target covers go to this thread's scratch window
            window = _WINDOW
            scratch, scratch_at = _scratch()
        else:
            window = _DEVICE_WINDOW
            fill_at = address_of(fill) if small else 0
        try:
            # A window at a time, its CRC taken while its bytes are still in the cache: a
            # second pass over a whole chunk from memory costs half as much again as the read.
            for lo in range(0, size, window):
                hi = min(lo + window, size)
                first, last = i * size + lo, i * size + hi
                if fill is None:
                    pieces = _pieces(targets, starts, first, last, scratch, first)
                else:
                    pieces = _pieces(targets, starts, first, last, fill, i * size)
                n = _preadv_all(fd, list(pieces), lo)
                got += n
                if n != hi - lo:
                    break
                for piece in pieces:
                    crc = crc32c(piece, crc)
                if small:
                    copy_out(small, small_starts, first, last,
                             *((scratch_at, first) if fill is None else (fill_at, i * size)))
            trailer = os.pread(fd, 5, size)
        except OSError as exc:
            raise unreadable(path, exc, "chunk file") from exc
        finally:
            os.close(fd)
        if got != size or len(trailer) != 4:
            raise CorruptShardError(
                f"{path}: expected {size + 4} bytes, file has {got + len(trailer)}"
                f"{'+' if len(trailer) > 4 else ''} (truncated or overwritten)")
        stored = int.from_bytes(trailer, "little")
        if crc != stored or crc != manifest.chunk_crc32c[i]:
            raise CorruptShardError(
                f"{path}: checksum mismatch (computed crc32c {crc:#010x}, file says "
                f"{stored:#010x}, manifest says {manifest.chunk_crc32c[i]:#010x})"
            )


def _wait_through_interrupts(futures: Sequence[Future[None]]) -> None:
    """Wait until every one of ``futures`` is done, however often interrupted (each is one
    chunk's read: milliseconds)."""
    while True:
        try:
            wait(futures)
            return
        except BaseException:  # a read must not outlive the call
            continue


# Reading a copy can fail because of this process or machine (no descriptors or memory left,
# no permission, interrupted): that says nothing about the copy, is raised as it is, and a
# healthy shard is never quarantined for it. Any other error (ENOENT, EIO, EBADMSG and ENODATA
# from a file system's own checksums, ESTALE, ELOOP...) means this copy cannot be used.
_NOT_THE_COPY = (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EACCES, errno.EPERM,
                 errno.EINTR, errno.EAGAIN, errno.ENOBUFS,
                 errno.EFAULT)  # the destination memory is not writable (load(into=...))


def unreadable(path: Path, exc: OSError, what: str) -> OSError:
    """The error for an OSError reading ``path``: CorruptShardError unless the trouble is this
    process's rather than the copy's."""
    if isinstance(exc, CorruptShardError) or exc.errno is None or exc.errno in _NOT_THE_COPY:
        return exc  # already a verdict, not a system call's error, or not the copy's trouble
    reason = "missing" if exc.errno == errno.ENOENT else f"unreadable ({exc.strerror})"
    return CorruptShardError(f"{path}: {what} {reason}")


_DECODER = json.JSONDecoder()


def parse_manifest_file(data: bytes, where: str) -> ShardManifest:
    """The manifest in the attributes of a shard group's zarr.json ``data`` read from ``where``.

    A file laid out as localckpt writes it (GROUP_PREFIX, the manifest's JSON, GROUP_SUFFIX) is
    parsed from that span alone, and the span becomes the manifest's ``encoded`` bytes (what a
    peer or the durable tier is sent) instead of the manifest being encoded again (about 35 ms
    for 10,000 tensors, on the serving rank's path of a restore): the bytes sent are the very
    bytes verified. Written by this version the span is canonical and its checksum is taken
    over it as it is (ShardManifest.from_canonical_envelope); an earlier writer's is encoded
    again to be checked. Any other layout, or an envelope with keys besides the manifest and
    its checksum, is parsed whole (and its manifest encoded again when sent)."""
    if data.startswith(GROUP_PREFIX) and data.endswith(GROUP_SUFFIX):
        manifest = ShardManifest.from_canonical_envelope(
            data[len(GROUP_PREFIX) : -len(GROUP_SUFFIX)], where)
        if manifest is not None:  # as this version writes it: verified without re-encoding
            return manifest
        try:  # as earlier writers laid it out: spaced, its checksum over another encoding
            text = data.decode()
            envelope, end = _DECODER.raw_decode(text, len(GROUP_PREFIX))
        except (ValueError, RecursionError):  # not as we write it: the whole file says why
            pass
        else:
            # Nothing beside what the checksum covers: those bytes are sent on as they are.
            if text[end:] == GROUP_SUFFIX.decode() and type(envelope) is dict and \
                    envelope.keys() == {"manifest", "crc32c"}:
                manifest = ShardManifest.from_json_dict(envelope, where)
                manifest.__dict__["encoded"] = data[len(GROUP_PREFIX):-len(GROUP_SUFFIX)]
                return manifest
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:  # nesting deeper than the parser's stack
        raise CorruptShardError(f"{where}: unreadable manifest ({exc})") from exc
    attrs = doc.get("attributes") if isinstance(doc, dict) else None
    return ShardManifest.from_json_dict(
        attrs.get("localckpt") if isinstance(attrs, dict) else None, where)


_local = threading.local()


def _scratch() -> tuple[memoryview, int]:
    """This thread's scratch window (_WINDOW bytes, kept for the thread's life) and its
    address."""
    found: tuple[memoryview, int] | None = getattr(_local, "scratch", None)
    if found is None or len(found[0]) < _WINDOW:
        array = (ctypes.c_char * _WINDOW)()
        found = _local.scratch = (memoryview(array).cast("B"), ctypes.addressof(array))
    return found


def _pieces(targets: Sequence[tuple[int, memoryview]], starts: Sequence[int], lo: int,
            hi: int, fill: memoryview, base: int) -> list[memoryview]:
    """The buffers that bytes [lo, hi) of the packed data go to, in order. Bytes no target
    covers go to ``fill``, which holds packed offset ``base`` at its start."""
    pieces: list[memoryview] = []
    pos = lo

    def gap(begin: int, end: int) -> None:
        pieces.append(fill[begin - base : end - base])

    k = max(bisect.bisect_right(starts, lo) - 1, 0)
    while k < len(targets) and targets[k][0] < hi:
        off, view = targets[k]
        begin, end = max(off, pos), min(off + len(view), hi)
        if end > begin:
            if begin > pos:  # alignment padding between tensors, or a device tensor's bytes
                gap(pos, begin)
            pieces.append(view[begin - off : end - off])
            pos = end
        k += 1
    if pos < hi:  # padding at the end of the data
        gap(pos, hi)
    return pieces


def _preadv_all(fd: int, pieces: list[memoryview], offset: int) -> int:
    """preadv into ``pieces`` until they are full or the file ends; returns bytes read."""
    total, i = 0, 0
    while i < len(pieces):
        n = os.preadv(fd, pieces[i : i + _IOV_MAX], offset + total)
        if n == 0:
            break
        total += n
        while i < len(pieces) and n >= len(pieces[i]):
            n -= len(pieces[i])
            i += 1
        if n:
            pieces[i] = pieces[i][n:]
    return total


def check_chunk_files(chunk_dir: Path, manifest: ShardManifest) -> None:
    """Every chunk file must be a regular file of ``chunk_nbytes`` + 4 bytes: checked before a
    reader allocates what the manifest claims (a forged manifest could claim terabytes)."""
    want = manifest.chunk_nbytes + 4
    for i in range(manifest.chunk_count):
        path = chunk_dir / str(i)
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError as exc:
            raise unreadable(path, exc, "chunk file") from exc
        if not stat.S_ISREG(st.st_mode) or st.st_size != want:
            raise CorruptShardError(
                f"{path}: expected a {want}-byte chunk file as the manifest says, found "
                f"{st.st_size if stat.S_ISREG(st.st_mode) else 'no regular file'} "
                "(truncated, overwritten or forged)")
