"""Pure global decisions over gathered inventories (no processes)."""

from __future__ import annotations

import time

import pytest

from localckpt.control.coverage import (
    Inventory,
    check_capacity,
    choose_latest,
    decode_inventories,
    retained_iterations,
    shards_to_delete,
    validate_save,
    why_incomplete,
)
from localckpt.control.retention import KeepPolicy
from localckpt.errors import ConfigurationError, InsufficientSpaceError, InvalidIterationError


def inv(rank: int, *shards: tuple[int, int, int], session: str = "s") -> Inventory:
    return Inventory(rank, session, frozenset(shards))


def own(world: int, iterations: list[int]) -> list[Inventory]:
    return [inv(r, *((it, r, world) for it in iterations)) for r in range(world)]


def test_newest_iteration_held_by_every_rank_wins() -> None:
    assert choose_latest(own(4, [1, 5, 9]), 4) == 9


def test_missing_rank_falls_back_to_older_complete_iteration() -> None:
    invs = own(3, [2, 4])
    invs[1] = inv(1, (2, 1, 3))  # rank 1 lost its shard of 4
    assert choose_latest(invs, 3) == 2


def test_gaps_and_nothing_in_common_give_minus_one() -> None:
    invs = [inv(0, (1, 0, 2), (3, 0, 2)), inv(1, (2, 1, 2), (4, 1, 2))]
    assert choose_latest(invs, 2) == -1
    assert choose_latest([inv(0), inv(1)], 2) == -1


def test_a_shard_held_by_another_rank_counts_it_can_be_fetched() -> None:
    # Rank 2's shard is on rank 0's node (a replica, or rank 2 ran there before ranks moved).
    invs = [inv(0, (7, 0, 3), (7, 2, 3)), inv(1, (7, 1, 3)), inv(2)]
    assert choose_latest(invs, 3) == 7
    assert choose_latest([inv(0, (7, 0, 3)), inv(1, (7, 1, 3)), inv(2)], 3) == -1


def test_other_world_sizes_never_count() -> None:
    invs = [inv(0, (5, 0, 2), (6, 0, 4)), inv(1, (5, 1, 2), (6, 1, 4))]
    assert choose_latest(invs, 2) == 5


def test_foreign_session_is_a_configuration_error() -> None:
    invs = [inv(0, (1, 0, 2)), inv(1, (1, 1, 2), session="other")]
    with pytest.raises(ConfigurationError, match="same session_id"):
        choose_latest(invs, 2)


@pytest.mark.parametrize("iterations,error,text", [
    ([5, 6], InvalidIterationError, "same iteration"),
    ([-3, -3], InvalidIterationError, "non-negative"),
    (["'7'", "'7'"], InvalidIterationError, "non-negative int"),
    ([4, 4], InvalidIterationError, "newer than the latest committed checkpoint 4"),
    ([3, 3], InvalidIterationError, "newer than the latest"),
])
def test_validate_save_rejects(iterations: list[object], error: type, text: str) -> None:
    with pytest.raises(error, match=text):
        validate_save(iterations, own(2, [4]), 2)


def test_validate_save_accepts_newer_and_overwrites_of_partial_iterations() -> None:
    invs = own(2, [4])
    invs[0] = inv(0, (4, 0, 2), (9, 0, 2))  # partial iteration 9 from a failed save
    assert validate_save([9, 9], invs, 2) == 9
    assert validate_save([5, 5], invs, 2) == 5


def test_retention_keeps_newest_complete_and_deletes_own_others() -> None:
    invs = own(2, [1, 2, 3])
    invs[0] = inv(0, (1, 0, 2), (2, 0, 2), (3, 0, 2), (4, 0, 2), (3, 1, 2))
    keep = retained_iterations(invs, 2, KeepPolicy(last=2))
    assert keep == {2, 3}
    # the partial iteration 4 goes too; everything outside `keep` in this root is pruned
    assert shards_to_delete(invs[0], keep, 2) == [(1, 0, 2), (4, 0, 2)]
    assert shards_to_delete(inv(0, (1, 1, 2), (3, 1, 2)), keep, 2) == [(1, 1, 2)]


def test_a_resharding_job_drops_other_world_sizes_shards_its_lineage_does_not_keep() -> None:
    mine = inv(0, (4, 0, 3), (4, 1, 3), (9, 0, 3), (6, 0, 2), (7, 0, 2))
    keep = {7}  # this world size's (2) kept iteration
    # others' shards: not this job's to judge
    assert shards_to_delete(mine, keep, 2) == [(6, 0, 2)]
    # resharding: the world-3 iteration 4 is older than all kept and outside the lineage's
    # keep set; 9 is newer than all kept
    assert shards_to_delete(mine, keep, 2, lineage={7, 9}) == [(4, 0, 3), (4, 1, 3), (6, 0, 2)]
    assert shards_to_delete(mine, keep, 2, lineage={4, 7}) == [(6, 0, 2)]  # 4 in the lineage
    # nothing kept: no floor for the other world sizes
    assert shards_to_delete(mine, set(), 2, lineage=set()) == [(6, 0, 2), (7, 0, 2)]


def test_capacity_counts_every_rank_writing_to_a_node() -> None:
    check_capacity([10, 10, 30], [20, 20, 30], [0, 0, 1])
    with pytest.raises(InsufficientSpaceError, match=r"node 0 \(ranks \[0, 1\]\)"):
        check_capacity([11, 10, 30], [25, 20, 30], [0, 0, 1])


def test_inventory_json_round_trip() -> None:
    i = inv(3, (1, 3, 8), (1, 5, 8), (2, 3, 8))
    assert Inventory.from_json(i.to_json(), 3) == i


def test_choose_latest_for_16k_ranks_and_10_iterations_is_fast() -> None:
    world = 16384
    invs = own(world, list(range(10)))
    started = time.perf_counter()
    assert choose_latest(invs, world) == 9
    assert time.perf_counter() - started < 5  # generous: a regression guard, not a benchmark


def test_node_mates_listing_the_same_shards_share_one_decoded_set() -> None:
    # 2 nodes x 2 ranks, replicated: node 0 lost iteration 7's replica of owner 3 on rank 1's
    # listing only (it looked before the replica was committed), node 1 has every shard.
    full = [(it, o, 4) for it in (5, 7) for o in range(4)]
    partial = [k for k in full if k != (7, 3, 4)]
    docs = [inv(0, *full).to_json(), inv(1, *partial).to_json(), inv(2, *full).to_json(),
            inv(3, *full).to_json()]
    decoded = decode_inventories(docs)
    assert decoded == [Inventory.from_json(d, r) for r, d in enumerate(docs)]
    assert [i.rank for i in decoded] == [0, 1, 2, 3]
    assert decoded[2].shards is decoded[3].shards  # equal neighbours: decoded once
    assert decoded[0].shards is not decoded[1].shards
    assert choose_latest(decoded, 4) == 7
    lost_own = [inv(r, *(k for k in full if k[1] == r and (k[0], r) != (7, 3)))
                for r in range(4)]
    assert choose_latest(decode_inventories([i.to_json() for i in lost_own]), 4) == 5


def test_other_world_sizes_are_reported_and_never_block_a_save() -> None:
    from localckpt.control.coverage import other_world_shards

    invs = [inv(0, (1, 0, 4), (1, 2, 4), (3, 0, 4)), inv(1, (1, 1, 4), (1, 3, 4))]
    assert other_world_shards(invs, 2) == {4: [1, 3]}
    assert validate_save([2, 2], invs, 2) == 2  # a new world's save goes ahead
    # ... and its retention leaves the old world's shards alone
    assert shards_to_delete(invs[0], {2}, 2) == []


def test_iterations_that_do_not_fit_the_directory_name_are_invalid() -> None:
    with pytest.raises(InvalidIterationError, match="10 digits"):
        validate_save([10**10, 10**10], own(2, []), 2)


def test_why_nothing_is_complete_names_the_newest_iteration_and_what_it_lacks() -> None:
    invs = [inv(0, (5, 0, 3), (10, 0, 3), (10, 1, 3)), inv(1, (5, 1, 3)), inv(2, (7, 0, 2))]
    assert why_incomplete(invs, 3) == "the newest iteration on disk, 10, has no copy of the " \
        "shard of rank 2"
    assert why_incomplete([inv(0), inv(1), inv(2)], 3) == ""
    from replication import ErasureCodingStrategy, Topology

    layout = ErasureCodingStrategy(2, 1).stripes(Topology(("a", "b", "c")))
    # stripe 0: ranks 0 and 1, its parity on rank 2's node (slot -1): only rank 1's shard left
    invs = [inv(0), inv(1, (10, 1, 3)), inv(2, (10, 2, 3))]
    assert why_incomplete(invs, 3, layout) == "the newest iteration on disk, 10, has no copy " \
        "of the shard of rank 0; stripe 0 (ranks [0, 1]) holds 1 of its blocks, 2 needed to " \
        "rebuild"


def test_a_fence_hides_nothing_on_a_root_that_finished_its_rollback() -> None:
    """Pure: the fence of rollback "r" (back with a node that died in it) hides what is newer
    than 20 on every root but one that finished "r" (what it holds newer was saved after);
    a fence written before ids hides everywhere, as before; the inventory carries the ids."""
    from localckpt.control.coverage import Inventory, decode_inventories, job_unfinished

    stale = Inventory(0, "s", frozenset({(20, 0, 2), (20, 1, 2), (30, 0, 2), (30, 1, 2)}),
                      ((20, 2, "r"),))
    finished = Inventory(1, "s", frozenset({(20, 0, 2), (50, 0, 2), (50, 1, 2)}), None,
                         frozenset({("r", 20, 2)}))
    docs = [inv.to_json() for inv in (stale, finished)]
    assert docs[1]["done"] == [["r", 20, 2]] and "done" not in docs[0]
    out = decode_inventories(docs)
    assert out[0].shards == {(20, 0, 2), (20, 1, 2)}
    assert out[1].shards == finished.shards and out[1].done == {("r", 20, 2)}
    assert choose_latest(out, 2) == 50
    assert job_unfinished(out) is None  # "r" finished somewhere: the durable tier is free
    legacy = [{**docs[0], "fence": [[20, 2]]}, docs[1]]
    out = decode_inventories(legacy)
    assert out[1].shards == {(20, 0, 2)} and job_unfinished(out) == ((20, 2, None),)
