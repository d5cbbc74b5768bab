"""One round of a restore (its plan, where the own shard's tensors go) and the verdicts a
restore reaches from what the ranks report: the saves their shards come from, and the errors of
an iteration that cannot be loaded."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from replication import ExchangePlan, RetrievalPlan, retrieval_plan, schedule, wanted_shards

from ..control.context import Context
from ..control.coverage import Inventory, owner_runs, owners_in
from ..errors import CorruptShardError, NoCheckpointError
from ..storage.device_reader import cuda_destination
from ..storage.host_memory import empty_host
from ..storage.layout import ShardRef, saves_marked
from ..storage.manifest import ShardManifest, dtype_from_name
from .destinations import Destinations, Into, check_layouts, match

logger = logging.getLogger(__name__)

Loaded = tuple[ShardManifest, list[torch.Tensor]]


@dataclass
class Round:
    """One attempt: the plan, the manifests of the copies this rank serves (checked), and its
    own shard once read or received."""

    iteration: int
    plan: RetrievalPlan
    holders: dict[tuple[int, int], list[int]]
    into: Into = field(default_factory=lambda: Into(None))  # the caller's tensors
    manifests: dict[tuple[int, int], ShardManifest] = field(default_factory=dict)
    own: Loaded | None = None
    destinations: Destinations | None = None  # where the own shard's tensors go
    _device: list[torch.device | None] = field(default_factory=list)  # device_for, once known

    def device_for(self, manifest: ShardManifest) -> torch.device | None:
        """The CUDA device the own shard is read onto through pinned memory (the same answer
        for the whole round): the one holding most bytes of ``into``'s CUDA tensors when it
        has any, else the one most of the shard's bytes were saved from; None: no CUDA."""
        if not self._device:
            nbytes: dict[torch.device, int] = {}
            for target in (self.into.paths() or {}).values():
                t = target.tensor
                if t.is_cuda:
                    nbytes[t.device] = nbytes.get(t.device, 0) + t.numel() * t.element_size()
            self._device.append(max(nbytes, key=nbytes.__getitem__) if nbytes
                                else cuda_destination(manifest))
        return self._device[0]

    def choose(self, manifest: ShardManifest,
               device: torch.device | None = None) -> list[torch.Tensor | None]:
        """The caller's tensors the own shard's entries are read into (see match): on the CPU,
        and on ``device`` for a read through pinned memory."""
        self.destinations = match(manifest, self.into.paths(), device)
        return self.destinations.direct

    def choose_or_refuse(self, manifest: ShardManifest) -> list[torch.Tensor | None]:
        """:meth:`choose` for a read from this rank's disk onto :meth:`device_for`, which stops
        before reading any data when the shard lies elsewhere than ``into``'s DTensors
        (LayoutMismatchError: a resharding load takes over). An entry the caller receives by a
        copy is read into host memory, never into a second tensor on a device."""
        targets = self.choose(manifest, self.device_for(manifest))
        assert self.destinations is not None
        check_layouts(self.destinations)
        targets = list(targets)
        for i in self.destinations.copied:
            e = manifest.tensors[i]
            targets[i] = empty_host(e.shape, dtype_from_name(e.dtype))
        return targets

    @property
    def fetches(self) -> ExchangePlan:
        """The transfers ``load`` waits for: each owner's shard to its owner. The replicas a
        replaced node must hold again are the write-back's, after ``load`` returned."""
        return schedule(t for t in self.plan.exchange.transfers if t.dst == t.owner)


def plan_round(ctx: Context, iteration: int, inventories: list[Inventory],
               into: Into | None = None) -> Round:
    """Who reads which copy of ``iteration`` and who receives what (pure: the same on every
    rank). ``iteration`` must be complete in ``inventories``."""
    world = ctx.world_size
    present = [frozenset((it, o) for it, o, w in inv.shards if it == iteration and w == world)
               for inv in inventories]
    holders: dict[tuple[int, int], list[int]] = {}
    for r, shards in enumerate(present):
        for s in shards:
            holders.setdefault(s, []).append(r)
    wants = wanted_shards(ctx.placement, ctx.topology, iteration, present)
    return Round(iteration, retrieval_plan(wants, holders), holders, into or Into(None))


def save_of(rnd: Round) -> Any:
    """The save id of this rank's own shard, once read (None: not read, or written before
    save ids)."""
    return rnd.own[0].metadata.get("save_id") if rnd.own is not None else None


def copies_held(ctx: Context, iteration: int, owners: Iterable[int],
                world_size: int | None = None) -> dict[str, list[list[int]]]:
    """The saves marked in the directories of the copies of ``iteration`` (of ``world_size``,
    default this job's; a resharding load names another) of ``owners`` this rank's node
    holds (as the gathered inventories say), each with its owners as runs
    (:func:`owner_runs`); only the node's first rank reports, the others nothing. What shows
    an iteration saved twice that a load would otherwise take from the older save's copies
    alone (its own shards on nodes the newer save never reached, the others served from
    them)."""
    if ctx.erasure is not None or ctx.topology.nodes[ctx.topology.node_of[ctx.rank]][0] \
            != ctx.rank:
        # An erasure-coded iteration saved twice is never resolved (its parity belongs to a
        # save): copies no rank reads must not make a whole one unloadable.
        return {}
    world = ctx.world_size if world_size is None else world_size
    by_save: dict[str, list[int]] = {}
    for owner in owners:
        if owner >= 0:  # not a parity block
            for save in saves_marked(ctx.store.ref(iteration, owner, world).path):
                by_save.setdefault(save, []).append(owner)
    return {save: owner_runs(held) for save, held in by_save.items()}


def saves_held(copies: Iterable[dict[str, list[list[int]]]]) -> dict[str, set[int]]:
    """The owners each save has copies of, over every node's :func:`copies_held`."""
    out: dict[str, set[int]] = {}
    for held in copies:
        for save, runs in held.items():
            out.setdefault(save, set()).update(owners_in(runs))
    return out


def mixed_saves(reports: list[dict[str, Any]]) -> dict[Any, list[int]] | None:
    """Ranks by the save their own shard comes from, when they are not all one save's: an
    iteration number saved twice (a later run resumed from an older iteration) whose shards
    were not all replaced. None when they agree (or cannot tell)."""
    ranks: dict[Any, list[int]] = {}
    for rank, report in enumerate(reports):
        if report.get("save") is not None:
            ranks.setdefault(report["save"], []).append(rank)
    return ranks if len(ranks) > 1 else None


def note_mixed(mixed: dict[int, str], iteration: int, reports: list[dict[str, Any]]) -> bool:
    """Whether the ranks' own shards of ``iteration``, or the copies of it their nodes hold
    (``copies``, see :func:`copies_held`), come from different saves (then it is recorded in
    ``mixed``, with why, and never loaded as it is: the same verdict on every rank, from the
    same gathered reports)."""
    by_save = mixed_saves(reports)
    if by_save is not None:
        mixed[iteration] = ("its shards come from different saves: " + "; ".join(
            f"ranks {ranks[:8]} hold save {save}" for save, ranks in by_save.items()))
        return True
    owners = saves_held(report.get("copies", {}) for report in reports)
    for rank, report in enumerate(reports):
        if report.get("save") is not None:  # read as its own (a copy without a marker too)
            owners.setdefault(report["save"], set()).add(rank)
    if len(owners) < 2:
        return False
    mixed[iteration] = ("its copies come from different saves: " + "; ".join(
        f"save {save} has copies of ranks {sorted(held)[:8]}"
        for save, held in sorted(owners.items())))
    return True


def not_loadable(ctx: Context, iteration: int, complete: list[int],
                  quarantined: list[list[str]]) -> Exception:
    """The agreed error of ``load(iteration=N)`` when N cannot be loaded."""
    shown = sorted(complete)[-8:]
    have = f"complete iterations: {shown}" if complete else "no complete iteration"
    if quarantined:
        return CorruptShardError(
            f"load: iteration {iteration} can no longer be loaded: corrupt copies were "
            f"quarantined ({'; '.join(f'{p}: {e}' for p, e, _ in quarantined[:4])}); {have}")
    return NoCheckpointError(
        f"load: iteration {iteration} of session {ctx.session_id!r} is not complete for a "
        f"world of {ctx.world_size} ranks; {have} (iterations() lists them)")


def nothing_left(ctx: Context, iteration: int, quarantined: list[list[str]],
                 unusable: dict[int, str] | None = None) -> Exception:
    """The agreed error when no complete iteration at or before ``iteration`` is left:
    NoCheckpointError only when none was ever there; CorruptShardError naming the copies set
    aside and the iterations found ``unusable`` (and why), which a job must not take for
    "start afresh"."""
    if unusable and not quarantined:
        shown = "; ".join(f"iteration {it}: {why}" for it, why in sorted(unusable.items())[-3:])
        return CorruptShardError(
            f"load: no iteration at or before {iteration} can be loaded: {shown}")
    if not quarantined:
        return NoCheckpointError(
            f"load: no complete checkpoint of session {ctx.session_id!r} at or before iteration "
            f"{iteration} for a world of {ctx.world_size} ranks")
    shown = "; ".join(f"{path}: {error}" for path, error, _ in quarantined[:4])
    more = f" (and {len(quarantined) - 4} more)" if len(quarantined) > 4 else ""
    return CorruptShardError(
        f"load: no complete iteration at or before {iteration} is left: {len(quarantined)} "
        f"corrupt copies were quarantined: {shown}{more}. The job can start afresh (the next "
        "find_latest does not choose them again)")


def shard_ref(ctx: Context, shard: tuple[int, int]) -> ShardRef:
    """Where this rank's node keeps ``shard`` (iteration, owner or parity slot)."""
    return ctx.store.ref(*shard, ctx.world_size)


def quarantine(ctx: Context, shard: tuple[int, int], exc: BaseException) -> list[str]:
    """Move this rank's copy of ``shard`` aside; [file, error, where it went]."""
    ref = shard_ref(ctx, shard)
    moved = ctx.store.quarantine(ref)
    logger.warning("rank %d: load: %s; this copy was quarantined to %s (it is removed when the "
                   "next save starts)", ctx.rank, exc, moved)
    return [str(ref.path), str(exc), str(moved)]


def transfer_seconds(ctx: Context, plan: ExchangePlan, pieces: dict[str, int]) -> float:
    """How long a rank with little to do may wait for the others' part of ``plan``: every
    piece on the wire, and its handling on arrival, is bounded by the timeout."""
    steps = sum(max(pieces.get(f"{t.iteration}:{t.owner}", 1) for t in round_)
                for round_ in plan.rounds)
    return ctx.timeout * (1 + 2 * steps)
