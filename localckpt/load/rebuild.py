"""Rebuilding the lost shards of an erasure-coded iteration: the step a restore takes before its
round when some owner's shard is held by no node (see :mod:`localckpt.load.restore`).

Two agreed steps, like a round's:

1. **verify**: every rank checks the blocks it serves (manifest, chunk files whole); a copy that
   fails is quarantined and the restore plans again (the stripe may still rebuild from other
   blocks, or the iteration is no longer complete and an older one is chosen). Every block
   reports its save id and each parity block what it was folded over: blocks of different saves,
   or a parity block laid out otherwise than this job's stripes (saved on another topology),
   make the iteration unusable, and an older one is chosen, on every rank alike.
2. **rebuild**: each owner of a lost shard receives its sources
   (:func:`replication.stripe_plans.rebuild_plan`), streamed from the serving ranks' disks and
   checked chunk by chunk on arrival, folds each in with its weight, and commits the shard under
   the manifest a parity block carries, every chunk checked against it
   (:class:`localckpt.storage.parity_io.ShardRebuilder`).

The restore then lists again and loads as if nothing had been lost; the parity blocks lost with
the nodes are folded again after the load, by the write-back (:func:`parity_repair`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

from replication import ExchangePlan, Transfer, parity_of_slot
from replication.executor import Outgoing
from replication.stripe_plans import (
    Rebuild,
    Repair,
    lost_members,
    parity_repair_plan,
    rebuild_plan,
)

from ..control.context import Context
from ..control.coverage import Inventory, holders_of
from ..errors import CorruptShardError
from ..ops.faults import fault_point
from ..storage.parity_io import ShardRebuilder
from ..storage.peer_io import built_or_draining, run_transfers
from ..storage.shard_stream import outgoing_from_disk, wire_messages
from .rounds import quarantine, shard_ref, transfer_seconds


@dataclass
class RebuildOutcome:
    """What every rank agreed: ``bad`` copies quarantined ([file, error, where]), blocks that
    arrived damaged from copies that read well (``retry``), or why the iteration cannot be
    rebuilt (``unusable``). All empty: the lost shards are committed on their owners' nodes."""

    bad: list[list[str]] = field(default_factory=list)
    retry: list[str] = field(default_factory=list)
    unusable: str | None = None


def needs_rebuild(ctx: Context, iteration: int, inventories: list[Inventory]) -> bool:
    """Whether some owner's shard of ``iteration`` is held by no node (erasure coding only)."""
    return ctx.erasure is not None and bool(lost_members(
        ctx.erasure, holders_of(inventories, iteration, ctx.world_size)))


def rebuild_lost(ctx: Context, iteration: int, inventories: list[Inventory]) -> RebuildOutcome:
    """Rebuild every lost shard of ``iteration`` on its owner. Collective (two agreed steps on
    ``ctx.group``, a third to quarantine stale blocks); the outcome is the same on every rank.
    Raises what a rank's failure other than a damaged copy raises (an I/O error serving a
    block), on every rank, or CollectiveError."""
    layout = ctx.erasure
    assert layout is not None
    holders = holders_of(inventories, iteration, ctx.world_size)
    step = f"rebuild of iteration {iteration}"
    passed_over: set[int] = set()  # parity slots whose last copy is stale: left on disk
    reason = passed_why = None
    while True:  # each round passes over at least one more slot: at most one per block
        planned = rebuild_plan(layout, iteration, {
            slot: h for slot, h in holders.items() if slot not in passed_over})
        if planned is None:  # coverage counts the same blocks: not reached unless they changed
            return RebuildOutcome(unusable=reason or "its lost shards cannot be rebuilt from "
                                  "the blocks held")
        rebuilds, plan = planned
        verify = ctx.group.exchange(f"{step}: verify blocks",
                                    partial(_verify_blocks, ctx, iteration, rebuilds))
        bad = [b for v in verify for b in v["bad"]]
        if bad:
            return RebuildOutcome(bad=bad)
        reports = {(int(slot), rank): r for rank, v in enumerate(verify)
                   for slot, r in v["blocks"].items()}
        reason, stale, last = _judge(ctx, rebuilds, reports, holders)
        if stale:  # copies of another save or layout: set aside, then plan again without them
            set_aside = ctx.group.exchange(f"{step}: stale blocks", partial(
                _quarantine_stale, ctx, iteration, [s for s in stale if s[1] == ctx.rank],
                reason))
            return RebuildOutcome(bad=[b for v in set_aside for b in v])
        if reason is not None and last - passed_over:  # the stripe's other blocks may do
            passed_over |= last
            passed_why = reason
            continue
        if reason is not None:
            return RebuildOutcome(unusable=reason)
        break
    pieces = {f"{iteration}:{slot}": int(r["pieces"]) for (slot, _), r in reports.items()}
    local = sum(int(reports[(slot, src)]["pieces"]) for r in rebuilds
                for slot, src, _ in r.sources if src == r.owner)  # read by an owner, after
    done = ctx.group.exchange(f"{step}: fold", partial(_rebuild, ctx, iteration, rebuilds, plan,
                                                       reports),
                              wait=transfer_seconds(ctx, plan, pieces) + ctx.timeout * local)
    outcome = RebuildOutcome([b for v in done for b in v["bad"]],
                             [r for v in done for r in v["retry"]],
                             next((v["unusable"] for v in done if v["unusable"]), None))
    if passed_over and not (outcome.bad or outcome.retry or outcome.unusable):
        # Rebuilt without them: they are of another save or layout. Set aside now (missing,
        # the write-back folds them again), or they would pass for this save's until needed.
        mine = [(slot, ctx.rank) for slot in sorted(passed_over)
                if min(holders[slot]) == ctx.rank]
        ctx.group.exchange(f"{step}: stale blocks", partial(
            _quarantine_stale, ctx, iteration, mine, passed_why))
    return outcome


def _verify_blocks(ctx: Context, iteration: int,
                   rebuilds: tuple[Rebuild, ...]) -> dict[str, Any]:
    """Check every block this rank serves (to a peer, or to itself from its own node);
    quarantine the ones that fail. Reports each one's save id, size and pieces on the wire,
    and a parity block's layout."""
    bad, blocks = [], {}
    fault_point("load_retrieval", ctx.rank, iteration)
    for slot in sorted({slot for r in rebuilds for slot, src, _ in r.sources
                        if src == ctx.rank}):
        try:
            m = ctx.store.read_manifest(shard_ref(ctx, (iteration, slot)))
        except CorruptShardError as exc:
            bad.append(quarantine(ctx, (iteration, slot), exc))
            continue
        report: dict[str, Any] = {"save": m.metadata.get("save_id"),
                                  "nbytes": m.chunk_count * m.chunk_nbytes,
                                  "pieces": wire_messages(m)}
        if m.parity is not None:
            report["layout"] = [m.parity.k, m.parity.m, list(m.parity.members)]
            report["sizes"] = list(m.parity.sizes)
        blocks[str(slot)] = report
    return {"bad": bad, "blocks": blocks}


def _judge(ctx: Context, rebuilds: tuple[Rebuild, ...],
           reports: dict[tuple[int, int], dict[str, Any]], holders: dict[int, list[int]]
           ) -> tuple[str | None, list[tuple[int, int]], set[int]]:
    """Why the sources of some rebuild do not belong together (or None), the parity copies
    ((slot, serving rank)) to set aside: folded by another save than the one the stripe's
    members hold on their own nodes (what they load), or over another layout than this job's,
    and the parity slots of such blocks whose last copy it is. A copy is set aside only while
    another node holds the same block (the next plan takes that one); the last copy never is:
    the next plan passes over it (the stripe's other blocks may do), and the iteration is
    unusable only when none is left (a restart on the old layout can undo that). Pure: the
    same on every rank."""
    layout = ctx.erasure
    assert layout is not None
    node_of = ctx.topology.node_of
    stale: set[tuple[int, int]] = set()
    last: set[int] = set()
    reason = None
    for r in rebuilds:
        members = list(layout.stripes[r.stripe].members)
        own = {reports[(slot, src)]["save"] for slot, src, _ in r.sources if slot == src}
        data = {reports[(slot, src)]["save"] for slot, src, _ in r.sources if slot >= 0}
        truth = next(iter(own or data)) if len(own or data) == 1 else None  # the members'
        parity = [(slot, src) for slot, src, _ in r.sources if slot < 0]
        for slot, src in parity:
            report = reports[(slot, src)]
            stripe, block = parity_of_slot(slot)
            if report.get("layout") != [layout.k, layout.m, members]:
                why = (f"parity block {block} of stripe {stripe} was folded over "
                       f"{report.get('layout')} ([k, m, members]), this job's stripe is "
                       f"{[layout.k, layout.m, members]}: saved on another topology")
            elif truth is not None and report["save"] not in (truth, None):
                why = (f"parity block {block} of stripe {stripe} is of save "
                       f"{report['save']}, its members' of save {truth}")
            else:
                continue
            reason = why
            if len({node_of[h] for h in holders.get(slot, ())}) > 1:
                stale.add((slot, src))
            else:
                last.add(slot)
        saves = {reports[(slot, src)]["save"] for slot, src, _ in r.sources} - {None}
        if reason is None and len(saves) > 1:
            reason = (f"the blocks of stripe {r.stripe} (members {members}) come from "
                      f"different saves: {sorted(saves)}")
        if reason is None:
            sizes = reports[parity[0]]["sizes"]
            if any(reports[p]["sizes"] != sizes for p in parity) or any(
                    reports[(slot, src)]["nbytes"] != sizes[members.index(slot)]
                    for slot, src, _ in r.sources if slot >= 0):
                reason = f"the blocks of stripe {r.stripe} (members {members}) disagree on " \
                         "their sizes"
    return reason, sorted(stale), last


def _quarantine_stale(ctx: Context, iteration: int, mine: list[tuple[int, int]],
                      reason: str | None) -> list[list[str]]:
    """Set aside this rank's copies of the stale blocks ``mine`` ((slot, this rank) each)."""
    return [quarantine(ctx, (iteration, slot), CorruptShardError(f"stale parity: {reason}"))
            for slot, _ in mine]


def _rebuild(ctx: Context, iteration: int, rebuilds: tuple[Rebuild, ...], plan: ExchangePlan,
             reports: dict[tuple[int, int], dict[str, Any]]) -> dict[str, Any]:
    """This rank's part: serve its blocks from disk, and rebuild and commit its own shard if it
    was lost. A served copy that fails its checksums is quarantined (``bad``); a block that
    arrived damaged is ``retry``; a rebuilt shard that fails its manifest's checksums makes the
    iteration ``unusable``. Any other failure raises."""
    mine = next((r for r in rebuilds if r.owner == ctx.rank), None)
    rebuilder = None
    bad: list[list[str]] = []
    if mine is not None:
        parity = next((slot, src) for slot, src, _ in mine.sources if slot < 0)
        rebuilt, rebuilding = built_or_draining(lambda: ShardRebuilder(
            ctx.store, mine, iteration, ctx.world_size,
            int(reports[parity]["sizes"][mine.index]), ctx.ring))

    # Each source is sent only as far as the shard it rebuilds reaches (in whole chunks): a
    # longer block's tail is never folded in, and damage there must not stop the rebuild.
    reaches = {r.owner: int(reports[next((slot, src) for slot, src, _ in r.sources
                                         if slot < 0)]["sizes"][r.index]) for r in rebuilds}

    def source(t: Transfer) -> Outgoing:
        fault_point("replica_send", ctx.rank, t.iteration)
        ref = shard_ref(ctx, t.shard)
        return outgoing_from_disk(ctx.store, ref, ctx.store.read_manifest(ref), ctx.ring,
                                  prefix=reaches[t.dst])

    def sink(t: Transfer, meta: bytes, nbytes: int) -> Any:
        if mine is None:
            raise CorruptShardError(f"rank {t.src} sent block {t.shard} to rank {ctx.rank}, "
                                    "which rebuilds nothing")
        return rebuilding(t, meta, nbytes)

    failures = run_transfers(plan, ctx.group, source, sink)
    if mine is not None:
        rebuilder = rebuilt()  # raises, agreed by the exchange, when it could not be built
    # Then the blocks the owner's own node keeps (ranks moved): after the transfers, so that
    # no peer waits on it, and any error but a damaged copy is raised, agreed by the exchange.
    local = [slot for slot, src, _ in mine.sources if src == ctx.rank] if mine else []
    for slot in local:
        assert rebuilder is not None
        try:
            rebuilder.fold_local(shard_ref(ctx, (iteration, slot)))
        except CorruptShardError as exc:
            bad.append(quarantine(ctx, (iteration, slot), exc))
    retry: list[str] = []
    for t, error in failures:
        if t.src == ctx.rank:
            if not isinstance(error, CorruptShardError):
                raise error
            if all(b[0] != str(shard_ref(ctx, t.shard).path) for b in bad):  # sent twice
                bad.append(quarantine(ctx, t.shard, error))
        else:  # the sender reports its own copy's failure, if that was it
            retry.append(f"block {t.shard} from rank {t.src}: {error}")
    unusable = None
    if rebuilder is not None and not failures and not bad:
        try:
            with ctx.timed("rebuild", rebuilder.iteration, len(rebuilder.out)):
                rebuilder.commit()
        except CorruptShardError as exc:
            unusable = f"rank {ctx.rank}'s rebuilt shard failed its checksums: {exc}"
    return {"bad": bad, "retry": retry, "unusable": unusable}


def parity_repair(ctx: Context, iteration: int, inventories: list[Inventory]) -> Repair | None:
    """The parity blocks of ``iteration`` to fold again after a load (their nodes were lost)
    and how the members' shards reach their holders; None when none is missing or there is no
    erasure coding (pure)."""
    if ctx.erasure is None:
        return None
    repair = parity_repair_plan(ctx.erasure, iteration,
                                holders_of(inventories, iteration, ctx.world_size))
    return repair if repair.blocks else None
