"""Rank programs for the CUDA multi-process tests (every rank on the one GPU of the machine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from scenarios import digest

from localckpt import LocalCheckpointManager


def cuda_state(rank: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(rank)
    return {"w": torch.randn(300_000, device="cuda", generator=g),  # spans chunks
            "small": [torch.randn(1 + i % 31, device="cuda", generator=g) for i in range(200)],
            "cpu": torch.arange(5) + rank}


def own_copy_corrupt_then_load(rank: int, world: int, base: str) -> dict[str, Any]:
    """Two nodes, each rank's shard replicated on the other; rank 0's own copy has a flipped
    byte: its load reads it through pinned memory, fails the checksum, quarantines it and takes
    the replica from rank 1."""
    from replication import make_strategy

    def manager() -> LocalCheckpointManager:
        return LocalCheckpointManager(Path(base) / f"node{rank}", "job",
                                      make_strategy("node_spread"), timeout=60,
                                      chunk_nbytes=64 << 10, node_id=f"node{rank}")

    state = cuda_state(rank)
    with manager() as mgr:
        mgr.save(state, 1)
    dist.barrier()
    if rank == 0:
        chunk = Path(base) / "node0" / "job" / "iter_0000000001" / "rank_00000_of_00002" / \
            "data" / "c" / "2"
        raw = bytearray(chunk.read_bytes())
        raw[100] ^= 0x01
        chunk.write_bytes(raw)
    dist.barrier()
    with manager() as mgr:
        loaded, ckpt_id = mgr.load()
    return {"ckpt_id": list(ckpt_id), "same": digest(loaded) == digest(state),
            "devices": sorted({str(t.device) for t in [loaded["w"], *loaded["small"]]}),
            "quarantined": [p.name for p in (Path(base) / f"node{rank}" / "job").glob(
                ".quarantine-*")]}
