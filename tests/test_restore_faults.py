"""Faults around a load's corrupt copies in one process (world of one): many corrupt
iterations in a row, and a copy that cannot be moved aside."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from localckpt import LocalCheckpointManager
from localckpt.storage import store as store_module


def _corrupt(root: Path, iteration: int) -> Path:
    shard = root / "s" / f"iter_{iteration:010d}" / "rank_00000_of_00001"
    chunk = shard / "data" / "c" / "0"
    data = bytearray(chunk.read_bytes())
    data[7] ^= 0xFF
    chunk.write_bytes(bytes(data))
    return shard


def test_a_load_falls_back_past_more_corrupt_iterations_than_are_left(root: Path) -> None:
    """Six of eight iterations are corrupt: the load must reach 2. Its bound on rounds shrank
    with every copy quarantined, and it gave up at 4 saying the job could start afresh."""
    with LocalCheckpointManager(root, "s", keep_last=8, timeout=10) as mgr:
        for it in range(1, 9):
            mgr.save({"w": torch.full((1000,), float(it))}, it)
    for it in range(3, 9):
        _corrupt(root, it)
    with LocalCheckpointManager(root, "s", keep_last=8, timeout=10) as mgr:
        state, ckpt = mgr.load()
    assert ckpt[0] == 2 and torch.equal(state["w"], torch.full((1000,), 2.0))


def test_a_corrupt_copy_that_cannot_be_moved_aside_does_not_stop_the_load(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The root went read-only after an I/O error (ext4 errors=remount-ro): the quarantine's
    rename fails. The load falls back as if it had been moved, and this process lists the
    copy no more."""
    with LocalCheckpointManager(root, "s", keep_last=3, timeout=10) as mgr:
        mgr.save({"w": torch.ones(1000)}, 1)
        mgr.save({"w": torch.zeros(1000)}, 2)
    bad = _corrupt(root, 2)
    real = os.rename

    def read_only(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if ".quarantine-" in str(dst):
            raise OSError(errno.EROFS, "Read-only file system", str(src))
        real(src, dst, *args, **kwargs)

    monkeypatch.setattr(store_module.os, "rename", read_only)
    with LocalCheckpointManager(root, "s", keep_last=3, timeout=10) as mgr:
        state, ckpt = mgr.load()
        assert ckpt[0] == 1 and torch.equal(state["w"], torch.ones(1000))
        assert mgr.find_latest() == 1
    assert bad.is_dir()  # left where it was: an operator removes it


def test_a_corrupt_copy_read_into_the_callers_tensors_is_judged_in_one_chunks_memory(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """load(into=...) exists so that no shard-sized memory is needed: telling a bad copy from
    bad destinations must not allocate the whole shard again (out of memory there hid the
    checksum error on every retry, and the older iteration was never tried)."""
    chunk = 64 << 10
    with LocalCheckpointManager(root, "s", keep_last=3, timeout=10, chunk_nbytes=chunk) as mgr:
        mgr.save({"w": torch.ones(100_000)}, 1)
        mgr.save({"w": torch.zeros(100_000)}, 2)
    _corrupt(root, 2)
    real = torch.empty

    def bounded(*args: Any, **kwargs: Any) -> torch.Tensor:
        size = args[0] if args else kwargs.get("size")
        if isinstance(size, int) and size > chunk:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory (injected)")
        return real(*args, **kwargs)

    into = {"w": torch.full((100_000,), 7.0)}
    with LocalCheckpointManager(root, "s", keep_last=3, timeout=10, chunk_nbytes=chunk) as mgr:
        monkeypatch.setattr(store_module.torch, "empty", bounded)
        state, ckpt = mgr.load(into=into)
    assert ckpt[0] == 1 and state["w"] is into["w"] and torch.equal(into["w"], torch.ones(100_000))


def test_a_resharding_job_falls_back_to_the_newest_iteration_of_any_world_size(
        tmp_path: Path) -> None:
    """reshard=True: a job of 2 ranks saved 5, one of 1 rank saved 8, the job of 2 saved 10,
    whose copy on rank 1 then failed its checks. 8 is what is left newest (find_latest says
    so); the load fell back to 5, among its own world size only, and with no 5 it told the job
    to start afresh."""
    import restore_scenarios
    from dist_harness import run_ranks

    base = str(tmp_path)
    for world, its in ((2, [5]), (1, [8]), (2, [10])):
        for r in run_ranks(restore_scenarios.save, world, tmp_path, base, its, True):
            assert r.ok, r.message
    chunk = tmp_path / "node1" / "job" / "iter_0000000010" / "rank_00001_of_00002" / "data" / \
        "c" / "0"
    data = bytearray(chunk.read_bytes())
    data[7] ^= 0xFF
    chunk.write_bytes(bytes(data))
    results = run_ranks(restore_scenarios.load, 2, tmp_path, base)
    assert all(r.ok for r in results), [r.message for r in results]
    assert [r.value for r in results] == [{"iteration": 8, "w": 8.0, "intact": True}] * 2


def test_a_slow_but_steady_read_of_the_own_shard_is_waited_for_per_chunk(
        tmp_path: Path) -> None:
    """The others wait for a rank reading its own shard as the save waits for a rank writing
    it: each chunk bounded by the timeout, not the whole shard (a healthy load failed with a
    timeout and left the group broken)."""
    import restore_scenarios
    from dist_harness import run_ranks

    for phase in ("save", "load"):
        results = run_ranks(restore_scenarios.slow_reads, 2, tmp_path, str(tmp_path), phase)
        assert all(r.ok for r in results), [r.message for r in results]
    assert [r.value for r in results] == [{"iteration": 1, "intact": True}] * 2


@pytest.mark.parametrize("lose", [False, True], ids=["local", "node-lost"])
def test_a_slow_read_of_a_large_own_shard_is_waited_for_by_a_rank_with_a_small_one(
        tmp_path: Path, lose: bool) -> None:
    """Shards of unequal size (a pipeline stage holding the embeddings): rank 1 reads 12
    chunks slowly, rank 0 one. Rank 0 waited as long as its own read may take, or only for the
    wire when node 0 was lost (the own read runs beside the fetch): both ranks failed the load,
    and every restart again."""
    import shutil

    import restore_scenarios
    from dist_harness import run_ranks

    sizes = (256, 6 << 20)  # 24 chunks: 4.8 s
    results = run_ranks(restore_scenarios.slow_reads, 2, tmp_path, str(tmp_path), "save", sizes)
    assert all(r.ok for r in results), [r.message for r in results]
    if lose:
        shutil.rmtree(tmp_path / "node0")
    results = run_ranks(restore_scenarios.slow_reads, 2, tmp_path, str(tmp_path),
                        "lose" if lose else "load", sizes)
    assert all(r.ok for r in results), [r.message for r in results]
    assert [r.value for r in results] == [{"iteration": 1, "intact": True}] * 2


def test_an_absurd_recorded_chunk_count_caps_the_wait_instead_of_failing_the_load(
        tmp_path: Path) -> None:
    """A manifest recording a largest shard of 2**40 chunks (forged, its checksum intact):
    the wait it implied overflowed gloo's timeout, the load raised OverflowError on every rank
    and broke the group, at every restart. Every wait is now capped like the group's own
    timeout."""
    import restore_scenarios
    from dist_harness import run_ranks

    results = run_ranks(restore_scenarios.forged_most_chunks, 2, tmp_path, str(tmp_path))
    assert [r.value for r in results] == ["intact"] * 2, [r.message for r in results]


def test_a_resharding_load_falls_back_past_an_iteration_whose_lost_shards_cannot_be_rebuilt(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Erasure coding, reshard=True: the newest iteration's lost shards turn out not
    rebuildable (its parity block is of another save). The plain load leaves it out and loads
    the one before; the resharding load raised on every rank, and the job needed a restart
    to get past it. (The rebuild's verdict is stubbed: a world of one has no stripes.)"""
    from types import SimpleNamespace

    from localckpt.load import resharding_loads

    with LocalCheckpointManager(root, "s", keep_last=3, reshard=True, timeout=10) as mgr:
        mgr.save({"w": torch.ones(4)}, 1)
        mgr.save({"w": torch.zeros(4)}, 2)
    monkeypatch.setattr(resharding_loads, "needs_rebuild", lambda ctx, it, listed: it == 2)
    monkeypatch.setattr(resharding_loads, "rebuild_lost", lambda ctx, it, listed: SimpleNamespace(
        unusable="parity block 0 of stripe 0 is of another save", retry=[], bad=[]))
    with LocalCheckpointManager(root, "s", keep_last=3, reshard=True, timeout=10) as mgr:
        manifest, state = mgr._load._load_resharded(None)
    assert manifest.iteration == 1 and torch.equal(state["w"], torch.ones(4))
