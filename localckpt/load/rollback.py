"""A rollback's deletions (``load(iteration=N, discard_newer=True)``), all or nothing across
nodes: every root hides its newer shards behind a fence (storage/rollback_fence.py) in one
agreed step before any rank deletes, and the durable tier's newer iterations go too.
"""

from __future__ import annotations

import contextlib
import logging

from ..control.context import Context
from ..errors import CollectiveError, error_from_failures
from ..save.persist import Persister
from ..storage.durable import DurableStore
from ..storage.rollback_fence import Fence
from .from_durable import within

logger = logging.getLogger(__name__)


def discard_newer(ctx: Context, iteration: int, world: int | None, tier: DurableStore | None,
                  persister: Persister | None) -> None:
    """Collective, after every rank loaded ``iteration``: hide, then delete, this root's shards
    newer than it (of ``world``; None: of every world size, a resharding job's lineage), and
    the durable tier's newer iterations. A failure agreed by every rank cancels it everywhere
    (raised); a collective that failed (a peer lost: some ranks may have got past the fence
    and deleted) keeps each fence, and the next save finishes the rollback. Deletions that fail
    are logged: what they leave stays hidden, and is tried again before the next save."""
    step = f"rollback to {iteration}: fence"
    # What a cancel puts back, read by every rank before any writes: ranks sharing a root
    # then put back the same fence (one that read after another rank wrote would put this
    # rollback's back).
    before: list[Fence | None] = []
    ctx.group.exchange(f"{step} as it was", lambda: before.append(ctx.store.fence()))
    written = []

    def fence() -> None:
        ctx.store.fence_rollback(iteration, world, before[0])
        written.append(True)

    outcome = ctx.group.gather_outcomes(step, fence)
    try:
        if outcome.failures:
            raise error_from_failures(step, outcome.failures) from outcome.local_error
        if tier is not None:  # fails alike on every rank
            _discard_newer_durable(ctx, tier, persister, iteration)
    except CollectiveError:
        raise
    except BaseException:
        if written:  # no root deletes: as it was before (an earlier rollback's stays)
            with contextlib.suppress(OSError):
                ctx.store.cancel_rollback(before[0])
        raise
    for failure in ctx.store.finish_rollback():  # hidden: tried again before each save
        logger.error("rank %d: discarding after the rollback to %d: %s", ctx.rank,
                     iteration, failure)


def _discard_newer_durable(ctx: Context, tier: DurableStore, persister: Persister | None,
                           iteration: int) -> None:
    """The rollback reaches the durable tier too, or its newer iterations would come back at
    the next ``find_latest``: every rank's persists settle (two agreed steps), then rank 0
    removes the newer iterations there, commit files first. Raises on every rank when that
    fails (nothing local was discarded yet)."""
    settle_s = (persister.wait_s if persister is not None else 0.0) + ctx.timeout / 2

    def settled() -> None:
        if persister is None:
            return
        try:
            if not persister.wait_idle(settle_s):
                raise TimeoutError(f"a persist to {tier.root} still runs")
        finally:  # alike on every rank, whatever the outcome
            within(ctx.timeout / 2, lambda: persister.rolled_back(iteration))

    def discard() -> None:
        if ctx.rank == 0:  # a hung mount: an error on every rank, not a hung rank 0
            within(ctx.timeout / 2, lambda: tier.discard_newer(iteration))

    ctx.group.exchange(f"rollback to {iteration}: persists settled", settled,
                       wait=settle_s + ctx.timeout)
    ctx.group.exchange(f"rollback to {iteration}: the durable tier", discard)
