"""Restoring from the durable tier when the node-local tiers cannot serve a newer iteration.

``find_latest`` asks the durable tier (rank 0 lists it, one exchange) for complete iterations
newer than the newest the local roots cover; ``load`` then copies each rank's own shard of the
newest of them into its node root, verified (:meth:`DurableStore.get`), in one agreed step, and
loads it from there as any local checkpoint. A candidate some rank cannot copy (missing, corrupt,
the store unreachable) is given up on every rank alike and the next older one tried; the local
tier's newest is the last resort. The copies stay: the local tier holds the iteration again, so
the next failure is cheap (the next save replicates afresh).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from ..control.context import Context
from ..errors import CorruptShardError, DurableTierUnavailableError
from ..ops.faults import fault_point
from ..storage.durable import DurableStore, GiveUp
from ..storage.layout import ShardRef
from ..storage.manifest import ShardManifest

logger = logging.getLogger(__name__)


def durable_candidates(ctx: Context, tier: DurableStore, newer_than: int,
                       any_world: bool = False) -> list[tuple[int, int]]:
    """(iteration, world size) of the complete durable iterations newer than ``newer_than``,
    newest first: rank 0's listing, the same on every rank. Of this world size only, unless
    ``any_world`` (a job that reshards). Collective (control group). A store rank 0 cannot
    list within half a timeout counts as empty (logged) when the local tiers hold an iteration;
    when they hold none, DurableTierUnavailableError on every rank."""
    def listing() -> dict[str, Any] | None:
        if ctx.rank != 0:
            return None
        try:
            return {"complete": within(ctx.timeout / 2, tier.complete_any)}
        except OSError as exc:  # TimeoutError included
            return {"failed": f"{type(exc).__name__}: {exc}"}

    answer = ctx.group.exchange("find_latest: durable tier", listing)[0] or {}
    if "failed" in answer:
        if newer_than < 0:  # nothing local either: a fresh start would lose the job's progress
            raise DurableTierUnavailableError(
                f"find_latest: the node-local tiers hold no checkpoint and the durable tier "
                f"{tier.root} could not be listed within {ctx.timeout / 2:g}s "
                f"({answer['failed']}); not starting over: restart once it is reachable")
        logger.error("rank %d: the durable tier %s could not be listed (%s): the local "
                     "tiers' iteration %d is used", ctx.rank, tier.root, answer["failed"],
                     newer_than)
    listed = [(int(it), int(world)) for it, world in answer.get("complete") or []]
    # Of two world sizes with the same iteration number, this job's first.
    return sorted(((it, world) for it, world in listed if it > newer_than and (
        any_world or world == ctx.world_size)),
        key=lambda c: (c[0], c[1] == ctx.world_size), reverse=True)


def fetched_by(ctx: Context, world: int) -> list[int]:
    """The owners of a ``world``-rank checkpoint whose shards this rank copies from the durable
    tier: its own at this world size; else owner o goes to rank o mod this world size (every
    shard to one rank; the resharding load then reads them where they are)."""
    if world == ctx.world_size:
        return [ctx.rank]
    return list(range(ctx.rank, world, ctx.world_size))


T = TypeVar("T")


def other_saves(ctx: Context, tier: DurableStore, iteration: int,
                world: int) -> list[ShardRef]:
    """The copies of ``iteration`` in this rank's node root that are not the committed save's
    (another save of that iteration number, or unreadable): a later restore after a node loss
    would otherwise mix them with the committed shards. Shards this node's ranks copy are
    theirs to check. A copy the tier's record cannot be read for (a tier fault, not the copy's)
    is kept: a load resolves the copies of two saves by their save ids, while a healthy replica
    deleted is redundancy lost. Reads only: the caller deletes them, once it knows it still
    wants to."""
    node_of = ctx.topology.node_of
    out = []
    committed_save: list[ShardManifest | None] = []  # the committed record, read once
    for ref in ctx.store.committed():
        if ref.iteration != iteration or ref.world_size != world:
            continue
        if ref.owner_rank < 0:  # a parity block (erasure), checked by the node's first rank
            if ctx.topology.leader(ctx.rank) == ctx.rank:
                if not committed_save:
                    committed_save.append(_committed(ctx, tier, ref.iteration, 0, world))
                if committed_save[0] is not None and not _folded_by(
                        ctx, ref, committed_save[0].metadata.get("save_id")):
                    out.append(ref)
            continue
        fetcher = ref.owner_rank if world == ctx.world_size else ref.owner_rank % ctx.world_size
        if node_of[fetcher] == node_of[ctx.rank]:
            continue
        try:
            mine = ctx.store.read_manifest(ref)
        except (OSError, CorruptShardError):
            out.append(ref)  # unreadable here: no load could use it
            continue
        theirs = _committed(ctx, tier, iteration, ref.owner_rank, world)
        if theirs is not None and mine != theirs:
            out.append(ref)
    return out


def _committed(ctx: Context, tier: DurableStore, iteration: int, owner: int,
               world: int) -> ShardManifest | None:
    """The manifest the durable tier committed for ``owner``'s shard; None (logged) when the
    tier fails to give it."""
    try:
        return tier.committed_manifest(iteration, owner, world)
    except (OSError, CorruptShardError) as exc:
        logger.warning("rank %d: the durable tier's record of rank %d's shard of iteration %d "
                       "could not be read (%s: %s); the local copies of it are kept",
                       ctx.rank, owner, iteration, type(exc).__name__, exc)
        return None


def _folded_by(ctx: Context, ref: ShardRef, save_id: str | None) -> bool:
    """Whether the parity block ``ref`` was folded by the save ``save_id`` (the one whose
    shards are being restored): else a later rebuild would mix two saves."""
    try:
        block = ctx.store.read_manifest(ref).metadata.get("save_id")
    except (OSError, CorruptShardError):
        return False
    return block is not None and block == save_id


def within(seconds: float, fn: Callable[[], T], stop: GiveUp | None = None) -> T:
    """``fn()`` on a daemon thread (a hung mount must hold neither rank 0 past the others'
    timeout nor the interpreter's exit); TimeoutError after ``seconds``, once ``stop`` (the
    work's own guard, when it has one) was given up."""
    box: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:
            errors.append(exc)
    thread = threading.Thread(target=run, daemon=True, name="localckpt-durable-list")
    thread.start()
    thread.join(seconds)
    if stop is not None and not box and not errors:
        stop.give_up()  # waits for a commit in progress; none starts after
    if errors:
        raise errors[0]
    if not box:
        raise TimeoutError(f"no answer within {seconds:g}s")
    return box[0]


# Failures of the store, not of a copy: an older candidate in the same store would fail alike.
# (A permission error is not one: a wrong umask or a 403 on one key is that iteration's.)
_UNAVAILABLE = {"TimeoutError", "ConnectionError", "ConnectionRefusedError",
                "ConnectionResetError", "ConnectionAbortedError", "BrokenPipeError",
                "DurableTierUnavailableError"}


def fetch_from_durable(ctx: Context, tier: DurableStore,
                       candidates: list[tuple[int, int]]) -> tuple[int, int, str | None]:
    """Copy this rank's shards (:func:`fetched_by`) of the newest candidate every rank can copy
    into its node root; returns that (iteration, world size, None), or (-1, -1, why) when none
    could be copied: ``why`` is None when each candidate was itself unusable (a missing or
    corrupt shard), or what made the store unavailable (a timeout, a refused connection; the
    older candidates are then not tried: they would fail alike, each after its bound).
    Collective (one agreed step per candidate tried); the same on every rank."""
    for iteration, world in candidates:
        fetched: list[int] = []

        def fetch(iteration: int = iteration, world: int = world,
                  fetched: list[int] = fetched) -> None:
            fault_point("durable_fetch", ctx.rank, iteration)
            for owner in fetched_by(ctx, world):
                # A shard of this iteration already here is kept only if it is the committed
                # one (not a leftover of another save of the same iteration number). A hung
                # mount fails this rank within the others' wait, instead of holding it for
                # ever, and a copy given up never commits later (over a newer save's shard).
                stop = GiveUp()
                try:
                    copied = within(3.5 * ctx.timeout, partial(
                        tier.get, ctx.store, iteration, owner, world, stop), stop)
                except TimeoutError:
                    tier.abandon()  # close() must not wait for its threads
                    raise
                if copied:
                    fetched.append(owner)
            # Deleted here, only if the reads ended in time: a thread left behind on a hung
            # mount must not delete a newer save's replica later.
            for ref in within(3.5 * ctx.timeout,
                              partial(other_saves, ctx, tier, iteration, world)):
                ctx.store.delete(ref, background=True)

        with ctx.timed("fetch_from_durable", iteration):
            # each rank copies at most this many shards, then checks its node root's other
            # copies, each step bounded by 3.5 timeouts
            steps = -(-world // ctx.world_size) + 1
            outcome = ctx.group.gather_outcomes(f"load: from the durable tier, iteration "
                                                f"{iteration}", fetch,
                                                wait=ctx.timeout * (3.5 * steps + 0.5))
        if not outcome.failures:
            return iteration, world, None
        why = "; ".join(f"rank {r}: {e[0]}: {e[1]}" for r, e in
                        sorted(outcome.failures.items())[:4])
        unavailable = all(e[0] in _UNAVAILABLE for e in outcome.failures.values())
        logger.warning("rank %d: iteration %d cannot be restored from the durable tier %s "
                       "(%s); %s", ctx.rank, iteration, tier.root, why,
                       "the store is unavailable" if unavailable else "trying an older one")
        for owner in fetched:  # an incomplete iteration here: nothing would load it
            ctx.store.delete(ctx.store.ref(iteration, owner, world), background=True)
        if unavailable:
            return -1, -1, why
    return -1, -1, None
