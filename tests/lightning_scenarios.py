"""Rank functions for tests/test_lightning.py."""

from __future__ import annotations

import torch


def save_step(rank: int, world: int, root: str, marker: str, step: int) -> None:
    from localckpt.integrations.lightning import LocalCkptIO

    io = LocalCkptIO(root, "job")
    io.on_every_rank = True  # as LocalCkptDDPStrategy sets it
    io.save_checkpoint({"global_step": step, "w": torch.full((2,), float(step))}, marker)
    io.teardown()


def save_with_a_type_on_one_rank(rank: int, world: int, root: str, marker: str) -> str:
    """Rank 1's checkpoint holds an enum no load is allowed to rebuild: every rank must raise,
    at once, and the next save must work (the group intact)."""
    import enum
    import time

    from localckpt.integrations.lightning import LocalCkptIO

    class Mode(enum.Enum):
        A = 1

    io = LocalCkptIO(root, "job", timeout=20)
    io.on_every_rank = True
    extra = {"mode": Mode.A} if rank == 1 else {}
    started = time.monotonic()
    try:
        io.save_checkpoint({"global_step": 1, "w": torch.ones(2), **extra}, marker)
        outcome = "saved"
    except Exception as exc:
        outcome = f"{type(exc).__name__} in {time.monotonic() - started:.0f}s: {exc}"
    io.save_checkpoint({"global_step": 2, "w": torch.ones(2)}, marker)
    io.teardown()
    return outcome
