"""FSDP2 + tensor parallelism checkpointed with localckpt: copy the parts marked ``# localckpt``.

A small transformer is sharded the way torchtitan does it: tensor parallelism over the ``tp``
dim of a 2-D device mesh (attention and MLP projections column- / row-wise), then ``fully_shard``
over ``dp``. Each rank saves only its own shards (DTensor leaves: the local shard and its
layout) to node-local storage, asynchronously, replicated to another node; on start-up the job
resumes from the newest complete checkpoint, straight into the model's and the optimizer's
tensors. The state goes through ``torch.distributed.checkpoint.state_dict`` (fully qualified
names, as DCP stores it) inside a Stateful ``AppState``, as in DCP's own recipe.

    torchrun --nproc-per-node 4 scripts/fsdp2_example.py --root /dev/shm/ckpt --steps 12

Runs on CPU with gloo, or on GPUs with NCCL (one per rank). ``--tp`` sets the tensor-parallel
degree (the rest is data parallel); ``--nodes`` simulates that many nodes on one machine (each
its own root, ``{node}`` in ``--root``) so replication has somewhere to go. Rank 0 writes one JSON
line per step (``--loss-log``): the step and its loss.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from localckpt import AsyncCallsQueue, LocalCheckpointManager

VOCAB, SEQ = 64, 16


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm1(x)
        # Under tensor parallelism each rank holds heads / tp of the heads: -1 takes its own.
        q, k, v = (p(h).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.w2(F.gelu(self.w1(self.norm2(x))))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = 32, heads: int = 4, layers: int = 2
                 ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.out = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))  # type: ignore[no-any-return]


def build(mesh: DeviceMesh, device: torch.device, seed: int = 0, **sizes: int) -> nn.Module:
    """The model (``sizes``: TinyTransformer's), tensor-parallel over ``tp`` and fully sharded
    over ``dp``."""
    torch.manual_seed(seed)  # the same initial weights on every rank
    model = TinyTransformer(**sizes).to(device)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {
            "q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
            "o": RowwiseParallel(), "w1": ColwiseParallel(), "w2": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


class TokenLoader:
    """A data loader that knows where it is (Stateful, like torchdata's StatefulDataLoader):
    the batch at a position depends only on (seed, position, data-parallel rank)."""

    def __init__(self, seed: int, dp_rank: int) -> None:
        self.seed, self.dp_rank, self.position = seed, dp_rank, 0

    def next(self, device: torch.device) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position * 101
                                          + self.dp_rank)
        self.position += 1
        return torch.randint(0, VOCAB, (4, SEQ + 1), generator=g).to(device)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


class AppState:
    """Model and optimizer through torch.distributed.checkpoint.state_dict (DCP's recipe), with
    the LR schedule and the data position. localckpt calls ``state_dict()`` when saving and,
    given it in ``load(into=...)``, ``load_state_dict()`` with what it loaded."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer,
                 sched: torch.optim.lr_scheduler.LRScheduler, loader: TokenLoader) -> None:
        self.model, self.optim, self.sched, self.loader = model, optim, sched, loader

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd, "sched": self.sched.state_dict(),
                "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.sched.load_state_dict(state["sched"])
        self.loader.load_state_dict(state["loader"])


def train_step(model: nn.Module, optim: torch.optim.Optimizer,
               sched: torch.optim.lr_scheduler.LRScheduler, tokens: torch.Tensor) -> float:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optim.step()
    optim.zero_grad()
    sched.step()
    return float(loss.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", required=True, help="node-local root; may contain {node}")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes on this machine")
    parser.add_argument("--stop-after", type=int, default=-1,
                        help="exit after this step (a job that stops and is resumed)")
    parser.add_argument("--loss-log", default="", help="rank 0's per-step losses, JSON lines")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda \
        else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    model = build(mesh, device)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 4))
    loader = TokenLoader(seed=7, dp_rank=mesh["dp"].get_local_rank())
    app = AppState(model, optim, sched, loader)

    # localckpt: one manager per job, node-local root, replicas on another node. Add
    # reshard=True to resume on another world size (docs/fsdp2.md: DTensors are reassembled,
    # plain state such as the loader's comes from old rank rank % old_world_size).
    node = rank * args.nodes // world
    mgr = LocalCheckpointManager(args.root.format(node=node), "fsdp2-example",
                                 "node_spread" if args.nodes > 1 else None,
                                 node_id=f"node{node}")
    queue = AsyncCallsQueue()
    start = 0
    if mgr.find_latest() >= 0:  # localckpt: resume into the live objects, in place
        _, (start, _, _) = mgr.load(into={"app": app})

    for step in range(start, args.steps):
        loss = train_step(model, optim, sched, loader.next(device))
        if rank == 0 and args.loss_log:
            with open(args.loss_log, "a") as f:
                f.write(json.dumps({"step": step, "loss": loss}) + "\n")
        queue.maybe_finalize_async_calls(blocking=False)
        if (step + 1) % args.save_every == 0:  # localckpt: staged now, written in background
            request = mgr.save({"app": app}, step + 1, is_async=True)
            if request is not None:
                queue.schedule_async_request(request)
        if step == args.stop_after:
            break
    queue.close()  # localckpt: finalize what is in flight, then let go
    mgr.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
