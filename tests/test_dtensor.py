"""DTensor (FSDP2 x tensor parallel) state dicts and Stateful objects, on 4 real gloo ranks: each
rank saves its local shards and their layout, and loads them back into a fresh job's DTensors
in place, from its own disk or, after its node was wiped, from a replica on the other node."""

from __future__ import annotations

from pathlib import Path

import dtensor_scenarios
import pytest
from dist_harness import run_ranks


@pytest.mark.parametrize(("via", "wipe_node"), [("app", -1), ("objects", 1)])
def test_fsdp2_tp_state_resumes_bit_identical(tmp_path: Path, root: Path, via: str,
                                              wipe_node: int) -> None:
    results = run_ranks(dtensor_scenarios.save_and_resume, 4, tmp_path, str(root), via,
                        wipe_node, deadline=180)
    assert all(r.ok for r in results), [r.message for r in results if not r.ok]
    values = [r.value for r in results]
    for rank, v in enumerate(values):
        assert v["ckpt"] == [3, rank, "fsdp"]
        assert v["in_place"], "load(into=...) returns the caller's objects, restored"
        assert v["identical"], f"rank {rank}: the loaded state differs from the saved one"
        assert v["rng"] and v["position"] == 6
        assert v["resumed"] == v["reference"], "the loss curve after resuming differs"
        assert v["healed"]
    # Only the wiped node's ranks fetched their shards, from the other node's replicas.
    assert [v["fetched"] > 0 for v in values] == [r // 2 == wipe_node for r in range(4)]


def test_dtensor_refusals_are_agreed_and_lose_nothing(tmp_path: Path, root: Path) -> None:
    results = run_ranks(dtensor_scenarios.refusals, 4, tmp_path, str(root), deadline=180)
    assert all(r.ok for r in results), [r.message for r in results if not r.ok]
    values = [r.value for r in results]
    for v in values:
        assert v["partial"].startswith("RankTypeError")
        assert "'grad_sum'" in v["partial"] and "partial (unreduced)" in v["partial"]
        assert v["no_into"].startswith("ConfigurationError") and "device mesh" in v["no_into"]
        assert v["other_mesh"] == "ok"  # the same world on another mesh: resharded
        assert v["identical"]
        assert v["resharded"][0] == 2 and v["resharded_identical"]  # with reshard=True
    assert [v["after"][0] for v in values] == [2] * 4
    # The same error on every rank.
    for key in ("partial", "no_into"):
        assert len({v[key].split(":")[0] for v in values}) == 1


@pytest.mark.parametrize(("before", "after", "corrupt"), [(4, 2, 1), (2, 4, -1)])
def test_a_job_of_another_world_size_resumes_on_the_same_loss_curve(
        tmp_path: Path, root: Path, before: int, after: int, corrupt: int) -> None:
    """FSDP2 x TP saved by `before` ranks on a (before/2, 2) mesh, loaded by `after` ranks on an
    (after/2, 2) mesh with reshard=True: every rank's DTensor shards are assembled from the old
    ranks' boxes, its plain state is old rank (rank % before)'s, and training goes on with the
    losses of the uninterrupted run of the same global batch (up to the reduction order). With
    ``corrupt``, node0's copy of that old owner's shard is damaged: it is quarantined and the
    replica on node1 serves instead."""
    saved = run_ranks(dtensor_scenarios.elastic_save, before, tmp_path, str(root),
                      deadline=180)
    assert all(r.ok for r in saved), [r.message for r in saved if not r.ok]
    reference = saved[0].value
    resumed = run_ranks(dtensor_scenarios.elastic_resume, after, tmp_path, str(root), corrupt,
                        deadline=180)
    assert all(r.ok for r in resumed), [r.message for r in resumed if not r.ok]
    for rank, r in enumerate(resumed):
        v = r.value
        assert v["latest"] == 3 and v["ckpt"] == [3, rank, "elastic"] and v["in_place"]
        assert v["position"] == 3 and v["plain_from"] == rank % before
        assert v["resumed"] == pytest.approx(reference, rel=1e-5), (v["resumed"], reference)
        assert v["again"] == 6  # and it checkpoints again, at its own world size
        assert len(v["quarantined"]) == (corrupt >= 0), v["quarantined"]


@pytest.mark.parametrize(("before", "after"), [(2, 1), (4, 3)])
def test_mixed_dtypes_and_uneven_shards_reshard_byte_exactly(
        tmp_path: Path, root: Path, before: int, after: int) -> None:
    saved = run_ranks(dtensor_scenarios.mixed_save, before, tmp_path, str(root), deadline=120)
    assert all(r.ok for r in saved), [r.message for r in saved if not r.ok]
    loaded = run_ranks(dtensor_scenarios.mixed_load, after, tmp_path, str(root), deadline=120)
    assert all(r.ok for r in loaded), [r.message for r in loaded if not r.ok]
    for rank, r in enumerate(loaded):
        v = r.value
        assert v["rejected"] == "InvalidIterationError"
        assert v["ckpt"] == [3, rank, "mixed"] and v["in_place"]
        assert all(v["exact"].values()), v["exact"]
        assert v["plain_from"] == rank % before
        assert v["older"].startswith("InvalidIterationError") and "newer than" in v["older"]
        assert v["after"] == 4
        # a rank keeps what it read for its own pieces until it builds, but never a whole
        # shard for a small share of it (its plain owner's few plain bytes): from a review
        for kept, pieces in v["own_held"]:
            assert kept <= 2 * pieces, v["own_held"]


def test_a_reshard_larger_than_one_round_moves_in_rounds_byte_exactly(
        tmp_path: Path, root: Path) -> None:
    """Each round of the all-to-all is bounded by the group's timeout: a reshard that could
    not move in one moves in several (here 256 bytes per rank a round), every byte in place."""
    saved = run_ranks(dtensor_scenarios.mixed_save, 2, tmp_path, str(root), deadline=120)
    assert all(r.ok for r in saved), [r.message for r in saved if not r.ok]
    loaded = run_ranks(dtensor_scenarios.mixed_load, 3, tmp_path, str(root), 256, deadline=120)
    assert all(r.ok for r in loaded), [r.message for r in loaded if not r.ok]
    rounds = {r.value["rounds"] for r in loaded}
    assert len(rounds) == 1 and rounds.pop() > 1  # the same rounds on every rank
    for r in loaded:
        assert all(r.value["exact"].values()), r.value["exact"]
        assert r.value["after"] == 4


def test_rounds_bound_what_each_rank_moves() -> None:
    """The fewest rounds that keep every rank's bytes a round near the limit, whatever the
    world size; each pair's share of a round the same at both of its ends."""
    from localckpt.load.reshard import ALIGN, _round_splits, round_count, round_share

    assert round_count({}, 1 << 30) == 1
    assert round_count({(0, 1): 3 << 30, (1, 0): 1 << 30}, 1 << 30) == 3
    # a sparse plan at 1,024 ranks: each rank sends 9 GiB to one other -> 9 rounds, not 9,000
    assert round_count({(r, (r + 1) % 1024): 9 << 30 for r in range(1024)}, 1 << 30) == 9
    assert round_count({(0, r): 1 << 20 for r in range(1024)}, 1 << 30) == 1
    for n in (0, 64, 128, 64 * 7, 64 * 1001):  # a pair's bytes: pieces padded to ALIGN
        for rounds in (1, 2, 3, 7):
            parts = [_round_splits([n], rounds, r)[0] for r in range(rounds)]
            assert sum(parts) == n and all(p >= 0 and p % ALIGN == 0 for p in parts)
            assert max(parts) == round_share(n, rounds) or n == 0


def test_replicated_shards_are_stored_once_per_replica_group(tmp_path: Path,
                                                             root: Path) -> None:
    """HSDP (replicate=2 x shard=2): each replicated shard is stored by one member of its group
    (chosen per leaf), so the job stores about half the bytes; after node 1 is wiped, the
    members that stored none of a leaf get it from the other's shard, bit-identical."""
    results = run_ranks(dtensor_scenarios.hsdp_dedupe, 4, tmp_path, str(root), deadline=180)
    assert all(r.ok for r in results), [r.message for r in results if not r.ok]
    values = [r.value for r in results]
    # a shard that leaves replicas to another rank is format version 3: older readers refuse it
    assert {v["sizes"]["dedupe_version"] for v in values} == {3}
    assert {v["sizes"]["full_version"] for v in values} == {2}
    stored = sum(v["sizes"]["dedupe"] for v in values)
    full = sum(v["sizes"]["full"] for v in values)
    assert 0.3 * full < stored < 0.7 * full, (stored, full)
    for rank, v in enumerate(values):
        assert v["ckpt"] == [2, rank, "dedupe"] and v["in_place"] and v["identical"]
        assert v["resumed"] == pytest.approx(v["reference"], rel=1e-6)


def test_a_replicated_shard_no_member_would_store_fails_the_save(tmp_path: Path,
                                                                 root: Path) -> None:
    results = run_ranks(dtensor_scenarios.non_spmd_replicas, 2, tmp_path, str(root),
                        deadline=120)
    assert all(r.ok for r in results), [r.message for r in results if not r.ok]
    for v in (r.value for r in results):
        assert v["refused"].startswith("ConfigurationError") and "rank 1 left 1" in v["refused"]
        assert v["latest"] == 1 and v["after"] == 3


@pytest.mark.parametrize(("strategy", "exact", "iteration"), [
    ("node_spread", None, 2), (None, None, 1), ("node_spread", 2, 2), (None, 2, None)])
def test_a_corrupt_keeper_copy_falls_back_like_any_corrupt_copy(
        tmp_path: Path, root: Path, strategy: str | None, exact: int | None,
        iteration: int | None) -> None:
    """Also for a rollback (``load(iteration=2)``, before: the first corrupt copy failed it
    although the other node held a good one); without a replica it names iteration 2."""
    results = run_ranks(dtensor_scenarios.dedupe_corrupt, 2, tmp_path, str(root), strategy,
                        exact, deadline=120)
    assert all(r.ok for r in results), [r.message for r in results if not r.ok]
    for rank, r in enumerate(results):
        if iteration is None:
            assert r.value["error"].startswith("CorruptShardError") and \
                "iteration 2" in r.value["error"], r.value
            continue
        assert r.value["ckpt"] == [iteration, rank, "dc"], r.value
        assert r.value["values"] == {"odd1": [iteration * 10.0], "odd": [iteration * 10.0 + 1]}


def test_two_dtensors_at_one_key_path_are_refused(tmp_path: Path, root: Path) -> None:
    results = run_ranks(dtensor_scenarios.duplicate_dtensor_paths, 2, tmp_path, str(root),
                        deadline=60)
    assert all(r.ok for r in results), [r.message for r in results if not r.ok]
    assert all("two DTensors at state dict key 'a/b'" in r.value for r in results)


def test_a_layout_whose_shards_are_not_blocks_is_refused_not_loaded_wrong(
        tmp_path: Path) -> None:
    """Resharding onto a _StridedShard layout whose local shards are not one block each (a
    flattened view of a tensor sharded on two mesh dims): refused with the leaf named, on
    every rank (before: each rank got a block from its first offset, a wrong tensor)."""
    base = str(tmp_path / "root")
    assert all(r.ok for r in run_ranks(dtensor_scenarios.flat_save, 2, tmp_path, base))
    results = run_ranks(dtensor_scenarios.flat_load, 4, tmp_path, base)
    assert all(r.ok for r in results), [r.message for r in results]
    for r in results:
        assert r.value["error"] is not None, r.value
        assert r.value["error"].startswith("ConfigurationError") and "'flat'" in \
            r.value["error"] and "_StridedShard" in r.value["error"], r.value


def test_a_resharding_load_whose_only_copy_is_corrupt_says_so(tmp_path: Path) -> None:
    """The only copy of an old shard fails its checksum: quarantined, and every rank raises
    CorruptShardError naming it (before: NoCheckpointError, which a job may take for "start
    afresh", as if nothing had been saved)."""
    base = str(tmp_path / "root")
    assert all(r.ok for r in run_ranks(dtensor_scenarios.flat_save, 1, tmp_path, base))
    results = run_ranks(dtensor_scenarios.flat_corrupt_load, 2, tmp_path, base)
    assert all(r.ok for r in results), [r.message for r in results]
    for r in results:
        assert r.value.startswith("CorruptShardError") and "quarantined" in r.value, r.value


def test_a_resharding_load_waits_for_long_reads_and_agrees_on_a_failed_allocation(
        tmp_path: Path) -> None:
    """The read step waits as long as the servers' shards may take (before: a rank with
    nothing to read timed out after one timeout while its peer still read); a rank that cannot
    allocate what it will receive fails inside an agreed step, the same error on every rank at
    once (before: a raw RuntimeError there, a timeout on the other rank)."""
    base, n = str(tmp_path / "root"), 4096  # 16 KiB: 4 messages of 4 KiB
    assert all(r.ok for r in run_ranks(dtensor_scenarios.flat_save, 1, tmp_path, base, n))
    slow = run_ranks(dtensor_scenarios.flat_load_with, 2, tmp_path, base, "slow_read", 1.0, n)
    assert [r.value for r in slow] == ["loaded", "loaded"], [r.value for r in slow]
    failed = run_ranks(dtensor_scenarios.flat_load_with, 2, tmp_path, base, "no_memory", 10.0,
                       n)
    assert all(r.ok for r in failed), [r.message for r in failed]
    for r in failed:
        assert "rank 1" in r.value and "can't allocate memory" in r.value, r.value
        assert r.elapsed < 8, (r.elapsed, r.value)


def test_resharded_bytes_damaged_in_transit_are_sent_again_never_loaded(
        tmp_path: Path) -> None:
    """A byte flipped between the serving rank's verified read and the receiving rank's
    tensors: the receiver's check of what each rank sent fails, every rank lists and moves
    the pieces again, and the load ends bit-identical (before: the damaged byte was loaded)."""
    base = str(tmp_path / "root")
    assert all(r.ok for r in run_ranks(dtensor_scenarios.flat_save, 1, tmp_path, base, 4096))
    results = run_ranks(dtensor_scenarios.flat_load_with, 2, tmp_path, base,
                        "damaged_in_transit", 20.0, 4096)
    assert [r.value for r in results] == ["loaded", "loaded"], [r.message for r in results]
