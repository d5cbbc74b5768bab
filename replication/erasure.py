"""Erasure-coded redundancy: where stripes and their parity blocks live (pure, no I/O).

A *stripe* is up to k ranks on as many different nodes; m parity blocks computed from their
shards go to m further nodes, one block each. Losing any m nodes loses at most m blocks of a
stripe (its members and parity holders are all on different nodes), and any k' of the
stripe's k' + m blocks rebuild the rest (k' members). Against full replicas (``node_spread``
with factor F, F - 1 extra copies of every shard) a node keeps about m / k extra copies.

The layout is a deterministic function of the topology, as every placement is: every rank
computes the same one, and a node replaced by an empty one (same ranks, same node index) gets
the same blocks back.

Parity blocks travel and are listed like shards, under an owner id below zero that no rank has
(:func:`parity_slot`), so the plans, the executor and the inventories carry them unchanged.

This module decides only. The codes that compute parity are in :mod:`replication.codes` and
:mod:`replication.parity`; who sends which block to whom is :mod:`replication.stripe_plans`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import combinations
from typing import Any

from .errors import TopologyError
from .strategies import Placement, ReplicationStrategy, register_strategy
from .topology import Topology

MAX_PARITY = 100  # parity blocks per stripe: block j of stripe s is slot -(1 + 100 s + j)


def parity_slot(stripe: int, block: int) -> int:
    """The owner id parity block ``block`` of stripe ``stripe`` is listed, sent and named by:
    below zero, so it is never a rank's."""
    if not (0 <= block < MAX_PARITY and stripe >= 0):
        raise ValueError(f"parity block {block} of stripe {stripe}: expected a stripe >= 0 and "
                         f"0 <= block < {MAX_PARITY}")
    return -(1 + stripe * MAX_PARITY + block)


def parity_of_slot(slot: int) -> tuple[int, int]:
    """(stripe, block) of a :func:`parity_slot`; ValueError for a rank's owner id."""
    if slot >= 0:
        raise ValueError(f"owner id {slot} is a rank's, not a parity block's")
    return divmod(-slot - 1, MAX_PARITY)


@dataclass(frozen=True)
class Stripe:
    """``members``: the ranks whose shards form the stripe, on different nodes; ``parity``: the
    rank keeping parity block j, for j in range(m), on m further nodes."""

    members: tuple[int, ...]
    parity: tuple[int, ...]


@dataclass(frozen=True)
class StripeLayout:
    """Every rank is a member of exactly one stripe."""

    k: int
    m: int
    stripes: tuple[Stripe, ...]

    def stripe_of(self, rank: int) -> int:
        """The index of the stripe ``rank`` is a member of."""
        for index, stripe in enumerate(self.stripes):
            if rank in stripe.members:
                return index
        raise KeyError(f"rank {rank} is in no stripe")

    def parity_kept_by(self, rank: int) -> list[tuple[int, int]]:
        """(stripe, parity block) pairs ``rank`` keeps."""
        return [(s, j) for s, stripe in enumerate(self.stripes)
                for j, holder in enumerate(stripe.parity) if holder == rank]

    def slots(self) -> list[tuple[int, int, int]]:
        """(stripe, block, slot) of every parity block."""
        return [(s, j, parity_slot(s, j)) for s, stripe in enumerate(self.stripes)
                for j in range(len(stripe.parity))]


@register_strategy
class ErasureCodingStrategy(ReplicationStrategy):
    """No replicas: the shards of up to ``k`` ranks on as many nodes form a stripe, and ``m``
    parity blocks computed from them go to ``m`` further nodes (:func:`stripe_layout`). Any
    ``m`` lost nodes per stripe are survivable, at about m / k of the shards' bytes per node
    instead of F - 1 times for full replicas. m = 1 is XOR parity; m >= 2 Reed-Solomon (needs
    ``pip install 'localckpt[erasure]'``)."""

    name = "erasure"

    def __init__(self, k: int = 3, m: int = 1) -> None:
        if type(k) is not int or k < 1 or type(m) is not int or not 1 <= m < MAX_PARITY:
            raise TopologyError(f"erasure: expected ints k >= 1 and 1 <= m < {MAX_PARITY}, "
                                f"got k={k!r}, m={m!r}")
        if m >= 2:
            from .parity import coefficients

            coefficients(k, m)  # ImportError without zfec, here rather than at a save
        self.k, self.m = k, m

    def describe(self) -> dict[str, Any]:
        return {"k": self.k, "m": self.m}

    def place(self, topology: Topology) -> Placement:
        return Placement(tuple(() for _ in range(topology.world_size)))

    def stripes(self, topology: Topology) -> StripeLayout:
        """The stripes and parity holders on ``topology``; TopologyError with fewer than
        k + m nodes."""
        return stripe_layout(topology, self.k, self.m)


def stripe_layout(topology: Topology, k: int, m: int) -> StripeLayout:
    """Stripes of up to ``k`` ranks and their ``m`` parity holders for ``topology``.

    Members: each stripe takes one rank from each of the ``k`` nodes with the most ranks not yet
    in a stripe (ties: the lower node), so as many stripes as possible are full; the ranks left
    on fewer than ``k`` nodes form shorter stripes (a short stripe is a full one whose missing
    members hold nothing). Parity: block j of a stripe goes to the node, of those holding
    none of the stripe's blocks, that keeps the fewest parity blocks so far (ties: the lower
    node), and there to its rank keeping the fewest. Raises TopologyError when fewer than
    ``k + m`` nodes exist (a stripe's blocks could not all be on different nodes).
    """
    if type(k) is not int or k < 1 or type(m) is not int or m < 1:
        raise TopologyError(f"erasure: expected k >= 1 and m >= 1 (ints), got k={k!r}, "
                            f"m={m!r}")
    nodes = topology.num_nodes
    if nodes < k + m:
        raise TopologyError(f"erasure {k}+{m}: a stripe's {k + m} blocks go to different "
                            f"nodes, so at least {k + m} nodes are needed, got {nodes}")
    left = [list(ranks) for ranks in topology.nodes]
    members: list[tuple[int, ...]] = []
    while any(left):
        fullest = sorted((n for n in range(nodes) if left[n]),
                         key=lambda n: (-len(left[n]), n))[:k]
        members.append(tuple(sorted(left[n].pop(0) for n in fullest)))
    node_load = [0] * nodes
    parity: list[list[int]] = []  # per stripe, the node of each parity block
    for group in members:
        used = {topology.node_of[r] for r in group}
        after = max(used)  # ties go round the nodes, starting after the stripe's last one
        chosen = []
        for _ in range(m):
            node = min((n for n in range(nodes) if n not in used),
                       key=lambda n: (node_load[n], (n - after) % nodes))
            used.add(node)
            node_load[node] += 1
            chosen.append(node)
        parity.append(chosen)
    _even_out(topology, members, parity, node_load)
    rank_load = [0] * topology.world_size
    stripes = []
    for group, chosen in zip(members, parity, strict=True):
        holders = []
        for node in chosen:
            rank = min(topology.nodes[node], key=lambda r: (rank_load[r], r))
            rank_load[rank] += 1
            holders.append(rank)
        stripes.append(Stripe(group, tuple(holders)))
    return StripeLayout(k, m, tuple(stripes))


def _even_out(topology: Topology, members: list[tuple[int, ...]], parity: list[list[int]],
              load: list[int]) -> None:
    """Move parity blocks from the most to the least loaded nodes (never onto a node holding a
    block of the same stripe) until the loads differ by at most one or no move is left."""
    while True:
        moved = False
        for hi in sorted(range(len(load)), key=lambda n: (-load[n], n)):
            for lo in sorted(range(len(load)), key=lambda n: (load[n], n)):
                if load[hi] - load[lo] <= 1:
                    break
                for s, chosen in enumerate(parity):
                    used = {topology.node_of[r] for r in members[s]} | set(chosen)
                    if hi in chosen and lo not in used:
                        chosen[chosen.index(hi)] = lo
                        load[hi] -= 1
                        load[lo] += 1
                        moved = True
                        break
                if moved:
                    break
            if moved:
                break
        if not moved:
            return


def recoverable(layout: StripeLayout, topology: Topology, lost_nodes: Iterable[int]) -> bool:
    """Whether every stripe keeps at least as many blocks as it has members after
    ``lost_nodes`` are gone (then every lost shard can be rebuilt)."""
    lost = set(lost_nodes)
    for stripe in layout.stripes:
        blocks = (*stripe.members, *stripe.parity)
        if sum(topology.node_of[r] in lost for r in blocks) > len(stripe.parity):
            return False
    return True


def rebuildable(layout: StripeLayout, data: set[int], parity: set[tuple[int, int]]) -> bool:
    """Whether every shard can be had: held (``data``: owners whose shard some node holds) or
    rebuilt from its stripe (as many of the stripe's blocks as it has members are held;
    ``parity``: (stripe, block) pairs some node holds)."""
    for s, stripe in enumerate(layout.stripes):
        held = sum(r in data for r in stripe.members)
        if held < len(stripe.members) and \
                held + sum((s, j) in parity for j in range(len(stripe.parity))) < \
                len(stripe.members):
            return False
    return True


def worst_node_losses(layout: StripeLayout, topology: Topology) -> list[tuple[int, ...]]:
    """Every set of ``m`` nodes whose loss some stripe does not survive (empty: any ``m`` node
    losses are survivable). For tests and ``describe``; combinatorial in the node count."""
    return [lost for lost in combinations(range(topology.num_nodes), layout.m)
            if not recoverable(layout, topology, lost)]


def describe_layout(layout: StripeLayout, topology: Topology) -> dict[str, Any]:
    """Per node: its ranks' shards and the parity blocks it keeps (for sizing)."""
    parity = [0] * topology.num_nodes
    for stripe in layout.stripes:
        for rank in stripe.parity:
            parity[topology.node_of[rank]] += 1
    return {"k": layout.k, "m": layout.m, "stripes": len(layout.stripes),
            "shards_per_node": [len(n) for n in topology.nodes], "parity_per_node": parity}
