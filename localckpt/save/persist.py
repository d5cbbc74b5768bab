"""Persisting finalized iterations to the durable tier, in the background.

After every ``every``-th finalized save (the same iterations on every rank: finalize is agreed),
each rank copies its own shard of that iteration from its node root to the durable tier
(:class:`localckpt.storage.durable.DurableStore`), on a thread of its own: no collective, neither
the training group nor localckpt's, and nothing the training thread waits for. Rank 0 then waits
for every rank's shard to be there and commits the iteration (its commit file, written last),
then applies the durable keep policy. At most one persist runs per rank; a request that arrives
meanwhile replaces the one waiting (the newest wins), so a slow store never queues work up.

A failure (store unreachable, full, an error, a timeout waiting for other ranks) is logged and
counted, never raised to training, and never touches a local checkpoint: the local shard being
copied is kept by local retention until the copy is over (:meth:`Persister.pinned`). Ranks that
coalesced differently leave uncommitted shards of an iteration; rank 0 removes those of
iterations older than the one it commits (each rank copies in order, so none is still written).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from ..control.context import Context
from ..control.retention import KeepPolicy
from ..errors import CorruptShardError
from ..ops.faults import fault_point
from ..storage.durable import DurableStore
from ..storage.rollback_fence import hidden, unfinished

logger = logging.getLogger(__name__)


class Persister:
    """One rank's persists. ``request`` and ``pinned`` are called from the training thread."""

    def __init__(self, ctx: Context, tier: DurableStore, every: int | None, keep: int,
                 wait: float, run: str, interval: float | None = None,
                 keep_every: int | None = None, any_world: bool = False) -> None:
        self.ctx, self.tier, self.every, self.wait_s = ctx, tier, every, wait
        self.keep = KeepPolicy(last=keep, every=keep_every)  # the durable tier's retention
        self.any_world = any_world  # reshard=True: other world sizes' iterations are this job's
        self.interval = interval  # seconds between persists by the clock (rank 0's decides)
        # When a persist was last asked for: never, so a run's first finalized save is due (a
        # job whose runs are all shorter than the interval persists too).
        self._asked_at = -float("inf")
        self.run = run  # this job run's id (rank 0's, agreed at start): names progress records
        self.persisted: list[int] = []  # iterations this rank copied (rank 0: committed)
        self.failures: list[tuple[int, str]] = []  # (iteration, error) of failed persists
        self._finalized = 0
        self._newest = -1  # the newest iteration requested: requests only go forward
        self._pending: int | None = None
        self._running: int | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="localckpt-persist")
        self._thread.start()

    def due_by_clock(self) -> bool:
        """Rank 0, in a finalize: whether ``interval`` seconds have passed since a persist was
        last asked for (its answer goes to every rank with the finalize's reports)."""
        return self.interval is not None and time.monotonic() - self._asked_at >= self.interval

    def finalized(self, iteration: int, due_by_clock: bool = False) -> None:
        """A save of ``iteration`` was finalized (the same on every rank, as is
        ``due_by_clock``, rank 0's verdict): persist it if it is the ``every``-th or due."""
        self._finalized += 1
        if due_by_clock or (self.every is not None and self._finalized % self.every == 0):
            self.request(iteration)

    def request(self, iteration: int) -> bool:
        """Persist ``iteration`` (committed locally on every rank) as soon as the one running
        is over, replacing an older request still waiting. Requests only go forward: one not
        newer than the newest requested is ignored (False), so every rank copies in order."""
        with self._cond:
            if iteration <= self._newest:
                logger.warning("rank %d: persist of iteration %d ignored: %d was requested "
                               "already", self.ctx.rank, iteration, self._newest)
                return False
            if self._pending is not None:
                logger.info("rank %d: persist of iteration %d skipped: %d is newer",
                            self.ctx.rank, self._pending, iteration)
            self._newest = self._pending = iteration
            self._asked_at = time.monotonic()
            self._cond.notify_all()
            return True

    def rolled_back(self, iteration: int) -> None:
        """The job went back to ``iteration``: later requests may name iterations up from there
        again, and this rank's progress record says so (rank 0 must not take a record of the
        discarded future for a rank that went past). Raises OSError from the tier."""
        with self._cond:  # the rollback point itself may be persisted (again: a no-op)
            self._newest = min(self._newest, iteration - 1)
        self.tier.mark_progress(self.ctx.rank, self.run, iteration)

    def pinned(self) -> set[int]:
        """Iterations whose local shards a persist still needs."""
        with self._cond:
            return {it for it in (self._pending, self._running) if it is not None}

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Whether no persist is running or waiting, waiting up to ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._pending is None and self._running is None, timeout)

    def close(self, timeout: float) -> None:
        """Let the persists running and waiting finish (up to ``timeout`` seconds in all: the
        last save before an exit is persisted too), then stop."""
        idle = self.wait_idle(timeout)
        with self._cond:
            self._closed = True
            self._pending = None
            self._cond.notify_all()
        self._thread.join(1.0 if idle else 0.0)
        if self._thread.is_alive():
            logger.error("rank %d: a persist to %s still runs at close", self.ctx.rank,
                         self.tier.root)
        else:
            self.tier.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                self._running, self._pending = self._pending, None
            iteration = self._running
            try:
                self._persist(iteration)
                self.persisted.append(iteration)
            except BaseException as exc:  # a store client's panic too: the thread goes on
                self.failures.append((iteration, f"{type(exc).__name__}: {exc}"))
                logger.error("rank %d: persisting iteration %d to %s failed (training goes "
                             "on; the local checkpoint is intact): %s", self.ctx.rank,
                             iteration, self.tier.root, exc)
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()

    def _persist(self, iteration: int) -> None:
        ctx, tier = self.ctx, self.tier
        with ctx.timed("persist", iteration) as box:
            tier.mark_progress(ctx.rank, self.run, iteration)
            fault_point("persist_write", ctx.rank, iteration)
            if hidden(unfinished(ctx.store.fence(), ctx.store.rollbacks_done()), iteration,
                      ctx.world_size):
                raise FileNotFoundError(f"iteration {iteration} was discarded by a rollback "
                                        "(its fence hides it): not persisted")
            manifest = ctx.store.read_manifest(ctx.store.ref(iteration, ctx.rank,
                                                             ctx.world_size))
            save_id = manifest.metadata.get("save_id")  # None: written before save ids
            # This save's copy already there (persisted before): not written again in place.
            if save_id is None or not tier.holds(iteration, ctx.rank, ctx.world_size, save_id):
                manifest = tier.put(ctx.store, iteration, ctx.rank, ctx.world_size)
                box["nbytes"] = manifest.data_nbytes
        if ctx.rank != 0:
            return
        with contextlib.suppress(OSError, CorruptShardError):
            if save_id is not None and \
                    tier.commit_record(iteration, ctx.world_size).get("save_id") == save_id:
                return  # committed already
        # Only shards of this very save count (rank 0's id, in every rank's manifest); a rank
        # whose newer request replaced this one never delivers it: its progress record says
        # it went past, and this one is given up at once.
        try:
            tier.commit(iteration, ctx.world_size, save_id, self.wait_s,
                        before=lambda: fault_point("persist_commit", ctx.rank, iteration),
                        gone_past=lambda r: tier.progress(r, self.run) > iteration)
        except BaseException:
            self._remove_abandoned(iteration)
            raise
        self._retain(iteration)

    def _remove_abandoned(self, failed: int) -> None:
        """Rank 0, after the commit of ``failed`` failed: remove the uncommitted iterations
        older than it that every rank has gone past (its progress record: each rank copies in
        order), which no commit will ever name. Without this a rank whose copies always fail
        (its node cannot write the tier) leaves the other ranks' shards of every persist."""
        tier = self.tier
        try:
            older = [it for it in tier.uncommitted() if it < failed]
            if not older:
                return
            past = min(tier.progress(r, self.run) for r in range(self.ctx.world_size))
            for it in older:
                if it < past:
                    tier.remove_uncommitted(it)
        except OSError as exc:
            logger.error("rank 0: removing abandoned copies in %s: %s", tier.root, exc)

    def _retain(self, committed: int) -> None:
        """Rank 0, after committing ``committed``: keep what the keep policy keeps of the
        complete iterations of this world size up to ``committed``, and remove the others,
        those of other world sizes older than all it keeps that the policy over every world
        size's iterations does not keep either (with ``any_world``), and uncommitted leftovers
        older than ``committed``. Iterations newer than ``committed`` are another run's (this
        one loaded an older one: they were unusable, or not offered): neither counted nor
        removed here, they never push this run's newest out of the tier."""
        tier, world = self.tier, self.ctx.world_size
        try:
            complete = [(it, w) for it, w in tier.complete_any() if it <= committed]
            kept = self.keep.keep([it for it, w in complete if w == world])
            # With reshard=True the other world sizes' iterations are this job's lineage: the
            # keep policy over all of them spares some; without, they are not this job's.
            lineage = self.keep.keep({it for it, _ in complete}) if self.any_world else None
            for it, w in complete:
                if (w == world and it not in kept) or (
                        w != world and lineage is not None and kept and it < min(kept)
                        and it not in lineage):
                    tier.delete(it, w)
            for it in tier.uncommitted():
                if it < committed:  # every rank copies in order: none still writes there
                    tier.remove_uncommitted(it)
            tier.remove_trash()
        except OSError as exc:
            logger.error("rank 0: durable retention in %s: %s (retried after the next "
                         "persist)", tier.root, exc)
