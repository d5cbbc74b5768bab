"""A small, deterministic data-parallel training job that checkpoints with localckpt.

Run under torchrun, on one node or on several simulated nodes (one torchrun agent per node,
``--nnodes K --node-rank i``). Every rank trains a replica of a small MLP with Adam; gradients are
averaged over the default (training) process group. The batch of each step is derived from
(seed, step, rank) and the RNG states travel in the checkpoint, so a run that is interrupted by
faults and resumes ends with weights bit-identical to an uninterrupted run of the same length.

At start-up it resumes through ``find_latest`` / ``load``; it saves every ``--save-every`` steps,
asynchronously (``--sync`` for blocking saves) with replication across nodes, and finalizes
completed saves each step. A save that fails (the same error on every rank) is logged and training
goes on: losing one checkpoint is not a reason to stop a job.

``--root`` may contain ``{node}`` (the torchrun node rank): each simulated node its own root.
``--crash-at-step S --crash-rank R`` hard-exits rank R at step S of the first attempt. Faults
inside localckpt are armed with ``LOCALCKPT_FAULTS`` (see localckpt/ops/faults.py). Call orders
that users get wrong, for the chaos harness: ``--desync-at-step S --desync-rank R`` makes rank R
call ``find_latest`` where the others save (first attempt only); ``--close-order manager-first``
closes the manager before the queue that still holds the last save.

Each rank appends JSON events to ``<out>/events-rank<r>.jsonl`` (start, resumed, finalized,
save_failed, done) and writes ``<out>/rank<r>.json`` with the final weights' digest at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from localckpt import (
    AsyncCallsQueue,
    CheckpointingError,
    CollectiveError,
    DurableTier,
    LocalCheckpointManager,
)
from replication import ErasureCodingStrategy


def build_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Dropout(0.1),
                               torch.nn.Linear(64, 8))


def batch(seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data-loader: the batch at ``step`` depends only on (seed, step, rank)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    x = torch.randn(16, 32, generator=g)
    return x, x[:, :8].sin() + 0.1 * torch.randn(16, 8, generator=g)


class Adam:
    """Adam written out, with the state dict of ``torch.optim.Adam`` (a step and two moments per
    parameter, one param group). ``torch.optim`` imports ``torch._dynamo`` at its first call,
    about 2 s of CPU per process on a small machine, and the chaos harness starts this script
    hundreds of times."""

    def __init__(self, params: Any, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        self.params = list(params)
        self.group = {"lr": lr, "betas": betas, "eps": eps,
                      "params": list(range(len(self.params)))}
        self.state = {i: {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                          "exp_avg_sq": torch.zeros_like(p)} for i, p in enumerate(self.params)}

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        lr, (b1, b2), eps = self.group["lr"], self.group["betas"], self.group["eps"]
        for i, p in enumerate(self.params):
            s = self.state[i]
            s["step"] += 1
            t = float(s["step"])
            s["exp_avg"].lerp_(p.grad, 1 - b1)
            s["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            denom = (s["exp_avg_sq"] / (1 - b2 ** t)).sqrt_().add_(eps)
            p.addcdiv_(s["exp_avg"], denom, value=-lr / (1 - b1 ** t))

    def state_dict(self) -> dict[str, Any]:
        return {"state": {i: dict(s) for i, s in self.state.items()},
                "param_groups": [dict(self.group)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        (group,) = state["param_groups"]
        self.group = {**group, "betas": tuple(group["betas"])}
        self.state = {int(i): {k: v.clone() for k, v in s.items()}
                      for i, s in state["state"].items()}


def weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Events:
    """Append-only JSON lines, one file per rank, kept across attempts and node replacement."""

    def __init__(self, out: Path, rank: int, attempt: int, node: int) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / f"events-rank{rank}.jsonl"
        self.base = {"rank": rank, "attempt": attempt, "node": node, "pid": os.getpid()}

    def __call__(self, event: str, **fields: Any) -> None:
        line = json.dumps({**self.base, "event": event, "t": time.time(), **fields}) + "\n"
        with open(self.path, "a") as f:
            f.write(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", required=True, help="node-local root; may contain {node}")
    parser.add_argument("--out", required=True, help="directory for per-rank results and events")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--crash-at-step", type=int, default=-1)
    parser.add_argument("--crash-rank", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="localckpt's and the training group's collective timeout")
    parser.add_argument("--repl", default="auto",
                        help="replication strategy name; auto: node_spread on 2+ nodes; "
                             "erasure: k = nodes - 1, m = 1")
    parser.add_argument("--keep-last", type=int, default=1)
    parser.add_argument("--recycle-files", action="store_true",
                        help="LocalCheckpointManager(recycle_files=True)")
    parser.add_argument("--sync", action="store_true", help="blocking saves instead of async")
    parser.add_argument("--step-seconds", type=float, default=0.0,
                        help="extra time per step (gives faults time to land mid-save)")
    parser.add_argument("--desync-at-step", type=int, default=-1)
    parser.add_argument("--desync-rank", type=int, default=1)
    parser.add_argument("--durable", default=None,
                        help="a shared directory or s3://bucket/prefix (AWS_* settings from the "
                             "environment): LocalCheckpointManager(durable=DurableTier(...))")
    parser.add_argument("--persist-every", type=int, default=1)
    parser.add_argument("--close-order", choices=("queue-first", "manager-first"),
                        default="queue-first")
    args = parser.parse_args()
    logging.basicConfig(level=os.environ.get("LOCALCKPT_LOG", "WARNING"),
                        format="%(asctime)s %(name)s: %(message)s")

    if "LOCALCKPT_DEMO_NODE" in os.environ:
        die_with_agent()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # The simulated node: fixed per agent by the launcher (torchrun's GROUP_RANK follows the
    # rendezvous order, which changes when a node is replaced).
    node = int(os.environ.get("LOCALCKPT_DEMO_NODE", os.environ.get("GROUP_RANK", "0")))
    init_process_group(attempt, args.timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes = world // int(os.environ.get("LOCAL_WORLD_SIZE", world))
    torch.set_num_threads(1)
    events = Events(Path(args.out), rank, attempt, node)
    events("start")

    model = build_model(args.seed)
    opt = Adam(model.parameters(), lr=1e-2)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)  # dropout masks differ per rank, as in real jobs

    repl: Any = ("node_spread" if nodes >= 2 else None) if args.repl == "auto" else args.repl
    if repl == "erasure":  # one parity block per stripe of the other nodes' ranks
        repl = ErasureCodingStrategy(k=max(1, nodes - 1), m=1)
    fetched: list[int] = []
    mgr = LocalCheckpointManager(
        args.root.format(node=node), "demo", repl, keep_last=args.keep_last,
        timeout=args.timeout, node_id=f"node{node}", recycle_files=args.recycle_files,
        durable=DurableTier(args.durable, persist_every=args.persist_every, keep=2)
        if args.durable else None,
        metrics=lambda m: fetched.append(m.nbytes) if m.phase in ("fetch_from_peer", "rebuild")
        else None)
    queue = AsyncCallsQueue(timeout=args.timeout)
    started = time.monotonic()
    resumed_from = mgr.find_latest()
    start_step = 0
    if resumed_from >= 0:
        state, (resumed_from, _, _) = mgr.load()  # an older one if the newest was corrupt
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(_as_random_state(state["rng"]["python"]))
        start_step = state["step"] + 1
    restore_s = time.monotonic() - started
    events("resumed", iteration=resumed_from, seconds=restore_s, fetched_bytes=sum(fetched))

    pending: dict[int, int] = {}  # queue call index -> iteration

    def finalize(blocking: bool = False) -> None:
        try:
            for index in queue.maybe_finalize_async_calls(blocking=blocking):
                events("finalized", iteration=pending.pop(index))
        except CollectiveError:
            raise  # localckpt's group is broken (a peer died or timed out): restart the job
        except CheckpointingError as exc:  # agreed on every rank: this save is lost
            failed = pending.pop(min(pending))
            events("save_failed", iteration=failed, error=type(exc).__name__, message=str(exc))

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
        if args.step_seconds:
            time.sleep(args.step_seconds)
        events("step", step=step)
        finalize()
        if (step + 1) % args.save_every == 0:
            if attempt == 0 and step == args.desync_at_step and rank == args.desync_rank:
                mgr.find_latest()  # where the other ranks save: both must raise CollectiveError
            while pending:  # so that an error raised by save() is this save's own
                finalize(blocking=True)
            save(mgr, queue, events, pending, finalize, step, args.sync, {
                "model": model.state_dict(), "optimizer": opt.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                "step": step})

    if args.close_order == "manager-first":
        mgr.close()  # the last async save is committed but not finalized
        try:
            queue.close()
        except CheckpointingError as exc:
            events("close_failed", error=type(exc).__name__, message=str(exc))
    else:
        while pending:
            finalize(blocking=True)
        queue.close()
    if args.durable and mgr.wait_for_persist(args.timeout * 4):
        persister = mgr._save.persister
        events("persisted", iterations=persister.persisted if persister else [])
    out = Path(args.out)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "node": node, "attempt": attempt, "resumed_from": resumed_from,
        "restore_seconds": restore_s, "fetched_bytes": sum(fetched),
        "digest": weights_digest(model),
    }))
    events("done", digest=weights_digest(model))
    if args.close_order == "queue-first":
        mgr.close()
    dist.destroy_process_group()


def save(mgr: LocalCheckpointManager, queue: AsyncCallsQueue, events: Events,
         pending: dict[int, int], finalize: Any, step: int, sync: bool, state: Any) -> None:
    try:
        if sync:
            mgr.save(state, iteration=step)
            events("finalized", iteration=step)
            return
        request = mgr.save(state, iteration=step, is_async=True)
    except CollectiveError:
        raise
    except CheckpointingError as exc:  # this save failed on every rank: training goes on
        events("save_failed", iteration=step, error=type(exc).__name__, message=str(exc))
        return
    if request is not None:
        pending[queue.schedule_async_request(request)] = step


def die_with_agent() -> None:
    """A simulated node's rank dies with its torchrun agent, as on a real node. torchrun starts
    workers in their own session, so killing the agent's process group (a node loss in the
    chaos harness, or the end of a scenario) would otherwise leave this rank running, orphaned."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the agent died before prctl took effect
        os._exit(1)


def init_process_group(attempt: int, timeout: float) -> None:
    """The training group, with its store keys namespaced by restart attempt.

    torchrun's agent keeps one store across restarts; without a per-attempt prefix a restarted
    gloo group reads the dead attempt's peer addresses and fails with "Connection refused".
    With several agents (nodes) the attempt counts differ per node, so there the agents run with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: every rendezvous round gets a fresh store.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_hosts_store,
                          timeout=timedelta(seconds=60))
    if agent_hosts_store:  # one agent's store for every attempt: namespace the keys
        store = dist.PrefixStore(f"attempt{attempt}", store)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))


def _as_random_state(state: Any) -> tuple[Any, ...]:
    version, internal, gauss = state
    return version, tuple(internal), gauss


if __name__ == "__main__":
    main()
