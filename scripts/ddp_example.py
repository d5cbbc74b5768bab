"""Plain DDP checkpointed with localckpt: copy the parts marked ``# localckpt``.

A training loop as people write it without a framework: a DDP model with dropout, AdamW, a
learning-rate schedule, a data loader whose position and shuffling seed are state, noise from
numpy and Python's ``random``, and a config dataclass. Everything that makes the run what it is
goes into one state dict (modules and optimizers as objects: they are restored in place); it
is saved asynchronously every few steps to node-local storage, replicated to another node, and
the job resumes from the newest complete checkpoint: its losses from there are bit-identical
to a run that never stopped.

    torchrun --nproc-per-node 2 scripts/ddp_example.py --root '/dev/shm/ckpt/{node}' --steps 12

With ``--preemption`` a SIGTERM (what schedulers send before they take the nodes) on any rank
makes every rank save the current step, finalize it and exit cleanly; the next start resumes
from there. ``--nodes`` simulates that many nodes on one machine (each its own root, ``{node}``
in ``--root``). Rank 0 writes one JSON line per step (``--loss-log``): the step and its loss;
each rank writes its pid next to it (``<loss-log>.pid<rank>``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import localckpt
from localckpt import AsyncCallsQueue, LocalCheckpointManager, SavePolicy


@dataclasses.dataclass
class TrainConfig:
    lr: float = 3e-3
    batch: int = 16
    noise: float = 0.05


localckpt.add_safe_types(TrainConfig)  # localckpt: the dataclasses a load may rebuild


class Loader:
    """Shuffles a synthetic dataset each epoch (a torch.Generator), walks this rank's part."""

    def __init__(self, rank: int, world: int, batch: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(512, 16, generator=g)
        self.y = self.x.sum(1, keepdim=True).sin()
        self.rank, self.world, self.batch = rank, world, batch
        self.epoch, self.position = 0, 0
        self.shuffle = torch.Generator().manual_seed(1)
        self.order = torch.randperm(len(self.x), generator=self.shuffle)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        mine = self.order[self.rank::self.world]
        if self.position + self.batch > len(mine):
            self.epoch, self.position = self.epoch + 1, 0
            self.order = torch.randperm(len(self.x), generator=self.shuffle)
            mine = self.order[self.rank::self.world]
        idx = mine[self.position:self.position + self.batch]
        self.position += self.batch
        return self.x[idx], self.y[idx]

    def state_dict(self) -> dict[str, Any]:  # Stateful: saved through state_dict()
        return {"epoch": self.epoch, "position": self.position, "order": self.order,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position, self.order = state["epoch"], state["position"], state["order"]
        self.shuffle.set_state(state["shuffle"].get_state())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", required=True, help="node-local root; may contain {node}")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes on this machine")
    parser.add_argument("--stop-after", type=int, default=-1,
                        help="exit after this step (a job that stops and is resumed)")
    parser.add_argument("--loss-log", default="", help="rank 0's per-step losses, JSON lines")
    parser.add_argument("--preemption", action="store_true",
                        help="save and exit when SIGTERM reaches any rank")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="a slower step")
    parser.add_argument("--rollback-to", type=int, default=None,
                        help="go back to this iteration (after a loss spike): the newer ones "
                             "are discarded and training goes on from it")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.loss_log:
        with open(f"{args.loss_log}.pid{rank}", "w") as f:
            f.write(str(os.getpid()))
    torch.manual_seed(rank)
    np.random.seed(rank)
    random.seed(rank)
    config = TrainConfig()
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1),
                                                  nn.Linear(64, 1)))
    optim = torch.optim.AdamW(model.parameters(), lr=config.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=args.steps)
    loader = Loader(rank, world, config.batch)
    state = {"model": model.module, "optimizer": optim, "scheduler": sched, "loader": loader,
             "config": config, "step": 0}

    def rng() -> dict[str, Any]:
        return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                "python": random.getstate()}

    # localckpt: one manager per job, node-local root, replicas on another node; save every
    # few steps; keep the last two iterations, every 6th and the one of the lowest loss
    node = rank * args.nodes // world
    mgr = LocalCheckpointManager(args.root.format(node=node), "ddp-example",
                                 "node_spread" if args.nodes > 1 else None,
                                 node_id=f"node{node}", keep_last=2, keep_every=6, keep_best=1,
                                 best_metric="loss",
                                 save_policy=SavePolicy(every_steps=args.save_every),
                                 preemption_signals=[signal.SIGTERM] if args.preemption else None)
    queue = AsyncCallsQueue()
    if mgr.find_latest() >= 0:  # localckpt: resume (or roll back), objects filled in place
        loaded, _ = mgr.load(into={**state, "rng": rng()}, iteration=args.rollback_to,
                             discard_newer=args.rollback_to is not None)
        state["step"], config = loaded["step"], loaded["config"]
        torch.set_rng_state(loaded["rng"]["torch"])
        np.random.set_state(loaded["rng"]["numpy"])
        random.setstate(loaded["rng"]["python"])

    for step in range(state["step"], args.steps):
        x, y = loader.next()
        x = x + config.noise * torch.from_numpy(np.random.standard_normal(x.shape)).float()
        y = y * (1 + config.noise * random.random())
        loss = nn.functional.mse_loss(model(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        if rank == 0 and args.loss_log:
            with open(args.loss_log, "a") as f:
                f.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
        time.sleep(args.step_seconds)
        if mgr.reached_preemption(step):  # localckpt: agreed on every rank, at this step
            state["step"] = step + 1
            mgr.save({**state, "rng": rng()}, step + 1, force=True)  # finalized when it returns
            break
        queue.maybe_finalize_async_calls(blocking=False)
        state["step"] = step + 1  # localckpt: the policy decides; staged now, written behind
        request = mgr.save({**state, "rng": rng()}, step + 1, is_async=True,
                           metrics={"loss": loss.item()})
        if request is not None:
            queue.schedule_async_request(request)
        if step == args.stop_after:
            break
    queue.close()  # localckpt: finalize what is in flight, then let go
    mgr.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
