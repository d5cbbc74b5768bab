"""Rank functions for tests/test_load_into.py (one rank per simulated node, F=2)."""

from __future__ import annotations

from typing import Any

import torch
from write_back_scenarios import big_state, manager


def save(rank: int, world: int, base: str) -> None:
    with manager(rank, base) as mgr:
        mgr.save(big_state(rank, 3), 3)


def load_into(rank: int, world: int, base: str, bad_rank: int) -> dict[str, Any]:
    template = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
                for k, v in big_state(rank, 3).items()}
    if rank == bad_rank:
        template["oops"] = object()
    with manager(rank, base) as mgr:
        loaded, _ = mgr.load(into=template)
    want = big_state(rank, 3)
    return {"identical": all(torch.equal(loaded[k], want[k]) for k in ("big", "big_bf16")),
            "in_place": loaded["big"] is template["big"] and
            loaded["big_bf16"] is template["big_bf16"]}
