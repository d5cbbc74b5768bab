"""A small, deterministic data-parallel training job that checkpoints with localckpt.

Run under torchrun. Every rank trains a replica of a small MLP with Adam; gradients are averaged
over the default (training) process group. The batch of each step is derived from (seed, step,
rank) and the RNG states travel in the checkpoint, so a run that crashes and resumes ends with
weights bit-identical to an uninterrupted run of the same length.

At start-up it resumes from ``find_latest`` / ``load``; it saves every ``--save-every`` steps.
``--crash-at-step S --crash-rank R`` kills rank R (hard exit, no cleanup) at step S of the first
attempt only (torchrun's TORCHELASTIC_RESTART_COUNT == 0), so torchrun's restart resumes it.
Each rank writes ``<out>/rank<r>.json`` with the final weights' digest and what it resumed from.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from localckpt import LocalCheckpointManager


def build_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Dropout(0.1),
                               torch.nn.Linear(64, 8))


def batch(seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data-loader: the batch at ``step`` depends only on (seed, step, rank)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    x = torch.randn(16, 32, generator=g)
    return x, x[:, :8].sin() + 0.1 * torch.randn(16, 8, generator=g)


def weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", required=True, help="node-local checkpoint root")
    parser.add_argument("--out", required=True, help="directory for per-rank result JSON")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--crash-at-step", type=int, default=-1)
    parser.add_argument("--crash-rank", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    logging.basicConfig(level=os.environ.get("LOCALCKPT_LOG", "WARNING"),
                        format="%(asctime)s %(name)s: %(message)s")

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    init_process_group(attempt)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    model = build_model(args.seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)  # dropout masks differ per rank, as in real jobs

    mgr = LocalCheckpointManager(args.root, "demo", timeout=args.timeout)
    started = time.monotonic()
    resumed_from = mgr.find_latest()
    start_step = 0
    if resumed_from >= 0:
        state, _ = mgr.load()
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(_as_random_state(state["rng"]["python"]))
        start_step = state["step"] + 1
    restore_s = time.monotonic() - started

    for step in range(start_step, args.steps):
        if attempt == 0 and step == args.crash_at_step and rank == args.crash_rank:
            os._exit(17)  # a hard crash: no cleanup, no finally blocks
        x, y = batch(args.seed, step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # data parallel on the training group
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        if (step + 1) % args.save_every == 0:
            mgr.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                      "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                      "step": step}, iteration=step)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "attempt": attempt, "resumed_from": resumed_from,
        "restore_seconds": restore_s, "digest": weights_digest(model),
    }))
    mgr.close()
    dist.destroy_process_group()


def init_process_group(attempt: int) -> None:
    """The training group, with its store keys namespaced by restart attempt.

    torchrun's agent keeps one store across restarts; without a per-attempt prefix a restarted
    gloo group reads the dead attempt's peer addresses and fails with "Connection refused".
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_hosts_store,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}", store),
                            rank=rank, world_size=world)


def _as_random_state(state: Any) -> tuple[Any, ...]:
    version, internal, gauss = state
    return version, tuple(internal), gauss


if __name__ == "__main__":
    main()
