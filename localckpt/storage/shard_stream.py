"""Streaming a committed shard between ranks without holding it whole: the sender reads it from
disk piece by piece (the next piece read while this one is on the wire), every chunk checked
against its CRC-32C before it leaves; the receiver takes the bytes of each large tensor straight
into that tensor's own storage and checks every chunk's CRC-32C as it completes.

Used by the load path: a shard fetched after node loss goes into the owner's tensors, not to
disk first (the write-back is a later, separate transfer; see :mod:`localckpt.load.write_back`).
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from replication import Transfer
from replication.executor import Outgoing, segments

from ..errors import CorruptShardError
from .checksum import crc32c
from .layout import ShardRef
from .manifest import ShardManifest
from .peer_io import PieceRing, prefix_nbytes, received_manifest
from .store import ShardStore
from .tensor_reads import fresh_or_given
from .views import COPY_OUT_MAX_NBYTES, byte_view, copy_out

# A tensor at least this large is its own segment on the wire, received in place; smaller ones
# (and alignment padding) arrive in a scratch buffer and are copied out: one message per small
# tensor would cost more than the copy.
DIRECT_MIN_NBYTES = 1 << 20
STREAM_PIECE_NBYTES = 16 << 20  # a committed shard is streamed from disk in pieces of this


def tensor_splits(manifest: ShardManifest) -> tuple[int, ...]:
    """Where the segments of ``manifest``'s data are cut besides the pieces: around every tensor
    of at least DIRECT_MIN_NBYTES, so each arrives in segments lying inside it."""
    cuts: set[int] = set()
    for e in manifest.tensors:
        if e.nbytes >= DIRECT_MIN_NBYTES:
            cuts.update((e.offset, e.offset + e.nbytes))
    return tuple(sorted(cuts))


def stream_piece_nbytes(manifest: ShardManifest) -> int:
    """Bytes per piece when ``manifest``'s shard is streamed from disk: whole chunks, about
    STREAM_PIECE_NBYTES."""
    return manifest.chunk_nbytes * max(1, STREAM_PIECE_NBYTES // manifest.chunk_nbytes)


def wire_messages(manifest: ShardManifest, splits: tuple[int, ...] = ()) -> int:
    """How many messages :func:`outgoing_from_disk` sends for ``manifest``'s shard with
    ``splits`` (what a wait for that transfer must allow for: each is bounded by the timeout)."""
    return max(1, len(segments(manifest.chunk_count * manifest.chunk_nbytes,
                               stream_piece_nbytes(manifest), splits)))


def outgoing_from_disk(store: ShardStore, ref: ShardRef, manifest: ShardManifest,
                       ring: PieceRing, splits: tuple[int, ...] = (),
                       prefix: int | None = None) -> Outgoing:
    """``ref``'s committed data as an :class:`Outgoing` (with ``prefix``: only the chunks
    holding its first ``prefix`` bytes), read piece by piece into ``ring``'s buffers with one
    piece of read-ahead, on a thread of its own (not queued behind the I/O pool, where the
    rank's own shard may be being read). A chunk that fails its checksum raises
    CorruptShardError from ``read``."""
    # Pieces of about 16 MiB, not the 64 MiB a replica is sent in: the read of piece i + 1 then
    # overlaps the send of piece i even for a small shard (a 64 MiB shard was read whole, then
    # sent: its restore after node loss took 15% longer); the same at 256 MiB.
    piece = stream_piece_nbytes(manifest)
    total = prefix_nbytes(manifest, prefix)
    reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="localckpt-send")
    ahead: dict[int, Future[torch.Tensor]] = {}

    def load(index: int) -> torch.Tensor:
        start = index * piece
        buf = ring.slot(index, min(piece, total - start))
        store.read_range(ref, manifest, start, buf)
        return buf

    def read(start: int, end: int) -> torch.Tensor:
        index = start // piece
        current = ahead.pop(index, None) or reader.submit(load, index)
        if end < total:  # the ring has >= 3 slots: this piece's and the next one's differ
            ahead[index + 1] = reader.submit(load, index + 1)
        return current.result()

    def close() -> None:
        reader.shutdown(wait=True)  # a read-ahead still filling a ring slot finishes first

    return Outgoing(manifest.encoded, total, piece, read, splits, close)


class TensorReceiver:
    """Receives one shard into a CPU tensor per manifest entry (:attr:`tensors`, complete after
    :meth:`finish`): fresh, or the caller's (``into``, as in ShardStore.read_tensors). Segments
    inside one tensor land in it directly; the others pass through a ``ring`` buffer and are
    copied out. Every chunk's CRC-32C is checked against the sender's manifest as the chunk
    completes, on a thread of its own while the next segment arrives: CorruptShardError on a
    mismatch (from a later call or :meth:`finish`)."""

    def __init__(self, t: Transfer, meta: bytes, nbytes: int, world_size: int,
                 ring: PieceRing,
                 into: Callable[[ShardManifest], Sequence[torch.Tensor | None]] | None = None
                 ) -> None:
        self.manifest, self._where = received_manifest(t, meta, nbytes, world_size)
        m = self.manifest
        self._ring = ring
        given = into(m) if into is not None else None
        self.tensors = fresh_or_given(m, given)
        placed, small = [], []
        for k, (e, x) in enumerate(zip(m.tensors, self.tensors, strict=True)):
            if e.nbytes <= COPY_OUT_MAX_NBYTES and (given is None or given[k] is None):
                if e.nbytes:  # fresh: this process's memory, copied out of the ring
                    small.append((e.offset, x.data_ptr(), e.nbytes))
            else:
                placed.append((e.offset, byte_view(x)))
        placed.sort(key=lambda p: p[0])
        self._starts = [off for off, _ in placed]
        self._views = [view for _, view in placed]
        self._small = sorted(small)
        self._small_starts = [off for off, _, _ in self._small]
        self._current_at = 0  # the scratch piece's address
        self._crc = [0] * m.chunk_count
        self._done = [0] * m.chunk_count  # bytes of each chunk checked so far
        self._current: memoryview = memoryview(b"")
        self._scratch = False
        self._checker: ThreadPoolExecutor | None = None
        self._checks: list[Future[None]] = []
        self._slot_checks: dict[int, Future[None]] = {}  # ring slot -> its last check

    def _holder(self, start: int, end: int) -> int | None:
        """The target whose bytes include all of [start, end), if one does."""
        k = bisect.bisect_right(self._starts, start) - 1
        if k >= 0 and end <= self._starts[k] + len(self._views[k]):
            return k
        return None

    def piece_buffer(self, index: int, start: int, end: int) -> torch.Tensor:
        k = self._holder(start, end)
        self._scratch = k is None
        if k is None:
            slot = index % self._ring.slots
            pending = self._slot_checks.pop(slot, None)
            if pending is not None:  # the slot's previous bytes are copied out and checked
                pending.result()
            buf = self._ring.slot(index, end - start)
            self._current, self._current_at = byte_view(buf), buf.data_ptr()
            return buf
        off = self._starts[k]
        self._current = self._views[k][start - off : end - off]
        return torch.frombuffer(self._current, dtype=torch.uint8)

    def piece_received(self, index: int, start: int, end: int) -> None:
        if self._checker is None:
            self._checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="localckpt-crc")
        # Copied out and checked on the checker thread while the next segment is on the wire;
        # one thread, so each chunk's checksum runs over its segments in order.
        check = self._checker.submit(self._check, self._current, start, end,
                                     self._current_at if self._scratch else None)
        self._checks.append(check)
        if self._scratch:
            self._slot_checks[index % self._ring.slots] = check
        if check.done():
            check.result()  # fail early when it already failed

    def _check(self, view: memoryview, start: int, end: int, scratch_at: int | None) -> None:
        if scratch_at is not None:  # copy out into every target the segment overlaps
            k = max(bisect.bisect_right(self._starts, start) - 1, 0)
            while k < len(self._starts) and self._starts[k] < end:
                off, target = self._starts[k], self._views[k]
                lo, hi = max(off, start), min(off + len(target), end)
                if hi > lo:
                    target[lo - off : hi - off] = view[lo - start : hi - start]
                k += 1
            copy_out(self._small, self._small_starts, start, end, scratch_at, start)
        size, m = self.manifest.chunk_nbytes, self.manifest
        pos = start
        while pos < end:
            chunk = pos // size
            stop = min((chunk + 1) * size, end)
            self._crc[chunk] = crc32c(view[pos - start : stop - start], self._crc[chunk])
            self._done[chunk] += stop - pos
            if self._done[chunk] == size and self._crc[chunk] != m.chunk_crc32c[chunk]:
                raise CorruptShardError(
                    f"{self._where}: chunk {chunk} failed its checksum on arrival (computed "
                    f"crc32c {self._crc[chunk]:#010x}, manifest says "
                    f"{m.chunk_crc32c[chunk]:#010x})")
            pos = stop

    def _drain(self) -> None:
        """Wait for every check; raise the first failure."""
        try:
            for check in self._checks:
                check.result()
        finally:
            if self._checker is not None:
                self._checker.shutdown(wait=True)
            self._checks, self._slot_checks = [], {}

    def finish(self) -> None:
        self._drain()
        short = [c for c, n in enumerate(self._done) if n != self.manifest.chunk_nbytes]
        if short:
            raise CorruptShardError(f"{self._where}: chunks {short[:8]} did not arrive whole")

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._drain()
        self.tensors = []
