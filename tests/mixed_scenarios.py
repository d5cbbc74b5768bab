"""Rank functions for tests/test_rollback.py's resharding loads of an iteration saved twice: 2
gloo ranks, one simulated node each, a DTensor ``w`` sharded over both. Loading it into a
DTensor laid out another way (Shard(1) instead of Shard(0)) takes the resharding load at the
saving world size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from localckpt import LocalCheckpointManager


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))


def state(value: float) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {"w": distribute_tensor(torch.full((4, 3), float(value)), _mesh(), [Shard(0)]),
            "it": torch.tensor(float(value))}


def other_layout() -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {"w": distribute_tensor(torch.zeros(4, 3), _mesh(), [Shard(1)]),
            "it": torch.tensor(0.0)}


def manager(rank: int, base: str, strategy: str | None) -> LocalCheckpointManager:
    return LocalCheckpointManager(Path(base) / f"node{rank}", "job", strategy, keep_last=10,
                                  timeout=20, node_id=f"node{rank}")


def save(rank: int, world: int, base: str, strategy: str | None, iterations: list[int],
         offset: int, rollback_to: int = -1) -> None:
    """Saves ``iterations`` (values offset by ``offset``), after a rollback to ``rollback_to``
    with discard_newer when it is not -1."""
    with manager(rank, base, strategy) as mgr:
        if rollback_to >= 0:
            mgr.load(into=other_layout(), iteration=rollback_to, discard_newer=True)
            mgr.wait_for_write_back()
        for it in iterations:
            mgr.save(state(it + offset), it)


def load_other_layout(rank: int, world: int, base: str, strategy: str | None,
                      exact: int | None = None) -> dict[str, Any]:
    with manager(rank, base, strategy) as mgr:
        try:
            state_, ckpt_id = mgr.load(into=other_layout(), iteration=exact)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"[:400]}
        mgr.wait_for_write_back()
        return {"loaded": ckpt_id[0], "value": float(state_["it"]),
                "w": float(state_["w"].full_tensor()[0, 0])}
