"""Rank programs for tests/test_restore_faults.py (run by dist_harness.run_ranks): jobs of
different world sizes saving into the same node roots, without replication."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from localckpt import LocalCheckpointManager


def _manager(rank: int, base: str, reshard: bool) -> LocalCheckpointManager:
    return LocalCheckpointManager(Path(base) / f"node{rank}", "job", timeout=30,
                                  node_id=f"node{rank}", keep_last=3, reshard=reshard)


def state(iteration: int) -> dict[str, Any]:
    """The same on every rank (a replicated model): any world size can load it."""
    return {"w": torch.full((1000,), float(iteration)), "iteration": iteration}


def save(rank: int, world: int, base: str, iterations: list[int], reshard: bool) -> None:
    with _manager(rank, base, reshard) as mgr:
        for it in iterations:
            mgr.save(state(it), it)


def load(rank: int, world: int, base: str) -> dict[str, Any]:
    with _manager(rank, base, True) as mgr:
        loaded, ckpt = mgr.load()
        return {"iteration": ckpt[0], "w": float(loaded["w"][0]),
                "intact": torch.equal(loaded["w"], state(ckpt[0])["w"])}
