"""Megatron-style local checkpointing through localckpt: the calls Megatron-LM makes for
``--non-persistent-ckpt-type local``, on a small tensor-parallel layer (parts marked
``# localckpt`` / ``# Megatron``).

Each rank holds its rows of a weight (a ShardedTensor with its global offset, as Megatron's
layers describe themselves), its RNG state (a ShardedObject) and the common state (``args``,
the iteration). A save builds an ``MCoreTensorAwareStateDict`` and hands it to the manager,
asynchronously, replicated to another node (clique replication, as Megatron's
``--replication``); a start finds the newest complete iteration, loads it (fetching a lost
node's shards from its peers) and turns it back into the model's state with Megatron's
``to_state_dict``.

    torchrun --nproc-per-node 2 scripts/megatron_example.py --root '/dev/shm/ckpt/{node}'

On GPUs the request goes to Megatron's own AsyncCallsQueue; on CPU (where that queue cannot
run: its agreement is a CUDA all-reduce) to localckpt's, which has the same calls.
``MCoreTensorAwareStateDict.from_state_dict`` needs nvidia-resiliency-ext; without it the
object is built as ``from_state_dict(algo="atomic")`` builds it. Rank 0 writes one JSON line per
step (``--loss-log``).
"""

from __future__ import annotations

import argparse
import json
import warnings
from typing import Any

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess  # noqa: E402
from megatron.core.dist_checkpointing.tensor_aware_state_dict import (  # noqa: E402
    HAVE_NVRX,
    MCoreTensorAwareStateDict,
)

from localckpt import AsyncCallsQueue  # noqa: E402
from localckpt.integrations.megatron import (  # noqa: E402  # localckpt: the drop-in
    CliqueReplicationStrategy,
    LocalCheckpointManager,
)

ROWS, COLS = 8, 16  # each rank's rows of the weight


class ShardedLayer:
    """A row-parallel linear layer's part on one rank, with its optimizer state."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        g = torch.Generator().manual_seed(rank)
        self.weight = torch.randn(ROWS, COLS, generator=g) * 0.1
        self.momentum = torch.zeros_like(self.weight)
        self.rng = torch.Generator().manual_seed(100 + rank)

    def step(self) -> float:
        x = torch.randn(32, COLS, generator=self.rng)
        target = x.sum(1, keepdim=True).repeat(1, ROWS).sin()
        y = x @ self.weight.T
        loss = ((y - target) ** 2).mean()
        grad = 2 * (y - target).T @ x / y.numel()
        self.momentum.mul_(0.9).add_(grad)
        self.weight.sub_(0.1 * self.momentum)
        return float(loss)

    def sharded_state_dict(self) -> dict[str, Any]:  # Megatron: what a layer describes
        def rows(key: str, t: torch.Tensor) -> ShardedTensor:
            return ShardedTensor.from_rank_offsets(key, t, (0, self.rank, self.world),
                                                   replica_id=0)
        return {"layer.weight": rows("layer.weight", self.weight),
                "optimizer.momentum": rows("optimizer.momentum", self.momentum),
                "rng_state": ShardedObject("rng_state", self.rng.get_state(), (self.world,),
                                           (self.rank,), replica_id=0)}

    def load(self, state: dict[str, Any]) -> None:
        self.weight.copy_(state["layer.weight"])
        self.momentum.copy_(state["optimizer.momentum"])
        self.rng.set_state(state["rng_state"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", required=True, help="node-local root; may contain {node}")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes on this machine")
    parser.add_argument("--stop-after", type=int, default=-1)
    parser.add_argument("--loss-log", default="")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layer = ShardedLayer(rank, world)
    node = rank * args.nodes // world
    # Megatron-LM: training.py builds the manager (localckpt: same call, localckpt's classes)
    repl = CliqueReplicationStrategy.from_replication_params(1, 2) if args.nodes > 1 else None
    manager = LocalCheckpointManager(args.root.format(node=node), repl_strategy=repl,
                                     node_id=f"node{node}")
    if torch.cuda.is_available():  # Megatron's queue needs CUDA; localckpt's has its calls
        from megatron.core.dist_checkpointing.strategies.async_utils import (
            AsyncCallsQueue as MegatronQueue,
        )
        queue: Any = MegatronQueue()
    else:
        queue = AsyncCallsQueue()

    start = 0
    if manager.find_latest() >= 0:  # Megatron: _load_non_persistent_base_checkpoint
        intermediate, _ = manager.load()
        state = intermediate.to_state_dict(layer.sharded_state_dict(), algo="atomic")
        layer.load(state)
        start = state["iteration"]

    for step in range(start, args.steps):
        loss = layer.step()
        if rank == 0 and args.loss_log:
            with open(args.loss_log, "a") as f:
                f.write(json.dumps({"step": step, "loss": loss}) + "\n")
        queue.maybe_finalize_async_calls(blocking=False)
        if (step + 1) % args.save_every == 0:  # Megatron: save_checkpoint(..., LOCAL)
            state_dict = {**layer.sharded_state_dict(), "iteration": step + 1,
                          "args": argparse.Namespace(**vars(args))}
            if HAVE_NVRX:
                tasd, _ = MCoreTensorAwareStateDict.from_state_dict(state_dict, algo="atomic")
            else:
                sharded, common = save_preprocess(state_dict, True)
                tasd = MCoreTensorAwareStateDict(common=common, sharded_state_dict=sharded)
            request = manager.save(tasd, step + 1, is_async=True)
            queue.schedule_async_request(request)
        if step == args.stop_after:
            break
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    manager.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
