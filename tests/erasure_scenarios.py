"""Rank functions for the erasure-coding tests: simulated nodes (one root and node id each) on
real gloo ranks. Shards differ in size from rank to rank, so stripes fold members of unequal
lengths."""

from __future__ import annotations

import errno
import itertools
import shutil
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from scenarios import digest, make_state

from localckpt import LocalCheckpointManager
from localckpt.storage.layout import list_shards
from replication import ErasureCodingStrategy, Topology


def state(rank: int, iteration: int) -> dict[str, Any]:
    return make_state(rank, iteration, n=2 + rank % 3)


def node_of(rank: int, per: int | list[int]) -> int:
    """``per`` ranks per node, or ``per[i]`` ranks on node i (unequal nodes)."""
    if isinstance(per, int):
        return rank // per
    return next(i for i in range(len(per)) if rank < sum(per[: i + 1]))


def manager(rank: int, base: str, k: int, m: int, per: int | list[int], **kwargs: Any
            ) -> LocalCheckpointManager:
    node = node_of(rank, per)
    kwargs.setdefault("timeout", 30)
    return LocalCheckpointManager(Path(base) / f"node{node}", "job",
                                  ErasureCodingStrategy(k, m), chunk_nbytes=8192,
                                  node_id=f"node{node}", **kwargs)


def expected_holdings(world: int, per: int | list[int], k: int, m: int) -> list[list[int]]:
    """Per node: the owners (ranks) and parity slots its root holds after a save."""
    topo = Topology(tuple(f"node{node_of(r, per)}" for r in range(world)))
    layout = ErasureCodingStrategy(k, m).stripes(topo)
    want: list[set[int]] = [set(ranks) for ranks in topo.nodes]
    for s, j, slot in layout.slots():
        want[topo.node_of[layout.stripes[s].parity[j]]].add(slot)
    return [sorted(w) for w in want]


def holdings(base: str, nodes: int, iteration: int) -> list[list[int]]:
    return [sorted(ref.owner_rank for ref in list_shards(Path(base) / f"node{n}", "job")
                   if ref.iteration == iteration) for n in range(nodes)]


def save(rank: int, world: int, base: str, k: int, m: int, per: int | list[int],
         iterations: list[int], keep_last: int = 1, is_async: bool = False,
         recycle_files: bool = False) -> None:
    with manager(rank, base, k, m, per, keep_last=keep_last,
                 recycle_files=recycle_files) as mgr:
        for it in iterations:
            request = mgr.save(state(rank, it), it, is_async=is_async)
            if request is not None:
                request.async_fn(*request.async_fn_args)
                for fn in request.finalize_fns:
                    fn()


def load(rank: int, world: int, base: str, k: int, m: int, per: int | list[int],
         slow_local_fold: float = 0.0) -> dict[str, Any]:
    """find_latest + load; with ``slow_local_fold`` (a timeout: seconds), rank 0's folds of
    parity from shards on its own node take longer than that timeout (a shard of tens of GB),
    and the next save follows at once (after the write-back that folds them)."""
    rebuilt: list[int] = []

    def hook(metric: Any) -> None:
        if metric.phase == "rebuild":
            rebuilt.append(metric.nbytes)

    kwargs: dict[str, Any] = {}
    if slow_local_fold:
        import localckpt.storage.parity_io as parity_io

        kwargs["timeout"] = slow_local_fold
        kwargs["keep_last"] = 2  # the repaired iteration stays beside the save after it
        real = parity_io.ParityFolder.fold_local
        if rank == 0:
            def slow(self: Any, ref: Any) -> Any:
                time.sleep(slow_local_fold + 1.5)
                return real(self, ref)
            parity_io.ParityFolder.fold_local = slow  # type: ignore[method-assign]
    written_back = None
    with manager(rank, base, k, m, per, metrics=hook, **kwargs) as mgr:
        latest = mgr.find_latest()
        if latest < 0:
            return {"latest": latest}
        loaded, (iteration, _, _) = mgr.load()
        if slow_local_fold:  # what training does next: a save (it waits for the write-back)
            try:
                mgr.save(state(rank, iteration + 2), iteration + 2)
                written_back = "ok"
            except Exception as exc:
                written_back = f"{type(exc).__name__}: {exc}"
    return {"latest": iteration, "found": latest, "written_back": written_back,
            "ok": digest(loaded) == digest(state(rank, iteration)), "rebuilt": sum(rebuilt)}


def every_loss(rank: int, world: int, base: str, k: int, m: int, per: int,
               iteration: int) -> list[dict[str, Any]]:
    """Save ``iteration``; then for every combination of m nodes: lose them (their roots
    wiped), restart (a fresh manager), load, and record what each node holds afterwards.
    Losses are not cumulative: each combination starts from the full save, copied back."""
    nodes = world // per
    save(rank, world, base, k, m, per, [iteration])
    dist.barrier()
    pristine = Path(base + "-pristine")
    if rank == 0:
        shutil.copytree(base, pristine, symlinks=True)
    out = []
    for lost in itertools.combinations(range(nodes), m):
        dist.barrier()
        node = rank // per
        if rank % per == 0:  # the node's first rank puts its root back, or wipes it
            shutil.rmtree(Path(base) / f"node{node}", ignore_errors=True)
            if node not in lost:
                shutil.copytree(pristine / f"node{node}", Path(base) / f"node{node}",
                                symlinks=True)
        dist.barrier()
        result = load(rank, world, base, k, m, per)
        dist.barrier()
        if rank == 0:
            result["held"] = holdings(base, nodes, iteration)
        out.append({"lost": list(lost), **result})
    dist.barrier()
    if rank == 0:  # beside the root, so the root's fixture does not remove it
        shutil.rmtree(pristine)
    return out


def parity_write_fails(rank: int, world: int, base: str, k: int, m: int, per: int,
                       bad_rank: int) -> dict[str, Any]:
    """Iteration 1 saves; committing a parity block of iteration 2 on ``bad_rank`` hits
    ENOSPC. Every rank must get the same error, iteration 2 gone, 1 intact."""
    with manager(rank, base, k, m, per) as mgr:
        mgr.save(state(rank, 1), 1)
        if rank == bad_rank:
            real = mgr._ctx.store.begin_write

            def full(manifest: Any) -> Any:
                if manifest.owner_rank < 0:
                    raise OSError(errno.ENOSPC, "No space left on device (injected)")
                return real(manifest)
            mgr._ctx.store.begin_write = full  # type: ignore[method-assign]
        try:
            mgr.save(state(rank, 2), 2)
            error = None
        except Exception as exc:
            error = (type(exc).__name__, str(exc))
    dist.barrier()
    return {"error": error, "held": holdings(base, world // per, 2),
            **load(rank, world, base, k, m, per)}


def durable_save(rank: int, world: int, base: str, durable: str, k: int, m: int, per: int,
                 iterations: list[int]) -> None:
    """Saves with erasure coding and a durable tier (every save persisted)."""
    from localckpt import DurableTier

    with manager(rank, base, k, m, per, durable=DurableTier(durable, keep=2)) as mgr:
        for it in iterations:
            mgr.save(state(rank, it), it)
        assert mgr.wait_for_persist(30)


def durable_load(rank: int, world: int, base: str, durable: str, k: int, m: int,
                 per: int) -> dict[str, Any]:
    from localckpt import DurableTier

    with manager(rank, base, k, m, per, durable=DurableTier(durable, persist_every=None)) as mgr:
        mgr.find_latest()
        loaded, (iteration, _, _) = mgr.load()
    dist.barrier()
    return {"latest": iteration, "ok": digest(loaded) == digest(state(rank, iteration)),
            "held": holdings(base, world // per, iteration) if rank == 0 else None}


def no_memory_for_parity(rank: int, world: int, base: str, k: int, m: int, per: int,
                         where: str) -> list[str]:
    """A rank cannot allocate what it folds: rank 2 its parity block at the save of 10
    (``where`` = "save": saves 5, 10, 11), or rank 0, loading after its node was lost, the
    shard it rebuilds ("rebuild": loads). What each call ended with."""
    import localckpt.load.rebuild as rebuild
    import localckpt.save.job as job

    if rank == 2 and where == "save":
        real = job.ParityFolder

        def folder(store: Any, layout: Any, iteration: int, *args: Any, **kwargs: Any) -> Any:
            if iteration == 10:
                raise MemoryError("cannot allocate the parity block (injected)")
            return real(store, layout, iteration, *args, **kwargs)
        job.ParityFolder = folder  # type: ignore[assignment,misc]
    if rank == 0 and where == "rebuild":
        def rebuilder(*args: Any, **kwargs: Any) -> Any:
            raise MemoryError("cannot allocate the rebuilt shard (injected)")
        rebuild.ShardRebuilder = rebuilder  # type: ignore[assignment,misc]
    out = []
    with manager(rank, base, k, m, per, keep_last=2, timeout=10) as mgr:
        for it in ((5, 10, 11) if where == "save" else (None,)):
            try:
                if it is None:
                    mgr.load()
                else:
                    mgr.save(state(rank, it), it)
                out.append("ok")
            except Exception as exc:
                out.append(f"{type(exc).__name__}: {exc}")
    return out


def save_again_dying_in_the_fold(rank: int, world: int, base: str, k: int, m: int,
                                 per: int) -> str:
    """A run that loads (iteration 5: 10 is incomplete) and saves 10 again, with other
    states; rank 2 dies sending its shard in the parity fold (after its own shard and before
    its parity block of 10 are committed)."""
    from localckpt.ops import faults

    if rank == 2:
        faults.arm(faults.Fault("replica_send", "kill", iteration=10))
    with manager(rank, base, k, m, per, keep_last=2, timeout=5) as mgr:
        mgr.load()
        try:
            mgr.save(state(rank, 1010), 10)
        except Exception as exc:
            return f"{type(exc).__name__}"
    return "saved"


def load_and_write_back(rank: int, world: int, base: str, k: int, m: int,
                        per: int) -> dict[str, Any]:
    with manager(rank, base, k, m, per, keep_last=2) as mgr:
        loaded, (iteration, _, _) = mgr.load()
        mgr.wait_for_write_back()
    return {"latest": iteration, "is": next((it for it in (5, 10, 1010) if digest(
        loaded) == digest(state(rank, it))), None)}
