"""The load path, top to bottom. One path whatever the replication: no replication is a
placement with no holders, and a rank whose shard is on another node (the ranks moved) receives
it like a replica.

1. **find_latest**: gather every rank's inventory; the newest iteration whose every owner's shard
   is held by some rank (pure, :func:`localckpt.control.coverage.choose_latest`);
2. **restore**, in rounds, each one agreed step after another:

   a. gather the inventories again and choose the newest complete iteration not newer than
      asked (a fallback lands here); with erasure coding, its lost shards are first rebuilt on
      their owners from their stripes (:mod:`localckpt.load.rebuild`), and the round lists
      again;
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

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial
from typing import Any

import torch

from replication import ExchangePlan, Transfer
from replication.executor import Outgoing

from ..control.context import Context
from ..control.coverage import (
    Inventory,
    choose_latest,
    choose_latest_any_world,
    complete_iterations,
    decode_inventories,
    other_world_shards,
    why_incomplete,
)
from ..errors import ConfigurationError, CorruptShardError, NoCheckpointError
from ..ops.faults import fault_point
from ..state_dict import rebuild_state_dict
from ..storage.manifest import ShardManifest
from ..storage.peer_io import run_transfers
from ..storage.shard_stream import (
    TensorReceiver,
    outgoing_from_disk,
    tensor_splits,
    wire_messages,
)
from .destinations import Into, Rewrap, fill_copied
from .mixed import resolve_mixed
from .rebuild import needs_rebuild, parity_repair, rebuild_lost
from .rounds import (
    Loaded,
    Round,
    copies_held,
    not_loadable,
    note_mixed,
    nothing_left,
    plan_round,
    quarantine,
    save_of,
    shard_ref,
    transfer_seconds,
)
from .write_back import WriteBack

logger = logging.getLogger(__name__)


def find_latest(ctx: Context, reshard: bool = False) -> tuple[int, int, list[Inventory]]:
    """The newest iteration every rank can load, or -1, the world size of the job that saved it,
    and the inventories it was chosen from (a load right after may plan from them). Collective.
    Shards written by a job of another world size are ignored (reported once, by rank 0) unless
    ``reshard``: then the newest complete iteration of any world size is chosen."""
    def listing() -> dict[str, Any]:
        fault_point("find_latest", ctx.rank)
        return ctx.inventory().to_json()

    inventories = decode_inventories(ctx.group.exchange("find_latest", listing))
    if reshard:
        latest, world = choose_latest_any_world(inventories, ctx.world_size, ctx.erasure)
        return latest, world, inventories
    latest = choose_latest(inventories, ctx.world_size, ctx.erasure)
    others = other_world_shards(inventories, ctx.world_size)
    if others and ctx.rank == 0:
        logger.warning(
            "find_latest: shards of another world size are on disk and are ignored: %s. This "
            "job has world size %d; LocalCheckpointManager(reshard=True) loads them onto it. "
            "They are kept (no retention touches them): remove them with `localckpt gc "
            "--session %s --world-size %d ROOT...`",
            "; ".join(f"world size {w}: iterations {its}" for w, its in others.items()),
            ctx.world_size, repr(ctx.session_id) if ctx.session_id else "''", ctx.world_size)
    return latest, ctx.world_size, inventories


def _blame_destination(ctx: Context, rnd: Round, shard: tuple[int, int],
                       exc: CorruptShardError) -> None:
    """A read into the caller's tensors failed its checks: read the copy again into private
    memory. If it verifies, the copy is healthy and must not be quarantined: the caller's
    tensors are at fault (read-only memory, or changed while load ran): ConfigurationError."""
    if rnd.destinations is None or not any(t is not None and t.is_cpu
                                           for t in rnd.destinations.direct):
        return  # tensors on a device cannot fail a checksum: it is taken on the host
    try:
        ctx.store.verify(shard_ref(ctx, shard))
    except CorruptShardError:
        return  # the copy itself is bad
    raise ConfigurationError(
        f"load(into=...): the checkpoint copy {shard_ref(ctx, shard).path} verifies when read into "
        f"fresh memory, but not when read into the tensors of `into` ({exc}): are they "
        "read-only, or changed by another thread while load ran?") from exc


def _read_seconds(ctx: Context, rnd: Round) -> float:
    """How long a rank may wait for the others to read their own shards and build their
    state dicts (a round with no transfers): each chunk of the save's largest shard bounded by
    the timeout, as a save waits for the chunks written. Shards differ in size (a pipeline
    stage holding the embeddings): the save records its largest in every shard's manifest;
    one saved before it did is taken to be as large as this rank's (its manifest is parsed
    already: find_latest)."""
    chunks = 0
    for shard in rnd.plan.sources_of(ctx.rank):
        with contextlib.suppress(Exception):  # a bad manifest is found by the step itself
            m = ctx.store.read_manifest(shard_ref(ctx, shard))
            chunks = max(chunks, m.chunk_count, m.metadata.get("most_chunks", 0))
    return ctx.timeout * (1 + chunks)


def _verify_sources(ctx: Context, rnd: Round,
                    built: list[tuple[ShardManifest, Any]] | None) -> dict[str, Any]:
    """Check every copy this rank serves: its manifest, and its chunk files all there and whole
    (the data's checksums are checked as it is read, in the fetch step). A copy that fails is
    quarantined. Returns ``bad``: [file, error, where it went] for each; ``pieces``: how many
    messages each shard served to a peer takes on the wire; ``reads``: the chunks of its own
    shard this rank reads from its node (the fetch waits for the largest, beside the wire).
    With ``built`` (the round has no transfers: every rank reads its own shard) the shard is
    read, verified and the state dict built in this step."""
    fault_point("load_retrieval", ctx.rank, rnd.iteration)
    rnd.into.paths()  # a bad ``into`` fails here, agreed
    bad = []
    pieces: dict[str, int] = {}
    reads = 0
    for shard in rnd.plan.sources_of(ctx.rank):
        try:
            if built is not None:  # the common case: only its own shard, for itself
                try:
                    rnd.own = ctx.store.read_tensors(shard_ref(ctx, shard), rnd.choose_or_refuse,
                                                     rnd.device_for)
                except CorruptShardError as exc:
                    _blame_destination(ctx, rnd, shard, exc)
                    raise
            else:
                m = rnd.manifests[shard] = ctx.store.read_manifest(shard_ref(ctx, shard))
                if shard == (rnd.iteration, ctx.rank):
                    reads = m.chunk_count
                # the fetch cuts at tensor edges; the write-back sends fewer: bounded alike
                pieces[f"{shard[0]}:{shard[1]}"] = wire_messages(m, tensor_splits(m))
        except CorruptShardError as exc:
            bad.append(quarantine(ctx, shard, exc))
    if built is not None and not bad:
        _build(ctx, rnd, built)
    return {"bad": bad, "pieces": pieces, "reads": reads, "save": save_of(rnd),
            "copies": copies_held(ctx, rnd.iteration, [
                owner for (_, owner), ranks in rnd.holders.items() if ctx.rank in ranks])}


def _fetch(ctx: Context, rnd: Round, built: list[tuple[ShardManifest, Any]],
           fetched: Callable[[float, int], None] | None) -> dict[str, Any]:
    """This rank's own shard read from its root (on a thread) while the owners' shards stream
    from their serving ranks' disks into their owners' tensors; then the state dict built. A
    copy that fails its checksums is quarantined (``bad``, as in :func:`_verify_sources`);
    ``retry``: what arrived damaged from a copy that read well (the wire). Any other failure
    raises."""
    rank = ctx.rank
    own_shard = (rnd.iteration, rank)
    reading: Future[Loaded] | None = None
    if any(t.src == rank == t.dst for t in rnd.plan.reads):
        # On the caller's stream, as if read on its thread: copies after what it queued, the
        # tensors its to use and free.
        initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        stream = torch.cuda.current_stream() if initialized else None

        def read_own() -> Loaded:
            with torch.cuda.stream(stream):
                return ctx.store.read_tensors(shard_ref(ctx, own_shard), rnd.choose_or_refuse,
                                              rnd.device_for)

        reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="localckpt-own")
        reading = reader.submit(read_own)
        reader.shutdown(wait=False)
    receivers: dict[tuple[int, int], TensorReceiver] = {}

    def source(t: Transfer) -> Outgoing:
        fault_point("replica_send", rank, t.iteration)
        m = rnd.manifests[t.shard]
        return outgoing_from_disk(ctx.store, shard_ref(ctx, t.shard), m, ctx.ring, tensor_splits(m))

    def sink(t: Transfer, meta: bytes, nbytes: int) -> TensorReceiver:
        receivers[t.shard] = TensorReceiver(t, meta, nbytes, ctx.world_size, ctx.ring,
                                            rnd.choose if t.owner == rank else None)
        return receivers[t.shard]

    started = time.monotonic()
    try:
        failures = run_transfers(rnd.fetches, ctx.group, source, sink)
    except BaseException:
        if reading is not None:  # never leave it writing into the caller's tensors
            wait([reading])
        raise
    bad: list[list[str]] = []
    retry: list[str] = []
    errors: list[tuple[tuple[int, int] | None, BaseException]] = [
        (t.shard if t.src == rank else None, exc) for t, exc in failures]
    if reading is not None:
        try:
            rnd.own = reading.result()
        except CorruptShardError as exc:
            _blame_destination(ctx, rnd, own_shard, exc)
            errors.append((own_shard, exc))
        except Exception as exc:
            errors.append((own_shard, exc))
    for served, error in errors:
        if not isinstance(error, CorruptShardError):
            raise error
        if served is not None:  # this rank's copy failed its checksums
            bad.append(quarantine(ctx, served, error))
        else:  # received damaged; if the sender's copy was bad it says so in ``bad``
            hint = (" (received into the tensors of load(into=...): were they changed while "
                    "load ran?)") if rnd.into.state is not None else ""
            retry.append(f"{error}{hint}")
    if own_shard in receivers and not failures:
        receiver = receivers[own_shard]
        rnd.own = (receiver.manifest, receiver.tensors)
        if fetched is not None:
            fetched(time.monotonic() - started, receiver.manifest.data_nbytes)
    if not bad and not retry:
        _build(ctx, rnd, built)
    return {"bad": bad, "retry": retry, "save": save_of(rnd)}


def restore(ctx: Context, iteration: int,
            fetched: Callable[[float, int], None] | None = None,
            inventories: list[Inventory] | None = None,
            into: Any = None, exact: bool = False,
            elsewhere: Callable[[int], int] | None = None
            ) -> tuple[ShardManifest, Any, WriteBack | None]:
    """This rank's state dict from the newest complete iteration not newer than ``iteration``
    (and its manifest), and the write-back started in the background to restore every rank's
    and every node's copies (None when nothing was missing). Collective. ``exact``: that
    iteration or an error, never an older one.

    Raises on every rank alike: CorruptShardError when corrupt copies were quarantined and no
    complete iteration is left (it names them), NoCheckpointError when none was there,
    UnsupportedFormatError, the failing rank's error while fetching or building the state dict,
    CollectiveError. ``fetched(seconds, nbytes)`` is told what this rank received from peers.
    ``inventories``: what :func:`find_latest` gathered just before, to plan the first round from
    (every rank passes them or none; a copy gone since fails verification and the next round
    lists again). ``into``: a state dict whose tensors are loaded into in place (see
    :mod:`localckpt.load.destinations`); TypeError, on every rank, for a leaf ``save`` would
    refuse. ``elsewhere(fallback)``: called (collectively, once) before falling back from the
    newest iteration to ``fallback`` (-1: none left); a newer iteration it returns has been put
    in the node roots (from the durable tier) and is loaded instead, nothing built before it.
    """
    hidden = {it: why for (it, world), why in ctx.unloadable.items()
              if world == ctx.world_size}
    if iteration < 0 and hidden:  # found unloadable earlier in this process: not "none"
        raise nothing_left(ctx, max(hidden), [], hidden)
    if iteration < 0:
        lacks = why_incomplete(inventories, ctx.world_size, ctx.erasure) if inventories else ""
        raise NoCheckpointError(
            f"no complete checkpoint of session {ctx.session_id!r} for a world of "
            f"{ctx.world_size} ranks in the node roots (this rank's: {ctx.root})"
            + (f": {lacks}" if lacks else ""))
    rank = ctx.rank
    destinations = Into(into)
    quarantined: list[list[str]] = []
    # iterations that cannot be loaded, and why: shards from different saves, lost shards that
    # cannot be rebuilt
    mixed: dict[int, str] = {}
    resolved: set[int] = set()  # iterations whose copies of other saves were set aside once

    def unmixed(reports: list[dict[str, Any]]) -> bool:
        """Whether the ranks' own shards (and the copies their nodes hold) come from one
        save; when not, the copies of the save that covers every rank are kept and the others
        set aside (plan again), or the iteration is left out from now on (every rank alike:
        the reports are the same)."""
        if not note_mixed(mixed, iteration, reports):
            return True
        if iteration not in resolved:
            resolved.add(iteration)
            why = resolve_mixed(ctx, iteration)
            if why is None:
                del mixed[iteration]
                return False
            mixed[iteration] += f"; {why}"
        ctx.unloadable[(iteration, ctx.world_size)] = mixed[iteration]
        return False

    rounds = damaged = limit = 0
    while True:
        rounds += 1
        started = time.monotonic()
        if inventories is None or rounds > 1:
            inventories = ctx.gather_inventories(f"load of iteration {iteration}: inventory")
        complete = complete_iterations(inventories, ctx.world_size, ctx.erasure)
        candidates = [it for it in complete if it <= iteration and it not in mixed]
        if exact and (not candidates or candidates[0] != iteration):
            why = mixed.get(iteration) or ctx.unloadable.get((iteration, ctx.world_size))
            if why is not None:
                raise CorruptShardError(f"load: iteration {iteration} cannot be loaded: {why}")
            raise not_loadable(ctx, iteration, complete, quarantined)
        if elsewhere is not None and (not candidates or candidates[0] != iteration):
            fallback = candidates[0] if candidates else -1
            newer, elsewhere = elsewhere(fallback), None  # asked once
            if newer > fallback:
                iteration, inventories = newer, None  # list again: its copies are here now
                mixed.pop(newer, None)
                continue
        # Each round loads, or sets aside at least one copy: bounded by the most ever listed
        # (the listings shrink as copies are quarantined).
        limit = max(limit, 2 + sum(len(i.shards) for i in inventories))
        if not candidates or rounds > limit:
            raise nothing_left(ctx, iteration, quarantined, {**hidden, **mixed})
        if candidates[0] != iteration:
            if rank == 0:
                why = mixed.get(iteration) or ("corrupt copies were quarantined: " + "; ".join(
                    b[0] for b in quarantined))
                logger.warning("load: iteration %d can no longer be loaded (%s); falling back "
                               "to iteration %d on every rank", iteration, why, candidates[0])
            iteration = candidates[0]
        if needs_rebuild(ctx, iteration, inventories):  # erasure coding: lost shards first
            rebuilt = rebuild_lost(ctx, iteration, inventories)
            quarantined += rebuilt.bad
            if rebuilt.bad:  # plan again without them (not a damage in transit)
                continue
            if rebuilt.unusable is not None:
                mixed[iteration] = ctx.unloadable[(iteration, ctx.world_size)] = \
                    rebuilt.unusable
            elif rebuilt.retry:
                damaged += 1
                if damaged > 2:
                    raise CorruptShardError(
                        f"load of iteration {iteration}: blocks arrived damaged from copies "
                        f"that read well, {damaged} times in this load; the last: "
                        f"{rebuilt.retry[-1]}")
            continue  # list again: the rebuilt shards are on their owners' nodes now
        step = f"load of iteration {iteration}"
        rnd = plan_round(ctx, iteration, inventories, destinations)
        planned = time.monotonic()
        built: list[tuple[ShardManifest, Any]] = []
        local_only = not rnd.plan.exchange.rounds  # the same plan on every rank
        verify = ctx.group.exchange(f"{step}: verify sources", partial(
            _verify_sources, ctx, rnd, built if local_only else None),
            wait=_read_seconds(ctx, rnd) if local_only else None)
        verified = time.monotonic()
        if any(v["bad"] for v in verify):
            quarantined += [b for v in verify for b in v["bad"]]
            continue  # re-plan: another copy, or an older iteration
        if not unmixed(verify):
            continue  # the copies of one save, or an older iteration
        repair = parity_repair(ctx, iteration, inventories)
        if local_only:  # every rank read its own shard and built its state dict
            return built[0][0], built[0][1], None if repair is None else WriteBack(
                ctx, ExchangePlan(()), {}, iteration, 0.0, repair)
        pieces = {k: n for v in verify for k, n in v["pieces"].items()}
        # Beside the wire, each rank reads its own shard: each chunk of the largest bounded
        # by the timeout too (a rank with little to do waits as long as the others' work).
        reading = ctx.timeout * max(int(v["reads"]) for v in verify)
        fetch = ctx.group.exchange(f"{step}: fetch", partial(_fetch, ctx, rnd, built, fetched),
                                   wait=transfer_seconds(ctx, rnd.fetches, pieces) + reading)
        logger.debug("rank %d: restore plan %.3fs, verify %.3fs, fetch %.3fs", rank,
                     planned - started, verified - planned, time.monotonic() - verified)
        if any(v["bad"] for v in fetch):
            quarantined += [b for v in fetch for b in v["bad"]]
            continue
        if any(v["retry"] for v in fetch):
            damaged += 1
            if damaged > 2:
                raise CorruptShardError(
                    f"load of iteration {iteration}: shards arrived damaged from copies that "
                    f"read well, {damaged} times in this load; the last: "
                    f"{next(r for v in fetch for r in v['retry'])}")
            continue
        if not unmixed(fetch):
            continue
        write_back = WriteBack(ctx, rnd.plan.exchange, rnd.holders, iteration,
                               transfer_seconds(ctx, rnd.plan.exchange, pieces), repair,
                               next((v["save"] for v in fetch if v["save"] is not None), None))
        return built[0][0], built[0][1], write_back


def write_back_after(ctx: Context, iteration: int, inventories: list[Inventory],
                     save_id: str | None) -> WriteBack | None:
    """The write-back of ``iteration`` (every rank's and every node's copies, as the placement
    wants them; of save ``save_id``, the one loaded) started in the background after a load
    that did not plan one itself (a resharding load at this world size); None when nothing is
    missing."""
    rnd = plan_round(ctx, iteration, inventories)
    repair = parity_repair(ctx, iteration, inventories)
    if not rnd.plan.exchange.rounds and repair is None:
        return None
    return WriteBack(ctx, rnd.plan.exchange, rnd.holders, iteration, None, repair, save_id)


def _build(ctx: Context, rnd: Round, out: list[tuple[ShardManifest, Any]]) -> None:
    """This rank's state dict from its shard of the round, rebuilt in the form it was saved,
    tensors on their recorded devices, DTensors on the caller's meshes, Stateful objects of
    ``into`` restored (their ``load_state_dict`` runs here, inside an agreed step)."""
    assert rnd.own is not None, "the own shard is read or received before the build"
    manifest, tensors = rnd.own
    placed = {}
    if rnd.destinations is not None:
        fill_copied(rnd.destinations, tensors)
        placed = rnd.destinations.placed
    rewrap = Rewrap(manifest, rnd.into, rnd.destinations)
    state = rebuild_state_dict(
        manifest.hollow, tensors, [e.key_path for e in manifest.tensors],
        [e.device for e in manifest.tensors], manifest.container == "plain", placed,
        manifest.layouts, rewrap.dtensor, rewrap.restorer, rnd.into.types)
    rewrap.check_restored()
    out.append((manifest, state))
