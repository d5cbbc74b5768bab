"""Rank functions for tests/test_megatron.py: Megatron's own async queue and tensor-aware state
dict on CPU gloo ranks, one rank per simulated node, clique replication F=2."""

from __future__ import annotations

import argparse
import multiprocessing
import warnings
from typing import Any, NamedTuple

import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")


def _cpu_queue() -> None:
    """Megatron's queue agrees through an all-reduce of a CUDA tensor: point torch.cuda's
    device calls at the CPU (gloo then reduces it); nothing else of Megatron is changed."""
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    # The harness's ranks are daemon processes (a torchrun rank is not): Megatron's queue
    # starts processes of its own, which daemons may not.
    multiprocessing.current_process()._config["daemon"] = False  # type: ignore[attr-defined]


def _manager(rank: int, base: str) -> Any:
    from localckpt.integrations.megatron import CliqueReplicationStrategy, LocalCheckpointManager

    return LocalCheckpointManager(f"{base}/node{rank}", "mcore", timeout=60,
                                  repl_strategy=CliqueReplicationStrategy.from_replication_params(
                                      1, 2), node_id=f"node{rank}")


def weights(iteration: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(iteration)
    return torch.randn(4 * world, 8, generator=g)


def sharded_state(rank: int, world: int, iteration: int, empty: bool = False) -> dict[str, Any]:
    """A Megatron sharded state dict: a tensor split along dim 0 across ranks, a per-rank
    ShardedObject, and common state (Megatron's args Namespace with a dtype and an enum)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.transformer.enums import AttnBackend

    local = weights(iteration, world)[4 * rank:4 * rank + 4].clone()
    if empty:
        local = torch.zeros_like(local)
    rng = None if empty else {"torch": torch.Generator().manual_seed(rank).get_state(),
                              "python": (3, tuple(range(5)), None), "step": iteration}
    return {
        "model": {"w": ShardedTensor.from_rank_offsets("model.w", local, (0, rank, world),
                                                       replica_id=0)},
        "rng_state": ShardedObject("rng_state", rng, (world,), (rank,), replica_id=0),
        "args": argparse.Namespace(lr=1e-4, params_dtype=torch.bfloat16,
                                   attention_backend=AttnBackend.auto),
        "iteration": iteration,
    }


def tensor_aware(rank: int, world: int, iteration: int) -> Any:
    """What MCoreTensorAwareStateDict.from_state_dict(algo="atomic") builds (it refuses to run
    without nvidia-resiliency-ext, its base class)."""
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import (
        MCoreTensorAwareStateDict,
    )

    sharded, common = save_preprocess(sharded_state(rank, world, iteration), True)
    return MCoreTensorAwareStateDict(common=common, sharded_state_dict=sharded)


def save_through_megatrons_queue(rank: int, world: int, base: str, persistent: bool) -> int:
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    _cpu_queue()
    queue = AsyncCallsQueue(persistent=persistent)
    with _manager(rank, base) as mgr:
        for iteration in (10, 20, 30):
            request = mgr.save(tensor_aware(rank, world, iteration), iteration, is_async=True)
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=False)
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
        return int(mgr.find_latest())


def load_for_megatron(rank: int, world: int, base: str) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import (
        MCoreTensorAwareStateDict,
    )

    with _manager(rank, base) as mgr:
        latest = mgr.find_latest()
        loaded, ckpt_id = mgr.load()
    state = loaded.to_state_dict(sharded_state(rank, world, 0, empty=True), algo="atomic")
    want = sharded_state(rank, world, latest)
    return {"latest": latest, "ckpt_id": list(ckpt_id),
            "kind": type(loaded) is MCoreTensorAwareStateDict,
            "weights": torch.equal(state["model"]["w"], want["model"]["w"].data),
            "rng": state["rng_state"]["step"] == latest and torch.equal(
                state["rng_state"]["torch"], want["rng_state"].data["torch"]),
            "args": state["args"] == want["args"]}


class NotAllowed(NamedTuple):
    """A type no load may build (never registered); picklable, as Megatron's common-state
    check pickles what a save holds."""

    x: int


def save_and_load_optimizer_shapes(rank: int, world: int, base: str) -> dict[str, Any]:
    """What Megatron's distributed optimizer and rerun state machine put in a checkpoint:
    per-bucket state keyed by (param dtype, grad dtype), a ShardedTensor whose local_shape is a
    torch.Size, a failed validation call (named tuples of megatron.core). Saved and loaded;
    then a save holding a named tuple no load may build (not allowed), refused on every rank."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import (
        MCoreTensorAwareStateDict,
    )
    from megatron.core.rerun_state_machine import Call, Caller

    def state(iteration: int, extra: Any = None) -> Any:
        plain = sharded_state(rank, world, iteration)
        plain["model"]["w"].local_shape = plain["model"]["w"].data.shape  # a torch.Size
        buckets = {(torch.bfloat16, torch.float32): [[{"exp_avg": torch.full((3,), .5)}]]}
        plain["optimizer"] = {"param_state": {0: buckets}, "per_bucket_numel": ShardedObject(
            "per_bucket_numel", [{(torch.bfloat16, torch.float32): [6]}], (world,), (rank,),
            replica_id=0)}
        plain["rerun"] = {"failed_validation_call": Call(Caller("loss is NaN", 0), 17)}
        if extra is not None:
            plain["extra"] = extra
        sharded, common = save_preprocess(plain, True)
        return MCoreTensorAwareStateDict(common=common, sharded_state_dict=sharded)

    with _manager(rank, base) as mgr:
        mgr.save(state(5), 5)
        loaded, _ = mgr.load()
        try:
            mgr.save(state(6, NotAllowed(1)), 6)
            refused = "saved"
        except Exception as exc:
            refused = f"{type(exc).__name__}: {exc}"
        latest = mgr.find_latest()
    got = loaded.to_state_dict(sharded_state(rank, world, 0, empty=True) | {
        "optimizer": {"param_state": {}, "per_bucket_numel": ShardedObject(
            "per_bucket_numel", None, (world,), (rank,), replica_id=0)},
        "rerun": {}}, algo="atomic")
    buckets = got["optimizer"]["param_state"][0]
    return {"keys": list(buckets) == [(torch.bfloat16, torch.float32)],
            "exp_avg": torch.equal(buckets[torch.bfloat16, torch.float32][0][0]["exp_avg"],
                                   torch.full((3,), .5)),
            "numel": got["optimizer"]["per_bucket_numel"] == [
                {(torch.bfloat16, torch.float32): [6]}],
            "call": got["rerun"]["failed_validation_call"] == Call(Caller("loss is NaN", 0), 17),
            "refused": refused, "latest": latest}
