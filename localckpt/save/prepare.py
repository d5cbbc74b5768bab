"""The two halves of preparing a save: staging (local) and the agreement (collective).

:func:`stage_shard` runs on the training thread: it flattens the state dict, copies its tensors
into the staging arena and builds the manifest. Nothing in it waits for another rank, lists the
root or deletes anything: it is the whole of an async save's stall.

:func:`agree_on_save` is the one agreed step before any byte is written: every rank's request
(iteration, inventory, bytes needed, free space, or its staging error) is gathered, and the pure
checks (iteration, capacity, replicated shards) run on the same gathered input everywhere, so
every rank reaches the same verdict. A synchronous save runs it on the training thread and the
manager's control group; an async save on the save's own thread and the data group, before it
writes (see :class:`localckpt.save.job.SaveJob`).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from replication import ExchangePlan, save_plan
from replication.erasure import StripeLayout
from replication.stripe_plans import parity_save_plan

from ..control.coverage import (
    check_capacity,
    decode_inventories,
    holders_of,
    job_fence,
    job_unfinished,
    validate_save,
)
from ..errors import (
    ConfigurationError,
    CorruptShardError,
    InsufficientSpaceError,
    UnsafeTypeError,
)
from ..hollow import format_nodes
from ..leaves import safe_types
from ..ops.faults import fault_point
from ..state_dict import BasicTensorAwareStateDict, as_tensor_aware
from ..storage.manifest import (
    COLUMNS_MIN_TENSORS,
    COLUMNS_VERSION,
    ShardManifest,
    TensorEntry,
    check_hollow,
    dtype_name,
    writer_identity,
)
from ..storage.peer_io import piece_count
from ..storage.rollback_fence import Fence, lowest
from ..storage.space import bytes_needed, chunking
from .dedupe import Deduped, dedupe, missing_replicas
from .early_copies import EagerCopies
from .metadata import iteration_metadata, wall_clock
from .staging import GATHER_MAX_NBYTES, PackedLayout, StagingArena, plan_layout

logger = logging.getLogger(__name__)

_new_entry = tuple.__new__

if TYPE_CHECKING:
    from ..control.collectives import CheckpointGroup
    from ..control.context import Context


@dataclass(frozen=True)
class StagedShard:
    """One rank's shard in the staging arena, before the agreement."""

    iteration: Any
    manifest: ShardManifest  # checksums not yet known; metadata set by the agreement
    payload: torch.Tensor  # the arena's bytes: must not be restaged before the save is done
    deduped: Deduped
    request: dict[str, Any]  # this rank's part of the agreement, without the listings


@dataclass(frozen=True)
class AgreedSave:
    """What every rank agreed on: write ``manifest`` from the payload, then ``plan``, then
    with erasure coding ``parity`` (the members' shards to their parity holders, who fold
    blocks over shards of ``sizes[r]`` packed bytes for rank r)."""

    manifest: ShardManifest
    plan: ExchangePlan | None
    wait_steps: int  # units of work the slowest rank may still have (SaveJob.wait_steps)
    parity: ExchangePlan | None = None
    sizes: tuple[int, ...] = ()


def stage_shard(ctx: Context, arena: StagingArena, state_dict: Any, iteration: Any,
                custom_metadata: Any, metrics: Any, dedupe_replicated: bool,
                loadable_types_only: bool = False) -> StagedShard:
    """Stage this rank's shard. Training thread; local; raises what the state dict or the
    metadata make impossible to save (TypeError, ValueError), or a staging fault; with
    ``loadable_types_only``, UnsafeTypeError for a dataclass, named tuple or enum type that is
    not registered (:func:`localckpt.add_safe_types`)."""
    meta = iteration_metadata(custom_metadata, metrics)  # checked before any staging
    meta["saved_unix"] = wall_clock()  # rank 0's is kept: keep_interval's clock
    meta["save_id"] = uuid.uuid4().hex  # rank 0's is kept: names this save's shards
    early = EagerCopies(arena)  # large tensors are copied as the walk meets them
    try:
        tasd = as_tensor_aware(state_dict, early.offer, early.stateful_met, GATHER_MAX_NBYTES)
        if loadable_types_only:
            _refuse_unloadable(getattr(tasd, "types", {}))
        deduped = dedupe(tasd, dedupe_replicated)  # drops none copied early (DTensor shards)
        layout = plan_layout(deduped.tensors, *early.placement(), paths=tasd.key_paths)
        chunk_nbytes, chunk_count = chunking(layout.nbytes, ctx.store.chunk_nbytes)
        fault_point("staging", ctx.rank, iteration)
        # The manifest is built while the copies from the GPU run; nothing returns before
        # they end.
        payload, settle = arena.stage_begin(deduped.tensors, layout, chunk_nbytes * chunk_count)
    except BaseException:
        early.abandon()
        raise
    try:
        manifest, request = _describe(ctx, tasd, deduped, layout, chunk_nbytes, chunk_count,
                                      iteration, meta, state_dict)
    finally:
        settle()
    return StagedShard(iteration, manifest, payload, deduped, request)


def _refuse_unloadable(types: dict[str, type]) -> None:
    refused = sorted(set(types) - set(safe_types()))
    if refused:
        raise UnsafeTypeError(
            f"save: the state dict holds objects of {refused}, which no load could build (a "
            "load builds only registered types): allow them first with "
            "localckpt.integrations.megatron.allow(...) or localckpt.add_safe_types(...)")


def _describe(ctx: Context, tasd: Any, deduped: Deduped, layout: PackedLayout, chunk_nbytes: int,
              chunk_count: int, iteration: Any, meta: dict[str, Any],
              state_dict: Any) -> tuple[ShardManifest, dict[str, Any]]:
    """The manifest of a staged shard and the request its save puts to the agreement."""
    names: dict[Any, str] = {}  # dtype and device -> str, computed once per save
    # tuple.__new__: TensorEntry(...) runs a Python __new__ per entry (10,000 tensors: 7.3 ->
    # 5.6 ms with the host tensors' device named without making a torch.device)
    entries = tuple([
        _new_entry(TensorEntry, (
            path, names.get(t.dtype) or names.setdefault(t.dtype, dtype_name(t.dtype)),
            tuple(t.shape), off, size,
            "cpu" if t.is_cpu else names.get(t.device) or names.setdefault(t.device,
                                                                           str(t.device))))
        for t, path, off, size in zip(deduped.tensors, tasd.key_paths, layout.offsets,
                                      layout.sizes, strict=True)])
    hollow = deduped.hollow
    # The lowest version that describes it: older readers read what they can, and refuse (not
    # misread) the rest. 2: DTensor and Stateful nodes; 3: replicas kept by another rank;
    # 4: numpy, Generator, dataclass and named tuple nodes; 6: a table of many tensors, in
    # columns (parsed in a third of the time).
    if type(tasd) is BasicTensorAwareStateDict:  # known from its walk (or, loaded, its tags)
        extended, stateful = tasd.extended, tasd.stateful_nodes
    else:
        extended, stateful = format_nodes(hollow)
    version = COLUMNS_VERSION if len(entries) >= COLUMNS_MIN_TENSORS else 4 if extended \
        else 3 if deduped.expected else 2 if tasd.layouts or stateful else 1
    manifest = ShardManifest(
        session_id=ctx.session_id, iteration=iteration, owner_rank=ctx.rank,
        world_size=ctx.world_size, tensors=entries, hollow=hollow, format_version=version,
        container="basic" if tasd is state_dict else "plain",
        data_nbytes=layout.nbytes, chunk_nbytes=chunk_nbytes, chunk_count=chunk_count,
        chunk_crc32c=(), identity={**writer_identity(), "job": ctx.job_identity})
    meta_nbytes = 256 * len(tasd.tensors) + 4096  # the manifest's room: generous
    request = {"iteration": iteration if type(iteration) is int else
               {"type": type(iteration).__name__, "repr": repr(iteration)},
               "nbytes": bytes_needed(meta_nbytes, chunk_nbytes, chunk_count),
               "meta_nbytes": meta_nbytes,
               "chunks": chunk_count, "pieces": piece_count(chunk_nbytes, chunk_count),
               "payload": chunk_nbytes * chunk_count,
               "replicas": deduped.digest, "meta": meta}
    return manifest, request


def bytes_written(gathered: list[dict[str, Any]], plan: ExchangePlan,
                  erasure: StripeLayout | None, chunk_nbytes: int) -> list[int]:
    """Disk bytes each rank's node root takes for a save (pure): its own shard, the replicas
    ``plan`` sends it, and with ``erasure`` the parity blocks it keeps. A block is as long as
    its stripe's longest shard, and its manifest holds every member's (a member's estimate:
    ``meta_nbytes`` of the gathered requests: 256 bytes a tensor, as for the shard itself)."""
    needed = [int(g["nbytes"]) for g in gathered]
    writes = list(needed)
    for t in plan.transfers:
        writes[t.dst] += needed[t.src]
    if erasure is not None:
        sizes = [int(g["payload"]) for g in gathered]
        for stripe in erasure.stripes:
            block = max(sizes[r] for r in stripe.members)
            manifests = 4096 + sum(int(gathered[r].get("meta_nbytes", 4096))
                                   for r in stripe.members)
            for holder in stripe.parity:
                writes[holder] += bytes_needed(manifests, *chunking(block, chunk_nbytes))
    return writes


def _check_loadable(m: ShardManifest) -> None:
    """TypeError unless every load can read ``m``'s structure back: what a load checks first
    (check_hollow), checked before anything is written (a structure it refuses, nested deeper
    than it reads or with a key it cannot rebuild, would be saved, then each healthy copy
    quarantined as corrupt by every load). In the agreement, off an async save's stall."""
    try:
        check_hollow(m.hollow, len(m.tensors), "save: the state dict", None, m.tensors,
                     m.format_version)
    except CorruptShardError as exc:
        raise TypeError(f"{exc}: no load could read it back") from None


class SaveAgreement:
    """The agreement of one manager's saves. ``any_world``: a save must be newer than any world
    size's latest (reshard=True). Remembers the replicated-shard digests last checked."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.any_world = False
        self._checked_replicas: list[int] | None = None
        # rank 0, with a durable tier: remove its iterations a rollback's fence hides
        self.discard_durable: Callable[[Fence], None] | None = None

    def agree(self, group: CheckpointGroup, staged: StagedShard | BaseException) -> AgreedSave:
        """Collective on ``group``. Raises on every rank alike the staging error of any rank
        (on a rank whose staging was interrupted, that KeyboardInterrupt or SystemExit; on
        the others RankInterruptedError), InvalidIterationError, InsufficientSpaceError or
        ConfigurationError (the agreed verdicts), or CollectiveError when no agreement was
        reached."""
        ctx = self.ctx

        def request() -> dict[str, Any]:
            if isinstance(staged, BaseException):
                raise staged
            _check_loadable(staged.manifest)
            # The previous save's retention may still be deleting on the reaper thread: not
            # waited for here, only when the space it frees is needed (_check_capacity).
            reaping = ctx.store.deletions_pending() or ctx.store.holds_recycled()
            ctx.store.remove_quarantined()  # corrupt copies a load set aside
            st = os.statvfs(ctx.root)
            inventory = ctx.inventory()
            # a rollback's fence: its shards are deleted before the write (_finish_rollback)
            reaping = reaping or inventory.fence is not None
            return {**staged.request, "inventory": inventory.to_json(),
                    "free": st.f_bavail * st.f_frsize, "reaping": reaping}

        gathered = group.exchange("save: stage and validate", request)
        assert not isinstance(staged, BaseException)  # the exchange raised it
        inventories = decode_inventories([g["inventory"] for g in gathered])
        fence = job_fence(inventories)
        if fence is not None:  # a rollback a failure interrupted: finished before any write
            self._finish_rollback(group, fence, job_unfinished(inventories))
        ctx.note_rollbacks_done(inventories)  # before this save writes here
        validate_save([g["iteration"] for g in gathered], inventories, ctx.world_size,
                      self.any_world, ctx.erasure)
        self._check_replicas(group, [int(g["replicas"]) for g in gathered], staged.deduped)
        plan = save_plan(ctx.placement, ctx.topology, staged.iteration)
        sizes = tuple(int(g["payload"]) for g in gathered)
        parity = None
        if ctx.erasure is not None:
            parity = parity_save_plan(ctx.erasure, staged.iteration)
        self._check_capacity(group, bytes_written(gathered, plan, ctx.erasure,
                                                  ctx.store.chunk_nbytes), gathered)
        it, world = staged.iteration, ctx.world_size
        if (it, world) in ctx.unloadable or holders_of(inventories, it, world):
            # agreed (the same inventories everywhere), and over before any rank writes
            group.exchange(f"save: the older copies of iteration {it} removed",
                           partial(self._remove_older_copies, it, plan))
        # A rank writes its chunks, then takes part in the replica (or parity) rounds, each as
        # long as the longest transfer in it: the bound of what a fast rank may wait for in
        # finalize.
        pieces = [int(g["pieces"]) for g in gathered]
        most_chunks = max(int(g["chunks"]) for g in gathered)
        steps = 2 + most_chunks + sum(
            max(pieces[t.src] for t in round_)
            for round_ in (*plan.rounds, *(parity.rounds if parity else ())))
        # Rank 0's, in every shard (one answer for metadata(iteration)), with the chunks of the
        # save's largest shard: how long a load waits for the slowest rank's read of its own.
        metadata = {**(gathered[0]["meta"] or staged.manifest.metadata),
                    "most_chunks": most_chunks}
        manifest = replace(staged.manifest, metadata=metadata)
        return AgreedSave(manifest, plan if plan.transfers else None, steps,
                          parity if parity is not None and parity.transfers else None, sizes)

    def _remove_older_copies(self, iteration: int, plan: ExchangePlan) -> None:
        """On this rank's node (its first rank), the copies of ``iteration`` this save will
        not replace: an older save of that number (a run resumed from an older iteration) left
        them, and beside this save's copies they could give every rank of a later job its own
        shard of the older save, which would then load (a load sees two saves only where the
        ranks' own copies differ). What is not removed is logged."""
        ctx = self.ctx
        node = ctx.topology.node_of[ctx.rank]
        members = ctx.topology.nodes[node]
        if members[0] != ctx.rank:
            return
        written = set(members) | {t.owner for t in plan.transfers
                                  if ctx.topology.node_of[t.dst] == node}
        for ref in ctx.store.committed():
            if ref.iteration == iteration and ref.world_size == ctx.world_size \
                    and ref.owner_rank >= 0 and ref.owner_rank not in written:
                try:
                    ctx.store.delete(ref, background=True)
                    logger.warning("rank %d: %s is a copy of an older save of iteration %d, "
                                   "which this save replaces: removed", ctx.rank, ref.path,
                                   iteration)
                except OSError as exc:
                    logger.warning("rank %d: %s, a copy of an older save of iteration %d, "
                                   "could not be removed (%s)", ctx.rank, ref.path, iteration,
                                   exc)

    def _finish_rollback(self, group: CheckpointGroup, fence: Fence,
                         durable: Fence | None) -> None:
        """Every root deletes what ``fence`` (the job's) hides, but on a root that finished
        the rollback (what it holds newer was saved after); rank 0 the durable tier's newer
        iterations, of the rollbacks no root finished (``durable``); then the fences go once
        every rank deleted, each root recording its rollbacks finished (a crash between
        leaves some fences: they still hide the rest). OSError on every rank naming what
        failed: the save is not written (its shards would be hidden by the fence, or land on
        a discarded one); the next save tries again."""
        ctx = self.ctx
        what = f"save: the rollback to iteration {lowest(fence)} is unfinished"

        def discard() -> list[str]:
            failed = ctx.store.discard_fenced(fence)
            if self.discard_durable is not None and ctx.rank == 0 and durable is not None:
                try:
                    self.discard_durable(durable)
                except Exception as exc:
                    failed.append(f"the durable tier: {exc}")
            return failed

        failed = [f for fs in group.exchange(f"{what}: discard", discard) for f in fs]
        if failed:
            raise OSError(f"{what}: {'; '.join(failed[:3])}; no save is written until those "
                          "are gone")
        group.exchange(f"{what}: lift the fences", ctx.store.lift_fence)
        logger.warning("rank %d: the rollback to iteration %d a failure interrupted is "
                       "finished", ctx.rank, lowest(fence))

    def _check_capacity(self, group: CheckpointGroup, writes: list[int],
                        gathered: list[dict[str, Any]]) -> None:
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
            store, root = self.ctx.store, self.ctx.root

            def free_after_deletions() -> int:  # within half the timeout the others wait
                deadline = time.monotonic() + self.ctx.timeout / 2
                store.wait_for_deletions(timeout=self.ctx.timeout / 4)
                store.drain_all_recycled(deadline)
                st = os.statvfs(root)
                return st.f_bavail * st.f_frsize

            free = group.exchange("save: free space after retention", free_after_deletions)
            check_capacity(writes, [int(f) for f in free], node_of)

    def _check_replicas(self, group: CheckpointGroup, digests: list[int],
                        deduped: Deduped) -> None:
        """Every replicated shard a rank skipped is stored by the rank it named (see
        :mod:`localckpt.save.dedupe`), checked when some rank's replicated leaves changed since
        the last check: one more exchange then. ConfigurationError on every rank otherwise."""
        if not any(digests) or digests == self._checked_replicas:
            return
        def report() -> dict[str, Any]:
            return {"provided": deduped.provided,
                    "expected": {str(k): v for k, v in deduped.expected.items()}}

        reports = group.exchange("save: replicated shards", report)
        missing = missing_replicas([r["provided"] for r in reports],
                                   [r["expected"] for r in reports])
        if missing:
            raise ConfigurationError(
                "save: replicated DTensor shards would be stored by no rank: "
                f"{'; '.join(missing[:4])}. The members of a replica group must hold the same "
                "DTensor leaves; else LocalCheckpointManager(dedupe_replicated=False). Nothing "
                "was written")
        self._checked_replicas = digests


AgreeFn = Callable[[], AgreedSave]
