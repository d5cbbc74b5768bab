"""Restoring from the durable tier when the node-local tiers cannot serve a newer iteration.

``find_latest`` asks the durable tier (rank 0 lists it, one exchange) for complete iterations
newer than the newest the local roots cover; ``load`` then copies each rank's own shard of the
newest of them into its node root, verified (:meth:`DurableStore.get`), in one agreed step, and
loads it from there as any local checkpoint. A candidate some rank cannot copy (missing, corrupt,
the store unreachable) is given up on every rank alike and the next older one tried; the local
tier's newest is the last resort. The copies stay: the local tier holds the iteration again, so
the next failure is cheap (the next save replicates afresh).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from ..control.context import Context
from ..ops.faults import fault_point
from ..storage.durable import DurableStore

logger = logging.getLogger(__name__)


def durable_candidates(ctx: Context, tier: DurableStore, newer_than: int) -> list[int]:
    """Complete durable iterations of this world size newer than ``newer_than``, newest first:
    rank 0's listing, the same on every rank. Collective (control group). A store rank 0 cannot
    list within half a timeout counts as empty (logged)."""
    def listing() -> list[int] | None:
        if ctx.rank != 0:
            return None
        try:
            return _within(ctx.timeout / 2, lambda: tier.complete(ctx.world_size))
        except OSError as exc:
            logger.error("rank 0: cannot list the durable tier %s: %s", tier.root, exc)
            return []

    listed = ctx.group.exchange("find_latest: durable tier", listing)[0] or []
    return sorted((int(it) for it in listed if int(it) > newer_than), reverse=True)


T = TypeVar("T")


def _within(seconds: float, fn: Callable[[], T]) -> T:
    """``fn()`` on a daemon thread (a hung mount must hold neither rank 0 past the others'
    timeout nor the interpreter's exit); TimeoutError after ``seconds``."""
    box: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:
            errors.append(exc)
    thread = threading.Thread(target=run, daemon=True, name="localckpt-durable-list")
    thread.start()
    thread.join(seconds)
    if errors:
        raise errors[0]
    if not box:
        raise TimeoutError(f"no answer within {seconds:g}s")
    return box[0]


def fetch_from_durable(ctx: Context, tier: DurableStore, candidates: list[int]) -> int:
    """Copy this rank's shard of the newest candidate every rank can copy into its node root;
    returns that iteration, or -1. Collective (one agreed step per candidate tried)."""
    world = ctx.world_size
    for iteration in candidates:
        fetched = False

        def fetch(iteration: int = iteration) -> None:
            nonlocal fetched
            fault_point("durable_fetch", ctx.rank, iteration)
            # A shard of this iteration already here is kept only if it is the committed one
            # (not a leftover of another save of the same iteration number).
            fetched = tier.get(ctx.store, iteration, ctx.rank, world)

        with ctx.timed("fetch_from_durable", iteration):
            outcome = ctx.group.gather_outcomes(f"load: from the durable tier, iteration "
                                                f"{iteration}", fetch, wait=4 * ctx.timeout)
        if not outcome.failures:
            return iteration
        logger.warning("rank %d: iteration %d cannot be restored from the durable tier %s "
                       "(%s); trying an older one", ctx.rank, iteration, tier.root,
                       "; ".join(f"rank {r}: {e[1]}" for r, e in
                                 sorted(outcome.failures.items())[:4]))
        if fetched:  # an incomplete iteration here: nothing would load it
            ctx.store.delete(ctx.store.ref(iteration, ctx.rank, world), background=True)
    return -1
