"""Multi-process scenarios of the durable tier (a shared directory every rank sees)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from agreement_scenarios import describe
from scenarios import digest, make_state

from localckpt import AsyncCallsQueue, DurableTier, LocalCheckpointManager


def _manager(rank: int, base: str, durable: str, keep_last: int = 1,
             **kwargs: Any) -> LocalCheckpointManager:
    from replication import make_strategy

    return LocalCheckpointManager(Path(base) / f"node{rank}", "job", make_strategy("node_spread"),
                                  timeout=20, chunk_nbytes=8192, node_id=f"node{rank}",
                                  keep_last=keep_last, durable=DurableTier(durable, **kwargs))


def save_and_persist(rank: int, world: int, base: str, durable: str, iterations: list[int],
                     every: int) -> dict[str, Any]:
    """Saves ``iterations`` (the odd ones async), persisting every ``every``-th; waits for the
    persists. Returns what this rank persisted and failed to."""
    mgr = _manager(rank, base, durable, persist_every=every, keep=2)
    queue = AsyncCallsQueue(timeout=30)
    for it in iterations:
        if it % 2:
            queue.schedule_async_request(mgr.save(make_state(rank, it), it, is_async=True))
            queue.maybe_finalize_async_calls(blocking=True)
        else:
            mgr.save(make_state(rank, it), it)
    queue.close()
    idle = mgr.wait_for_persist(30)
    persister = mgr._save.persister
    assert persister is not None
    out = {"idle": idle, "persisted": list(persister.persisted),
           "failures": list(persister.failures), "latest": mgr.latest_iteration}
    mgr.close()
    return out


def restore(rank: int, world: int, base: str, durable: str) -> dict[str, Any]:
    """A fresh job (maybe on empty nodes): find_latest + load, then one more save."""
    mgr = _manager(rank, base, durable, persist_every=None)
    latest = mgr.find_latest()
    try:
        state, ckpt_id = mgr.load()
    except Exception as exc:
        mgr.close()
        return {"latest": latest, "error": describe(exc)}
    local = sorted(r.iteration for r in mgr._ctx.store.committed() if r.owner_rank == rank)
    mgr.save(make_state(rank, 100), 100)
    after = mgr.find_latest()
    mgr.close()
    return {"latest": latest, "loaded": ckpt_id[0], "digest": digest(state),
            "expected": digest(make_state(rank, ckpt_id[0])), "local": local, "after": after,
            "error": None}


def _timeline(rank: int, state: Any) -> str:
    for offset, name in ((0, "A"), (1000, "B")):
        for it in range(1, 6):
            if digest(state) == digest(make_state(rank, it + offset)):
                return f"{name}{it}"
    return "?"


def save_timeline(rank: int, world: int, base: str, durable: str, iterations: list[int],
                  offset: int, fail_rank: int, fail_iteration: int) -> dict[str, Any]:
    """Restore whatever there is, then save ``iterations`` with the states of ``offset``'s
    timeline, persisting each; ``fail_rank``'s copy of ``fail_iteration`` fails."""
    from localckpt.storage.durable import DurableStore

    real_put = DurableStore.put

    def put(self: DurableStore, local: Any, iteration: int, owner: int, w: int) -> Any:
        if rank == fail_rank and iteration == fail_iteration:
            raise OSError(5, "the copy failed (injected)")
        return real_put(self, local, iteration, owner, w)
    DurableStore.put = put  # type: ignore[method-assign]
    mgr = _manager(rank, base, durable, persist_every=1, keep=5, commit_timeout=3)
    start = mgr.find_latest()
    if start >= 0:
        mgr.load()
    for it in iterations:
        mgr.save(make_state(rank, it + offset), it)
        assert mgr.wait_for_persist(30)
    persister = mgr._save.persister
    assert persister is not None
    out = {"start": start, "persisted": list(persister.persisted),
           "failures": [f[0] for f in persister.failures]}
    mgr.close()
    DurableStore.put = real_put  # type: ignore[method-assign]
    return out


def restore_timeline(rank: int, world: int, base: str, durable: str) -> dict[str, Any]:
    mgr = _manager(rank, base, durable, persist_every=None)
    latest = mgr.find_latest()
    state, ckpt_id = mgr.load()
    mgr.close()
    return {"latest": latest, "loaded": ckpt_id[0], "timeline": _timeline(rank, state)}


def restore_timeline_tier_flaky_for(rank: int, world: int, base: str, durable: str,
                                    failing_owner: int) -> dict[str, Any]:
    """restore_timeline with the tier failing, on rank 0 only, to read the committed manifest
    of ``failing_owner``'s shard (a 503 on one key: a fault of the tier, not of any copy)."""
    from localckpt.storage.durable import DurableStore

    real = DurableStore.committed_manifest

    def flaky(self: DurableStore, iteration: int, owner: int, *args: Any) -> Any:
        if owner == failing_owner:
            raise OSError("injected: 503 Slow Down")
        return real(self, iteration, owner, *args)
    if rank == 0:
        DurableStore.committed_manifest = flaky  # type: ignore[method-assign]
    return restore_timeline(rank, world, base, durable)


def local_only_saves(rank: int, world: int, base: str, iterations: list[int]) -> None:
    """Saves without a durable tier (timeline A), to leave shards in node roots."""
    from replication import make_strategy

    with LocalCheckpointManager(Path(base) / f"node{rank}", "job", make_strategy("node_spread"),
                                timeout=20, chunk_nbytes=8192, node_id=f"node{rank}") as mgr:
        for it in iterations:
            mgr.save(make_state(rank, it), it)


def persist_older_after_newer(rank: int, world: int, base: str, durable: str
                              ) -> dict[str, Any]:
    """persist(3) then persist(1) on every rank: the older one is ignored, 3 is committed."""
    mgr = _manager(rank, base, durable, persist_every=None, keep=5, commit_timeout=10)
    for it in (1, 2, 3):
        mgr.save(make_state(rank, it), it)
    mgr.persist(3)
    mgr.persist(1)
    assert mgr.wait_for_persist(30)
    persister = mgr._save.persister
    assert persister is not None
    out = {"persisted": list(persister.persisted), "failures": list(persister.failures),
           "complete": persister.tier.complete(world)}
    mgr.close()
    return out


def rollback_then_save(rank: int, world: int, base: str, durable: str) -> dict[str, Any]:
    """Persist 1-4, roll back to 2, save 3 anew: 3 must be committed (no record of the
    discarded 4 may make rank 0 give it up)."""
    mgr = _manager(rank, base, durable, keep_last=5, persist_every=1, keep=5, commit_timeout=10)
    for it in (1, 2, 3, 4):
        mgr.save(make_state(rank, it), it)
        assert mgr.wait_for_persist(30)
    mgr.load(iteration=2, discard_newer=True)
    from localckpt.save.persist import Persister

    real_persist = Persister._persist

    def late(self: Persister, iteration: int) -> None:  # rank 1 starts its copy of 3 late
        if rank == 1:
            time.sleep(1.0)
        real_persist(self, iteration)
    Persister._persist = late  # type: ignore[method-assign]
    mgr.save(make_state(rank, 1003), 3)
    assert mgr.wait_for_persist(30)
    Persister._persist = real_persist  # type: ignore[method-assign]
    persister = mgr._save.persister
    assert persister is not None
    out = {"failures": list(persister.failures), "complete": persister.tier.complete(world)}
    mgr.close()
    return out


def bad_settings_on_one_rank(rank: int, world: int, base: str, bad_rank: int) -> dict[str, Any]:
    """Every rank names a bucket; ``bad_rank``'s settings hold a key the S3 client does not
    know. Returns what the manager's construction raised, or that it worked (then closes it)."""
    options = {"no_such_setting": "1"} if rank == bad_rank else {}
    try:
        mgr = _manager(rank, base, "s3://b/x", options=options)
    except Exception as exc:
        return {"error": describe(exc)}
    mgr.close()
    return {"error": None}


def restore_and_wait(rank: int, world: int, base: str, durable: str) -> dict[str, Any]:
    """A fresh job on empty nodes: load from the durable tier, then wait for the write-back.
    Returns the shards this node root then holds."""
    mgr = _manager(rank, base, durable, persist_every=None)
    mgr.find_latest()
    _, ckpt_id = mgr.load()
    mgr.wait_for_write_back()
    held = sorted((r.iteration, r.owner_rank) for r in mgr._ctx.store.committed())
    mgr.close()
    return {"loaded": ckpt_id[0], "held": held}


def restore_at_another_world(rank: int, world: int, base: str, durable: str,
                             old_world: int, keep: int = 1) -> dict[str, Any]:
    """A job of ``world`` ranks on empty nodes, ``reshard=True``: load the newest durable
    iteration saved by ``old_world`` ranks, then save and persist two iterations of its own."""
    from replication import make_strategy

    mgr = LocalCheckpointManager(Path(base) / f"node{rank}", "job",
                                 make_strategy("node_spread") if world > 1 else None,
                                 timeout=20, chunk_nbytes=8192, node_id=f"node{rank}",
                                 reshard=True, durable=DurableTier(durable, keep=keep))
    latest = mgr.find_latest()
    state, ckpt_id = mgr.load()
    out = {"latest": latest, "loaded": ckpt_id[0], "digest": digest(state),
           "expected": digest(make_state(rank % old_world, ckpt_id[0]))}
    for it in (10, 11):
        mgr.save(make_state(rank, it), it)
        assert mgr.wait_for_persist(30)
    persister = mgr._save.persister
    assert persister is not None
    out["failures"] = list(persister.failures)
    out["complete"] = persister.tier.complete_any()
    out["other_world_local"] = sorted({(r.iteration, r.world_size) for r in
                                       mgr._ctx.store.committed() if r.world_size != world})
    mgr.close()
    return out


def save_kept(rank: int, world: int, base: str, durable: str, iterations: list[int],
              every: int | None) -> None:
    """Saves ``iterations`` keeping 10 of them locally, persisting every ``every``-th (None:
    none); waits for the persists."""
    mgr = _manager(rank, base, durable, keep_last=10, persist_every=every, keep=5)
    for it in iterations:
        mgr.save(make_state(rank, it), it)
    assert mgr.wait_for_persist(30)
    mgr.close()


def restore_resharding_on_node0(rank: int, world: int, base: str,
                                durable: str) -> dict[str, Any]:
    """A job of ``world`` ranks (another world size than the saver's) restarting on node 0."""
    mgr = LocalCheckpointManager(Path(base) / "node0", "job", None, timeout=20,
                                 chunk_nbytes=8192, node_id="node0", reshard=True, keep_last=10,
                                 durable=DurableTier(durable, keep=5))
    try:
        _, ckpt_id = mgr.load()
        return {"loaded": ckpt_id[0]}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        mgr.close()


def save_keeping_all(rank: int, world: int, base: str, durable: str) -> None:
    """Saves 1, 2, 3, each persisted; every one kept in the node roots and the tier."""
    mgr = _manager(rank, base, durable, keep_last=5, keep=5, persist_every=1)
    try:
        for it in (1, 2, 3):
            mgr.save(make_state(rank, it), it)
            assert mgr.wait_for_persist(30)
    finally:
        mgr.close()


def rollback_dies_at_fence(rank: int, world: int, base: str, durable: str) -> str:
    """A rollback to 2 (discard_newer) in which rank 1 is killed once its fence is written:
    nothing was discarded from the durable tier yet."""
    import os

    from rollback_scenarios import rollback_with_fence

    mgr = _manager(rank, base, durable, keep_last=5, keep=5)
    real = mgr._ctx.store.fence_rollback

    def fence(iteration: int, world_size: int | None, before: Any, *rid: str) -> None:
        real(iteration, world_size, before, *rid)
        os._exit(9)

    return rollback_with_fence(mgr, rank, 2, fence)


def restart_save(rank: int, world: int, base: str, durable: str) -> dict[str, Any]:
    """A restarted job loads the newest, saves 3 and persists it; what it loaded."""
    mgr = _manager(rank, base, durable, keep_last=5, keep=5, persist_every=1)
    try:
        state, ckpt_id = mgr.load()
        mgr.wait_for_write_back()
        mgr.save(make_state(rank, 3 + 1000), 3)
        assert mgr.wait_for_persist(30)
    finally:
        mgr.close()
    return {"loaded": ckpt_id[0], "identical": digest(state) == digest(make_state(rank, 2))}


def one_rank_never_delivers(rank: int, world: int, base: str, durable: str) -> int:
    """Rank 1's copies always fail (its node cannot write the tier); four saves, each
    persisted; how many persists failed on this rank."""
    from localckpt.storage.durable import DurableStore

    if rank == 1:
        def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
            raise PermissionError(13, "Permission denied (injected)")

        DurableStore.put = refuse  # type: ignore[method-assign]
    mgr = _manager(rank, base, durable, keep=2, commit_timeout=1)
    try:
        for it in range(1, 5):
            mgr.save(make_state(rank, it), it)
            mgr.wait_for_persist(20)
        persister = mgr._save.persister
        assert persister is not None
        return len(persister.failures)
    finally:
        mgr.close()
