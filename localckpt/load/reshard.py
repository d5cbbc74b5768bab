"""Load a checkpoint written by a job of another world size (or another mesh): each rank's DTensor
shards are assembled from the boxes of the old ranks' shards that overlap them, read by the ranks
holding those shards (locally or as replicas) and sent to it; its plain state is that of old rank
``rank % old_world`` (:func:`localckpt.control.reshard.plain_owner`).

Collective, in three agreed steps and one transfer, on the library's groups:

1. **layouts**: every rank reports the DTensor shards its ``into`` holds (their boxes) and the
   manifests of the old shards it serves (the lowest rank holding each); every rank then plans the
   same pieces (pure, :func:`localckpt.control.reshard.plan_reshard`);
2. **read**: every serving rank reads its old shards (every chunk's checksum verified) and packs
   the pieces for each destination;
3. an ``all_to_all`` on the data group moves them (in the fewest rounds that move at most about
   ROUND_NBYTES per rank each, every round bounded by the group's timeout);
4. **build**: every rank copies its pieces into its DTensors' local shards and builds its state
   dict (Stateful objects restored) from its plain owner's structure.

A copy that fails its checks is quarantined by the rank that read it and the load raises
CorruptShardError on every rank; the manager then lists again and retries (another holder's copy,
or an older iteration). Not yet: a serving rank holds the old shards it serves in memory while it
packs (the same-world load streams). The pieces a rank reads for itself stay from its read to its
build: views of the shard read when they are at least half of it, else copies (a whole shard
is never kept for a few plain bytes).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from ..control.collectives import collective_error
from ..control.context import Context
from ..control.coverage import Inventory, holders_of
from ..control.reshard import OldShard, Piece, Want, choose_servers, plain_owner, plan_reshard
from ..dtensors import DTensorLayout
from ..errors import ConfigurationError, CorruptShardError, MixedSavesError
from ..ops.faults import fault_point
from ..state_dict import rebuild_state_dict
from ..storage.checksum import crc32c
from ..storage.host_memory import empty_host
from ..storage.manifest import ShardManifest, dtype_from_name, dtype_name
from ..storage.shard_stream import wire_messages
from ..storage.views import distinct_elements, first_read_only, refuse_past_storage
from .destinations import Destinations, Into, Rewrap, Target, read_only_error
from .rounds import copies_held, saves_held
from .tied import split_tied

logger = logging.getLogger(__name__)

ALIGN = 64  # bytes: every piece starts at a multiple of this in the send and receive buffers
# What one round of the all-to-all moves per rank at most: each round is one collective bounded
# by the data group's timeout, so a reshard that could not move in one timeout at the network's
# speed moves in several rounds instead of failing every attempt alike (as long as this much
# moves within a timeout: 1 GiB takes 9 s at 1 Gb/s).
ROUND_NBYTES = 1 << 30


def round_count(pairs: dict[tuple[int, int], int], limit: int) -> int:
    """How many rounds an all-to-all of ``pairs`` ((src, dst) -> bytes) takes so that no rank
    sends or receives much more than ``limit`` bytes a round (pure: the same on every rank):
    the fewest that do."""
    sent: dict[int, int] = defaultdict(int)
    got: dict[int, int] = defaultdict(int)
    for (src, dst), n in pairs.items():
        sent[src] += n
        got[dst] += n
    return max(1, -(-max([*sent.values(), *got.values(), 0]) // limit))


def round_share(nbytes: int, rounds: int) -> int:
    """The bytes of a pair's ``nbytes`` each round moves (the last round the rest): both ends
    of the pair compute it alike."""
    share = -(-nbytes // rounds)
    return -(-share // ALIGN) * ALIGN


def _round_splits(splits: list[int], rounds: int, r: int) -> list[int]:
    return [max(0, min(round_share(n, rounds), n - r * round_share(n, rounds)))
            for n in splits]


def _all_to_all(group: Any, received: torch.Tensor, sent: torch.Tensor, recv_splits: list[int],
                send_splits: list[int], rounds: int, buffers: tuple[torch.Tensor, torch.Tensor],
                clock: list[float]) -> None:
    """``all_to_all_single`` of ``sent`` into ``received``, in ``rounds`` collectives that each
    move every pair's :func:`round_share` (the same rounds and splits on every rank), through
    ``buffers`` (made before, in an agreed step: a failed allocation here would be one rank's
    alone). ``clock`` gets the start of each round."""
    if rounds == 1:
        clock.append(time.monotonic())
        dist.all_to_all_single(received, sent, recv_splits, send_splits, group=group)
        return
    send_at = [sum(send_splits[:d]) for d in range(len(send_splits))]
    recv_at = [sum(recv_splits[:s]) for s in range(len(recv_splits))]
    out_buffer, in_buffer = buffers
    for r in range(rounds):
        out_splits = _round_splits(send_splits, rounds, r)
        in_splits = _round_splits(recv_splits, rounds, r)
        pos = 0
        for a, n, total in zip(send_at, out_splits, send_splits, strict=True):
            lo = a + r * round_share(total, rounds)
            out_buffer[pos : pos + n].copy_(sent[lo : lo + n])
            pos += n
        clock.append(time.monotonic())
        dist.all_to_all_single(in_buffer[: sum(in_splits)], out_buffer[:pos], in_splits,
                               out_splits, group=group)
        pos = 0
        for a, n, total in zip(recv_at, in_splits, recv_splits, strict=True):
            lo = a + r * round_share(total, rounds)
            received[lo : lo + n].copy_(in_buffer[pos : pos + n])
            pos += n


def _entry_tensor(manifest: ShardManifest, buffer: torch.Tensor, i: int) -> torch.Tensor:
    e = manifest.tensors[i]
    return buffer[e.offset:e.offset + e.nbytes].view(dtype_from_name(e.dtype)).view(e.shape)


def _piece(manifest: ShardManifest, buffer: torch.Tensor, p: Piece) -> torch.Tensor:
    """Piece ``p``'s elements in ``buffer``, the shard of old owner ``p.owner`` as read: its
    box of a DTensor entry, or a plain entry whole."""
    t = _entry_tensor(manifest, buffer, p.entry)
    return _box(t, p.src_start, p.size) if p.entry in manifest.layouts else t


def _box(t: torch.Tensor, start: tuple[int, ...], size: tuple[int, ...]) -> torch.Tensor:
    for dim, (s, n) in enumerate(zip(start, size, strict=True)):
        t = t.narrow(dim, s, n)
    return t


def _check_one_save(manifests: dict[int, ShardManifest], step: str,
                    copies: list[dict[str, list[list[int]]]]) -> None:
    """MixedSavesError (on every rank: the manifests are gathered) when the old shards read,
    or the copies of the iteration the job's nodes hold (``copies``: see
    :func:`.rounds.copies_held`), come from different saves of the iteration (one put back
    from a backup after it was re-saved; the older save's copies alone read by servers
    chosen by load): never a state dict mixed from two saves, nor an older save loaded over a
    newer one (the caller resolves)."""
    saves: dict[Any, set[int]] = saves_held(copies)
    for owner, manifest in sorted(manifests.items()):
        save = manifest.metadata.get("save_id")
        if save is not None:
            saves.setdefault(save, set()).add(owner)
    if len(saves) > 1:
        raise MixedSavesError(f"{step}: its shards come from different saves: " + "; ".join(
            f"old ranks {sorted(owners)[:8]} have copies of save {save}"
            for save, owners in sorted(saves.items())))


def not_a_block(path: str, layout: DTensorLayout, whose: str) -> ConfigurationError:
    return ConfigurationError(
        f"cannot reshard {path!r}: {whose} ({layout.describe()}) is not one block of the "
        "global tensor (a _StridedShard layout, such as a flattened view of a tensor sharded "
        "on two mesh dims); load it onto the mesh and placements it was saved with, or "
        "save and load the tensor unflattened")


def reshard_restore(ctx: Context, iteration: int, old_world: int,
                    inventories: list[Inventory], into: Any) -> tuple[ShardManifest, Any]:
    """This rank's state dict from ``iteration`` as saved by a job of ``old_world`` ranks, and
    its plain owner's manifest. Collective. Raises on every rank alike: ConfigurationError
    naming the leaves that cannot be resharded (or a DTensor leaf ``into`` has no DTensor for),
    the failing rank's error while reading (CorruptShardError) or building, CollectiveError."""
    rank, world = ctx.rank, ctx.world_size
    step = f"load of iteration {iteration} (saved by {old_world} ranks)"
    holders = holders_of(inventories, iteration, old_world)
    servers = choose_servers(holders, old_world)
    target = Into(into)

    def checked(owner: int, read: Any) -> Any:
        """``read(ref)`` of this rank's copy of ``owner``'s shard; a copy that fails its checks
        is quarantined (and the error raised)."""
        ref = ctx.store.ref(iteration, owner, old_world)
        try:
            return read(ref)
        except CorruptShardError as exc:
            moved = ctx.store.quarantine(ref)
            logger.warning("rank %d: load: %s; this copy was quarantined to %s", rank, exc, moved)
            raise

    def describe() -> dict[str, Any]:
        fault_point("load_retrieval", rank, iteration)
        for p, t in (target.paths() or {}).items():
            if t.layout is not None and not t.layout.is_block:
                raise not_a_block(p, t.layout, "this rank's shard in `into`")
        wants = {p: [list(t.layout.global_shape), dtype_name(t.tensor.dtype),
                     list(t.layout.offset), list(t.tensor.shape)]
                 for p, t in (target.paths() or {}).items() if t.layout is not None}
        # As the verified bytes, not a dict: no rank encodes a manifest again to check it.
        manifests = {str(o): checked(o, ctx.store.read_manifest).encoded.decode()
                     for o, server in servers.items() if server == rank}
        return {"wants": wants, "manifests": manifests,
                "copies": copies_held(ctx, iteration,
                                      [o for o, ranks in holders.items() if rank in ranks],
                                      old_world)}

    started = time.monotonic()
    described = ctx.group.exchange(f"{step}: layouts", describe)
    laid_out = time.monotonic()
    manifests = {int(o): ShardManifest.from_json_bytes(text.encode(), f"shard {o} of {step}")
                 for d in described for o, text in d["manifests"].items()}
    _check_one_save(manifests, step, [d["copies"] for d in described])
    old: dict[str, list[OldShard]] = defaultdict(list)
    for o, m in sorted(manifests.items()):
        paths = [m.tensors[i].key_path for i in m.layouts]
        if len(set(paths)) != len(paths):
            raise ConfigurationError(f"load: shard {o} of {step} names a DTensor key path "
                                     "twice; it cannot be resharded")
        for i, layout in m.layouts.items():
            if i in m.replicas:  # another member of its replica group stored it
                continue
            e = m.tensors[i]
            if not layout.is_block:  # the same verdict on every rank: the same manifests
                raise not_a_block(e.key_path, layout, f"old rank {o}'s saved shard")
            old[e.key_path].append(OldShard(o, i, layout.global_shape, e.dtype, layout.offset,
                                            e.shape))
    wants = [{p: Want(tuple(g), dt, tuple(off), tuple(shape))
              for p, (g, dt, off, shape) in d["wants"].items()} for d in described]
    if old_world == world:  # a leaf `into` has no DTensor for (a fresh optimizer's state):
        for r, mine in enumerate(wants):  # the rank's own saved box, wrapped on into's mesh
            m = manifests[r]
            for i, layout in m.layouts.items():
                e = m.tensors[i]
                mine.setdefault(e.key_path, Want(layout.global_shape, e.dtype, layout.offset,
                                                 m.replicas.get(i, e.shape)))
    pieces = plan_reshard(old, servers, wants)  # the same verdict on every rank
    # Plain state: every non-DTensor entry of each rank's plain owner, whole.
    for dst in range(world):
        q = plain_owner(dst, old_world)
        pieces += [Piece(servers[q], dst, q, i, e.key_path, (), (), ())
                   for i, e in enumerate(manifests[q].tensors) if i not in manifests[q].layouts]

    def nbytes(p: Piece) -> int:
        """The piece's bytes, padded to ALIGN so every piece starts aligned in the buffers
        (its dtype can be viewed in place there)."""
        e = manifests[p.owner].tensors[p.entry]
        if p.entry not in manifests[p.owner].layouts:  # plain state: the whole entry
            n = e.nbytes
        else:
            n = dtype_from_name(e.dtype).itemsize * int(torch.Size(p.size).numel())
        return -(-n // ALIGN) * ALIGN

    # this rank's pieces, in plan order: sent per destination, received per source
    outgoing: dict[int, list[Piece]] = defaultdict(list)
    incoming: dict[int, list[Piece]] = defaultdict(list)
    for p in pieces:
        if p.src == rank:
            outgoing[p.dst].append(p)
        if p.dst == rank:
            incoming[p.src].append(p)
    # A rank's pieces from the shards it reads itself never enter the buffers: copied from
    # what it read straight into its tensors (the plan makes most of a reshard's pieces so).
    send_splits = [sum(map(nbytes, outgoing[d])) if d != rank else 0 for d in range(world)]
    recv_splits = [sum(map(nbytes, incoming[s])) if s != rank else 0 for s in range(world)]
    pairs: dict[tuple[int, int], int] = defaultdict(int)
    for p in pieces:  # every rank's pairs: every rank agrees on the rounds
        if p.src != p.dst:
            pairs[p.src, p.dst] += nbytes(p)
    rounds = round_count(pairs, ROUND_NBYTES)
    own: dict[Piece, torch.Tensor] = {}  # this rank's own pieces, as read
    round_buffers: list[torch.Tensor] = []  # made in the agreed read step
    sent: list[torch.Tensor] = []
    group = ctx.data_group
    received: list[torch.Tensor] = []

    def pack() -> dict[str, int]:
        """Read and pack what this rank sends; the CRC-32C of its bytes for each rank it
        sends to (only those: the table every rank gathers grows with the plan, not with the
        square of the world)."""
        buffers = {o: checked(o, ctx.store.read)[1]
                   for o in sorted({p.owner for ps in outgoing.values() for p in ps})}
        mine: dict[int, int] = defaultdict(int)  # owner -> bytes of its pieces kept here
        for p in outgoing[rank]:
            mine[p.owner] += nbytes(p)
        for p in outgoing[rank]:  # a view keeps the whole shard alive: only when worth it
            t = _piece(manifests[p.owner], buffers[p.owner], p)
            own[p] = t if 2 * mine[p.owner] >= buffers[p.owner].numel() else _copy(t)
        out = empty_host(sum(send_splits))
        if group.group is not None:  # a failure here is agreed, not one rank's alone
            received.append(empty_host(sum(recv_splits)))
            if rounds > 1:  # what a round sends and receives, reused by every round
                round_buffers.extend(empty_host(sum(_round_splits(splits, rounds, 0)))
                                     for splits in (send_splits, recv_splits))
            group.check_usable(f"{step}: transfer")
        pos = 0
        for dst in range(world):
            for p in outgoing[dst] if dst != rank else ():
                t = _piece(manifests[p.owner], buffers[p.owner], p)
                # one copy, from the read shard straight into the send buffer
                out[pos:pos + t.numel() * t.element_size()].view(t.dtype).view(
                    t.shape).copy_(t)
                pos += nbytes(p)
        sent.append(out)
        if group.group is None:
            return {}
        return {str(dst): crc for dst, crc in enumerate(_crcs(out, send_splits))
                if send_splits[dst]}

    planned = time.monotonic()
    # A rank may wait here while the servers read whole shards: each message's worth of a
    # server's reads is bounded by the timeout, as a transfer's messages are.
    units = max(sum(wire_messages(manifests[o]) for o, server in servers.items()
                    if server == r) for r in range(world))
    crcs = ctx.group.exchange(f"{step}: read", pack, wait=ctx.timeout * (1 + units))
    read = time.monotonic()
    if group.group is None:
        received.append(sent[0])
    elif pairs:  # none when every piece is its reader's own (the same plan on every rank)
        clock: list[float] = []
        try:
            _all_to_all(group.group, received[0], sent[0], recv_splits, send_splits, rounds,
                        (round_buffers[0], round_buffers[1]) if rounds > 1 else
                        (sent[0], received[0]), clock)
        except RuntimeError as exc:
            where = f" (round {len(clock)} of {rounds})" if rounds > 1 else ""
            err = collective_error(f"{step}: transfer{where}", exc,
                                   time.monotonic() - (clock[-1] if clock else read),
                                   group.timeout)
            group.mark_broken(err)
            ctx.group.mark_broken(err)
            raise err from exc
    sent.clear()
    moved = time.monotonic()
    built: list[tuple[ShardManifest, Any]] = []

    def build() -> None:
        # The pieces were checked as read from disk; what crossed the wire is checked as
        # it arrived. Damage in transit fails the step: the load lists and moves them again.
        damaged = [src for src, crc in enumerate(_crcs(received[0], recv_splits))
                   if recv_splits[src] and crcs[src].get(str(rank)) != crc] \
            if group.group is not None else []
        if damaged:
            raise CorruptShardError(f"{step}: the bytes from ranks {damaged} arrived damaged "
                                    "(their checksum differs from the sender's)")
        built.append(_build(manifests[plain_owner(rank, old_world)], incoming, manifests,
                            received[0], own, rank, target, nbytes, old_world == world))
        own.clear()

    ctx.group.exchange(f"{step}: build", build)
    logger.debug("rank %d: reshard layouts %.3fs, plan %.3fs, read %.3fs, transfer %.3fs, "
                 "build %.3fs", rank, laid_out - started, planned - laid_out, read - planned,
                 moved - read, time.monotonic() - moved)
    return built[0]


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` in fresh host memory (huge pages when large)."""
    return empty_host(t.shape, t.dtype).copy_(t)


def _crcs(buffer: torch.Tensor, splits: list[int]) -> list[int]:
    """The CRC-32C of each consecutive ``splits`` bytes of ``buffer``."""
    data, out, pos = buffer.numpy(), [], 0
    for n in splits:
        out.append(crc32c(data[pos:pos + n]))
        pos += n
    return out


def _refuse_read_only(manifest: ShardManifest, targets: dict[str, Target]) -> None:
    """ConfigurationError naming the key of a tensor of ``into`` the build would copy into
    (a DTensor's local shard; a plain tensor of the saved dtype and shape) that lies in
    read-only memory: the copy would kill the process."""
    written = []
    for e in manifest.tensors:
        mine = targets.get(e.key_path)
        if mine is not None and (mine.layout is not None or (
                mine.tensor.dtype == dtype_from_name(e.dtype)
                and tuple(mine.tensor.shape) == tuple(e.shape))):
            written.append((e.key_path, mine.tensor))
    k = first_read_only([t for _, t in written])
    if k is not None:
        raise read_only_error(written[k][0])


def _build(manifest: ShardManifest, incoming: dict[int, list[Piece]],
           manifests: dict[int, ShardManifest], received: torch.Tensor,
           own: dict[Piece, torch.Tensor], rank: int, target: Into, nbytes: Any,
           same_world: bool) -> tuple[ShardManifest, Any]:
    """Copy the received pieces, and those of the shards this rank read itself (``own``: each
    such piece's elements as read), into this rank's DTensors and plain tensors, then rebuild its
    state dict from ``manifest`` (its plain owner's). At the same world size a DTensor leaf
    ``into`` has none for is received into a fresh tensor and wrapped on ``into``'s mesh."""
    targets = target.paths() or {}
    shards: dict[str, torch.Tensor] = {}  # DTensor leaf -> the local shard the pieces go to
    missing = []
    for i in manifest.layouts:
        e = manifest.tensors[i]
        mine = targets.get(e.key_path)
        if mine is not None and mine.layout is not None:
            refuse_past_storage(mine.tensor, f"load(into=...): the tensor at key {e.key_path!r}")
            shards[e.key_path] = mine.tensor
        elif same_world:
            shards[e.key_path] = empty_host(manifest.replicas.get(i, e.shape),
                                            dtype_from_name(e.dtype))
        else:
            missing.append(e.key_path)
    if missing:
        raise ConfigurationError(
            f"load: resharding needs a DTensor in load(into=...) at every DTensor leaf of the "
            f"checkpoint; `into` has none at {missing[:5]}"
            f"{f' (and {len(missing) - 5} more)' if len(missing) > 5 else ''}")
    _refuse_read_only(manifest, targets)
    plain: dict[int, torch.Tensor] = {}
    placed: dict[int, torch.Tensor] = {}
    fills: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # entry -> (into's, loaded)
    pos = 0
    for src in sorted(incoming):  # the receive buffer holds each other source's pieces in turn
        for p in incoming[src]:
            e = manifests[p.owner].tensors[p.entry]
            dtype = dtype_from_name(e.dtype)
            if src == rank:
                data = own[p]
            elif p.entry in manifests[p.owner].layouts:  # pieces start ALIGN-aligned: viewed
                data = received[pos:pos + dtype.itemsize * int(torch.Size(p.size).numel())
                                ].view(dtype).view(p.size)
            else:
                data = received[pos:pos + e.nbytes].view(dtype).view(e.shape)
            if p.entry in manifests[p.owner].layouts:
                with torch.no_grad():
                    _box(shards[p.path], p.dst_start, p.size).copy_(data)
            else:  # into ``into``'s tensor at its path when it fits, else its own storage
                mine = targets.get(e.key_path)
                if mine is not None and mine.layout is None and mine.tensor.dtype == dtype \
                        and tuple(mine.tensor.shape) == tuple(e.shape) \
                        and distinct_elements(mine.tensor):
                    refuse_past_storage(mine.tensor,  # about to be written
                                        f"load(into=...): the tensor at key {e.key_path!r}")
                    fills[p.entry] = (mine.tensor, data)
                else:
                    plain[p.entry] = _copy(data)
            pos += nbytes(p) if src != rank else 0
    # Tensors of ``into`` sharing memory (tied weights) are filled only with agreeing values.
    apart = split_tied(fills, {i: manifest.tensors[i].key_path for i in fills})
    with torch.no_grad():
        for i, (mine_tensor, data) in fills.items():
            if i in apart:
                plain[i] = _copy(data)
            else:
                mine_tensor.copy_(data)
                plain[i] = placed[i] = mine_tensor
    tensors = [shards[e.key_path] if i in manifest.layouts else plain[i]
               for i, e in enumerate(manifest.tensors)]
    dtensors = {}  # the caller's DTensors; the others are wrapped on into's mesh (Rewrap)
    for i in manifest.layouts:
        mine = targets.get(manifest.tensors[i].key_path)
        if mine is not None and mine.layout is not None:
            placed[i], dtensors[i] = tensors[i], mine.dtensor
    rewrap = Rewrap(manifest, target, Destinations([None] * len(tensors), dtensors=dtensors))
    rewrap.resharding = True
    state = rebuild_state_dict(
        manifest.hollow, tensors, [e.key_path for e in manifest.tensors],
        [e.device for e in manifest.tensors], manifest.container == "plain", placed,
        manifest.layouts, rewrap.dtensor, rewrap.restorer, target.types)
    rewrap.check_restored()
    return manifest, state
