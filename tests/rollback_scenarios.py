"""Rank functions for tests/test_rollback.py (one rank per simulated node, node_spread F=2)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from scenarios import digest, make_state

from localckpt import LocalCheckpointManager


def manager(rank: int, base: str, strategy: str | None = "node_spread",
            keep_last: int = 3) -> LocalCheckpointManager:
    return LocalCheckpointManager(Path(base) / f"node{rank}", "job", strategy,
                                  keep_last=keep_last, timeout=30, node_id=f"node{rank}")


def save(rank: int, world: int, base: str, strategy: str | None = "node_spread") -> None:
    with manager(rank, base, strategy) as mgr:
        for it in (10, 20, 30):
            mgr.save(make_state(rank, it), it)


def rollback(rank: int, world: int, base: str) -> dict[str, Any]:
    with manager(rank, base) as mgr:
        listed = mgr.iterations()
        state, ckpt_id = mgr.load(iteration=20)
        mgr.wait_for_write_back()
        return {"iterations": listed, "loaded": ckpt_id[0],
                "identical": digest(state) == digest(make_state(rank, 20))}


def resave(rank: int, world: int, base: str, offset: int,
           strategy: str | None = "node_spread") -> None:
    """A later run rolls back to 20 and saves 30 again, with other states."""
    with manager(rank, base, strategy) as mgr:
        mgr.load(iteration=20, discard_newer=True)
        mgr.wait_for_write_back()
        mgr.save(make_state(rank, 30 + offset), 30)


def load_newest(rank: int, world: int, base: str, exact: int | None = None,
                strategy: str | None = "node_spread") -> dict[str, Any]:
    with manager(rank, base, strategy) as mgr:
        try:
            state, ckpt_id = mgr.load(iteration=exact)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {"loaded": ckpt_id[0], "error": None,
                "is": next((it for it in (10, 20, 30, 1030, 2030) if digest(state) == digest(
                    make_state(rank, it))), None)}


def lineage_saves(rank: int, world: int, base: str, iterations: list[int], reshard: bool,
                  keep_every: int | None = None) -> list[tuple[int, int]]:
    """Saves on one shared root (one node), keep_last=3; with ``reshard`` it first loads the
    newest of any world size. Returns the (iteration, world size) the root then holds."""
    with LocalCheckpointManager(Path(base), "s", None, keep_last=3, keep_every=keep_every,
                                timeout=20, chunk_nbytes=4096, node_id="one",
                                reshard=reshard) as mgr:
        if reshard:
            mgr.load()
        for it in iterations:
            mgr.save(make_state(rank, it), it)
        mgr._ctx.store.wait_for_deletions()
        return sorted({(r.iteration, r.world_size) for r in mgr._ctx.store.committed()})


def reshard_load(rank: int, world: int, base: str) -> dict[str, Any]:
    """A job of ``world`` ranks (on the first nodes' roots) loads the newest of any world size."""
    with LocalCheckpointManager(Path(base) / f"node{rank}", "job", None, reshard=True,
                                timeout=30, node_id=f"node{rank}") as mgr:
        try:
            _, ckpt_id = mgr.load()
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {"loaded": ckpt_id[0], "error": None}


def fall_back_then_save_again(rank: int, world: int, base: str) -> dict[str, Any]:
    """No replicas, 30 cannot be loaded (shards of two saves): the load falls back to 20, and
    the run goes on from there and saves 30 again (keep_last=1), after a first try refused for
    space (30 must stay out of the listing until a save of it is finalized)."""
    from localckpt.errors import InsufficientSpaceError
    from localckpt.save import prepare

    with manager(rank, base, None, keep_last=1) as mgr:
        _, ckpt_id = mgr.load()
        real = prepare.SaveAgreement._check_capacity

        def full(self: Any, *args: Any) -> None:
            raise InsufficientSpaceError("no room (injected)")
        prepare.SaveAgreement._check_capacity = full  # type: ignore[method-assign]
        try:
            mgr.save(make_state(rank, 2030), 30)
        except InsufficientSpaceError:
            pass
        finally:
            prepare.SaveAgreement._check_capacity = real  # type: ignore[method-assign]
        latest, listed = mgr.find_latest(), mgr.iterations()
        mgr.save(make_state(rank, 2030), 30)
        after = sorted(int(p.name[5:]) for p in (Path(base) / f"node{rank}" / "job").glob(
            "iter_*"))
    with manager(rank, base, None) as mgr:
        state, _ = mgr.load()
        return {"loaded": ckpt_id[0], "latest": latest, "iterations": listed, "after": after,
                "is": 2030 if digest(state) == digest(make_state(rank, 2030)) else None}


def load_with(rank: int, world: int, base: str, args: list[dict[str, Any]],
              pending: bool = False) -> dict[str, Any]:
    """Each rank calls ``load(**args[rank])``; returns what it loaded or the error's class,
    and after an error what a plain ``load()`` then loads (the group is still usable).
    ``pending``: an async save of 40 is still to be finalized when the load starts."""
    with manager(rank, base, keep_last=4) as mgr:
        if pending:
            mgr.save(make_state(rank, 40), 40, is_async=True)
        try:
            _, ckpt_id = mgr.load(**args[rank])
        except Exception as exc:
            return {"error": type(exc).__name__, "message": str(exc),
                    "then": mgr.load()[1][0]}
        return {"loaded": ckpt_id[0], "error": None}


def save_these(rank: int, world: int, base: str, iterations: list[int], offset: int) -> None:
    with manager(rank, base, None) as mgr:
        for it in iterations:
            mgr.save(make_state(rank, it + offset), it)


def load_twice(rank: int, world: int, base: str) -> list[str]:
    """load() twice in one process, then find_latest(): what each gave."""
    out = []
    with manager(rank, base, None) as mgr:
        for _ in range(2):
            try:
                out.append(f"loaded {mgr.load()[1][0]}")
            except Exception as exc:
                out.append(type(exc).__name__)
        out.append(f"find_latest {mgr.find_latest()}")
    return out


def rollback_dies_deleting(rank: int, world: int, base: str, how: str) -> dict[str, Any]:
    """Rank 1 rolls back to 20 with discard_newer, and its first deletion of a newer shard
    kills it ("die": the node lost mid-rollback) or fails ("fail": an OSError)."""
    import os

    mgr = manager(rank, base)
    if rank == 1:
        store = mgr._ctx.store

        def delete(ref: Any, background: bool = False) -> None:
            if how == "die":
                os._exit(9)
            raise PermissionError(13, "Permission denied", str(ref.path))

        store.delete = delete  # type: ignore[method-assign]
    try:
        _, ckpt_id = mgr.load(iteration=20, discard_newer=True)
        listed = mgr.iterations()
        try:
            mgr.save(make_state(rank, 21), 21)
        except Exception as exc:
            return {"loaded": ckpt_id[0], "listed": listed,
                    "save_error": f"{type(exc).__name__}: {exc}"}
        return {"loaded": ckpt_id[0], "listed": listed, "save_error": None}
    finally:
        mgr.close()


def rollback_interrupted(rank: int, world: int, base: str, how: str) -> dict[str, Any]:
    """Rank 1's rollback to 20 (discard_newer) stops at the fence: "lost answer" (the exchange
    completed, but rank 1 lost its answer: a CollectiveError there only), "died after fence"
    (killed once its fence is written), "died before fence" (killed before writing it)."""
    import os

    from localckpt.errors import CollectiveError

    mgr = manager(rank, base)
    if rank == 1:
        store, group = mgr._ctx.store, mgr._ctx.group
        real_fence, real_gather = store.fence_rollback, group.gather_outcomes

        def fence(iteration: int, world_size: int | None, before: Any, *rid: str) -> None:
            if how == "died before fence":
                os._exit(9)
            real_fence(iteration, world_size, before, *rid)
            if how == "died after fence":
                os._exit(9)

        def gather(step: str, local: Any, wait: float | None = None) -> Any:
            out = real_gather(step, local, wait)
            if how == "lost answer" and step.endswith(": fence"):
                raise CollectiveError("injected: this rank lost the exchange's answer")
            return out

        store.fence_rollback = fence  # type: ignore[method-assign]
        group.gather_outcomes = gather  # type: ignore[method-assign]
    try:
        _, ckpt_id = mgr.load(iteration=20, discard_newer=True)
        return {"loaded": ckpt_id[0]}
    except Exception as exc:
        return {"error": type(exc).__name__}
    finally:
        with contextlib.suppress(Exception):
            mgr.close()


def restart_and_save(rank: int, world: int, base: str, iteration: int) -> dict[str, Any]:
    """A restarted job: load the newest, save ``iteration``; what it loaded and then lists."""
    with manager(rank, base) as mgr:
        state, ckpt_id = mgr.load()
        mgr.wait_for_write_back()
        mgr.save(make_state(rank, iteration), iteration)
        return {"loaded": ckpt_id[0], "is": next(
            (it for it in (10, 20, 30) if digest(state) == digest(make_state(rank, it))), None),
            "then": mgr.iterations()}


def rollback_with_fence(mgr: LocalCheckpointManager, rank: int, iteration: int,
                        fence: Any) -> str:
    """``mgr.load(iteration=..., discard_newer=True)`` with rank 1's fence step replaced by
    ``fence`` (which may kill the process); "rolled back", or the error's class. Closes
    ``mgr``."""
    if rank == 1:
        mgr._ctx.store.fence_rollback = fence  # type: ignore[method-assign]
    return _rolled_back(mgr, iteration)


def _rolled_back(mgr: LocalCheckpointManager, iteration: int) -> str:
    """``mgr.load(iteration=..., discard_newer=True)``: "rolled back", or the error's class.
    Closes ``mgr``."""
    try:
        mgr.load(iteration=iteration, discard_newer=True)
        return "rolled back"
    except Exception as exc:
        return type(exc).__name__
    finally:
        with contextlib.suppress(Exception):
            mgr.close()


def rollback_fails_alike(rank: int, world: int, base: str) -> str:
    """A rollback to 10 whose fence rank 1 cannot write (ENOSPC): an error every rank agrees
    on, which cancels it."""
    def fence(iteration: int, world_size: int | None, before: Any, *rid: str) -> None:
        raise OSError(28, "No space left on device (injected)")

    return rollback_with_fence(manager(rank, base), rank, 10, fence)


def rollback_fenced_then_fails(rank: int, world: int, base: str) -> str:
    """A rollback to 10 whose fence rank 1 writes, then fails to make durable (EIO from the
    fsync of its session directory after the rename): an error every rank agrees on."""
    mgr = manager(rank, base)
    real = mgr._ctx.store.fence_rollback

    def fence(iteration: int, world_size: int | None, before: Any, *rid: str) -> None:
        real(iteration, world_size, before, *rid)
        raise OSError(5, "Input/output error (injected)")

    return rollback_with_fence(mgr, rank, 10, fence)


def _shared_root(base: str) -> LocalCheckpointManager:
    """Every rank on one node root (one node of several GPUs), a durable tier beside it."""
    from localckpt import DurableTier

    return LocalCheckpointManager(Path(base) / "root", "job", None, keep_last=3, timeout=30,
                                  node_id="one",
                                  durable=DurableTier(Path(base) / "durable", persist_every=None))


def save_on_a_shared_root(rank: int, world: int, base: str) -> None:
    with _shared_root(base) as mgr:
        for it in (10, 20, 30):
            mgr.save(make_state(rank, it), it)


def rollback_fails_on_a_shared_root(rank: int, world: int, base: str) -> str:
    """A rollback to 20 that fails after every rank fenced the shared root: rank 0 cannot
    discard the durable tier's newer iterations. Rank 1 reads and writes the fence file late
    (a slower rank)."""
    import time

    import localckpt.storage.store_rollback as store_module

    def late(fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            time.sleep(0.5)
            return fn(*args, **kwargs)
        return wrapped

    mgr = _shared_root(base)
    if rank == 1:
        store_module.read_fence = late(store_module.read_fence)
        store_module.write_fence = late(store_module.write_fence)
    if rank == 0:
        def fail(iteration: int) -> None:
            raise PermissionError(13, "Permission denied (injected)")

        mgr._load.durable.discard_newer = fail  # type: ignore[union-attr, method-assign]
    return _rolled_back(mgr, 20)


def listed_on_a_shared_root(rank: int, world: int, base: str) -> dict[str, Any]:
    with _shared_root(base) as mgr:
        return {"latest": mgr.find_latest(), "iterations": mgr.iterations()}


def on_nodes(rank: int, world: int, base: str, nodes: list[str], saves: list[int],
             strategy: str | None = "node_spread", offset: int = 0, load: bool = True
             ) -> dict[str, Any]:
    """A job whose rank r runs on node ``nodes[r]`` (its root base/<node>): load the newest
    (unless not ``load``), save ``saves`` (states of iteration + ``offset``); what it loaded
    (and whether the state is that iteration's, or which iteration + offset it is) and then
    lists."""
    with LocalCheckpointManager(Path(base) / nodes[rank], "job", strategy, keep_last=3,
                                timeout=30, node_id=nodes[rank]) as mgr:
        if not load:
            for it in saves:
                mgr.save(make_state(rank, it + offset), it)
            return {"then": mgr.iterations()}
        state, ckpt_id = mgr.load()
        mgr.wait_for_write_back()
        for it in saves:
            mgr.save(make_state(rank, it + offset), it)
        out = {"loaded": ckpt_id[0],
               "identical": digest(state) == digest(make_state(rank, ckpt_id[0])),
               "then": mgr.iterations()}
        if not out["identical"]:
            out["is"] = next((v for v in range(ckpt_id[0], ckpt_id[0] + 3000, 1000)
                              if digest(state) == digest(make_state(rank, v))), None)
        return out


def on_nodes_first_save(rank: int, world: int, base: str, nodes: list[str]) -> None:
    """Saves 10 with replicas, then (a job without them) 20, rank r on node ``nodes[r]``."""
    for strategy, it in (("node_spread", 10), (None, 20)):
        with LocalCheckpointManager(Path(base) / nodes[rank], "job", strategy, keep_last=3,
                                    timeout=30, node_id=nodes[rank]) as mgr:
            mgr.save(make_state(rank, it), it)


def reshard_on_nodes(rank: int, world: int, base: str, nodes: list[str], offset: int,
                     load: bool) -> Any:
    """node_spread, rank r on node ``nodes[r]``: save 20 (states + ``offset``), or load with
    reshard=True (plain state: old rank ``rank % 2``'s); what it loaded and whose it is."""
    with LocalCheckpointManager(Path(base) / nodes[rank], "job", "node_spread", keep_last=3,
                                timeout=30, node_id=nodes[rank], reshard=load) as mgr:
        if not load:
            mgr.save(make_state(rank, 20 + offset), 20)
            return mgr.iterations()
        state, ckpt_id = mgr.load()
        return {"loaded": ckpt_id[0], "is": next(
            (v for v in (20, 1020) if digest(state) == digest(make_state(rank % 2, v))), None)}
