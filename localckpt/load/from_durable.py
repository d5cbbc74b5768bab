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

from ..control.context import Context
from ..ops.faults import fault_point
from ..storage.durable import DurableStore

logger = logging.getLogger(__name__)


def durable_candidates(ctx: Context, tier: DurableStore, newer_than: int) -> list[int]:
    """Complete durable iterations of this world size newer than ``newer_than``, newest first:
    rank 0's listing, the same on every rank. Collective (control group). A store rank 0 cannot
    list counts as empty (logged)."""
    def listing() -> list[int] | None:
        if ctx.rank != 0:
            return None
        try:
            return tier.complete(ctx.world_size)
        except OSError as exc:
            logger.error("rank 0: cannot list the durable tier %s: %s", tier.root, exc)
            return []

    listed = ctx.group.exchange("find_latest: durable tier", listing)[0] or []
    return sorted((int(it) for it in listed if int(it) > newer_than), reverse=True)


def fetch_from_durable(ctx: Context, tier: DurableStore, candidates: list[int]) -> int:
    """Copy this rank's shard of the newest candidate every rank can copy into its node root;
    returns that iteration, or -1. Collective (one agreed step per candidate tried)."""
    world = ctx.world_size
    for iteration in candidates:
        fetched = False

        def fetch(iteration: int = iteration) -> None:
            nonlocal fetched
            if any(r.iteration == iteration and r.owner_rank == ctx.rank
                   and r.world_size == world for r in ctx.store.committed()):
                return  # already here (a node that survived)
            fault_point("durable_fetch", ctx.rank, iteration)
            tier.get(ctx.store, iteration, ctx.rank, world)
            fetched = True

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
