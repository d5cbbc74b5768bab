"""Rank functions for tests/test_load_into.py (one rank per simulated node, F=2)."""

from __future__ import annotations

from pathlib import Path
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


def read_only_into(rank: int, world: int, base: str, where: str) -> str:
    """``into``'s "big" on rank 1 is a read-only mapping of a file (written as zeros): the load
    must refuse it on every rank, naming the key, before anything writes to it."""
    import mmap
    import warnings

    template = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
                for k, v in big_state(rank, 3).items()}
    if rank == 1:
        backing = Path(where) / "read-only.bin"
        big = template["big"]
        backing.write_bytes(bytes(big.numel() * big.element_size()))
        with open(backing, "rb") as f:
            pages = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer warns about a non-writable buffer
            template["big"] = torch.frombuffer(pages, dtype=big.dtype).view(big.shape)
    with manager(rank, base) as mgr:
        try:
            mgr.load(into=template)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    return "loaded"


def save_apart(rank: int, world: int, base: str) -> None:
    """Two ranks on one node root: a plain tensor, and two keys saved with different values."""
    from pathlib import Path

    from localckpt import LocalCheckpointManager

    with LocalCheckpointManager(Path(base) / "node0", "job", timeout=30) as mgr:
        mgr.save({"w": torch.full((1 << 16,), float(rank + 1)),
                  "emb": torch.full((8,), float(rank)),
                  "head": torch.full((8,), float(rank + 5)),
                  "tied_a": torch.full((8,), 9.0), "tied_b": torch.full((8,), 9.0)}, 1)


def reshard_into(rank: int, world: int, base: str, case: str) -> dict[str, Any]:
    """A job of another world size (reshard=True) loads into a shrunk tensor ("shrunk"), a
    read-only one ("read-only"), an expanded one ("expanded"), next
    to a freed tensor the checkpoint has nothing for ("freed elsewhere"), or into tied tensors
    ("tied": ``emb``/``head`` saved apart, ``tied_a``/``tied_b`` saved alike)."""
    from pathlib import Path

    from localckpt import LocalCheckpointManager

    w = torch.zeros(1 << 16)
    apart, tied = torch.full((8,), -1.0), torch.zeros(8)
    if case == "shrunk":
        w.untyped_storage().resize_(8)
        into: dict[str, Any] = {"w": w}
    elif case == "read-only":
        import mmap
        import warnings

        backing = Path(base) / "read-only.bin"
        backing.write_bytes(bytes(w.numel() * 4))
        with open(backing, "rb") as f:
            pages = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            into = {"w": torch.frombuffer(pages, dtype=torch.float32)}
    elif case == "expanded":
        into = {"w": torch.zeros(1).expand(1 << 16)}
    elif case == "freed elsewhere":
        unrelated = torch.zeros(4)
        unrelated.untyped_storage().resize_(0)
        into = {"w": w, "unrelated": unrelated}
    else:
        into = {"emb": apart, "head": apart, "tied_a": tied, "tied_b": tied}
    out: dict[str, Any] = {}
    with LocalCheckpointManager(Path(base) / "node0", "job", timeout=30, reshard=True) as mgr:
        try:
            state, _ = mgr.load(into=into)
        except (TypeError, ValueError) as exc:
            return {"error": str(exc)}
    if case == "freed elsewhere":
        return {"w_in_place": state["w"] is w and bool((w == 1.0).all())}
    if case == "expanded":
        return {"fresh": state["w"] is not into["w"], "w": state["w"].unique().tolist(),
                "untouched": bool((into["w"] == 0).all())}
    out["emb"], out["head"] = state["emb"][0].item(), state["head"][0].item()
    out["apart_untouched"] = bool((apart == -1.0).all())
    out["tied_in_place"] = state["tied_a"] is tied and state["tied_b"] is tied and \
        bool((tied == 9.0).all())
    return out
