"""Real gloo ranks (spawned processes): save, find_latest and load across 2 and 4 ranks."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import scenarios
from dist_harness import run_ranks


@pytest.mark.parametrize("world,ranks_per_node", [(2, 1), (4, 2)])
def test_save_then_fresh_manager_loads_bit_identical(tmp_path: Path, root: Path, world: int,
                                                    ranks_per_node: int) -> None:
    results = run_ranks(scenarios.save_then_restore, world, tmp_path, str(root), [3, 7],
                        ranks_per_node)
    for r in results:
        assert r.ok, r.message
        assert r.value["latest"] == 7
        assert r.value["ckpt_id"] == [7, r.rank, "job"]
        assert r.value["digest"] == r.value["expected"]
    # keep_last=1: only iteration 7 remains on disk
    iters = {p.name for p in root.glob("node*/job/iter_*")}
    assert iters == {"iter_0000000007"}


@pytest.mark.parametrize("keep_last,expected", [(2, 4), (1, -1)])
def test_deleted_shard_falls_back_to_previous_kept_iteration(tmp_path: Path, root: Path,
                                                             keep_last: int, expected: int) -> None:
    results = run_ranks(scenarios.save_only, 2, tmp_path, str(root), [4, 8], keep_last)
    assert all(r.ok for r in results), [r.message for r in results]
    shutil.rmtree(root / "node1" / "job" / "iter_0000000008" / "rank_00001_of_00002")
    results = run_ranks(scenarios.find_and_load, 2, tmp_path, str(root))
    for r in results:
        assert r.ok, r.message
        assert r.value["latest"] == expected
        if expected >= 0:
            assert r.value["digest"] == r.value["expected"]


def test_stale_leftovers_do_not_block_and_are_cleaned(tmp_path: Path, root: Path) -> None:
    # A crash mid-save left temporaries (rank 0 and 1) and a half-finished shard of iteration 5.
    it_dir = root / "node1" / "job" / "iter_0000000005"
    (it_dir / ".tmp-rank_00001_of_00002-w00001-deadbeef0000" / "data").mkdir(parents=True)
    (it_dir / "rank_00001_of_00002").mkdir()  # committed name, but no manifest
    (root / "node0" / "job" / "iter_0000000005" /
     ".trash-rank_00000_of_00002-w00000-0123456789ab").mkdir(parents=True)
    results = run_ranks(scenarios.save_then_restore, 2, tmp_path, str(root), [5])
    for r in results:
        assert r.ok, r.message
        assert r.value["latest"] == 5 and r.value["digest"] == r.value["expected"]
    leftovers = [p for p in root.rglob(".*") if p.name.startswith((".tmp-", ".trash-"))]
    assert leftovers == []


def test_mismatched_iterations_raise_on_every_rank(tmp_path: Path, root: Path) -> None:
    results = run_ranks(scenarios.save_iteration_per_rank, 2, tmp_path, str(root), [3, 4])
    for r in results:
        assert r.raised("InvalidIterationError"), r.message
        assert "same iteration" in r.message
    assert not list(root.rglob("rank_*"))


def test_old_and_negative_iterations_raise_on_every_rank(tmp_path: Path, root: Path) -> None:
    assert all(r.ok for r in run_ranks(scenarios.save_only, 2, tmp_path, str(root), [10]))
    for bad, text in ((10, "newer than the latest committed checkpoint 10"),
                      (-1, "non-negative")):
        results = run_ranks(scenarios.save_iteration_per_rank, 2, tmp_path, str(root), [bad, bad])
        for r in results:
            assert r.raised("InvalidIterationError") and r.raised("ValueError"), r.message
            assert text in r.message
    results = run_ranks(scenarios.find_and_load, 2, tmp_path, str(root))
    assert all(r.ok and r.value["latest"] == 10 for r in results)


def test_unsupported_leaf_on_one_rank_raises_type_error_on_every_rank(tmp_path: Path,
                                                                      root: Path) -> None:
    results = run_ranks(scenarios.save_with_bad_leaf_on, 2, tmp_path, str(root), 1)
    for r in results:
        assert r.raised("TypeError"), r.message
        assert "rank 1" in r.message and "model/oops" in r.message and "object" in r.message


def test_write_failure_on_one_rank_removes_partial_iteration(tmp_path: Path, root: Path) -> None:
    results = run_ranks(scenarios.write_fails_on, 2, tmp_path, str(root), 1)
    for r in results:
        assert r.ok, r.message
        name, bases, msg = r.value["error"]
        assert name == "RankOSError" and "OSError" in bases
        assert "rank 1" in msg and "injected" in msg
        assert r.value["dirs"] == ["iter_0000000001"]  # iteration 2 removed on every node
        assert r.value["latest"] == 1 and r.value["digest"] == r.value["expected"]


def test_corrupt_shard_raises_naming_the_file_on_every_rank(tmp_path: Path, root: Path) -> None:
    assert all(r.ok for r in run_ranks(scenarios.save_only, 2, tmp_path, str(root), [6]))
    chunk = root / "node1" / "job" / "iter_0000000006" / "rank_00001_of_00002" / "data" / "c" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[100] ^= 0xFF
    chunk.write_bytes(raw)
    results = run_ranks(scenarios.find_and_load, 2, tmp_path, str(root))
    for r in results:
        assert r.raised("CorruptShardError"), r.message
        assert str(chunk) in r.message and "checksum mismatch" in r.message


def test_missing_peer_raises_timeout_instead_of_hanging(tmp_path: Path, root: Path) -> None:
    started = time.monotonic()
    results = run_ranks(scenarios.stall_then_exit, 2, tmp_path, str(root), 1, 8.0, deadline=60)
    assert results[1].ok
    assert results[0].raised("CollectiveTimeoutError") and results[0].raised("TimeoutError"), \
        results[0].message
    assert "find_latest" in results[0].message
    assert time.monotonic() - started < 45


@pytest.mark.parametrize("sizes", [[0, 10, 4000], [5, 70_000, 0]])
def test_exchange_of_small_and_large_payloads(tmp_path: Path, sizes: list[int]) -> None:
    for r in run_ranks(scenarios.exchange_sizes, 3, tmp_path, sizes):
        assert r.ok, r.message
        assert r.value == sizes
