"""Erasure-coded stripes, the plans (pure): who sends which block to whom to fold parity at a
save, rebuild lost shards and fold lost parity again, simulated byte for byte with the codes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from replication import Topology, make_strategy, parity_of_slot, parity_slot, strategy_names
from replication.codes import decode, encode
from replication.erasure import StripeLayout, stripe_layout
from replication.parity import ParityAccumulator, fold, rebuild_weights
from replication.stripe_plans import (
    lost_members,
    missing_parity,
    parity_repair_plan,
    parity_save_plan,
    rebuild_plan,
)

TOPOLOGIES = [Topology.uniform(4, 1), Topology.uniform(6, 1), Topology.uniform(5, 2),
              Topology(tuple(f"n{i}" for i, c in enumerate([3, 1, 2, 2, 1, 3]) for _ in range(c)))]


def shards_of(world: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, 1000 + 337 * r % 2000, dtype=np.uint8) for r in range(world)]


def encoded(layout: StripeLayout, data: list[np.ndarray]) -> dict[int, np.ndarray]:
    """Every block by slot: the members' shards, the parity blocks as encode makes them."""
    blocks = dict(enumerate(data))
    for s, stripe in enumerate(layout.stripes):
        members = [data[r] for r in stripe.members]
        members += [np.zeros(0, np.uint8)] * (layout.k - len(members))  # a short stripe
        for j, block in enumerate(encode(members, layout.m)):
            blocks[parity_slot(s, j)] = block
    return blocks


def held_after(layout: StripeLayout, topo: Topology, lost: set[int]) -> dict[int, list[int]]:
    """slot -> ranks holding it once the nodes ``lost`` are replaced by empty ones."""
    where = {r: r for r in range(topo.world_size)}
    where |= {parity_slot(s, j): h for s, stripe in enumerate(layout.stripes)
              for j, h in enumerate(stripe.parity)}
    return {slot: [r for r in topo.nodes[topo.node_of[rank]]]
            for slot, rank in where.items() if topo.node_of[rank] not in lost}


def test_parity_slots_are_below_zero_and_round_trip() -> None:
    assert parity_slot(0, 0) == -1 and parity_slot(3, 2) == -303
    assert parity_of_slot(parity_slot(7, 99)) == (7, 99)
    with pytest.raises(ValueError, match="rank's"):
        parity_of_slot(0)
    with pytest.raises(ValueError, match="0 <= block < 100"):
        parity_slot(0, 100)


def test_the_strategy_is_registered_by_name_and_places_no_replicas() -> None:
    assert "erasure" in strategy_names()
    strategy = make_strategy("erasure", k=4, m=2)
    topo = Topology.uniform(6, 2)
    assert strategy.place(topo).holders == ((),) * 12
    assert strategy.stripes(topo) == stripe_layout(topo, 4, 2)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="k >= 1"):
        make_strategy("erasure", k=0)


@pytest.mark.parametrize("k,m", [(3, 1), (4, 2), (2, 3)])
def test_rebuild_weights_invert_the_code_for_every_choice_of_k_blocks(k: int, m: int) -> None:
    rng = np.random.default_rng(k + m)
    members = [rng.integers(0, 256, 257, dtype=np.uint8) for _ in range(k)]
    blocks = members + encode(members, m)
    for sources in itertools.combinations(range(k + m), k):
        for member in range(k):
            out = np.zeros(257, np.uint8)
            for block, w in zip(sources, rebuild_weights(k, m, sources, member), strict=True):
                fold(out, 0, blocks[block], w)
            assert np.array_equal(out, members[member]), (sources, member)
    with pytest.raises(ValueError, match="distinct blocks"):
        rebuild_weights(k, m, (0,) * k, 0)


def test_every_member_sends_its_shard_to_every_parity_holder_one_stream_at_a_time() -> None:
    topo = Topology.uniform(6, 2)
    layout = stripe_layout(topo, 4, 2)
    plan = parity_save_plan(layout, 7)
    sent = sorted((t.src, t.dst) for t in plan.transfers)
    assert sent == sorted((r, h) for s in layout.stripes for r in s.members for h in s.parity)
    assert all(t.owner == t.src and t.iteration == 7 for t in plan.transfers)
    for round_ in plan.rounds:
        ends = [x for t in round_ for x in (t.src, t.dst)]
        assert len(ends) == len(set(ends))


@pytest.mark.parametrize("k,m", [(3, 1), (4, 2)])
@pytest.mark.parametrize("topo", TOPOLOGIES, ids=lambda t: f"{t.num_nodes}n{t.world_size}r")
def test_any_m_lost_nodes_are_rebuilt_and_their_parity_folded_again(topo: Topology, k: int,
                                                                    m: int) -> None:
    if topo.num_nodes < k + m:
        return
    layout = stripe_layout(topo, k, m)
    data = shards_of(topo.world_size, k * m)
    blocks = encoded(layout, data)
    for lost in itertools.combinations(range(topo.num_nodes), m):
        holders = held_after(layout, topo, set(lost))
        planned = rebuild_plan(layout, 3, holders)
        assert planned is not None, lost
        rebuilds, plan = planned
        assert sorted(r.owner for r in rebuilds) == lost_members(layout, holders)
        assert sorted(r.owner for r in rebuilds) == [
            r for r in range(topo.world_size) if topo.node_of[r] in lost]
        got = {}
        for r in rebuilds:
            out = np.zeros(len(data[r.owner]), np.uint8)
            for slot, src, w in r.sources:
                assert src in holders[slot] and src != r.owner
                fold(out, 0, blocks[slot], w)
            got[r.owner] = out
            assert np.array_equal(out, data[r.owner]), (lost, r)
        assert sorted((t.src, t.dst, t.owner) for t in plan.transfers) == sorted(
            (src, r.owner, slot) for r in rebuilds for slot, src, _ in r.sources)
        # the rebuilt shards are written back; then the lost parity blocks are folded again
        for r in got:
            holders[r] = list(topo.nodes[topo.node_of[r]])
        repair = parity_repair_plan(layout, 3, holders)
        assert sorted(repair.blocks) == sorted(missing_parity(layout, holders))
        assert repair.local == ()  # every node has its own ranks' shards: all sent
        for s, j in repair.blocks:
            stripe = layout.stripes[s]
            acc = ParityAccumulator(k, m, j, len(blocks[parity_slot(s, j)]))
            incoming = [t for t in repair.plan.transfers if t.dst == stripe.parity[j]
                        and t.owner in stripe.members]
            assert sorted(t.owner for t in incoming) == sorted(stripe.members)
            for t in incoming:
                acc.add(stripe.members.index(t.owner), 0, data[t.owner])
            assert np.array_equal(acc.block, blocks[parity_slot(s, j)])


def test_a_stripe_that_lost_more_than_m_blocks_is_not_rebuildable() -> None:
    topo = Topology.uniform(4, 1)
    layout = stripe_layout(topo, 3, 1)
    holders = held_after(layout, topo, {0, 1})
    assert rebuild_plan(layout, 1, holders) is None
    # and nothing is folded again from a stripe with a lost member
    assert parity_repair_plan(layout, 1, held_after(layout, topo, {0, 3})).blocks == ()


def test_decode_agrees_with_the_folded_rebuild_on_a_short_stripe() -> None:
    topo = Topology.uniform(4, 1)
    layout = stripe_layout(topo, 3, 1)  # stripe 1 is rank 3 alone, its parity on rank 0
    data = shards_of(4, 5)
    blocks = encoded(layout, data)
    holders = held_after(layout, topo, {3})
    planned = rebuild_plan(layout, 2, holders)
    assert planned is not None
    (rebuild,), _ = planned
    assert rebuild.owner == 3 and [s for s, _, _ in rebuild.sources] == [parity_slot(1, 0)]
    sizes = [len(data[3]), 0, 0]
    assert np.array_equal(decode({3: blocks[parity_slot(1, 0)], 1: b"", 2: b""}, sizes, 1)[0],
                          data[3])


def test_a_block_only_the_owners_node_holds_is_read_there_not_given_up() -> None:
    """Ranks moved: rank 0 (stripe 0's member) now runs where stripe 0's parity lives, and its
    old node was lost. The rebuild reads that block from the owner's own node; a repair whose
    holder's node keeps a member's shard reads it there too."""
    topo = Topology.uniform(4, 1)
    layout = stripe_layout(topo, 3, 1)  # stripe 0: members 0, 1, 2, parity on rank 3
    holders = {1: [1], 2: [2], 3: [3], parity_slot(0, 0): [0], parity_slot(1, 0): [0]}
    planned = rebuild_plan(layout, 4, holders)
    assert planned is not None
    (rebuild,), plan = planned
    assert (parity_slot(0, 0), 0) in [(slot, src) for slot, src, _ in rebuild.sources]
    assert all(not t.local for t in plan.transfers)  # the local read is the owner's own
    repair = parity_repair_plan(layout, 4, {0: [3], 1: [1], 2: [2], 3: [0]})
    assert repair.blocks == ((0, 0), (1, 0))
    assert {(t.src, t.dst, t.owner) for t in repair.local} == {(3, 3, 0), (0, 0, 3)}


@pytest.mark.parametrize("k,m,nodes,per", [(3, 1, 4, 2), (4, 2, 6, 2)])
def test_a_member_serves_its_own_shard_when_copies_lie_elsewhere_too(k: int, m: int,
                                                                     nodes: int,
                                                                     per: int) -> None:
    """Copies of a member's shard on other nodes may be another save's (a node that came back,
    ranks renumbered): the rebuild takes the member's own copy, the one it loads."""
    topo = Topology.uniform(nodes, per)
    layout = stripe_layout(topo, k, m)
    for lost in itertools.combinations(range(nodes), m):
        holders = held_after(layout, topo, set(lost))
        everywhere = [r for r in range(topo.world_size) if topo.node_of[r] not in lost]
        for r in range(topo.world_size):
            if r in holders:  # a surviving shard: copies on every surviving node as well
                holders[r] = everywhere
        planned = rebuild_plan(layout, 1, holders)
        assert planned is not None
        for rebuild in planned[0]:
            assert all(src == slot for slot, src, _ in rebuild.sources if slot >= 0), rebuild


def test_a_parity_holder_has_room_for_a_block_whose_manifest_holds_every_members() -> None:
    """A parity block's manifest embeds each member's: its holder's space check counted 4 KiB
    for it, so a node sized to the check filled up after everything was written (3,300
    tensors in an 8+1 stripe: 1 MB reserved, 1.9 MB written)."""
    from localckpt.save.prepare import bytes_written
    from localckpt.storage.space import bytes_needed, chunking
    from replication import ExchangePlan
    from replication.erasure import Stripe, StripeLayout

    tensors, payload, chunk = 1100, 1 << 20, 1 << 20
    meta = 256 * tensors + 4096
    gathered = [{"nbytes": bytes_needed(meta, *chunking(payload, chunk)), "payload": payload,
                 "meta_nbytes": meta} for _ in range(4)]
    layout = StripeLayout(3, 1, (Stripe((0, 1, 2), (3,)),))
    writes = bytes_written(gathered, ExchangePlan(()), layout, chunk)
    own = gathered[3]["nbytes"]
    assert writes[:3] == [own] * 3
    assert writes[3] - own >= bytes_needed(3 * meta, *chunking(payload, chunk))
