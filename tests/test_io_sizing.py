"""Default I/O threads: a rank's share of the cores it may run on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from localckpt import LocalCheckpointManager
from localckpt.storage import io_sizing
from localckpt.storage.io_sizing import (
    MAX_IO_THREADS,
    MIN_IO_THREADS,
    default_io_threads,
    ranks_sharing,
)


@pytest.mark.parametrize(("sharing", "cores", "expected"), [
    (1, 2, 2),     # a 2-core CI runner: as before
    (2, 2, 2),     # never fewer than two
    (1, 16, 12),   # alone on a 16-core GPU host: capped where loads stopped scaling
    (8, 16, 2),    # eight ranks share those cores
    (4, 16, 4),
    (1, 64, 12),
    (1, 10, 10),
    (0, 6, 6),
])
def test_default_is_the_share_of_the_cores(sharing: int, cores: int, expected: int) -> None:
    assert default_io_threads(sharing, cores) == expected
    assert MIN_IO_THREADS <= expected <= MAX_IO_THREADS


def test_ranks_share_the_cores_of_their_node_with_the_same_cpu_set() -> None:
    nodes = ["a", "a", "a", "a", "b", "b"]
    # a container's cpuset (or no pinning): one set for the whole node
    assert ranks_sharing(0, nodes, ["s"] * 6) == 4
    assert ranks_sharing(5, nodes, ["s"] * 6) == 2
    # NUMA binding: two ranks per set
    assert ranks_sharing(1, nodes, ["x", "x", "y", "y", "z", "w"]) == 2
    assert ranks_sharing(4, nodes, ["x", "x", "y", "y", "z", "w"]) == 1


def test_usable_cores_reads_the_affinity_mask_and_the_cgroup_quota(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(io_sizing, "_CPU_MAX", str(tmp_path / "missing"))
    cores, key = io_sizing.usable_cores()
    assert cores == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7})
    assert io_sizing.usable_cores() == (4, io_sizing.usable_cores()[1]) != (4, key)
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("150000 100000\n")  # 1.5 CPUs of quota
    monkeypatch.setattr(io_sizing, "_CPU_MAX", str(cpu_max))
    assert io_sizing.usable_cores()[0] == 2
    cpu_max.write_text("max 100000\n")
    assert io_sizing.usable_cores()[0] == 4
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert io_sizing.usable_cores()[0] == 16


def test_the_manager_sizes_its_pool_from_the_cores(root: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(io_sizing, "usable_cores", lambda: (16, "set"))
    with LocalCheckpointManager(root) as mgr:
        assert mgr._ctx.store._pool._max_workers == 12
        mgr.save({"w": torch.arange(10)}, 1)
        assert torch.equal(mgr.load()[0]["w"], torch.arange(10))
    with LocalCheckpointManager(root, io_threads=3) as mgr:
        assert mgr._ctx.store._pool._max_workers == 3
