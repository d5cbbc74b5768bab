"""A rollback's deletions (``load(iteration=N, discard_newer=True)``), all or nothing across
nodes: every root hides its newer shards behind a fence (storage/rollback_fence.py) in one
agreed step before any rank deletes, and the durable tier's newer iterations go too.
"""

from __future__ import annotations

import logging

from ..control.context import Context
from ..errors import CollectiveError, error_from_failures
from ..save.persist import Persister
from ..storage.durable import DurableStore
from ..storage.rollback_fence import FENCE_NAME, Fence, new_rollback_id
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

    def as_it_was() -> str | None:
        before.append(ctx.store.fence())
        return new_rollback_id() if ctx.rank == 0 else None

    # rank 0's id names this rollback in every fence (a root that finishes it records it)
    rollback_id = str(ctx.group.exchange(f"{step} as it was", as_it_was)[0])
    tried = []

    def fence() -> None:
        # Before the write: one that fails after its rename (the directory's fsync) has put
        # the fence in place all the same, and must be cancelled with the rest.
        tried.append(True)
        ctx.store.fence_rollback(iteration, world, before[0], rollback_id)

    outcome = ctx.group.gather_outcomes(step, fence)
    try:
        if outcome.failures:
            raise error_from_failures(step, outcome.failures) from outcome.local_error
        if tier is not None:  # fails alike on every rank
            _discard_newer_durable(ctx, tier, persister, iteration)
    except CollectiveError:
        raise
    except BaseException:
        if tried:  # no root deletes: as it was before (an earlier rollback's stays)
            try:
                ctx.store.cancel_rollback(before[0])
            except OSError as exc:  # the next save would finish the rollback reported failed
                logger.error("rank %d: the rollback to %d failed, and its fence in %s could "
                             "not be taken back (%s): the next save finishes that rollback "
                             "(deleting the newer iterations) unless the file %s is put back "
                             "as it was before the rollback, or removed", ctx.rank, iteration,
                             ctx.store.session_path, exc, FENCE_NAME)
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
