"""Rank programs for the multi-process tests (run by dist_harness.run_ranks in spawned ranks)."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import torch

from localckpt import LocalCheckpointManager


def make_state(rank: int, iteration: int, n: int = 3) -> dict[str, Any]:
    """A deterministic training-like state dict, different per rank and iteration."""
    g = torch.Generator().manual_seed(rank * 1000 + iteration)
    return {
        "model": {f"layer{i}.weight": torch.randn(64, 32, generator=g) for i in range(n)}
        | {"emb": torch.randn(100, 16, generator=g).to(torch.bfloat16)},
        "optimizer": {"state": {0: {"step": torch.tensor(float(iteration)),
                                    "exp_avg": torch.randn(64, 32, generator=g)}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]},
        "rng": torch.Generator().manual_seed(rank).get_state(),
        "iteration": iteration,
        "rank": rank,
    }


def digest(obj: Any) -> str:
    """A hash of a state dict's structure and exact tensor bytes."""
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            h.update(f"T{x.dtype}{tuple(x.shape)}{x.device}".encode())
            h.update(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                     if x.numel() else b"")
        elif isinstance(x, dict):
            h.update(f"D{type(x).__name__}{len(x)}".encode())
            for k, v in x.items():
                h.update(repr(k).encode())
                walk(v)
        elif isinstance(x, (list, tuple)):
            h.update(f"L{type(x).__name__}{len(x)}".encode())
            for v in x:
                walk(v)
        else:
            h.update(f"S{type(x).__name__}{x!r}".encode())

    walk(obj)
    return h.hexdigest()


def rank_root(base: str, rank: int, ranks_per_node: int) -> Path:
    """Simulated nodes: ranks_per_node ranks share a root, as on a real node."""
    return Path(base) / f"node{rank // ranks_per_node}"


def save_then_restore(rank: int, world: int, base: str, iterations: list[int],
                      ranks_per_node: int = 1) -> dict[str, Any]:
    root = rank_root(base, rank, ranks_per_node)
    with LocalCheckpointManager(root, "job", timeout=30) as mgr:
        for it in iterations:
            mgr.save(make_state(rank, it), it)
    with LocalCheckpointManager(root, "job", timeout=30) as fresh:
        latest = fresh.find_latest()
        loaded, ckpt_id = fresh.load()
    return {"latest": latest, "ckpt_id": list(ckpt_id), "digest": digest(loaded),
            "expected": digest(make_state(rank, latest))}


def save_only(rank: int, world: int, base: str, iterations: list[int], keep_last: int = 1,
              ranks_per_node: int = 1) -> None:
    root = rank_root(base, rank, ranks_per_node)
    with LocalCheckpointManager(root, "job", keep_last=keep_last, timeout=30) as mgr:
        for it in iterations:
            mgr.save(make_state(rank, it), it)


def find_and_load(rank: int, world: int, base: str, ranks_per_node: int = 1) -> dict[str, Any]:
    root = rank_root(base, rank, ranks_per_node)
    with LocalCheckpointManager(root, "job", timeout=30) as mgr:
        latest = mgr.find_latest()
        if latest < 0:
            return {"latest": latest}
        loaded, ckpt_id = mgr.load()
    return {"latest": latest, "ckpt_id": list(ckpt_id), "digest": digest(loaded),
            "expected": digest(make_state(rank, latest))}


def save_iteration_per_rank(rank: int, world: int, base: str, iterations: list[int]) -> None:
    """Each rank saves iterations[rank]: mismatched iterations must fail on every rank."""
    with LocalCheckpointManager(Path(base) / f"node{rank}", "job", timeout=30) as mgr:
        mgr.save(make_state(rank, 0), iterations[rank])


def save_with_bad_leaf_on(rank: int, world: int, base: str, bad_rank: int) -> None:
    state = make_state(rank, 1)
    if rank == bad_rank:
        state["model"]["oops"] = object()
    with LocalCheckpointManager(Path(base) / f"node{rank}", "job", timeout=30) as mgr:
        mgr.save(state, 1)


def write_fails_on(rank: int, world: int, base: str, bad_rank: int) -> dict[str, Any]:
    """Iteration 1 saves; iteration 2's write raises on bad_rank; iteration 1 must still load."""
    root = Path(base) / f"node{rank}"
    with LocalCheckpointManager(root, "job", timeout=30) as mgr:
        mgr.save(make_state(rank, 1), 1)
        if rank == bad_rank:
            def broken_write(*args: Any, **kwargs: Any) -> Any:
                raise OSError(5, "Input/output error (injected)")
            mgr._ctx.store.write = broken_write  # type: ignore[method-assign]
        try:
            mgr.save(make_state(rank, 2), 2)
        except Exception as exc:
            error = (type(exc).__name__, [c.__name__ for c in type(exc).__mro__], str(exc))
        else:
            error = None
        leftover = sorted(p.name for p in (root / "job").iterdir())
    return {"error": error, "dirs": leftover, **find_and_load(rank, world, base)}


def stall_then_exit(rank: int, world: int, base: str, slow_rank: int, sleep: float) -> None:
    """slow_rank never joins find_latest; the others must raise within the 3 s timeout."""
    with LocalCheckpointManager(Path(base) / f"node{rank}", "job", timeout=3) as mgr:
        if rank == slow_rank:
            time.sleep(sleep)
            return
        mgr.find_latest()


def _replicated_manager(rank: int, base: str, strategy: str, kwargs: dict[str, Any],
                        ranks_per_node: int, keep_last: int = 1,
                        metrics: Any = None, recycle_files: bool = False
                        ) -> LocalCheckpointManager:
    from replication import make_strategy

    node = rank // ranks_per_node
    return LocalCheckpointManager(Path(base) / f"node{node}", "job",
                                  make_strategy(strategy, **kwargs), keep_last=keep_last,
                                  timeout=30, chunk_nbytes=8192, node_id=f"node{node}",
                                  metrics=metrics, recycle_files=recycle_files)


def recycled_saves(rank: int, world: int, base: str, iterations: int) -> dict[str, Any]:
    """Saves with recycle_files=True, 2 ranks per node sharing the node's pool, replicas
    received into recycled files too; each iteration loaded back and compared."""
    node_root = Path(base) / f"node{rank // 2}" / "job"
    ok, reused = [], 0
    with _replicated_manager(rank, base, "node_spread", {}, 2, recycle_files=True) as mgr:
        for it in range(1, iterations + 1):
            before = {p.stat().st_ino for p in (node_root / ".recycle").glob("*")} \
                if (node_root / ".recycle").is_dir() else set()
            mgr.save(make_state(rank, it, n=4), it)
            now = {p.stat().st_ino for p in node_root.glob(f"iter_{it:010d}/*/data/c/*")}
            reused += len(before & now)
            loaded, ckpt_id = mgr.load()
            ok.append(ckpt_id[0] == it and digest(loaded) == digest(make_state(rank, it, n=4)))
            mgr._ctx.store.wait_for_deletions()
    return {"ok": ok, "reused": reused}


def replicated_save(rank: int, world: int, base: str, strategy: str, kwargs: dict[str, Any],
                    ranks_per_node: int, iterations: list[int], keep_last: int = 1) -> None:
    with _replicated_manager(rank, base, strategy, kwargs, ranks_per_node, keep_last) as mgr:
        for it in iterations:
            mgr.save(make_state(rank, it, n=4), it)


def replicated_load(rank: int, world: int, base: str, strategy: str, kwargs: dict[str, Any],
                    ranks_per_node: int) -> dict[str, Any]:
    fetched: list[int] = []  # bytes this rank received from peers (or rebuilt from them)

    def hook(m: Any) -> None:
        if m.phase in ("fetch_from_peer", "rebuild"):
            fetched.append(m.nbytes)

    with _replicated_manager(rank, base, strategy, kwargs, ranks_per_node,
                             metrics=hook) as mgr:
        latest = mgr.find_latest()
        if latest < 0:
            return {"latest": latest}
        loaded, ckpt_id = mgr.load()
    return {"latest": latest, "ckpt_id": list(ckpt_id), "digest": digest(loaded),
            "expected": digest(make_state(rank, latest, n=4)), "fetched": sum(fetched)}


def replica_receive_fails_on(rank: int, world: int, base: str, bad_rank: int) -> dict[str, Any]:
    """Iteration 1 replicates; receiving a replica of iteration 2 hits ENOSPC on bad_rank."""
    import errno

    with _replicated_manager(rank, base, "node_spread", {}, 2) as mgr:
        mgr.save(make_state(rank, 1, n=4), 1)
        if rank == bad_rank:
            real = mgr._ctx.store.begin_write

            def full(manifest: Any) -> Any:
                if manifest.owner_rank != rank:
                    raise OSError(errno.ENOSPC, "No space left on device (injected)")
                return real(manifest)
            mgr._ctx.store.begin_write = full  # type: ignore[method-assign]
        try:
            mgr.save(make_state(rank, 2, n=4), 2)
            error = None
        except Exception as exc:
            error = (type(exc).__name__, [c.__name__ for c in type(exc).__mro__], str(exc))
    # Visible entries only: the other rank of the node may still be removing its ``.trash-*``.
    return {"error": error,
            "iters": sorted(p.name for p in (Path(base) / f"node{rank // 2}" / "job").iterdir()
                            if not p.name.startswith(".")),
            **replicated_load(rank, world, base, "node_spread", {}, 2)}


def async_saves(rank: int, world: int, base: str, per_node: int, iterations: list[int],
                fail_rank: int = -1, fail_iteration: int = -1) -> dict[str, Any]:
    """Async saves with a training loop doing all_reduce on the default group meanwhile.
    ``per_node`` ranks per simulated node with node_spread replication; 0: no replication."""
    import torch.distributed as dist

    from localckpt.save.async_calls import AsyncCallsQueue

    replicated = per_node > 0
    per_node = per_node or 1
    queue = AsyncCallsQueue(timeout=30)
    mgr = (_replicated_manager(rank, base, "node_spread", {}, per_node) if replicated
           else LocalCheckpointManager(Path(base) / f"node{rank}", "job", timeout=30))
    errors, sums = [], []
    for it in iterations:
        if rank == fail_rank and it == fail_iteration:
            real = mgr._ctx.store.write

            def broken(*args: Any, real: Any = real, **kwargs: Any) -> Any:
                mgr._ctx.store.write = real  # type: ignore[method-assign]
                raise OSError(5, "Input/output error (injected in the background)")
            mgr._ctx.store.write = broken  # type: ignore[method-assign]
        queue.schedule_async_request(mgr.save(make_state(rank, it, n=4), it, is_async=True))
        for _ in range(20):  # training steps on the default (training) group
            t = torch.ones(1000) * (rank + 1)
            dist.all_reduce(t)
            sums.append(float(t[0]))
            try:
                queue.maybe_finalize_async_calls(blocking=False)
            except Exception as exc:
                errors.append((type(exc).__name__, [c.__name__ for c in type(exc).__mro__],
                               str(exc)))
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except Exception as exc:
        errors.append((type(exc).__name__, [c.__name__ for c in type(exc).__mro__], str(exc)))
    queue.close()
    mgr.close()
    dirs = sorted(p.name for p in (Path(base) / f"node{rank // per_node}" / "job").iterdir())
    loaded = (replicated_load(rank, world, base, "node_spread", {}, per_node) if replicated
              else find_and_load_n4(rank, base))
    return {"errors": errors, "all_reduce_ok": set(sums) == {world * (world + 1) / 2},
            "dirs": dirs, **loaded}


def find_and_load_n4(rank: int, base: str) -> dict[str, Any]:
    with LocalCheckpointManager(Path(base) / f"node{rank}", "job", timeout=30) as mgr:
        latest = mgr.find_latest()
        loaded, _ = mgr.load()
    return {"latest": latest, "digest": digest(loaded),
            "expected": digest(make_state(rank, latest, n=4))}


def exchange_sizes(rank: int, world: int, sizes: list[int]) -> list[int]:
    """Every rank contributes a payload of sizes[rank] characters; returns what it gathered."""
    from localckpt.control.collectives import CheckpointGroup

    group = CheckpointGroup(30)
    try:
        gathered = group.exchange("sizes", lambda: chr(ord("a") + rank) * sizes[rank])
    finally:
        group.close()
    assert gathered == [chr(ord("a") + r) * n for r, n in enumerate(sizes)]
    return [len(g) for g in gathered]
