"""The load path, top to bottom. One path whatever the replication: no replication is a
placement with no holders, and a rank whose shard is on another node (the ranks moved) receives
it like a replica.

1. **find_latest**: gather every rank's inventory; the newest iteration whose every owner's shard
   is held by some rank (pure, :func:`localckpt.control.coverage.choose_latest`);
2. **restore**, in rounds, each one agreed step after another:

   a. gather the inventories again and choose the newest complete iteration not newer than
      asked (a fallback lands here);
   b. plan who reads which copy and who receives what (pure, ``replication.retrieval_plan``):
      every rank its own shard, every node the replicas its placement puts on it;
   c. every rank reads and verifies the copies it serves. A copy that fails is quarantined
      (moved aside, named in a warning) and the round starts again: another copy serves it, or
      the iteration is no longer complete and an older one is chosen, on every rank alike;
   d. transfers: received shards are verified and written back, so the job is again one node
      loss away from trouble, not zero;
   e. the state dict is built (a written-back own shard read, tensors moved to their devices) in
      an agreed step: a failure there, say a CUDA allocation on one rank, is the same error on
      every rank. When every shard was on its own node (no transfers: the usual restart) that
      happens in the verify step, and a load right after ``find_latest`` plans its first round
      from the inventories ``find_latest`` gathered, so such a load is one collective.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from replication import RetrievalPlan, Transfer, retrieval_plan, wanted_shards

from ..control.context import Context
from ..control.coverage import (
    Inventory,
    choose_latest,
    complete_iterations,
    decode_inventories,
    other_world_shards,
)
from ..errors import CorruptShardError, NoCheckpointError
from ..ops.faults import fault_point
from ..state_dict import rebuild_state_dict
from ..storage.layout import ShardRef
from ..storage.manifest import ShardManifest
from ..storage.peer_io import (
    StoreReceiver,
    exchange_shards,
    piece_count,
    tensors_from_buffer,
)

logger = logging.getLogger(__name__)

Loaded = tuple[ShardManifest, list[torch.Tensor]]


def find_latest(ctx: Context) -> tuple[int, list[Inventory]]:
    """The newest iteration every rank can load, or -1, and the inventories it was chosen from
    (a load right after may plan from them). Collective. Shards written by a job of another world
    size are reported (once, by rank 0) and otherwise ignored."""
    def listing() -> dict[str, Any]:
        fault_point("find_latest", ctx.rank)
        return ctx.inventory().to_json()

    inventories = decode_inventories(ctx.group.exchange("find_latest", listing))
    latest = choose_latest(inventories, ctx.world_size)
    others = other_world_shards(inventories, ctx.world_size)
    if others and ctx.rank == 0:
        logger.warning(
            "find_latest: shards of another world size are on disk and are ignored: %s. This "
            "job has world size %d and localckpt cannot reshard them yet; they are kept (no "
            "retention touches them): remove them with `localckpt gc --session %s "
            "--world-size %d ROOT...`",
            "; ".join(f"world size {w}: iterations {its}" for w, its in others.items()),
            ctx.world_size, repr(ctx.session_id) if ctx.session_id else "''", ctx.world_size)
    return latest, inventories


@dataclass
class _Round:
    """One attempt: the plan, what this rank read to serve, and its own shard."""

    iteration: int
    plan: RetrievalPlan
    served: dict[tuple[int, int], tuple[ShardManifest, torch.Tensor]] = field(default_factory=dict)
    own: Loaded | None = None
    received: dict[tuple[int, int], StoreReceiver] = field(default_factory=dict)

    def source(self, t: Transfer) -> tuple[ShardManifest, torch.Tensor]:
        return self.served[t.shard]


def plan_round(ctx: Context, iteration: int, inventories: list[Inventory]) -> _Round:
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
    return _Round(iteration, retrieval_plan(wants, holders))


def _verify_sources(ctx: Context, rnd: _Round,
                    built: list[tuple[ShardManifest, Any]] | None) -> dict[str, Any]:
    """Read and verify every copy this rank serves (its own shard straight into its tensors).
    A copy that fails is quarantined. Returns ``bad``: [file, error, where it went] for each,
    and ``pieces``: how many messages each shard served takes on the wire. With ``built`` (the
    round has no transfers) and nothing bad here, the state dict is built in the same step."""
    fault_point("load_retrieval", ctx.rank, rnd.iteration)
    store, world, rank = ctx.store, ctx.world_size, ctx.rank
    bad = []
    pieces: dict[str, int] = {}
    for shard in rnd.plan.sources_of(rank):
        it, owner = shard
        ref = ShardRef(it, owner, world, store.path_of(it, owner, world))
        only_for_me = all(t.dst == rank for t in rnd.plan.reads
                          if t.src == rank and t.shard == shard)
        try:
            if only_for_me and owner == rank:
                rnd.own = store.read_tensors(ref)  # the common case
            else:
                manifest, buf = store.read(ref)
                rnd.served[shard] = (manifest, buf)
                pieces[f"{it}:{owner}"] = piece_count(manifest.chunk_nbytes,
                                                      manifest.chunk_count)
                if owner == rank:
                    rnd.own = (manifest, tensors_from_buffer(manifest, buf))
        except CorruptShardError as exc:
            moved = store.quarantine(ref)
            logger.warning("rank %d: load: %s; this copy was quarantined to %s (it is removed "
                           "when the next save starts)", rank, exc, moved)
            bad.append([str(ref.path), str(exc), str(moved)])
    if built is not None and not bad:
        _build(ctx, rnd, built)
    return {"bad": bad, "pieces": pieces}


def restore(ctx: Context, iteration: int,
            fetched: Callable[[float, int], None] | None = None,
            inventories: list[Inventory] | None = None) -> tuple[ShardManifest, Any]:
    """This rank's state dict from the newest complete iteration not newer than ``iteration``
    (and its manifest), every rank's and every node's replicas restored on the way. Collective.

    Raises on every rank alike: CorruptShardError when corrupt copies were quarantined and no
    complete iteration is left (it names them), NoCheckpointError when none was there,
    UnsupportedFormatError, the failing rank's error while building the state dict,
    CollectiveError. ``fetched(seconds, nbytes)`` is told what this rank received from peers.
    ``inventories``: what :func:`find_latest` gathered just before, to plan the first round from
    (every rank passes them or none; a copy gone since fails verification and the next round
    lists again).
    """
    if iteration < 0:
        raise NoCheckpointError(
            f"no complete checkpoint of session {ctx.session_id!r} under {ctx.root} for a world "
            f"of {ctx.world_size} ranks")
    rank = ctx.rank
    quarantined: list[list[str]] = []
    rounds = 0
    while True:
        rounds += 1
        started = time.monotonic()
        if inventories is None or rounds > 1:
            inventories = ctx.gather_inventories(f"load of iteration {iteration}: inventory")
        candidates = [it for it in complete_iterations(inventories, ctx.world_size)
                      if it <= iteration]
        if not candidates or rounds > 1 + sum(len(i.shards) for i in inventories):
            raise _nothing_left(ctx, iteration, quarantined)
        if candidates[0] != iteration:
            if rank == 0:
                logger.warning("load: iteration %d can no longer be loaded (corrupt copies were "
                               "quarantined: %s); falling back to iteration %d on every rank",
                               iteration, "; ".join(b[0] for b in quarantined), candidates[0])
            iteration = candidates[0]
        step = f"load of iteration {iteration}"
        rnd = plan_round(ctx, iteration, inventories)
        planned = time.monotonic()
        built: list[tuple[ShardManifest, Any]] = []
        local_only = not rnd.plan.exchange.rounds  # the same plan on every rank
        verify = ctx.group.exchange(f"{step}: verify sources", partial(
            _verify_sources, ctx, rnd, built if local_only else None))
        verified = time.monotonic()
        if any(v["bad"] for v in verify):
            quarantined += [b for v in verify for b in v["bad"]]
            continue  # re-plan: another copy, or an older iteration
        if local_only:  # every rank read its own shard and built its state dict
            return built[0]
        # Every piece on the wire, and its write on arrival, is bounded by the timeout; a rank
        # with little to do waits for the others' rounds as long as they may take.
        pieces = {k: n for v in verify for k, n in v["pieces"].items()}
        steps = sum(max(pieces.get(f"{t.iteration}:{t.owner}", 1) for t in round_)
                    for round_ in rnd.plan.exchange.rounds)
        ctx.group.exchange(f"{step}: fetch from peers", partial(
            exchange_shards, rnd.plan.exchange, ctx.group, ctx.store, ctx.world_size,
            rnd.source, ctx.ring, rnd.received), wait=ctx.timeout * (1 + 2 * steps))
        rnd.served.clear()  # sent: the copies read for peers go before the state dict is built
        if fetched is not None and rnd.received:
            fetched(time.monotonic() - verified,
                    sum(r.manifest.data_nbytes for r in rnd.received.values()))
        logger.debug("rank %d: restore plan %.3fs, read+verify %.3fs, transfers %.3fs", rank,
                     planned - started, verified - planned, time.monotonic() - verified)
        if rnd.received:
            logger.info("rank %d: fetched the shards of owners %s from peers and wrote them back",
                        rank, sorted(o for _, o in rnd.received))
        ctx.group.exchange(f"{step}: build the state dict",
                           partial(_build, ctx, rnd, built))
        return built[0]


def _build(ctx: Context, rnd: _Round, out: list[tuple[ShardManifest, Any]]) -> None:
    """This rank's state dict from its shard of the round: read back from its root if it was
    fetched, rebuilt in the form it was saved, tensors on their recorded devices."""
    if rnd.own is None:  # fetched and written back: read it like any local shard
        it, rank, world = rnd.iteration, ctx.rank, ctx.world_size
        rnd.own = ctx.store.read_tensors(ShardRef(it, rank, world,
                                                  ctx.store.path_of(it, rank, world)))
    manifest, tensors = rnd.own
    out.append((manifest, rebuild_state_dict(
        manifest.hollow, tensors, [e.key_path for e in manifest.tensors],
        [e.device for e in manifest.tensors], manifest.container == "plain")))


def _nothing_left(ctx: Context, iteration: int, quarantined: list[list[str]]) -> Exception:
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
