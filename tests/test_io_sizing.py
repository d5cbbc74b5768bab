"""Default I/O threads: a rank's share of the cores it may run on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from localckpt import LocalCheckpointManager
from localckpt.storage import io_sizing
from localckpt.storage.io_sizing import MAX_IO_THREADS, MIN_IO_THREADS, default_io_threads


@pytest.mark.parametrize(("ranks", "cores", "pinned", "expected"), [
    (1, 2, False, 2),     # a 2-core CI runner: as before
    (2, 2, False, 2),     # never fewer than two
    (1, 16, False, 8),    # alone on a 16-core GPU host: capped where tmpfs stopped scaling
    (8, 16, False, 2),    # eight ranks share those cores
    (4, 16, False, 4),
    (8, 4, True, 4),      # pinned to its own 4 cores: those are its share already
    (1, 64, True, 8),
    (0, 6, False, 6),     # no rank count known: the whole machine
])
def test_default_is_the_ranks_share_of_its_cores(ranks: int, cores: int, pinned: bool,
                                                 expected: int) -> None:
    assert default_io_threads(ranks, cores, pinned) == expected
    assert MIN_IO_THREADS <= expected <= MAX_IO_THREADS


def test_usable_cores_reads_the_affinity_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert io_sizing.usable_cores() == (4, True)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert io_sizing.usable_cores() == (16, False)
    monkeypatch.delattr(os, "sched_getaffinity")
    assert io_sizing.usable_cores() == (16, False)


def test_the_manager_sizes_its_pool_from_the_cores(root: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(io_sizing, "usable_cores", lambda: (16, False))
    with LocalCheckpointManager(root) as mgr:
        assert mgr._ctx.store._pool._max_workers == 8
        mgr.save({"w": torch.arange(10)}, 1)
        assert torch.equal(mgr.load()[0]["w"], torch.arange(10))
    with LocalCheckpointManager(root, io_threads=3) as mgr:
        assert mgr._ctx.store._pool._max_workers == 3
