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
from typing import Any, TypeVar

from ..control.context import Context
from ..errors import CorruptShardError, DurableTierUnavailableError
from ..ops.faults import fault_point
from ..storage.durable import DurableStore

logger = logging.getLogger(__name__)


def durable_candidates(ctx: Context, tier: DurableStore, newer_than: int) -> list[int]:
    """Complete durable iterations of this world size newer than ``newer_than``, newest first:
    rank 0's listing, the same on every rank. Collective (control group). A store rank 0 cannot
    list within half a timeout counts as empty (logged) when the local tiers hold an iteration;
    when they hold none, DurableTierUnavailableError on every rank."""
    def listing() -> dict[str, Any] | None:
        if ctx.rank != 0:
            return None
        try:
            return {"complete": within(ctx.timeout / 2, lambda: tier.complete(ctx.world_size))}
        except OSError as exc:  # TimeoutError included
            return {"failed": f"{type(exc).__name__}: {exc}"}

    answer = ctx.group.exchange("find_latest: durable tier", listing)[0] or {}
    if "failed" in answer:
        if newer_than < 0:  # nothing local either: a fresh start would lose the job's progress
            raise DurableTierUnavailableError(
                f"find_latest: the node-local tiers hold no checkpoint and the durable tier "
                f"{tier.root} could not be listed within {ctx.timeout / 2:g}s "
                f"({answer['failed']}); not starting over: restart once it is reachable")
        logger.error("rank %d: the durable tier %s could not be listed (%s): the local "
                     "tiers' iteration %d is used", ctx.rank, tier.root, answer["failed"],
                     newer_than)
    listed = answer.get("complete") or []
    return sorted((int(it) for it in listed if int(it) > newer_than), reverse=True)


T = TypeVar("T")


def drop_other_saves(ctx: Context, tier: DurableStore, iteration: int) -> None:
    """Delete the replicas of ``iteration`` in this rank's node root that are not the
    committed save's (another save of that iteration number): a later restore after a node loss
    would otherwise mix them with the committed shards. The node's own ranks' shards are theirs
    to check."""
    world, node_of = ctx.world_size, ctx.topology.node_of
    for ref in ctx.store.committed():
        if ref.iteration != iteration or ref.world_size != world or \
                node_of[ref.owner_rank] == node_of[ctx.rank]:
            continue
        try:
            same = ctx.store.read_manifest(ref) == tier.committed_manifest(iteration,
                                                                           ref.owner_rank, world)
        except (OSError, CorruptShardError):
            same = False
        if not same:
            ctx.store.delete(ref, background=True)


def within(seconds: float, fn: Callable[[], T]) -> T:
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
            # (not a leftover of another save of the same iteration number). A hung mount
            # fails this rank within the others' wait, instead of holding it for ever.
            fetched = within(3.5 * ctx.timeout,
                             lambda: tier.get(ctx.store, iteration, ctx.rank, world))
            drop_other_saves(ctx, tier, iteration)

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
