"""Erasure-coded redundancy, the pure part: stripe layouts and the parity codes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from replication import Topology, TopologyError
from replication.codes import decode, encode, parity_nbytes
from replication.erasure import (
    describe_layout,
    rebuildable,
    recoverable,
    stripe_layout,
    worst_node_losses,
)

UNEQUAL = Topology(tuple(f"n{i}" for i, count in enumerate([4, 1, 3, 2, 2, 5, 1])
                         for _ in range(count)))
LAYOUTS = [Topology.uniform(n, per) for n, per in ((4, 1), (5, 2), (6, 4), (8, 8), (7, 3))]
LAYOUTS += [UNEQUAL, Topology(("a", "b", "a", "c", "d", "b", "e", "a"))]


@pytest.mark.parametrize("k,m", [(3, 1), (4, 2), (2, 1), (2, 2), (6, 3)])
@pytest.mark.parametrize("topo", LAYOUTS, ids=lambda t: f"{t.num_nodes}n{t.world_size}r")
def test_every_stripe_is_on_different_nodes_and_survives_any_m_node_losses(
        topo: Topology, k: int, m: int) -> None:
    if topo.num_nodes < k + m:
        with pytest.raises(TopologyError, match=f"at least {k + m} nodes"):
            stripe_layout(topo, k, m)
        return
    layout = stripe_layout(topo, k, m)
    assert sorted(r for s in layout.stripes for r in s.members) == list(range(topo.world_size))
    for stripe in layout.stripes:
        assert 1 <= len(stripe.members) <= k and len(stripe.parity) == m
        nodes = [topo.node_of[r] for r in (*stripe.members, *stripe.parity)]
        assert len(set(nodes)) == len(nodes), stripe  # members and parity: all different nodes
    assert worst_node_losses(layout, topo) == []
    assert stripe_layout(topo, k, m) == layout  # every rank computes the same
    # as many full stripes as the nodes allow: a short one only when < k nodes have ranks left
    short = [s for s in layout.stripes if len(s.members) < k]
    assert len(short) <= max(len(n) for n in topo.nodes)


@pytest.mark.parametrize("k,m", [(3, 1), (4, 2)])
def test_parity_is_spread_evenly_over_the_nodes(k: int, m: int) -> None:
    for topo in (Topology.uniform(8, 4), Topology.uniform(6, 8), Topology.uniform(12, 2)):
        parity = describe_layout(stripe_layout(topo, k, m), topo)["parity_per_node"]
        assert max(parity) - min(parity) <= 1, parity
        per_rank = [len(stripe_layout(topo, k, m).parity_kept_by(r))
                    for r in range(topo.world_size)]
        assert max(per_rank) - min(per_rank) <= 1, per_rank


def test_one_more_node_loss_than_m_is_not_survivable() -> None:
    topo = Topology.uniform(4, 2)
    layout = stripe_layout(topo, 3, 1)
    assert not all(recoverable(layout, topo, lost)
                   for lost in itertools.combinations(range(4), 2))


def test_rebuildable_counts_held_and_parity_blocks() -> None:
    topo = Topology.uniform(4, 1)
    layout = stripe_layout(topo, 3, 1)  # ranks 0-2, parity on rank 3; rank 3 alone, parity on 0
    assert [(s.members, s.parity) for s in layout.stripes] == [((0, 1, 2), (3,)), ((3,), (0,))]
    assert rebuildable(layout, {0, 1, 2, 3}, set())
    assert rebuildable(layout, {0, 2, 3}, {(0, 0)})  # one lost shard, parity held
    assert not rebuildable(layout, {0, 3}, {(0, 0)})  # two lost, one parity block
    assert not rebuildable(layout, {0, 2, 3}, set())
    assert rebuildable(layout, {0, 1, 2}, {(1, 0)})  # a short stripe's parity is a copy


@pytest.mark.parametrize("bad", [(0, 1), (3, 0), ("3", 1)])
def test_bad_k_or_m_is_refused(bad: tuple[object, object]) -> None:
    with pytest.raises(TopologyError, match="k >= 1 and m >= 1"):
        stripe_layout(Topology.uniform(8, 1), *bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- codes


@pytest.mark.parametrize("k,m", [(3, 1), (4, 2), (1, 2), (2, 3)])
@pytest.mark.parametrize("piece", [4096, 1 << 20])
def test_any_k_blocks_rebuild_shards_of_unequal_sizes(k: int, m: int, piece: int) -> None:
    rng = np.random.default_rng(k * 10 + m)
    sizes = [100_003, 0, 65_536, 4097, 1][:k]
    members = [rng.integers(0, 256, s, dtype=np.uint8) for s in sizes]
    parity = encode(members, m, piece=piece)
    assert [len(p) for p in parity] == [parity_nbytes(sizes)] * m
    blocks = {i: members[i] for i in range(k)} | {k + j: parity[j] for j in range(m)}
    for lost in itertools.combinations(range(k + m), m):
        rebuilt = decode({i: b for i, b in blocks.items() if i not in lost}, sizes, m,
                         piece=piece)
        assert sorted(rebuilt) == [i for i in lost if i < k]
        for i, data in rebuilt.items():
            assert np.array_equal(data, members[i]), (lost, i)


def test_xor_parity_is_the_xor_of_the_zero_padded_members() -> None:
    a, b = np.array([1, 2, 3], np.uint8), np.array([7], np.uint8)
    (parity,) = encode([a, b.tobytes(), memoryview(bytes([255, 0]))], 1)
    assert parity.tolist() == [1 ^ 7 ^ 255, 2, 3]


def test_too_few_blocks_or_wrong_sizes_are_refused() -> None:
    members = [np.ones(10, np.uint8), np.ones(6, np.uint8), np.ones(8, np.uint8)]
    parity = encode(members, 2)
    with pytest.raises(ValueError, match="3 of the stripe's 5 blocks"):
        decode({0: members[0], 3: parity[0]}, [10, 6, 8], 2)
    with pytest.raises(ValueError, match="block 1 has 5 bytes, expected 6"):
        decode({0: members[0], 1: members[1][:5], 3: parity[0]}, [10, 6, 8], 2)


# ---------------------------------------------------------------- parity built piecewise


@pytest.mark.parametrize("k,m", [(3, 1), (4, 2), (2, 3)])
def test_parity_folded_in_piece_by_piece_in_any_order_is_what_encode_makes(k: int,
                                                                          m: int) -> None:
    from replication.parity import ParityAccumulator

    rng = np.random.default_rng(7)
    sizes = [70_001, 12_345, 0, 40_000][:k]
    members = [rng.integers(0, 256, s, dtype=np.uint8) for s in sizes]
    expected = encode(members, m)
    pieces = [(i, lo, members[i][lo: lo + 4096]) for i in range(k)
              for lo in range(0, sizes[i], 4096)]
    rng.shuffle(pieces)  # arrival order is any order
    blocks = []
    for j in range(m):
        acc = ParityAccumulator(k, m, j, parity_nbytes(sizes))
        for i, lo, data in pieces:
            acc.add(i, lo, data)
        assert np.array_equal(acc.block, expected[j]), j
        blocks.append(acc.block)
    # and the code rebuilds from them
    have = {i: members[i] for i in range(m, k)} | {k + j: b for j, b in enumerate(blocks)}
    rebuilt = decode(have, sizes, m)
    assert all(np.array_equal(rebuilt[i], members[i]) for i in range(min(m, k)))


def test_a_piece_outside_the_parity_block_is_refused() -> None:
    from replication.parity import ParityAccumulator

    acc = ParityAccumulator(3, 1, 0, 10)
    with pytest.raises(ValueError, match="outside the 10-byte parity block"):
        acc.add(0, 8, np.ones(4, np.uint8))
    with pytest.raises(ValueError, match="parity block 1"):
        ParityAccumulator(3, 1, 1, 10)
    with pytest.raises(ValueError, match="member -1"):
        acc.add(-1, 0, np.ones(4, np.uint8))
