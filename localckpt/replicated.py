"""Replication glue between the shard store and :mod:`replication`: sending committed shards to
the ranks a strategy names, and restoring after node loss (fetch, verify, write back).

Every function here is called by all ranks together (from LocalCheckpointManager) and runs its
global decisions as pure plans over gathered inventories.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from replication import (
    ExchangePlan,
    Placement,
    RetrievalPlan,
    Topology,
    Transfer,
    retrieval_plan,
    wanted_shards,
)
from replication.executor import run_exchange

from .collectives import CheckpointGroup
from .coverage import Inventory
from .errors import CorruptShardError, NoCheckpointError
from .faults import fault_point
from .gc_pause import gc_paused
from .manifest import ShardManifest, dtype_from_name
from .shard_writer import ShardWriter
from .staging import unpack
from .store import ShardRef, ShardStore, byte_view

logger = logging.getLogger(__name__)


PIECE_TARGET_NBYTES = 64 << 20


def piece_nbytes(manifest: ShardManifest) -> int:
    """Bytes per message on the wire: whole chunks, about 64 MiB (one message per 16 MiB chunk
    measured 40% slower than one per shard on gloo loopback)."""
    return manifest.chunk_nbytes * max(1, PIECE_TARGET_NBYTES // manifest.chunk_nbytes)


class PieceRing:
    """A few receive buffers reused for every incoming piece, transfer and save: received bytes
    land in memory that is already mapped (a fresh buffer per shard doubled the transfer time
    with page faults), and receive memory stays bounded whatever the shard size."""

    def __init__(self, slots: int = 3) -> None:
        self.slots = slots
        self._buffers: list[torch.Tensor] = []

    def slot(self, index: int, nbytes: int) -> torch.Tensor:
        k = index % self.slots
        while len(self._buffers) <= k:
            self._buffers.append(torch.empty(0, dtype=torch.uint8))
        if self._buffers[k].numel() < nbytes:
            self._buffers[k] = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffers[k][:nbytes]


class StoreReceiver:
    """Receives one shard and commits it through the store as it arrives: the chunks of piece i
    are checksummed and written while piece i+1 is still on the wire; the commit checks every
    chunk against the sender's manifest. Pieces cycle through the ``ring``'s buffers."""

    def __init__(self, store: ShardStore, t: Transfer, meta: bytes, nbytes: int,
                 world_size: int, ring: PieceRing) -> None:
        where = f"shard (iteration {t.iteration}, owner {t.owner}) from rank {t.src}"
        with gc_paused():  # parsing allocates ~10 objects per tensor; see gc_paused
            self.manifest = ShardManifest.from_json_bytes(meta, where)
        m = self.manifest
        expected = (store.session_id, t.iteration, t.owner, world_size)
        got = (m.session_id, m.iteration, m.owner_rank, m.world_size)
        if got != expected or nbytes != m.chunk_count * m.chunk_nbytes:
            raise CorruptShardError(f"{where}: manifest says (session, iteration, owner, world) = "
                                    f"{got} and {nbytes} bytes, expected {expected}")
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
                    received: dict[tuple[int, int], StoreReceiver] | None = None) -> None:
    """Run this rank's part of ``plan``; raise the first local failure (the caller agrees).
    Received shards are committed to ``store`` (and listed in ``received``)."""
    def send(t: Transfer) -> tuple[bytes, torch.Tensor, int]:
        fault_point("replica_send", group.rank, t.iteration)
        manifest, payload = source(t)
        return manifest.encoded, payload, piece_nbytes(manifest)

    def sink(t: Transfer, meta: bytes, nbytes: int) -> StoreReceiver:
        receiver = StoreReceiver(store, t, meta, nbytes, world_size, ring)
        if received is not None:
            received[t.shard] = receiver
        return receiver

    failures = run_exchange(plan, group.rank, send, sink, group.group)
    if failures:
        t, exc = failures[0]
        logger.error("transfer of shard %s from rank %d to rank %d failed: %s", t.shard, t.src,
                     t.dst, exc)
        raise exc


def tensors_from_buffer(manifest: ShardManifest, buffer: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor of ``manifest`` copied out of the packed ``buffer`` into its own storage."""
    return unpack(buffer, [(e.offset, e.nbytes, dtype_from_name(e.dtype), e.shape)
                           for e in manifest.tensors])


@dataclass
class _Round:
    """One attempt of :func:`restore`: the plan, what this rank read to serve, and its own shard."""

    plan: RetrievalPlan
    served: dict[tuple[int, int], tuple[ShardManifest, torch.Tensor]] = field(default_factory=dict)
    own: tuple[ShardManifest, list[torch.Tensor]] | None = None
    received: dict[tuple[int, int], StoreReceiver] = field(default_factory=dict)

    def source(self, t: Transfer) -> tuple[ShardManifest, torch.Tensor]:
        return self.served[t.shard]


def _plan_round(iteration: int, world: int, inventories: list[Inventory], topology: Topology,
                placement: Placement) -> _Round:
    present = [frozenset((it, o) for it, o, w in inv.shards if it == iteration and w == world)
               for inv in inventories]
    holders: dict[tuple[int, int], list[int]] = {}
    for r, shards in enumerate(present):
        for s in shards:
            holders.setdefault(s, []).append(r)
    plan = retrieval_plan(wanted_shards(placement, topology, iteration, present), holders)
    if plan.missing:
        raise NoCheckpointError(
            f"load of iteration {iteration}: no verified copy of the shards of owner ranks "
            f"{[o for _, o in plan.missing]} exists on any node (corrupt copies were removed); "
            "restart to fall back to an older kept iteration, if any")
    return _Round(plan)


def _verify_sources(rnd: _Round, rank: int, world: int, store: ShardStore,
                    read_own: Callable[[ShardRef], tuple[ShardManifest, list[torch.Tensor]]]
                    ) -> list[int]:
    """Read and verify every copy this rank serves; delete corrupt ones. Returns their owners."""
    bad = []
    for shard in rnd.plan.sources_of(rank):
        it, owner = shard
        ref = ShardRef(it, owner, world, store.path_of(it, owner, world))
        only_for_me = all(t.dst == rank for t in rnd.plan.reads
                          if t.src == rank and t.shard == shard)
        try:
            if only_for_me and owner == rank:
                rnd.own = read_own(ref)  # the common case: straight into the tensors
            else:
                manifest, buf = store.read(ref)
                rnd.served[shard] = (manifest, buf)
                if owner == rank:
                    rnd.own = (manifest, tensors_from_buffer(manifest, buf))
        except CorruptShardError as exc:
            logger.warning("rank %d: %s; removing this copy and using a replica", rank, exc)
            store.delete(ref)
            bad.append(owner)
    return bad


def restore(iteration: int, group: CheckpointGroup, store: ShardStore, topology: Topology,
            placement: Placement,
            read_own: Callable[[ShardRef], tuple[ShardManifest, list[torch.Tensor]]],
            gather: Callable[[str], list[Inventory]],
            ring: PieceRing, fetched: Callable[[float, int], None] | None = None
            ) -> tuple[ShardManifest, list[torch.Tensor]]:
    """Bring every rank its shard of ``iteration`` and every node the replicas ``placement`` puts
    on it (written back to its root). Collective. Copies whose checksum fails are deleted and
    replaced from verified ones; raises NoCheckpointError on every rank when some shard has no
    verified copy anywhere. ``fetched(seconds, nbytes)`` is told what this rank received."""
    rank, world = group.rank, group.world_size
    step = f"load of iteration {iteration}"
    max_rounds = 1 + sum(1 + len(h) for h in placement.holders)  # each retry removes a copy
    for _ in range(max_rounds):
        started = time.monotonic()
        rnd = _plan_round(iteration, world, gather(f"{step}: inventory"), topology, placement)
        planned = time.monotonic()
        bad = group.exchange(f"{step}: verify sources",
                             partial(_verify_sources, rnd, rank, world, store, read_own))
        verified = time.monotonic()
        if any(bad):
            continue
        group.exchange(f"{step}: fetch from peers", partial(
            exchange_shards, rnd.plan.exchange, group, store, world, rnd.source, ring,
            rnd.received))
        if fetched is not None and rnd.received:
            fetched(time.monotonic() - verified,
                    sum(r.manifest.data_nbytes for r in rnd.received.values()))
        logger.debug("rank %d: restore plan %.3fs, read+verify %.3fs, transfers %.3fs", rank,
                     planned - started, verified - planned, time.monotonic() - verified)
        if rnd.own is None:  # fetched and written back: read it like any local shard
            rnd.own = read_own(ShardRef(iteration, rank, world,
                                        store.path_of(iteration, rank, world)))
        if rnd.received:
            logger.info("rank %d: fetched the shards of owners %s from peers and wrote them back",
                        rank, sorted(o for _, o in rnd.received))
        return rnd.own
    raise CorruptShardError(f"{step}: gave up after {max_rounds} rounds of replacing corrupt "
                            "copies")
