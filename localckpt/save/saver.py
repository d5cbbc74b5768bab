"""The save path of one manager, top to bottom:

1. **settle** the async save still in flight (back-pressure: its arena is about to be reused);
2. **stage** (local, :func:`~localckpt.save.prepare.stage_shard`): flatten the state dict, copy
   its tensors into the staging arena, build the manifest;
3. **agree**, one agreed step (:class:`~localckpt.save.prepare.SaveAgreement`): gather every
   rank's request (iteration, inventory, bytes needed, free space) or its staging error;
   whatever failed on one rank fails the save on every rank alike, then the pure checks
   (iteration, capacity) run on the same gathered input everywhere. A synchronous save agrees
   on the training thread; an async save on its own thread, so that its stall is step 2 alone
   and a failure of steps 2-3 is raised by its finalize step, on every rank;
4. **run** the :class:`~localckpt.save.job.SaveJob`: write the shard and replicate it, now or on
   the save's own thread;
5. **finalize**, one agreed step: every rank reports its write and its inventory. The iteration is
   removed only when every rank *agreed* it failed; when the ranks could not agree (a peer died,
   the group was closed) nothing is deleted, and a complete iteration is found by the next
   ``find_latest``. Then retention, which never fails a finalized save.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from functools import partial
from typing import Any

from replication.stripe_plans import missing_parity

from ..control.context import Context
from ..control.coverage import choose_latest, decode_inventories, holders_of
from ..control.retention import KeepPolicy
from ..errors import (
    CheckpointingError,
    CollectiveTimeoutError,
    IncompleteCheckpointError,
    RankInterruptedError,
    describe_failure,
    error_from_failures,
)
from ..gc_pause import gc_paused
from ..ops.faults import fault_point
from ..state_dict import as_tensor_aware
from ..storage.space import chunking
from .async_calls import AsyncRequest, finalizing_agreed_calls
from .dedupe import dedupe
from .job import AGREEMENT_STEPS, SaveJob, wait_for_save, waitable
from .persist import Persister
from .prepare import SaveAgreement, StagedShard, stage_shard
from .retainer import Retainer
from .staging import StagingArena, growth_slack, plan_layout

logger = logging.getLogger(__name__)


class SavePath:
    """Saves of one manager. Called from the training thread only. ``latest_iteration`` is the
    newest iteration a finalize found complete (-1 before any).

    The save in flight (``busy`` decides what a new save does meanwhile: "wait" or "skip") and
    the staging arena belong to this object alone.
    """

    def __init__(self, ctx: Context, keep: KeepPolicy, busy: str) -> None:
        self.ctx = ctx
        self.retainer = Retainer(ctx, keep)
        self.busy = busy
        self.latest_iteration = -1
        self._arena = StagingArena()
        self._inflight: SaveJob | None = None
        self._finalizing = threading.RLock()  # see _finalize_job
        self.agreement = SaveAgreement(ctx)  # .any_world: reshard=True
        self.dedupe_replicated = True
        # a save refuses a type no load could build (an integration whose load takes no
        # ``into``: the user would find out at the restore, after the node was lost)
        self.loadable_types_only = False
        self.persister: Persister | None = None  # the durable tier's, when there is one

    def save(self, state_dict: Any, iteration: Any, is_async: bool, custom_metadata: Any = None,
             metrics: Any = None) -> AsyncRequest | None:
        """See :meth:`LocalCheckpointManager.save`. Collective."""
        ctx = self.ctx
        # An async save agrees on the data group: a control group found out of step (or a
        # peer lost) must stop it here, not let it write and fail only at its finalize.
        ctx.group.check_usable("save")
        with ctx.timed("stall", iteration) as box, gc_paused():
            if not self.settle(skip=is_async and self.busy == "skip"):
                logger.info("rank %d: skipping save of iteration %s: the previous one is still "
                            "in flight", ctx.rank, iteration)
                return None
            staged: StagedShard | BaseException
            try:
                staged = stage_shard(ctx, self._arena, state_dict, iteration, custom_metadata,
                                     metrics, self.dedupe_replicated,
                                     self.loadable_types_only)
            except BaseException as exc:  # the agreement makes it every rank's
                staged = exc
            if not isinstance(staged, (StagedShard, Exception)):
                # Ctrl-C or an exit in the walk: the others' agreement is told now (async: on
                # their save threads, and their finalize raises it with no exchange) and raises
                # RankInterruptedError; here it is raised as it came, no save left in flight.
                try:
                    self.agreement.agree(ctx.data_group if is_async else ctx.group, staged)
                except CheckpointingError as exc:  # the peers could not be told: the group
                    raise staged from exc  # is broken, and they will find that out
                raise staged  # (agree raised it)
            if not is_async:
                agreed = self.agreement.agree(ctx.group, staged)
                assert isinstance(staged, StagedShard)
                box["nbytes"] = agreed.manifest.data_nbytes
                job = SaveJob(iteration, agreed.manifest, staged.payload, agreed.plan,
                              metrics=ctx.metrics, wait_steps=agreed.wait_steps,
                              parity=agreed.parity, sizes=agreed.sizes)
                job.run(ctx)
                if job.error is None or isinstance(job.error, Exception):
                    self._finalize_job(job)
                    return None
                # Ctrl-C or an exit on the training thread: the finalize tells every rank at
                # once that this save failed, then it is raised as it came (not a failed save).
                with contextlib.suppress(CheckpointingError):
                    self._finalize_job(job)
                raise job.error
            if not isinstance(staged, StagedShard):
                logger.error("rank %d: staging iteration %s failed (raised by the finalize "
                             "step, on every rank): %s", ctx.rank, iteration, staged)
                job = SaveJob(iteration, None, None,  # type: ignore[arg-type]
                              agree=partial(self.agreement.agree, ctx.data_group, staged),
                              metrics=ctx.metrics)
            else:
                box["nbytes"] = staged.manifest.data_nbytes
                job = SaveJob(iteration, staged.manifest, staged.payload,
                              agree=partial(self.agreement.agree, ctx.data_group, staged),
                              metrics=ctx.metrics)
        self._inflight = job
        try:
            job.start(ctx)
        except BaseException as exc:  # no thread, no agreement: the finalize's exchange fails
            job.error = exc
            job.agreed.set()
            job.done.set()
        return AsyncRequest(wait_for_save, (job.done,),
                            finalize_fns=(partial(self._finalize_job, job),),
                            bound=partial(job.bound, self.ctx.timeout))

    def reserve(self, state_dict: Any) -> int:
        """Size and pre-fault the staging arena for saves of ``state_dict`` (and, recycling
        files, put the chunk files of its shard and of the replicas it receives in the pool);
        returns the bytes one such save stages. Not collective. A save in flight keeps its own
        buffer alive. TypeError for a leaf or tensor a save would refuse (one reaching past its
        storage included)."""
        tasd = as_tensor_aware(state_dict)
        tensors = dedupe(tasd, self.dedupe_replicated).tensors
        chunk_nbytes, chunk_count = chunking(plan_layout(tensors, paths=tasd.key_paths).nbytes,
                                             self.ctx.store.chunk_nbytes)
        nbytes = chunk_nbytes * chunk_count
        self._arena.reserve(nbytes, growth_slack(len(tensors), nbytes))
        files = self.ctx.store.files
        if files is not None:
            held = sum(self.ctx.rank in h for h in self.ctx.placement.holders)
            files.preallocate(chunk_count * (1 + held), chunk_nbytes + 4)
        return nbytes

    def close(self) -> bool:
        """Wait (up to the timeout) for the local work of a save in flight: its shard is then
        committed, to be finalized through the AsyncCallsQueue or found by the next job.
        Whether no save thread is left running."""
        job = self._inflight
        ended = job is None or job.wait(self.ctx.timeout)
        if not ended:
            logger.error("rank %d: async save of iteration %d still running at close",
                         self.ctx.rank, job.iteration)  # type: ignore[union-attr]
        self._arena = StagingArena()  # the staging memory goes now, not when garbage collected
        return ended

    # ------------------------------------------------------------------ 1. settle

    def settle(self, skip: bool = False) -> bool:
        """Back-pressure before anything that needs the arena or a settled disk: wait for the
        async save in flight (bounded by the timeout) and finalize it (collective). With
        ``skip``, return False on every rank instead of waiting if it is not done on some rank.
        A finalize running on another thread (the queue's on a helper thread) is waited for:
        it marks its save finalized before its exchanges, which this thread's next collective
        must not run beside (the two would pair across ranks)."""
        with self._finalizing:
            job = self._inflight
        if job is None or job.finalized:
            self._inflight = None
            return True
        group = self.ctx.group
        # A rank interrupted in that save's walk has nothing in flight and asks no one: the
        # others, told by the agreement, must not ask either (their calls would pair off).
        if skip and not self._interrupted_elsewhere(job) \
                and not all(group.exchange("save: previous done?", job.done.is_set)):
            return False
        self._wait(job)
        try:
            self._finalize_job(job)
        except RankInterruptedError as exc:  # that rank has nothing in flight to settle: the
            # failure is its request's to raise; here every rank goes on to the same exchange
            logger.error("rank %d: the async save of iteration %d failed: %s", self.ctx.rank,
                         job.iteration, exc)
        return True

    def finalize_over(self) -> None:
        """Return once no other thread is inside a finalize of this manager's save (one the
        queue runs on a helper thread): its exchanges run on the control group, and this
        thread's next one must not run beside them."""
        with self._finalizing:
            pass

    def _interrupted_elsewhere(self, job: SaveJob) -> bool:
        """Whether ``job``'s agreement heard that a rank was interrupted in its walk (waiting
        for the agreement as long as it may take: the same answer on every rank)."""
        job.agreed.wait(waitable(self.ctx.timeout * AGREEMENT_STEPS))
        return isinstance(job.agreed_error, RankInterruptedError)

    def _wait(self, job: SaveJob) -> None:
        """Wait for ``job``'s own thread as long as its agreement and the work agreed may
        take; CollectiveTimeoutError (the control group is then unusable) after that."""
        if not job.wait(self.ctx.timeout):
            err = CollectiveTimeoutError(
                f"the async save of iteration {job.iteration} did not finish within "
                f"{job.bound(self.ctx.timeout):g}s")
            self.ctx.group.mark_broken(err)  # the other ranks time out in finalize: so do we
            raise err

    # ------------------------------------------------------------------ 5. finalize

    def _finalize_job(self, job: SaveJob) -> None:
        """Finalize ``job`` once. The queue may call this after back-pressure already did: it
        then gets the same outcome (the same error on every rank if it failed), never a
        success for a save that failed. Unless the AsyncCallsQueue calls it after agreeing the
        call is done everywhere, other ranks may still be writing: the agreement then waits for
        them as long as their work may take."""
        # One finalize per save, whichever thread asks (the queue's on a helper thread and
        # back-pressure on the training thread): a second caller waits and gets its outcome.
        with self._finalizing:
            if job.finalized:
                if job.finalize_error is not None:
                    raise job.finalize_error
                return
            # Its own thread must be over, whoever calls (a queue whose waiter died early: its
            # staging memory would be restaged under the thread, and a late commit hold the
            # next save's bytes). The agreement's exchanges first, then the work it agreed on.
            self._wait(job)
            job.finalized = True
            if self._inflight is job:
                self._inflight = None
            try:
                with self.ctx.timed("finalize", job.iteration):
                    self._finalize(job, finalizing_agreed_calls())
            except BaseException as exc:
                job.finalize_error = exc
                raise

    def _finalize(self, job: SaveJob, done_everywhere: bool) -> None:
        """Agree whether the iteration is complete; then retention, or its removal."""
        ctx, iteration = self.ctx, job.iteration
        if isinstance(job.agreed_error, RankInterruptedError):
            raise job.agreed_error  # that rank has no save to finalize: see save()

        def report() -> dict[str, Any]:
            if job.agreed_error is not None:  # refused by the agreement: nothing was written
                raise job.agreed_error
            fault_point("after_commit", ctx.rank, iteration)
            if isinstance(job.error, Exception):
                raise job.error
            if job.error is not None:  # e.g. KeyboardInterrupt on the save's thread
                raise RuntimeError(f"the save's background work stopped: {job.error!r}")
            doc = self.retainer.report(ctx.inventory(also=iteration))
            if ctx.rank == 0 and self.persister is not None and self.persister.due_by_clock():
                doc["persist_due"] = True  # rank 0's clock decides for every rank
            return doc

        # Raises CollectiveError when no agreement was reached: then nothing is deleted. A rank
        # whose write and transfers ended early waits for the others' as long as their work
        # may take (SaveJob.wait_steps), unless the queue already agreed all are done.
        wait = None if done_everywhere else ctx.timeout * job.wait_steps
        outcome = ctx.group.gather_outcomes("save: finalize", report, wait=wait)
        if outcome.failures:
            refusal = job.agreed_error
            if refusal is not None and len(outcome.failures) == ctx.world_size and all(
                    tuple(f) == describe_failure(refusal) for f in outcome.failures.values()):
                raise refusal  # the agreement's own verdict, alike everywhere
            error: Exception = error_from_failures("save: finalize", outcome.failures)
        else:
            inventories = decode_inventories(outcome.values)  # type: ignore[arg-type]
            latest = choose_latest(inventories, ctx.world_size, ctx.erasure)
            unprotected = [] if ctx.erasure is None else missing_parity(
                ctx.erasure, holders_of(inventories, iteration, ctx.world_size))
            if latest == iteration and not unprotected:
                self.latest_iteration = iteration
                # replaced by this save: it counts again
                ctx.unloadable.pop((iteration, ctx.world_size), None)
                ctx.store.drain_recycled(job.started_ns)  # what this save did not write over
                self.retainer.retain(iteration, inventories, outcome.values)
                if self.persister is not None:
                    due = outcome.values[0]
                    self.persister.finalized(iteration, isinstance(due, dict)
                                             and due.get("persist_due") is True)
                return
            missing = [inv.rank for inv in inventories
                       if (iteration, inv.rank, ctx.world_size) not in inv.shards]
            error = IncompleteCheckpointError(
                f"save of iteration {iteration}: expected a shard from every rank, ranks "
                f"{missing} have none; the latest complete iteration is {latest}" if missing
                else f"save of iteration {iteration}: parity blocks (stripe, block) "
                f"{unprotected[:8]} were not committed; the latest complete iteration is "
                f"{latest}")
        # Every rank agreed the save failed: its shards here, replicas included, can go, if
        # this rank passed the agreement (which checked that no complete iteration has this
        # number: what it holds of it was written by this save). A deletion that fails is left
        # to the next save's retention: the agreed error is raised.
        if not job.passed_agreement or iteration <= self.latest_iteration:
            raise error from outcome.local_error
        for ref in ctx.store.committed():
            if ref.iteration == iteration and ref.world_size == ctx.world_size:
                try:
                    ctx.store.delete(ref)
                except OSError as exc:
                    logger.error("rank %d: removing %s of the failed save: %s", ctx.rank,
                                 ref.path, exc)
        raise error from outcome.local_error

