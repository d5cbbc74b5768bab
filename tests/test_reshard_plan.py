"""The resharding plan and the any-world-size choice of find_latest: pure, no processes."""

from __future__ import annotations

import math
from typing import Any

import pytest

from localckpt.control.coverage import Inventory, choose_latest_any_world
from localckpt.control.reshard import OldShard, Want, plain_owner, plan_reshard
from localckpt.errors import ConfigurationError, IncompleteCheckpointError


def _rows(owners: int, rows: int, cols: int = 3) -> list[OldShard]:
    """A (rows, cols) tensor sharded by rows over ``owners`` (torch.chunk sizes)."""
    step = math.ceil(rows / owners)
    out = []
    for o in range(owners):
        start = min(o * step, rows)
        out.append(OldShard(o, 7, (rows, cols), "float32", (start, 0),
                            (min(rows, start + step) - start, cols)))
    return out


def _want(start: int, n: int, rows: int, cols: int = 3) -> Want:
    return Want((rows, cols), "float32", (start, 0), (n, cols))


def test_four_row_shards_onto_two_take_the_overlapping_boxes_only() -> None:
    old = {"w": _rows(4, 10)}  # rows 0-2, 3-5, 6-8, 9
    pieces = plan_reshard(old, {0: 0, 1: 0, 2: 1, 3: 1}, [{"w": _want(0, 5, 10)},
                                                          {"w": _want(5, 5, 10)}])
    got = [(p.src, p.dst, p.owner, p.src_start, p.dst_start, p.size) for p in pieces]
    assert got == [(0, 0, 0, (0, 0), (0, 0), (3, 3)), (0, 0, 1, (0, 0), (3, 0), (2, 3)),
                   (0, 1, 1, (2, 0), (0, 0), (1, 3)), (1, 1, 2, (0, 0), (1, 0), (3, 3)),
                   (1, 1, 3, (0, 0), (4, 0), (1, 3))]
    assert all(p.entry == 7 and p.path == "w" for p in pieces)


def test_a_column_shard_onto_row_shards_cuts_both_dims() -> None:
    cols = [OldShard(o, 0, (4, 6), "bfloat16", (0, 3 * o), (4, 3)) for o in range(2)]
    pieces = plan_reshard({"w": cols}, {0: 0, 1: 1},
                          [{"w": Want((4, 6), "bfloat16", (2 * r, 0), (2, 6))}
                           for r in range(2)])
    assert [(p.dst, p.owner, p.src_start, p.dst_start, p.size) for p in pieces] == [
        (0, 0, (0, 0), (0, 0), (2, 3)), (0, 1, (0, 0), (0, 3), (2, 3)),
        (1, 0, (2, 0), (0, 0), (2, 3)), (1, 1, (2, 0), (0, 3), (2, 3))]


def test_a_replicated_box_is_read_once_from_the_copy_the_destination_serves() -> None:
    replicas = [OldShard(o, 0, (5,), "float32", (0,), (5,)) for o in (3, 1, 2)]
    pieces = plan_reshard({"b": replicas}, {1: 0, 2: 1, 3: 1},
                          [{"b": Want((5,), "float32", (0,), (5,))}])
    assert [(p.owner, p.src) for p in pieces] == [(1, 0)]


def test_a_replicated_box_is_served_by_the_destination_itself_or_the_least_busy_holder(
        ) -> None:
    """Every holder of a replicated box (tensor parallel's norms, an embedding left whole)
    served it from the lowest owner: on a (dp 2, tp 2) -> (dp 4) reshard, ranks 0 and 2 packed
    and sent their whole shards while ranks 1 and 3 sent a fifth of theirs. A rank that serves
    a copy itself takes its own; the others spread over the servers."""
    replicas = [OldShard(o, 0, (5,), "float32", (0,), (5,)) for o in (0, 1)]
    whole = Want((5,), "float32", (0,), (5,))
    pieces = plan_reshard({"b": replicas}, {0: 0, 1: 1}, [{"b": whole}] * 4)
    assert [(p.dst, p.owner, p.src) for p in pieces] == [(0, 0, 0), (1, 1, 1), (2, 0, 0),
                                                         (3, 1, 1)]
    # rows sharded over dp, replicated over tp (owners 2k, 2k+1 hold the same rows)
    old = [OldShard(o, 0, (8, 2), "float32", (4 * (o // 2), 0), (4, 2)) for o in range(4)]
    wants = [{"w": Want((8, 2), "float32", (2 * r, 0), (2, 2))} for r in range(4)]
    pieces = plan_reshard({"w": old}, {o: o for o in range(4)}, wants)
    assert [(p.dst, p.src) for p in pieces] == [(0, 0), (1, 1), (2, 2), (3, 3)]


@pytest.mark.parametrize(("old", "want", "why"), [
    ({}, _want(0, 5, 10), "the checkpoint has none"),
    ({"w": _rows(2, 12)}, _want(0, 5, 10), "global shape [12, 3]"),
    ({"w": _rows(2, 10)[:1]}, _want(0, 10, 10), "cover 15 of the 30"),  # a shard missing
    ({"w": [*_rows(2, 10), OldShard(5, 0, (10, 3), "float32", (4, 0), (2, 3))]},
     _want(0, 10, 10), "more than once"),  # overlapping, unequal boxes
])
def test_what_cannot_be_assembled_is_named(old: dict, want: Want, why: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigurationError, match="cannot reshard") as info:
        plan_reshard(old, {o: 0 for o in range(8)}, [{"w": want}])
    assert "'w'" in str(info.value) and why in str(info.value)


def test_plain_state_goes_to_the_same_rank_or_wraps_around() -> None:
    assert [plain_owner(r, 2) for r in range(4)] == [0, 1, 0, 1]
    assert [plain_owner(r, 4) for r in range(2)] == [0, 1]


def _inv(rank: int, *shards: tuple[int, int, int]) -> Inventory:
    return Inventory(rank, "s", frozenset(shards))


def test_find_latest_of_any_world_size_takes_the_newest_complete_one() -> None:
    old4 = [(9, o, 4) for o in range(4)]
    invs = [_inv(0, *old4[:2], (5, 0, 2)), _inv(1, *old4[2:], (5, 1, 2))]
    assert choose_latest_any_world(invs, 2) == (9, 4)
    partial = [_inv(0, *old4[:2], (5, 0, 2)), _inv(1, old4[2], (5, 1, 2))]  # owner 3 lost
    assert choose_latest_any_world(partial, 2) == (5, 2)
    tie = [_inv(0, (5, 0, 2), (5, 0, 1)), _inv(1, (5, 1, 2))]
    assert choose_latest_any_world(tie, 2) == (5, 2)  # this world size wins a tie
    assert choose_latest_any_world([_inv(0), _inv(1)], 2) == (-1, 2)


def test_old_shards_are_served_by_their_holders_in_turn() -> None:
    from localckpt.control.reshard import choose_servers

    everywhere = {o: [0, 1] for o in range(4)}  # 4 -> 2 ranks, every node holds all
    assert choose_servers(everywhere, 4) == {0: 0, 1: 1, 2: 0, 3: 1}
    assert choose_servers({0: [3, 5], 1: [3, 5], 2: [5]}, 3) == {0: 3, 1: 5, 2: 5}
    with pytest.raises(IncompleteCheckpointError, match=r"old owners \[1\]"):
        choose_servers({0: [0], 1: []}, 2)


@pytest.mark.parametrize("seed", range(12))
def test_an_all_to_all_in_rounds_delivers_every_byte_where_one_would(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """reshard._all_to_all on ranks played by threads, with an all_to_all_single that
    exchanges in memory: random pair sizes (empty ones too), several rounds; each rank's
    received buffer is what a single all-to-all gives."""
    import random
    import threading
    import types

    import torch

    from localckpt.load import reshard

    rng = random.Random(seed)
    world = rng.randint(1, 5)
    pairs = {(s, d): 64 * rng.choice([0, 0, 1, 2, 5, 17]) for s in range(world)
             for d in range(world)}
    rounds = reshard.round_count(pairs, rng.choice([64, 256, 1000]))
    sent = [torch.randint(0, 256, (sum(pairs[s, d] for d in range(world)),), dtype=torch.uint8)
            for s in range(world)]
    barrier = threading.Barrier(world)
    posted: dict[int, tuple[torch.Tensor, list[int]]] = {}

    def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any,
                          input_split_sizes: Any, group: Any) -> None:
        rank = group
        posted[rank] = (input.clone(), list(input_split_sizes))
        barrier.wait()
        pos = 0
        for src in range(world):
            data, splits = posted[src]
            at = sum(splits[:rank])
            n = output_split_sizes[src]
            assert splits[rank] == n  # both ends of every pair agree on the round's share
            output[pos : pos + n].copy_(data[at : at + n])
            pos += n
        barrier.wait()

    monkeypatch.setattr(reshard, "dist", types.SimpleNamespace(
        all_to_all_single=all_to_all_single))
    received = [torch.zeros(sum(pairs[s, d] for s in range(world)), dtype=torch.uint8)
                for d in range(world)]
    errors: list[BaseException] = []

    def rank_(r: int) -> None:
        try:
            send = [pairs[r, d] for d in range(world)]
            recv = [pairs[s, r] for s in range(world)]
            buffers = (torch.empty(sum(reshard._round_splits(send, rounds, 0)), dtype=torch.uint8),
                       torch.empty(sum(reshard._round_splits(recv, rounds, 0)), dtype=torch.uint8))
            reshard._all_to_all(r, received[r], sent[r], recv, send, rounds, buffers, [])
        except BaseException as exc:  # reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=rank_, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    for d in range(world):
        expected = torch.cat([sent[s][sum(pairs[s, x] for x in range(d)):][:pairs[s, d]]
                              for s in range(world)])
        assert torch.equal(received[d], expected), (d, rounds)
