"""Shards to and from peers: sending committed (or staged) shards over the executor of
:mod:`replication`, and committing what peers send through the store as it arrives.

Used by the save path (replicas) and the load path (fetching after node loss).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

from replication import ExchangePlan, Transfer
from replication.executor import Outgoing, Receiver, Sink, Source, run_exchange

from ..control.collectives import CheckpointGroup, collective_error
from ..errors import CorruptShardError
from ..gc_pause import gc_paused
from ..ops.faults import fault_point
from ..save.staging import unpack
from .host_memory import empty_host
from .manifest import ShardManifest, dtype_from_name
from .shard_writer import ShardWriter
from .store import ShardStore
from .views import byte_view

logger = logging.getLogger(__name__)


PIECE_TARGET_NBYTES = 64 << 20


def piece_nbytes(manifest: ShardManifest) -> int:
    """Bytes per message on the wire: whole chunks, about 64 MiB (one message per 16 MiB chunk
    measured 40% slower than one per shard on gloo loopback)."""
    return manifest.chunk_nbytes * max(1, PIECE_TARGET_NBYTES // manifest.chunk_nbytes)


def piece_count(chunk_nbytes: int, chunk_count: int) -> int:
    """Messages a shard of ``chunk_count`` chunks takes on the wire (each bounded by the
    timeout: what an agreement after transfers must allow for)."""
    per_piece = max(1, PIECE_TARGET_NBYTES // chunk_nbytes)
    return max(1, -(-chunk_count // per_piece))


class PieceRing:
    """A few receive buffers reused for every incoming piece, transfer and save: received bytes
    land in memory that is already mapped (a fresh buffer per shard doubled the transfer time
    with page faults), and receive memory stays bounded whatever the shard size."""

    def __init__(self, slots: int = 3) -> None:
        self.slots = slots
        self._buffers: list[torch.Tensor] = []

    def release(self) -> None:
        """Free the buffers (they are allocated again on use)."""
        self._buffers = []

    def reserve(self, nbytes: int) -> None:
        """Every slot at least ``nbytes`` now, its pages touched. Safe beside a thread using
        the ring (a load's write-back): a buffer is touched before it is put in its slot, and
        one already handed out is never written here."""
        for k in range(self.slots):
            self._grown(k, nbytes, touched=True)

    def slot(self, index: int, nbytes: int) -> torch.Tensor:
        k = index % self.slots
        return self._grown(k, nbytes)[:nbytes]

    def _grown(self, k: int, nbytes: int, touched: bool = False) -> torch.Tensor:
        while len(self._buffers) <= k:
            self._buffers.append(torch.empty(0, dtype=torch.uint8))
        if self._buffers[k].numel() < nbytes:
            # Kept across saves: not an inference tensor (see StagingArena.buffer).
            with torch.inference_mode(False):
                grown = empty_host(nbytes)
                if touched:
                    grown.zero_()
                self._buffers[k] = grown
        return self._buffers[k]


def prefix_nbytes(manifest: ShardManifest, prefix: int | None) -> int:
    """The bytes of ``manifest``'s data that hold its first ``prefix`` bytes, in whole chunks
    (each checked against its CRC); None: all of it."""
    total = manifest.chunk_count * manifest.chunk_nbytes
    if prefix is None:
        return total
    return min(total, -(-max(prefix, 0) // manifest.chunk_nbytes) * manifest.chunk_nbytes)


def received_manifest(t: Transfer, meta: bytes, nbytes: int, world_size: int,
                      prefix: int | None = None) -> tuple[ShardManifest, str]:
    """The manifest a peer sent for transfer ``t`` (and how errors name the shard), checked to
    be that shard's, of ``nbytes`` bytes (with ``prefix``: the chunks holding its first
    ``prefix`` bytes, :func:`prefix_nbytes`). Raises CorruptShardError. The session may differ,
    as on the local read path: a session directory copied or renamed on purpose (the load path
    warns about it)."""
    where = f"shard (iteration {t.iteration}, owner {t.owner}) from rank {t.src}"
    with gc_paused():  # parsing allocates ~10 objects per tensor; see gc_paused
        m = ShardManifest.from_json_bytes(meta, where)
    expected = (t.iteration, t.owner, world_size)
    got = (m.iteration, m.owner_rank, m.world_size)
    if got != expected or nbytes != prefix_nbytes(m, prefix):
        raise CorruptShardError(f"{where}: manifest says (iteration, owner, world) = {got} "
                                f"and {nbytes} bytes are sent, expected {expected} and "
                                f"{prefix_nbytes(m, prefix)} bytes")
    return m, where


class StoreReceiver:
    """Receives one shard and commits it through the store as it arrives: the chunks of piece i
    are checksummed and written while piece i+1 is still on the wire; the commit checks every
    chunk against the sender's manifest. Pieces cycle through the ``ring``'s buffers."""

    def __init__(self, store: ShardStore, t: Transfer, meta: bytes, nbytes: int,
                 world_size: int, ring: PieceRing) -> None:
        self.manifest = m = received_manifest(t, meta, nbytes, world_size)[0]
        self._ring = ring
        self._store = store
        self._in_slot: dict[int, range] = {}  # ring slot -> chunks whose bytes it holds
        self._current = torch.empty(0, dtype=torch.uint8)  # the piece being received
        self._writer: ShardWriter = store.begin_write(m)

    def piece_buffer(self, index: int, start: int, end: int) -> torch.Tensor:
        for chunk in self._in_slot.pop(index % self._ring.slots, range(0)):
            self._writer.wait_chunk(chunk)  # the slot's previous bytes are on disk
        self._current = self._ring.slot(index, end - start)
        return self._current

    def piece_received(self, index: int, start: int, end: int) -> None:
        size = self.manifest.chunk_nbytes
        if (end - start) % size or start % size:
            raise CorruptShardError(f"piece [{start}, {end}) is not made of whole {size}-byte "
                                    "chunks")
        view = byte_view(self._current)
        chunks = range(start // size, end // size)
        for j, chunk in enumerate(chunks):
            self._writer.submit_chunk(chunk, view[j * size : (j + 1) * size])
        self._in_slot[index % self._ring.slots] = chunks

    def finish(self) -> None:
        self._store.commit(self._writer)

    def abort(self) -> None:
        self._writer.abort()


def exchange_shards(plan: ExchangePlan, group: CheckpointGroup, store: ShardStore,
                    world_size: int,
                    source: Callable[[Transfer], tuple[ShardManifest, torch.Tensor]],
                    ring: PieceRing,
                    received: dict[tuple[int, int], StoreReceiver] | None = None,
                    sink: Sink | None = None) -> None:
    """Run this rank's part of ``plan``, sending in-memory shards (``source``); raise the first
    local failure (the caller agrees). Received shards are committed to ``store`` (and listed in
    ``received``), or go to ``sink`` when one is given. A failure of the group itself raises
    CollectiveError (see :func:`run_transfers`)."""
    def send(t: Transfer) -> Outgoing:
        fault_point("replica_send", group.rank, t.iteration)
        manifest, payload = source(t)
        return Outgoing.of_tensor(manifest.encoded, payload, piece_nbytes(manifest))

    def commit(t: Transfer, meta: bytes, nbytes: int) -> StoreReceiver:
        receiver = StoreReceiver(store, t, meta, nbytes, world_size, ring)
        if received is not None:
            received[t.shard] = receiver
        return receiver

    failures = run_transfers(plan, group, send, sink or commit)
    if failures:
        raise failures[0][1]


def run_transfers(plan: ExchangePlan, group: CheckpointGroup, source: Source, sink: Sink
                  ) -> list[tuple[Transfer, BaseException]]:
    """Run this rank's part of ``plan``; return the transfers that failed on this rank's side
    (logged), for the caller to agree on. A failure of the group itself (a peer died, a timeout,
    a misrouted stream) leaves it unusable: that raises CollectiveError, now and for every later
    transfer on it."""
    what = f"shard transfers of iteration {plan.transfers[0].iteration}" if plan.transfers \
        else "shard transfers"
    group.check_usable(what)
    started = time.monotonic()
    try:
        failures = run_exchange(plan, group.rank, source, sink, group.group)
    except Exception as exc:  # the streams cannot be realigned after this
        err = collective_error(what, exc, time.monotonic() - started, group.timeout)
        group.mark_broken(err)
        raise err from exc
    for t, error in failures:
        logger.error("transfer of shard %s from rank %d to rank %d failed: %s", t.shard, t.src,
                     t.dst, error)
    return failures


class _Sinking(Protocol):
    def sink(self, t: Transfer, meta: bytes, nbytes: int) -> Receiver: ...


R = TypeVar("R", bound=_Sinking)


def built_or_draining(build: Callable[[], R]) -> tuple[Callable[[], R], Sink]:
    """For a rank about to receive transfers into what ``build()`` makes (a parity block, a
    rebuilt shard): that object (a callable returning it) and its ``sink``. When building
    fails (no memory for the block), the sink fails every transfer instead, so that the
    streams are still drained and no peer waits on this rank; the callable then raises that
    error, for the caller to report after the transfers, through its agreement."""
    try:
        built = build()
    except Exception as exc:
        error = exc

        def failed() -> R:
            raise error

        def refuse(t: Transfer, meta: bytes, nbytes: int) -> Any:
            raise error
        return failed, refuse
    return lambda: built, built.sink


def tensors_from_buffer(manifest: ShardManifest, buffer: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor of ``manifest`` copied out of the packed ``buffer`` into its own storage."""
    return unpack(buffer, [(e.offset, e.nbytes, dtype_from_name(e.dtype), e.shape)
                           for e in manifest.tensors])
