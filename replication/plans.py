"""Plans as data: who sends which shard to whom. Pure functions, identical on every rank.

A shard is named by ``(iteration, owner)``. Ranks of one node share a root, so "rank h holds
shard s" means s is committed on h's node; a replica on the owner's own node adds nothing and is
never planned.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .strategies import Placement
from .topology import Topology

ShardId = tuple[int, int]  # (iteration, owner rank)


@dataclass(frozen=True, order=True)
class Transfer:
    """``src`` sends shard (``iteration``, ``owner``) to ``dst``; ``src == dst`` is a local read."""

    src: int
    dst: int
    iteration: int
    owner: int

    @property
    def shard(self) -> ShardId:
        return (self.iteration, self.owner)

    @property
    def local(self) -> bool:
        return self.src == self.dst


@dataclass(frozen=True)
class ExchangePlan:
    """Transfers grouped into rounds; within a round every rank takes part in at most one
    transfer, so each rank sends or receives one stream at a time (gloo on few cores is ~4x
    faster one direction at a time than both at once)."""

    rounds: tuple[tuple[Transfer, ...], ...]

    @property
    def transfers(self) -> tuple[Transfer, ...]:
        return tuple(t for r in self.rounds for t in r)

    def involving(self, rank: int) -> list[Transfer]:
        """This rank's transfers, in the order it must perform them."""
        return [t for r in self.rounds for t in r if rank in (t.src, t.dst)]


def schedule(transfers: Iterable[Transfer]) -> ExchangePlan:
    """First-fit rounds: each transfer goes to the earliest round where neither end is busy.
    Deadlock-free: a rank only ever waits on a peer's earlier-or-same round."""
    busy: dict[int, set[int]] = {}
    rounds: list[list[Transfer]] = []
    for t in sorted(transfers):
        if t.local:
            continue
        src_busy, dst_busy = busy.setdefault(t.src, set()), busy.setdefault(t.dst, set())
        r = 0
        while r in src_busy or r in dst_busy:
            r += 1
        if r == len(rounds):
            rounds.append([])
        rounds[r].append(t)
        src_busy.add(r)
        dst_busy.add(r)
    return ExchangePlan(tuple(tuple(r) for r in rounds))


def save_plan(placement: Placement, topology: Topology, iteration: int) -> ExchangePlan:
    """Every owner sends its new shard to one holder per node the placement names (other than
    its own node)."""
    transfers = []
    for owner, holders in enumerate(placement.holders):
        seen = {topology.node_of[owner]}
        for h in holders:
            if topology.node_of[h] not in seen:
                seen.add(topology.node_of[h])
                transfers.append(Transfer(owner, h, iteration, owner))
    return schedule(transfers)


def owners_without_remote_copy(placement: Placement, topology: Topology) -> list[int]:
    """Owner ranks none of whose replica holders is on another node: a strategy that places
    replicas only on node mates (clique with replication_jump 1 on torchrun's layout, or ranks
    the topology puts on one node) protects against nothing a node loss does."""
    return [owner for owner, holders in enumerate(placement.holders)
            if not any(not topology.same_node(owner, h) for h in holders)]


def wanted_shards(placement: Placement, topology: Topology, iteration: int,
                  present: Sequence[frozenset[ShardId]]) -> list[tuple[int, ShardId]]:
    """(rank, shard) pairs to deliver so that every rank has its own shard and every node again
    keeps the replicas the placement puts on it. ``present[r]``: shards on rank r's node."""
    wants = [(r, (iteration, r)) for r in range(topology.world_size)]
    for owner, holders in enumerate(placement.holders):
        seen = {topology.node_of[owner]}
        for h in holders:
            node = topology.node_of[h]
            if node not in seen:
                seen.add(node)
                if (iteration, owner) not in present[h]:
                    wants.append((h, (iteration, owner)))
    return wants


@dataclass(frozen=True)
class RetrievalPlan:
    """``reads``: every delivery (local reads have src == dst); ``missing``: shards no rank
    holds; ``exchange``: the remote deliveries, scheduled."""

    reads: tuple[Transfer, ...]
    missing: tuple[ShardId, ...]
    exchange: ExchangePlan

    def sources_of(self, rank: int) -> list[ShardId]:
        """Shards ``rank`` must read from its node (for itself or to send), each once."""
        return sorted({t.shard for t in self.reads if t.src == rank})


def retrieval_plan(wants: Iterable[tuple[int, ShardId]],
                   holders: Mapping[ShardId, Sequence[int]],
                   shard_nbytes: Mapping[ShardId, int] | None = None) -> RetrievalPlan:
    """Choose a source for every wanted (dst, shard): dst itself when its node holds it, else the
    holder with the fewest bytes assigned so far (ties: lowest rank) so load spreads over every
    holder in the job, not only the owner's group."""
    sizes = shard_nbytes or {}
    assigned: dict[int, int] = {}
    reads, missing = [], []
    for dst, shard in sorted(set(wants)):
        candidates = holders.get(shard, ())
        if not candidates:
            missing.append(shard)
            continue
        if dst in candidates:
            src = dst
        else:
            src = min(candidates, key=lambda h: (assigned.get(h, 0), h))
            assigned[src] = assigned.get(src, 0) + sizes.get(shard, 1)
        reads.append(Transfer(src, dst, *shard))
    return RetrievalPlan(tuple(reads), tuple(sorted(set(missing))), schedule(reads))
