"""The save path of one manager, top to bottom:

1. **settle** the async save still in flight (back-pressure: its arena is about to be reused);
2. **prepare**, one agreed step: flatten the state dict, copy its tensors into the staging arena,
   build the manifest, and gather every rank's request (iteration, inventory, bytes needed, free
   space). Whatever fails on one rank, in staging too, fails the save on every rank alike; then
   the pure checks (iteration, capacity) run on the same gathered input everywhere;
3. **run** the :class:`~localckpt.save.job.SaveJob`: write the shard and replicate it, now or on
   the AsyncCallsQueue's thread;
4. **finalize**, one agreed step: every rank reports its write and its inventory. The iteration is
   removed only when every rank *agreed* it failed; when the ranks could not agree (a peer died,
   the group was closed) nothing is deleted, and a complete iteration is found by the next
   ``find_latest``. Then retention, which never fails a finalized save.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from functools import partial
from typing import Any

from replication import save_plan

from ..control.context import Context
from ..control.coverage import (
    check_capacity,
    choose_latest,
    decode_inventories,
    validate_save,
)
from ..control.retention import KeepPolicy
from ..errors import (
    CollectiveTimeoutError,
    ConfigurationError,
    CorruptShardError,
    IncompleteCheckpointError,
    InsufficientSpaceError,
    error_from_failures,
)
from ..gc_pause import gc_paused
from ..hollow import uses_extended
from ..ops.faults import fault_point
from ..state_dict import BasicTensorAwareStateDict, as_tensor_aware
from ..storage.manifest import (
    ShardManifest,
    TensorEntry,
    check_hollow,
    dtype_name,
    writer_identity,
)
from ..storage.peer_io import piece_count
from ..storage.store import bytes_needed, chunking
from .async_calls import AsyncRequest, finalizing_agreed_calls
from .dedupe import Deduped, dedupe, missing_replicas
from .job import SaveJob, wait_for_save
from .metadata import iteration_metadata, wall_clock
from .retainer import Retainer
from .staging import StagingArena, plan_layout

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
        self.any_world = False  # reshard=True: a save must be newer than any world's latest
        self.dedupe_replicated = True
        self._checked_replicas: list[int] | None = None  # every rank's digest, last checked

    def save(self, state_dict: Any, iteration: Any, is_async: bool, custom_metadata: Any = None,
             metrics: Any = None) -> AsyncRequest | None:
        """See :meth:`LocalCheckpointManager.save`. Collective."""
        ctx = self.ctx
        with ctx.timed("stall", iteration) as box, gc_paused():
            if not self.settle(skip=is_async and self.busy == "skip"):
                logger.info("rank %d: skipping save of iteration %s: the previous one is still "
                            "in flight", ctx.rank, iteration)
                return None
            job = self._prepare(state_dict, iteration, custom_metadata, metrics)
            box["nbytes"] = job.manifest.data_nbytes
            if not is_async:
                job.run(ctx)
                self._finalize_job(job)
                return None
        self._inflight = job
        try:
            job.start(ctx)
        except BaseException as exc:  # no thread: the failure is the finalize's, agreed
            job.error = exc
            job.done.set()
        return AsyncRequest(wait_for_save, (job.done,),
                            finalize_fns=(partial(self._finalize_job, job),))

    def reserve(self, state_dict: Any) -> int:
        """Size and pre-fault the staging arena for saves of ``state_dict`` (and, recycling
        files, put the chunk files of its shard and of the replicas it receives in the pool);
        returns the bytes one such save stages. Not collective. A save in flight keeps its own
        buffer alive."""
        tasd = as_tensor_aware(state_dict)
        tensors = dedupe(tasd, self.dedupe_replicated).tensors
        chunk_nbytes, chunk_count = chunking(plan_layout(tensors).nbytes,
                                             self.ctx.store.chunk_nbytes)
        nbytes = chunk_nbytes * chunk_count
        self._arena.reserve(nbytes)
        files = self.ctx.store.files
        if files is not None:
            held = sum(self.ctx.rank in h for h in self.ctx.placement.holders)
            files.preallocate(chunk_count * (1 + held), chunk_nbytes + 4)
        return nbytes

    def close(self) -> None:
        """Wait (up to the timeout) for the local work of a save in flight: its shard is then
        committed, to be finalized through the AsyncCallsQueue or found by the next job."""
        job = self._inflight
        if job is not None and not job.done.wait(self.ctx.timeout):
            logger.error("rank %d: async save of iteration %d still running at close",
                         self.ctx.rank, job.iteration)
        self._arena = StagingArena()  # the staging memory goes now, not when garbage collected

    # ------------------------------------------------------------------ 1. settle

    def settle(self, skip: bool = False) -> bool:
        """Back-pressure before anything that needs the arena or a settled disk: wait for the
        async save in flight (bounded by the timeout) and finalize it (collective). With
        ``skip``, return False on every rank instead of waiting if it is not done on some rank.
        """
        job = self._inflight
        if job is None or job.finalized:
            self._inflight = None
            return True
        group = self.ctx.group
        if skip and not all(group.exchange("save: previous done?", job.done.is_set)):
            return False
        if not job.done.wait(self.ctx.timeout):
            err = CollectiveTimeoutError(
                f"the async save of iteration {job.iteration} did not finish within "
                f"{self.ctx.timeout:g}s")
            group.mark_broken(err)  # the other ranks time out in finalize: so do we, for good
            raise err
        self._finalize_job(job)
        return True

    # ------------------------------------------------------------------ 2. prepare

    def _prepare(self, state_dict: Any, iteration: Any, custom_metadata: Any = None,
                 metrics: Any = None) -> SaveJob:
        """Stage locally and gather every rank's request in one exchange, then decide."""
        ctx = self.ctx
        staged: dict[str, Any] = {}

        def stage() -> dict[str, Any]:
            meta = iteration_metadata(custom_metadata, metrics)  # checked before any staging
            meta["saved_unix"] = wall_clock()  # rank 0's is kept: keep_interval's clock
            tasd = as_tensor_aware(state_dict)
            deduped = dedupe(tasd, self.dedupe_replicated)
            staged["deduped"] = deduped
            layout = plan_layout(deduped.tensors)
            chunk_nbytes, chunk_count = chunking(layout.nbytes, ctx.store.chunk_nbytes)
            # The previous save's retention may still be deleting on the reaper thread: not
            # waited for here (it is the stall's largest part with keep_last=1), only when the
            # space it frees is needed (below).
            reaping = ctx.store.deletions_pending() or ctx.store.holds_recycled()
            ctx.store.remove_quarantined()  # corrupt copies a load set aside
            st = os.statvfs(ctx.root)
            fault_point("staging", ctx.rank, iteration)
            payload = self._arena.stage(deduped.tensors, layout, chunk_nbytes * chunk_count)
            names: dict[Any, str] = {}  # dtype and device -> str, computed once per save
            entries = tuple(
                TensorEntry(key_path=path, dtype=names.get(t.dtype) or names.setdefault(
                                t.dtype, dtype_name(t.dtype)),
                            shape=tuple(t.shape), offset=off, nbytes=size,
                            device=names.get(t.device) or names.setdefault(t.device,
                                                                           str(t.device)))
                for t, path, off, size in zip(deduped.tensors, tasd.key_paths, layout.offsets,
                                              layout.sizes, strict=True))
            hollow = deduped.hollow
            statefuls = tasd.statefuls if type(tasd) is BasicTensorAwareStateDict else None
            if statefuls is None:  # a user's implementation: refuse what no load could decode
                try:
                    check_hollow(hollow, len(entries), "hollow_structure()")
                except CorruptShardError as exc:
                    raise TypeError(str(exc)) from None
            # The lowest version that describes it: older readers read what they can, and
            # refuse (not misread) the rest. 2: DTensor and Stateful nodes; 3: replicas kept
            # by another rank; 4: numpy, Generator, dataclass and named tuple nodes.
            extended = tasd.extended if type(tasd) is BasicTensorAwareStateDict else \
                uses_extended(hollow)
            version = 4 if extended else 3 if deduped.expected else \
                2 if tasd.layouts or statefuls else 1
            staged["manifest"] = ShardManifest(
                session_id=ctx.session_id, iteration=iteration, owner_rank=ctx.rank,
                world_size=ctx.world_size, tensors=entries, hollow=hollow, format_version=version,
                container="basic" if tasd is state_dict else "plain",
                data_nbytes=layout.nbytes, chunk_nbytes=chunk_nbytes, chunk_count=chunk_count,
                chunk_crc32c=(), identity={**writer_identity(), "job": ctx.job_identity})
            staged["payload"] = payload
            return {"iteration": iteration if type(iteration) is int else repr(iteration),
                    "inventory": ctx.inventory().to_json(),
                    "nbytes": bytes_needed(256 * len(tasd.tensors) + 4096, chunk_nbytes,
                                           chunk_count),
                    "free": st.f_bavail * st.f_frsize, "reaping": reaping,
                    "chunks": chunk_count,
                    "pieces": piece_count(chunk_nbytes, chunk_count),
                    "replicas": deduped.digest, "meta": meta}

        gathered = ctx.group.exchange("save: stage and validate", stage)
        # Every rank reaches the same verdicts from the same gathered input.
        inventories = decode_inventories([g["inventory"] for g in gathered])
        validate_save([g["iteration"] for g in gathered], inventories, ctx.world_size,
                      self.any_world)
        self._check_replicas([int(g["replicas"]) for g in gathered], staged["deduped"])
        plan = save_plan(ctx.placement, ctx.topology, iteration)
        needed = [int(g["nbytes"]) for g in gathered]
        writes = list(needed)
        for t in plan.transfers:
            writes[t.dst] += needed[t.src]
        self._check_capacity(writes, gathered)
        # A rank writes its chunks, then takes part in the replica rounds, each as long as the
        # longest transfer in it: the bound of what a fast rank may wait for in finalize.
        pieces = [int(g["pieces"]) for g in gathered]
        steps = 2 + max(int(g["chunks"]) for g in gathered) + sum(
            max(pieces[t.src] for t in round_) for round_ in plan.rounds)
        manifest = staged["manifest"]
        if gathered[0]["meta"]:  # rank 0's, in every shard: one answer for metadata(iteration)
            manifest = replace(manifest, metadata=gathered[0]["meta"])
        return SaveJob(iteration, manifest, staged["payload"],
                       plan if plan.transfers else None, metrics=ctx.metrics,
                       wait_steps=steps)

    def _check_capacity(self, writes: list[int], gathered: list[dict[str, Any]]) -> None:
        """InsufficientSpaceError on every rank unless each node has room for what its ranks
        write. When space is short while some rank's reaper still deletes an older iteration
        or recycled files hold space, every rank (deciding alike from the gathered input) waits
        for its deletions, deletes the recycled files, and the free space is gathered again:
        one more exchange, only then. (Recycled files are not counted as free: a save may not
        take them all, and what it does not take is freed only after it.)"""
        node_of = self.ctx.topology.node_of
        try:
            check_capacity(writes, [int(g["free"]) for g in gathered], node_of)
        except InsufficientSpaceError:
            if not any(g["reaping"] for g in gathered):
                raise
            def free_after_deletions() -> int:
                self.ctx.store.wait_for_deletions()
                self.ctx.store.drain_all_recycled()
                st = os.statvfs(self.ctx.root)
                return st.f_bavail * st.f_frsize

            free = self.ctx.group.exchange("save: free space after retention",
                                           free_after_deletions)
            check_capacity(writes, [int(f) for f in free], node_of)

    def _check_replicas(self, digests: list[int], deduped: Deduped) -> None:
        """Every replicated shard a rank skipped is stored by the rank it named (see
        :mod:`localckpt.save.dedupe`), checked when some rank's replicated leaves changed since
        the last check: one more exchange then. ConfigurationError on every rank otherwise."""
        if not any(digests) or digests == self._checked_replicas:
            return
        def report() -> dict[str, Any]:
            return {"provided": deduped.provided,
                    "expected": {str(k): v for k, v in deduped.expected.items()}}

        reports = self.ctx.group.exchange("save: replicated shards", report)
        missing = missing_replicas([r["provided"] for r in reports],
                                   [r["expected"] for r in reports])
        if missing:
            raise ConfigurationError(
                "save: replicated DTensor shards would be stored by no rank: "
                f"{'; '.join(missing[:4])}. The members of a replica group must hold the same "
                "DTensor leaves; else LocalCheckpointManager(dedupe_replicated=False). Nothing "
                "was written")
        self._checked_replicas = digests

    # ------------------------------------------------------------------ 4. finalize

    def _finalize_job(self, job: SaveJob) -> None:
        """Finalize ``job`` once. The queue may call this after back-pressure already did: it
        then gets the same outcome (the same error on every rank if it failed), never a
        success for a save that failed. Unless the AsyncCallsQueue calls it after agreeing the
        call is done everywhere, other ranks may still be writing: the agreement then waits for
        them as long as their work may take."""
        if job.finalized:
            if job.finalize_error is not None:
                raise job.finalize_error
            return
        # Its own thread must be over, whoever calls (a queue whose waiter died early: its
        # staging memory would be restaged under the thread, and a late commit hold the next
        # save's bytes)
        if not job.done.wait(self.ctx.timeout * job.wait_steps):
            err = CollectiveTimeoutError(
                f"the async save of iteration {job.iteration} did not finish within "
                f"{self.ctx.timeout * job.wait_steps:g}s")
            self.ctx.group.mark_broken(err)
            raise err
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

        def report() -> dict[str, Any]:
            fault_point("after_commit", ctx.rank, iteration)
            if isinstance(job.error, Exception):
                raise job.error
            if job.error is not None:  # e.g. KeyboardInterrupt on the save's thread
                raise RuntimeError(f"the save's background work stopped: {job.error!r}")
            return self.retainer.report(ctx.inventory())

        # Raises CollectiveError when no agreement was reached: then nothing is deleted. A rank
        # whose write and transfers ended early waits for the others' as long as their work
        # may take (SaveJob.wait_steps), unless the queue already agreed all are done.
        wait = None if done_everywhere else ctx.timeout * job.wait_steps
        outcome = ctx.group.gather_outcomes("save: finalize", report, wait=wait)
        if outcome.failures:
            error: Exception = error_from_failures("save: finalize", outcome.failures)
        else:
            inventories = decode_inventories(outcome.values)  # type: ignore[arg-type]
            latest = choose_latest(inventories, ctx.world_size)
            if latest == iteration:
                self.latest_iteration = iteration
                ctx.store.drain_recycled(job.started_ns)  # what this save did not write over
                self.retainer.retain(iteration, inventories, outcome.values)
                return
            missing = [inv.rank for inv in inventories
                       if (iteration, inv.rank, ctx.world_size) not in inv.shards]
            error = IncompleteCheckpointError(
                f"save of iteration {iteration}: expected a shard from every rank, ranks "
                f"{missing} have none; the latest complete iteration is {latest}")
        # Every rank agreed the save failed: its shards here, replicas included, can go. A
        # deletion that fails is left to the next save's retention: the agreed error is raised.
        for ref in ctx.store.committed():
            if ref.iteration == iteration and ref.world_size == ctx.world_size:
                try:
                    ctx.store.delete(ref)
                except OSError as exc:
                    logger.error("rank %d: removing %s of the failed save: %s", ctx.rank,
                                 ref.path, exc)
        raise error from outcome.local_error

