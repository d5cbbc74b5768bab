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


def slow_reads(rank: int, world: int, base: str, phase: str,
               sizes: tuple[int, int] = (3 << 20, 3 << 20)) -> dict[str, Any]:
    """Rank 1 reads its chunks slowly but steadily (0.2 s each, one at a time: 12 chunks take
    2.4 s, each well inside the 1 s timeout... of a chunk, not of the whole read). ``sizes``:
    each rank's float32 elements (12 MiB: 12 chunks of 1 MiB); the shards are replicated on
    the other node (``phase`` "lose": node 0 was wiped before this load)."""
    import threading
    import time

    from localckpt.storage import shard_reader

    if rank == 1 and phase in ("load", "lose"):
        real, lock = shard_reader.ChunkReads._read, threading.Lock()

        def slow(self: Any, *args: Any) -> None:
            if self.pool is not None:  # its own shard's reads, not those it serves to a peer
                with lock:
                    time.sleep(0.2)
            real(self, *args)

        shard_reader.ChunkReads._read = slow  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(rank)
    mine = {"w": torch.randn(sizes[rank], generator=g)}
    with LocalCheckpointManager(Path(base) / f"node{rank}", "job", "node_spread", timeout=1,
                                chunk_nbytes=1 << 20, node_id=f"node{rank}") as mgr:
        if phase == "save":
            mgr.save(mine, 1)
            return {}
        loaded, ckpt = mgr.load()
        return {"iteration": ckpt[0], "intact": torch.equal(loaded["w"], mine["w"])}


def forged_most_chunks(rank: int, world: int, base: str) -> str:
    """Every shard of iteration 1 records an absurd largest-shard chunk count (a forged or
    damaged manifest, its checksum intact); a load of it must still work (the wait it implies
    is capped), and quickly when every rank is there."""
    import dataclasses

    from localckpt.save import prepare

    real = prepare.SaveAgreement.agree

    def forged(self: Any, group: Any, staged: Any) -> Any:
        agreed = real(self, group, staged)
        metadata = {**agreed.manifest.metadata, "most_chunks": (1 << 40) - 1}
        return dataclasses.replace(agreed, manifest=dataclasses.replace(agreed.manifest,
                                                                        metadata=metadata))

    prepare.SaveAgreement.agree = forged  # type: ignore[method-assign]
    root = Path(base) / f"node{rank}"
    mine = {"w": torch.full((1000,), float(rank))}
    with LocalCheckpointManager(root, "job", node_id=f"node{rank}") as mgr:
        mgr.save(mine, 1)
    prepare.SaveAgreement.agree = real  # type: ignore[method-assign]
    with LocalCheckpointManager(root, "job", node_id=f"node{rank}") as mgr:
        loaded, _ = mgr.load()
    return "intact" if torch.equal(loaded["w"], mine["w"]) else "wrong"
