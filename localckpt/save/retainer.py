"""Retention after a finalized save: what every rank reports for it (the metadata of the
iterations it holds, what the keep predicate keeps), and the deletion of what the agreed keep
set leaves out. Called from the training thread by the save's finalize; deletions run on the
store's reaper thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ..control.context import Context
from ..control.coverage import (
    Inventory,
    lineage_keeps,
    merge_metadata,
    retained_iterations,
    shards_to_delete,
)
from ..control.retention import KeepPolicy
from ..ops.faults import fault_point

logger = logging.getLogger(__name__)


class Retainer:
    """A manager's keep policy, and the metadata of the shards its rank read (a committed
    shard's never changes)."""

    def __init__(self, ctx: Context, policy: KeepPolicy) -> None:
        self.ctx, self.policy = ctx, policy
        # by (iteration, owner, the manifest file's inode, mtime and size)
        self._cache: dict[tuple[int, int, int, int, int], dict[str, Any]] = {}
        # Iterations this rank must keep for now (a persist to the durable tier copies them):
        # reported, and kept by every rank (the node roots they share hold them too).
        self.pinned: Callable[[], set[int]] = set
        # Iterations a call of this rank is about to load (a rollback's target, while the
        # async save in flight is finalized first): kept alike.
        self.holding: set[int] = set()
        self.any_world = False  # reshard=True: other world sizes' shards are this job's lineage

    def report(self, inventory: Inventory) -> dict[str, Any]:
        """This rank's ``inventory`` as the finalize sends it, with what the policy needs from
        every rank: the metadata of the iterations this rank holds, the predicate's keeps."""
        doc = inventory.to_json()
        if self.policy.needs_metadata:
            doc["metadata"] = self._known_metadata()
        if self.policy.predicate is not None:
            held = {k[0] for k in inventory.shards if k[2] == self.ctx.world_size}
            doc["predicate_keeps"] = self._predicate_keeps(held, doc.get("metadata", {}))
        pinned = self.pinned() | self.holding
        if pinned:
            doc["pinned"] = sorted(pinned)
        return doc

    def retain(self, iteration: int, inventories: list[Any], reports: Sequence[Any]) -> None:
        """Delete what the policy no longer keeps, decided from every rank's ``reports`` (the
        same on every rank). Never raises: the save is finalized on every rank, and what is
        left is retried after the next save."""
        self._retain(iteration, inventories, merge_metadata(reports),
                     {int(it) for v in reports if isinstance(v, dict)
                      for it in (*v.get("predicate_keeps", ()), *v.get("pinned", ()))})

    def _known_metadata(self) -> dict[str, Any]:
        """The metadata (metrics, save time) of each iteration of this world size this rank
        holds a shard of (from its manifest: rank 0's, in every shard), for keep policies by
        metric or time."""
        ctx, out = self.ctx, {}
        committed = [r for r in ctx.store.committed() if r.world_size == ctx.world_size]
        # A committed shard's metadata never changes, but one iteration number may be saved
        # again (after a rollback, or a failed save): keyed by the manifest file itself.
        keys = {}
        for ref in committed:
            with contextlib.suppress(OSError):  # gone since the listing: says nothing
                st = os.stat(ref.path / "zarr.json")
                keys[ref] = (ref.iteration, ref.owner_rank, st.st_ino, st.st_mtime_ns,
                             st.st_size)
        cache = self._cache
        for key in set(cache) - set(keys.values()):
            del cache[key]
        for ref in committed:
            if str(ref.iteration) in out or ref not in keys:
                continue
            key = keys[ref]
            if key not in cache:
                try:
                    cache[key] = ctx.store.read_manifest(ref).metadata
                except Exception:  # a corrupt copy says nothing; another rank's may
                    continue
            # only what the policy reads: custom metadata (up to 64 KiB an iteration) would
            # be all-gathered at every finalize, for every iteration held
            wanted = {k: v for k, v in cache[key].items() if k in ("metrics", "saved_unix")}
            if wanted:
                out[str(ref.iteration)] = wanted
        return out

    def _predicate_keeps(self, held: set[int], metadata: dict[str, Any]) -> list[int]:
        """The iterations of this rank's root the keep predicate keeps, asked here (with the
        metrics this rank knows; an error keeps the iteration): every rank keeps what any
        rank's predicate keeps, so ranks whose predicates answer differently delete alike."""
        ctx, predicate, out = self.ctx, self.policy.predicate, []
        assert predicate is not None
        for it in sorted(held):
            values = metadata.get(str(it)) or {}
            try:
                keep = bool(predicate(it, values.get("metrics")))
            except Exception:
                logger.exception("rank %d: keep_predicate failed for iteration %d: kept",
                                 ctx.rank, it)
                keep = True
            if keep:
                out.append(it)
        return out

    def _retain(self, iteration: int, inventories: list[Any],
                metadata: dict[int, Any] | None = None,
                predicate_keeps: set[int] | None = None) -> None:
        """Delete what retention no longer keeps, on the reaper thread. Never raises: the save
        is finalized on every rank, and what is left is retried after the next save."""
        ctx = self.ctx
        try:
            fault_point("finalize", ctx.rank, iteration)
            policy = replace(self.policy, predicate=None)  # its answers are every rank's, below
            keep = retained_iterations(inventories, ctx.world_size, policy, metadata,
                                       ctx.erasure)
            keep |= predicate_keeps or set()
            lineage = lineage_keeps(inventories, ctx.world_size, self.policy) \
                if self.any_world else None
            for it, owner, world in shards_to_delete(inventories[ctx.rank], keep,
                                                     ctx.world_size, lineage):
                try:  # one shard that cannot go (EBUSY, EACCES) must not keep the others
                    ctx.store.delete(ctx.store.ref(it, owner, world), background=True)
                except Exception:
                    logger.exception("rank %d: deleting shard (iteration %d, owner %d, world "
                                     "%d) failed; retried after the next save", ctx.rank, it,
                                     owner, world)
            ctx.store.remove_leftovers(background=True)
        except Exception:
            logger.exception("rank %d: retention after a finalized save failed; it is retried "
                             "after the next save", ctx.rank)
