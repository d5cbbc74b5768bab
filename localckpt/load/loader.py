"""Loads of one manager: ``find_latest``, ``iterations`` and ``load``, and the write-back a load
leaves running. Called from the training thread only; every method but
:meth:`LoadPath.wait_for_write_back` is collective (see :class:`localckpt.LocalCheckpointManager`
for the contracts users rely on).

The newest complete iteration is shared with the save path (a finalized save sets it):
:class:`~localckpt.save.saver.SavePath` holds it, and this object reads and sets it there.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from ..control.context import Context
from ..control.coverage import (
    Inventory,
    choose_latest_any_world,
    complete_iterations,
    job_unfinished,
)
from ..errors import (
    ConfigurationError,
    DurableTierUnavailableError,
    InvalidIterationError,
    LayoutMismatchError,
    NoCheckpointError,
)
from ..gc_pause import gc_paused
from ..ops.metrics import PhaseMetric
from ..save.saver import SavePath
from ..storage.durable import DurableStore
from ..storage.manifest import ShardManifest
from ..storage.rollback_fence import hidden
from .from_durable import durable_candidates, fetch_from_durable
from .resharding_loads import ReshardingLoads
from .restore import find_latest, restore
from .rollback import discard_newer
from .write_back import WriteBack

logger = logging.getLogger(__name__)


class LoadPath(ReshardingLoads):
    """The load side of a manager: what ``find_latest`` found (for the load that follows), the
    last load's write-back, and the shards already warned about."""

    def __init__(self, ctx: Context, save: SavePath, reshard: bool,
                 job_identity: dict[str, Any]) -> None:
        self.ctx, self._save, self.reshard = ctx, save, reshard
        self._job_identity = job_identity
        self._listed: list[Inventory] | None = None  # find_latest's, for the load that follows
        self._found = (-1, ctx.world_size)  # find_latest's (iteration, world size it was saved at)
        self._write_back: WriteBack | None = None  # the last load's, until waited for
        self._warned_foreign: set[int] = set()
        # why the durable tier could not deliver the newer iteration a load last asked it for
        self._tier_unavailable: str | None = None
        self.durable: DurableStore | None = None
        self._local_found: tuple[int, int] = (-1, ctx.world_size)  # the local tiers' newest
        # find_latest's: durable (iteration, world size) newer than the local tiers cover,
        # newest first, and the newest the local tiers cover (the fallback)
        self._durable_candidates: list[tuple[int, int]] = []
        self._local_latest = -1

    @property
    def latest_iteration(self) -> int:
        return self._save.latest_iteration

    @latest_iteration.setter
    def latest_iteration(self, iteration: int) -> None:
        self._save.latest_iteration = iteration

    def forget_listing(self) -> None:
        """The disk is about to change (a save): a load must list again, and what the durable
        tier offered is no longer newer than what the job holds."""
        self._listed = None
        self._durable_candidates = []

    def settle(self) -> None:
        """Before anything that reads the disk: the write-back is over and the async save in
        flight finalized."""
        self.wait_for_write_back()
        self._save.settle()

    def find_latest(self, durable: bool = True) -> int:
        """See :meth:`LocalCheckpointManager.find_latest`. ``durable=False``: the local tiers
        only (a load listing again after its durable step was decided)."""
        self.settle()
        ctx = self.ctx
        with ctx.timed("find_latest", -1) as box, gc_paused():
            self.latest_iteration, world, self._listed = find_latest(ctx, self.reshard)
            ctx.note_rollbacks_done(self._listed)  # before a load writes here
            self._found = (self.latest_iteration, world)
            self._local_latest, self._durable_candidates = self.latest_iteration, []
            self._local_found = self._found
            if self.durable is not None and durable:  # newer than any local one (any world
                # size with reshard)
                # a rollback a failure interrupted hides the tier's newer iterations too
                # (until a root finished it: it discarded them there)
                fence = job_unfinished(self._listed)
                self._durable_candidates = [
                    c for c in durable_candidates(ctx, self.durable, self.latest_iteration,
                                                  self.reshard)
                    if not hidden(fence, *c)]
                if self._durable_candidates:
                    self._found = self._durable_candidates[0]
                    self.latest_iteration = self._found[0]
            box["iteration"] = self.latest_iteration
        if self.latest_iteration >= 0 and world == ctx.world_size:
            # Parsed once: load finds it in the store's manifest cache.
            ref = ctx.store.ref(self.latest_iteration, ctx.rank, ctx.world_size)
            with contextlib.suppress(Exception), gc_paused():  # load verifies; this only looks
                self._warn_if_foreign(ctx.store.read_manifest(ref))
        return self.latest_iteration

    def iterations(self) -> list[int]:
        """See :meth:`LocalCheckpointManager.iterations`."""
        self.settle()
        inventories = self.ctx.gather_inventories("iterations")
        return sorted(complete_iterations(inventories, self.ctx.world_size, self.ctx.erasure))

    def metadata(self, iteration: Any) -> dict[str, Any]:
        """See :meth:`LocalCheckpointManager.metadata`."""
        self._settle_keeping(iteration)
        ctx = self.ctx

        def check() -> int:
            if type(iteration) is not int or iteration < 0:  # every rank's error
                raise InvalidIterationError(f"metadata: iteration: expected a non-negative "
                                            f"int, got {type(iteration).__name__} {iteration!r}")
            return iteration

        def mine() -> dict[str, Any] | None:
            for ref in ctx.store.committed():
                if ref.iteration == iteration and ref.world_size == ctx.world_size:
                    with contextlib.suppress(Exception):  # another copy, or a peer's, may do
                        return {"m": ctx.store.read_manifest(ref).metadata}
            return None

        # The iteration is an argument checked alike on every rank, not part of the step's
        # name: ranks asking about different ones get a ConfigurationError, not a broken group.
        with ctx.group.arguments("metadata (iteration)", check):
            seen_by_rank = ctx.group.exchange("metadata", mine)
        for seen in seen_by_rank:
            if seen is not None:
                meta = seen["m"]
                return {"iteration": iteration, "custom": meta.get("custom"),
                        "metrics": meta.get("metrics"), "saved_unix": meta.get("saved_unix")}
        raise NoCheckpointError(f"metadata: no rank holds a readable shard of iteration "
                                f"{iteration} (session {ctx.session_id!r}, world size "
                                f"{ctx.world_size})")

    def _settle_keeping(self, iteration: Any) -> None:
        """settle(), ``iteration`` (when one is asked for) kept by the retention of the save
        finalized there: its keep policy may otherwise delete the very iteration asked for."""
        holding = self._save.retainer.holding
        target = {iteration} if type(iteration) is int and iteration >= 0 else set()
        holding |= target
        try:
            self.settle()
        finally:
            holding -= target

    def load(self, into: Any, iteration: int | None,
             discard_newer: bool = False) -> tuple[ShardManifest, Any]:
        """See :meth:`LocalCheckpointManager.load`. Returns the manifest of the shard loaded (its
        iteration) and the state."""
        def check() -> list[Any]:
            if type(discard_newer) is not bool or (discard_newer and iteration is None):
                raise ConfigurationError(
                    f"load: discard_newer: expected a bool, and an iteration with it, got "
                    f"discard_newer={discard_newer!r}, iteration={iteration!r}")
            if iteration is not None and (type(iteration) is not int or iteration < 0):
                raise InvalidIterationError(
                    f"load: iteration: expected None or a non-negative int, got {iteration!r}")
            return [iteration, discard_newer]

        # An async save in flight is finalized first, on every rank (its own agreement), so
        # that the arguments ride on a load's step. They are checked with its first exchange,
        # whichever it is: a bad argument on one rank, or a rollback on some ranks only, is one
        # error on every rank, before anything is deleted or returned.
        # A rollback's target is kept by the retention of the save finalized here.
        self._settle_keeping(iteration)
        with self.ctx.group.arguments("load (iteration, discard_newer)", check):
            return self._load(into, iteration, discard_newer)

    def _load(self, into: Any, iteration: int | None,
              discard_newer: bool) -> tuple[ShardManifest, Any]:
        if iteration is not None:
            manifest, state = self._load_exactly(into, iteration)
            if discard_newer:
                self._discard_newer(iteration)
            return manifest, state
        if self.latest_iteration < 0:
            self.find_latest()
        if self._durable_candidates:  # newer than the local tiers: copied here first
            assert self.durable is not None
            fetched, world, unavailable = fetch_from_durable(self.ctx, self.durable,
                                                             self._durable_candidates)
            self._durable_candidates, self._listed = [], None
            self.latest_iteration = fetched if fetched >= 0 else self._local_latest
            self._found = (fetched, world) if fetched >= 0 else self._local_found
            if fetched < 0 and self.latest_iteration < 0 and unavailable:
                raise DurableTierUnavailableError(  # what it holds may still load later
                    f"load: no complete checkpoint in the local tiers, and the durable tier "
                    f"{self.durable.root} holds newer ones it could not deliver: "
                    f"{unavailable}. Do not start afresh: retry once the store is back")
            if fetched < 0 and self.latest_iteration < 0:
                raise NoCheckpointError(
                    f"load: no complete checkpoint in the local tiers, and none the durable "
                    f"tier {self.durable.root} could restore (session {self.ctx.session_id!r}, "
                    f"world size {self.ctx.world_size})")
            if fetched < 0 and unavailable:
                logger.error("load: the durable tier %s could not deliver its newer "
                             "iterations (%s); loading iteration %d of the local tiers",
                             self.durable.root, unavailable, self.latest_iteration)
        if self._saved_by() != self.ctx.world_size:  # another world size (reshard=True)
            return self._load_resharded(into)
        listed, self._listed = self._listed, None
        try:
            with self.ctx.timed("load", self.latest_iteration) as box, gc_paused():
                manifest, state, self._write_back = restore(
                    self.ctx, self.latest_iteration, self._fetched, listed, into,
                    elsewhere=self._elsewhere if self.durable is not None or self.reshard
                    else None)
                box["nbytes"], box["iteration"] = manifest.data_nbytes, manifest.iteration
        except LayoutMismatchError:  # agreed: another mesh, or replicas another member stored
            return self._load_resharded(into)
        self.latest_iteration = manifest.iteration
        self._warn_if_foreign(manifest)
        return manifest, state

    def _elsewhere(self, fallback: int) -> int:
        """``restore``'s ``elsewhere`` (see :meth:`_newer_from_durable`), which also looks at
        the other world sizes with ``reshard``: an iteration of one of them newer than
        ``fallback`` raises LayoutMismatchError (agreed: every rank decides from the same
        gathered listings), and the load goes on through resharding, which loads the newest of
        any world size. Collective."""
        if self.durable is not None:
            got = self._newer_from_durable(fallback)
            if got >= 0:
                return got
        if self.reshard:
            ctx = self.ctx
            newest, world = choose_latest_any_world(
                ctx.gather_inventories("load: newer iterations of other world sizes"),
                ctx.world_size, ctx.erasure)
            if newest > fallback and world != ctx.world_size:
                raise LayoutMismatchError(
                    f"load: iteration {newest}, saved by {world} ranks, is newer than {fallback}, "
                    f"the newest loadable one of this world size: it is loaded through "
                    f"resharding")
        return -1

    def _newer_from_durable(self, fallback: int, any_world: bool = False,
                            exclude: set[int] | frozenset[int] = frozenset()) -> int:
        """``restore``'s ``elsewhere``: its newest local iteration turned out unusable (corrupt
        in every node root, not rebuildable) and it would fall back to ``fallback``; the
        newest iteration of this world size (of any, ``any_world``: a resharding load) the
        durable tier holds newer than that (and not in ``exclude``), copied into the node roots
        (the newest checkpoint is not given up while an intact copy of it exists), or -1.
        Collective; every rank takes the same path (the verdicts are agreed)."""
        ctx = self.ctx
        assert self.durable is not None
        fence = job_unfinished(ctx.gather_inventories("load: a rollback's fence"))
        candidates = [c for c in durable_candidates(ctx, self.durable, fallback, any_world)
                      if c[0] not in exclude  # fetched already by this load: failed again
                      and not hidden(fence, *c)]
        if not candidates:
            return -1
        fetched, world, unavailable = fetch_from_durable(ctx, self.durable, candidates)
        self._tier_unavailable = unavailable if fetched < 0 else None
        if fetched < 0:
            logger.error("rank %d: load: the local copies of iterations newer than %d are "
                         "unusable and the durable tier %s could not deliver them (%s); "
                         "loading iteration %d", ctx.rank, fallback, self.durable.root,
                         unavailable or "no intact copy", fallback)
            return -1
        # An iteration this process found unusable (copies of two saves, a lost shard that
        # could not be rebuilt) is whole again: the tier's copy of one save replaced them.
        ctx.unloadable.pop((fetched, world), None)
        logger.warning("rank %d: load: the local copies of iterations newer than %d are "
                       "unusable; iteration %d was copied from the durable tier %s",
                       ctx.rank, fallback, fetched, self.durable.root)
        return fetched

    def _load_exactly(self, into: Any, iteration: int) -> tuple[ShardManifest, Any]:
        """``load(iteration=N)``: that iteration at this world size, or an error; never another
        one (a corrupt copy is replaced by another holder's, as for the newest)."""
        self._listed = None
        with self.ctx.timed("load", iteration) as box, gc_paused():
            try:
                manifest, state, self._write_back = restore(
                    self.ctx, iteration, self._fetched, None, into, exact=True)
            except LayoutMismatchError:  # agreed: onto another mesh, or replicas elsewhere
                manifest, state = self._reshard_exactly(into, iteration)
            box["nbytes"], box["iteration"] = manifest.data_nbytes, manifest.iteration
        self._warn_if_foreign(manifest)
        return manifest, state

    def _discard_newer(self, iteration: int) -> None:
        """After a rollback to ``iteration`` (every rank loaded it): delete this root's shards
        of newer iterations of this world size (of every world size with ``reshard``: the
        job's lineage), so saves go on from there. Each root's ranks
        delete alike (a rename only one wins); a shard left by a failure only makes its
        iteration incomplete, which retention removes."""
        ctx = self.ctx
        # It may still be writing the rolled-back iteration's copies; and a write-back that
        # failed on one rank must stop every rank's deletions, not that rank's alone.
        # (its bound read once it is over: it grows once its thread counted the pieces)
        bound = self._write_back.bound if self._write_back is not None else None
        ctx.group.exchange(f"rollback to {iteration}: write-back over",
                           self.wait_for_write_back, wait=bound)
        discard_newer(ctx, iteration, None if self.reshard else ctx.world_size, self.durable,
                      self._save.persister)
        self._listed = None
        self.latest_iteration = iteration

    def _fetched(self, seconds: float, nbytes: int) -> None:
        ctx = self.ctx
        ctx.metrics.emit(PhaseMetric("fetch_from_peer", ctx.rank, self.latest_iteration,
                                     seconds, nbytes, ctx.session_id, time.time()))

    def _saved_by(self) -> int:
        """The world size of the job that saved ``latest_iteration``: find_latest's answer while
        it still names that iteration, else this job's (a save of this job set it)."""
        iteration, world = self._found
        return world if iteration == self.latest_iteration else self.ctx.world_size

    def stop_write_back(self, seconds: float) -> bool:
        """After the write-back overran its bound: stop it (see WriteBack.stop); whether its
        thread ended within ``seconds`` (True when there is none)."""
        return self._write_back is None or self._write_back.stop(seconds)

    def wait_for_write_back(self) -> None:
        """See :meth:`LocalCheckpointManager.wait_for_write_back`. Not collective."""
        if self._write_back is not None:
            self._write_back.wait()  # raises: kept, to be waited for again (close)
            self._write_back = None

    def _warn_if_foreign(self, manifest: ShardManifest) -> None:
        """Warn (once per iteration) when a shard was written by another session or by a job
        laid out on other nodes: expected after a node was replaced, worth a look otherwise
        (data-loader and RNG states belong to the rank that wrote them)."""
        if manifest.iteration in self._warned_foreign:
            return
        job = manifest.identity.get("job")
        problems = []
        if manifest.session_id != self.ctx.session_id:
            problems.append(f"session {manifest.session_id!r}, this job's is "
                            f"{self.ctx.session_id!r}")
        if isinstance(job, dict) and job != self._job_identity:
            problems.append(f"topology {job}, this job's is {self._job_identity}")
        if problems:
            self._warned_foreign.add(manifest.iteration)
            logger.warning("rank %d: shard of iteration %d (owner %d) was written by a different "
                           "job: %s", self.ctx.rank, manifest.iteration, manifest.owner_rank,
                           "; ".join(problems))
