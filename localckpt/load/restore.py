"""The load path: bring every rank its shard of an iteration, from its own disk or from a peer,
and every node the replicas its placement puts on it (written back).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from replication import (
    Placement,
    RetrievalPlan,
    Topology,
    Transfer,
    retrieval_plan,
    wanted_shards,
)

from ..control.collectives import CheckpointGroup
from ..control.coverage import Inventory
from ..errors import CorruptShardError, NoCheckpointError
from ..storage.manifest import ShardManifest
from ..storage.peer_io import PieceRing, StoreReceiver, exchange_shards, tensors_from_buffer
from ..storage.store import ShardRef, ShardStore

logger = logging.getLogger(__name__)


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
