"""Rank functions for tests/test_lightning.py."""

from __future__ import annotations

import torch


def save_step(rank: int, world: int, root: str, marker: str, step: int) -> None:
    from localckpt.integrations.lightning import LocalCkptIO

    io = LocalCkptIO(root, "job")
    io.on_every_rank = True  # as LocalCkptDDPStrategy sets it
    io.save_checkpoint({"global_step": step, "w": torch.full((2,), float(step))}, marker)
    io.teardown()
