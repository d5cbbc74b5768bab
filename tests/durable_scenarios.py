"""Multi-process scenarios of the durable tier (a shared directory every rank sees)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agreement_scenarios import describe
from scenarios import digest, make_state

from localckpt import AsyncCallsQueue, DurableTier, LocalCheckpointManager


def _manager(rank: int, base: str, durable: str, **kwargs: Any) -> LocalCheckpointManager:
    from replication import make_strategy

    return LocalCheckpointManager(Path(base) / f"node{rank}", "job", make_strategy("node_spread"),
                                  timeout=20, chunk_nbytes=8192, node_id=f"node{rank}",
                                  durable=DurableTier(durable, **kwargs))


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
