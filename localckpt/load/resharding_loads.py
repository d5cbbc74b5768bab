"""The resharding loads of a :class:`~localckpt.load.loader.LoadPath` (a mixin): the newest
complete iteration at any world size (``reshard=True``), and ``load(iteration=N)`` when N's
copies are not where a same-layout load can take them. Both list afresh and retry when a copy
fails its checks, as the same-world load falls back.
"""

from __future__ import annotations

import logging
from typing import Any

from ..control.context import Context
from ..control.coverage import Inventory, complete_iterations
from ..errors import (
    CorruptShardError,
    DurableTierUnavailableError,
    IncompleteCheckpointError,
    MixedSavesError,
    NoCheckpointError,
)
from ..gc_pause import gc_paused
from ..storage.durable import DurableStore
from ..storage.manifest import ShardManifest
from .mixed import resolve_mixed
from .rebuild import needs_rebuild, rebuild_lost
from .reshard import reshard_restore
from .restore import write_back_after
from .write_back import WriteBack

logger = logging.getLogger(__name__)

RESHARD_ATTEMPTS = 4  # a resharding load that met corrupt copies lists again this many times


class ReshardingLoads:
    """Resharding load methods of a load path; the load path provides the members below."""

    ctx: Context
    durable: DurableStore | None
    latest_iteration: int
    _listed: list[Inventory] | None
    _tier_unavailable: str | None
    _write_back: WriteBack | None

    def find_latest(self, durable: bool = True) -> int:
        raise NotImplementedError

    def _newer_from_durable(self, fallback: int, any_world: bool = False,
                            exclude: set[int] | frozenset[int] = frozenset()) -> int:
        raise NotImplementedError

    def _saved_by(self) -> int:
        raise NotImplementedError

    def _reshard_exactly(self, into: Any, iteration: int) -> tuple[ShardManifest, Any]:
        """``load(iteration=N)`` through the resharding path: a copy that failed its checks
        (quarantined) or a shard gone since the listing makes it list again and take another
        holder's copy, as the newest's load does; never another iteration. Raises on every
        rank alike: CorruptShardError naming the copies set aside once N is no longer
        complete, or after RESHARD_ATTEMPTS tries."""
        ctx = self.ctx
        failures: list[str] = []
        resolved = False
        attempt = 0
        while attempt < RESHARD_ATTEMPTS:
            inventories = ctx.gather_inventories(f"load of iteration {iteration}")
            if iteration not in complete_iterations(inventories, ctx.world_size, ctx.erasure):
                break  # only after a failure: restore() found it complete just before
            try:
                manifest, state = reshard_restore(ctx, iteration, ctx.world_size, inventories,
                                                  into)
            except MixedSavesError as exc:  # agreed: the covering save's copies, once
                why = "still mixed" if resolved else resolve_mixed(ctx, iteration)
                resolved = True
                if why is not None:
                    failures.append(f"{exc} ({why})")
                    break
                continue
            except (CorruptShardError, IncompleteCheckpointError) as exc:  # agreed
                attempt += 1
                failures.append(str(exc))
                continue
            self._write_back = write_back_after(ctx, iteration, inventories,
                                                manifest.metadata.get("save_id"))
            return manifest, state
        raise CorruptShardError(f"load: iteration {iteration} can no longer be loaded: "
                                + "; ".join(failures[-2:]))

    def _load_resharded(self, into: Any) -> tuple[ShardManifest, Any]:
        """The resharding load of the newest complete iteration (any world size with
        ``reshard``), listing afresh; a copy that failed its checks (quarantined) or a shard gone
        since the listing makes it list and plan again, at most RESHARD_ATTEMPTS times. At this
        world size the write-back of a replaced node starts after it."""
        ctx = self.ctx
        failures: list[str] = []
        failed_at = -1  # the newest iteration an attempt failed to load
        self._tier_unavailable = None
        fetched: set[int] = set()  # from the tier in this load: one failing again is given up
        resolved: set[tuple[int, int]] = set()  # iterations saved twice: stale copies set aside
        attempt = 0  # lists after a failure (a fallback past an unloadable iteration is none)
        while attempt < RESHARD_ATTEMPTS:
            if self._listed is None:  # the durable tier was consulted already, by load
                self.find_latest(durable=False)
                if self.durable is not None and self.latest_iteration < failed_at:
                    got = self._newer_from_durable(self.latest_iteration, any_world=True,
                                                   exclude=fetched)
                    if got >= 0:
                        fetched.add(got)
                        self.find_latest(durable=False)  # the tier's copy is the newest now
            listed, self._listed = self._listed, None
            if self.latest_iteration < 0 or listed is None:
                if failures and self._tier_unavailable:  # what it holds may still load
                    raise DurableTierUnavailableError(
                        f"load: no complete checkpoint is left in the local tiers (copies "
                        f"failed their checks: {failures[-1]}), and the durable tier "
                        f"{self.durable.root if self.durable else ''} could not deliver its "
                        f"newer ones: {self._tier_unavailable}. Do not start afresh: retry "
                        "once the store is back")
                if failures:  # not "nothing was saved": a job must not start afresh silently
                    raise CorruptShardError(
                        "load: no complete checkpoint is left to load: copies that failed their "
                        "checks were quarantined (or gone since the listing): "
                        + "; ".join(failures[-2:]))
                raise NoCheckpointError(f"load: no complete checkpoint of session "
                                        f"{ctx.session_id!r} is left to load")
            old_world = self._saved_by()
            if old_world == ctx.world_size and needs_rebuild(ctx, self.latest_iteration, listed):
                # erasure coding: its lost shards first, on their owners' nodes; list again
                outcome = rebuild_lost(ctx, self.latest_iteration, listed)
                if outcome.unusable:  # agreed: left out from now on, as the plain load does
                    key = (self.latest_iteration, old_world)
                    ctx.unloadable[key] = outcome.unusable
                    failures.append(f"iteration {key[0]}: {outcome.unusable}")
                    failed_at = max(failed_at, self.latest_iteration)
                    if ctx.rank == 0:
                        logger.warning("load: iteration %d: its lost shards cannot be rebuilt "
                                       "(%s); falling back to an older iteration", key[0],
                                       outcome.unusable)
                    continue  # not an attempt, as a fallback past mixed saves
                attempt += 1
                if outcome.retry and attempt == RESHARD_ATTEMPTS:  # agreed
                    raise CorruptShardError(
                        f"load of iteration {self.latest_iteration}: its lost shards could not "
                        f"be rebuilt: {outcome.retry}")
                continue
            try:
                with ctx.timed("load", self.latest_iteration) as box, gc_paused():
                    manifest, state = reshard_restore(ctx, self.latest_iteration,
                                                      old_world, listed, into)
                    box["nbytes"] = manifest.data_nbytes
            except MixedSavesError as exc:  # the same on every rank
                key = (self.latest_iteration, old_world)
                # as the plain load does: the newest save, when it covers every old rank, is
                # loaded (its stale copies set aside); else the iteration is left out from now
                # on. Neither counts as an attempt: each happens once per iteration.
                why = "still mixed after its stale copies were set aside" if key in resolved \
                    else resolve_mixed(ctx, *key)
                resolved.add(key)
                if why is None:
                    continue
                ctx.unloadable[key] = f"{exc} ({why})"
                failures.append(str(exc))
                failed_at = max(failed_at, self.latest_iteration)
                if ctx.rank == 0:
                    logger.warning("load: %s (%s); falling back to an older iteration", exc,
                                   why)
                continue
            except (CorruptShardError, IncompleteCheckpointError) as exc:  # agreed; list again
                attempt += 1
                if attempt == RESHARD_ATTEMPTS:
                    raise
                failures.append(str(exc))
                failed_at = max(failed_at, self.latest_iteration)
                continue
            if old_world == ctx.world_size:  # a replaced node gets its copies back
                self._write_back = write_back_after(ctx, manifest.iteration, listed,
                                                    manifest.metadata.get("save_id"))
            elif ctx.rank == 0:
                logger.info("load: iteration %d was saved by %d ranks; resharded onto %d",
                            manifest.iteration, old_world, ctx.world_size)
            self.latest_iteration = manifest.iteration
            return manifest, state
        # the last attempt rebuilt an erasure-coded iteration's lost shards: not loaded yet
        raise CorruptShardError(f"load: gave up after {RESHARD_ATTEMPTS} attempts to list and "
                                f"load a complete iteration: " + "; ".join(failures[-2:]))
