"""Parity blocks from the bytes peers send: folded as they arrive, committed like shards.

Two sinks for :func:`localckpt.storage.peer_io.run_transfers`, each holding only what it builds,
never the blocks it is sent:

- :class:`ParityFolder` (a parity holder, at a save and when a lost block is folded again): each
  member's shard is folded into the block of its stripe this rank keeps; once every member
  arrived the block is committed (:meth:`ParityFolder.commit`) with a version-5 manifest that
  carries the members' sizes and manifests.
- :class:`ShardRebuilder` (the owner of a lost shard, at a restore): each block of the stripe is
  folded in with its weight (:class:`replication.stripe_plans.Rebuild`); the shard is then
  committed under the manifest a parity block carried, every chunk checked against its CRC.

Every arriving chunk is checked against the CRC-32C in its sender's manifest as it is folded
(CorruptShardError): a block is never built from damaged bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from replication import StripeLayout, Transfer, parity_slot
from replication.parity import ParityAccumulator, fold
from replication.stripe_plans import Rebuild

from ..errors import CorruptShardError
from .checksum import crc32c
from .layout import ShardRef
from .manifest import ShardManifest, TensorEntry, writer_identity
from .parity_info import PARITY_FORMAT_VERSION, ParityInfo
from .peer_io import PieceRing, prefix_nbytes, received_manifest
from .shard_stream import STREAM_PIECE_NBYTES
from .space import chunking
from .store import ShardStore
from .views import byte_view


class _Incoming:
    """One block on the wire: its checked manifest, each piece folded in as it arrives."""

    def __init__(self, t: Transfer, meta: bytes, nbytes: int, world_size: int, ring: PieceRing,
                 fold_in: Any, prefix: int | None = None) -> None:
        self.manifest, self._where = received_manifest(t, meta, nbytes, world_size, prefix)
        self.meta = meta
        self._ring, self._fold_in = ring, fold_in
        self._current = torch.empty(0, dtype=torch.uint8)
        self.complete = False

    def piece_buffer(self, index: int, start: int, end: int) -> torch.Tensor:
        self._current = self._ring.slot(index, end - start)
        return self._current

    def piece_received(self, index: int, start: int, end: int) -> None:
        m, size = self.manifest, self.manifest.chunk_nbytes
        if start % size or (end - start) % size:
            raise CorruptShardError(f"{self._where}: piece [{start}, {end}) is not made of "
                                    f"whole {size}-byte chunks")
        view = byte_view(self._current)
        for j, chunk in enumerate(range(start // size, end // size)):
            got = crc32c(view[j * size: (j + 1) * size])
            if got != m.chunk_crc32c[chunk]:
                raise CorruptShardError(
                    f"{self._where}: chunk {chunk} failed its checksum on arrival (computed "
                    f"crc32c {got:#010x}, manifest says {m.chunk_crc32c[chunk]:#010x})")
        self._fold_in(start, view)

    def finish(self) -> None:
        self.complete = True

    def abort(self) -> None:
        self.complete = False


@dataclass
class _FromDisk:
    """A block read from this rank's own node root instead of received (its manifest)."""

    manifest: ShardManifest
    meta: bytes
    complete: bool = True


def fold_from_disk(store: ShardStore, ref: ShardRef, ring: PieceRing,
                   fold_in: Callable[[int, memoryview], None],
                   prefix: int | None = None) -> _FromDisk:
    """Read the committed block ``ref`` piece by piece (every chunk checked against its CRC:
    CorruptShardError; with ``prefix``, only the chunks holding its first ``prefix`` bytes) and
    fold each piece in, as if it had arrived from a peer."""
    manifest = store.read_manifest(ref)
    total = prefix_nbytes(manifest, prefix)
    piece = manifest.chunk_nbytes * max(1, STREAM_PIECE_NBYTES // manifest.chunk_nbytes)
    for index, start in enumerate(range(0, total, piece)):
        buf = ring.slot(index, min(piece, total - start))
        store.read_range(ref, manifest, start, buf)
        fold_in(start, byte_view(buf))
    return _FromDisk(manifest, manifest.encoded)


@dataclass
class _Block:
    stripe: int
    block: int
    acc: ParityAccumulator
    # member index -> its stream, or its copy read from this node's root
    arrived: dict[int, _Incoming | _FromDisk] = field(default_factory=dict)


class ParityFolder:
    """The parity blocks of ``iteration`` this rank keeps, folded from the members' shards as
    they arrive (``sizes[r]``: member r's packed bytes, agreed before). Use :meth:`sink` as the
    exchange's sink, then :meth:`commit`. ``metadata``: the save's (rank 0's save id, clock),
    recorded in each block (None: the members'). ``blocks``: (stripe, block) of the blocks to
    fold (None: every block the layout gives this rank)."""

    def __init__(self, store: ShardStore, layout: StripeLayout, iteration: int, rank: int,
                 world_size: int, sizes: Mapping[int, int], ring: PieceRing,
                 metadata: dict[str, Any] | None,
                 blocks: list[tuple[int, int]] | None = None) -> None:
        self.store, self.layout, self.iteration = store, layout, iteration
        self.world_size, self.ring, self.metadata, self.sizes = world_size, ring, metadata, sizes
        self._blocks: dict[int, _Block] = {}  # by stripe: a rank keeps one block of a stripe
        self.committed: list[tuple[int, int]] = []  # (stripe, block), by commit
        for s, j in (layout.parity_kept_by(rank) if blocks is None else blocks):
            members = layout.stripes[s].members
            nbytes = max(sizes[r] for r in members)
            chunk_nbytes, count = chunking(nbytes, store.chunk_nbytes)
            self._blocks[s] = _Block(s, j, ParityAccumulator(layout.k, layout.m, j,
                                                             chunk_nbytes * count))

    def sink(self, t: Transfer, meta: bytes, nbytes: int) -> _Incoming:
        s = self.layout.stripe_of(t.owner)
        block = self._blocks.get(s)
        if block is None or t.iteration != self.iteration:
            raise CorruptShardError(f"rank {t.src} sent shard {t.shard} for a parity block "
                                    f"this rank does not keep")
        if nbytes != self.sizes[t.owner]:
            raise CorruptShardError(f"rank {t.src} sent {nbytes} bytes of shard {t.shard}, "
                                    f"{self.sizes[t.owner]} were agreed")
        index = self.layout.stripes[s].members.index(t.owner)
        incoming = _Incoming(t, meta, nbytes, self.world_size, self.ring,
                             lambda start, view: block.acc.add(index, start, view))
        block.arrived[index] = incoming
        return incoming

    def fold_local(self, ref: ShardRef) -> None:
        """Fold in member ``ref.owner_rank``'s shard from this node's own root (a repair whose
        holder's node keeps the member's shard): CorruptShardError for a damaged copy."""
        s = self.layout.stripe_of(ref.owner_rank)
        block = self._blocks[s]
        index = self.layout.stripes[s].members.index(ref.owner_rank)
        manifest = self.store.read_manifest(ref)
        if manifest.chunk_count * manifest.chunk_nbytes != self.sizes[ref.owner_rank]:
            raise CorruptShardError(f"{ref.path}: {manifest.chunk_count * manifest.chunk_nbytes}"
                                    f" bytes, {self.sizes[ref.owner_rank]} were agreed")
        block.arrived[index] = fold_from_disk(
            self.store, ref, self.ring, lambda start, view: block.acc.add(index, start, view))

    def commit(self) -> list[tuple[int, int]]:
        """Commit every block whose members all arrived whole; (stripe, block) of each. Then
        raises when a block is missing a member (the save fails, on every rank through its
        finalize) or a commit failed (the first error); :attr:`committed` lists what was
        committed either way."""
        committed = self.committed
        errors: list[Exception] = []
        for s, b in sorted(self._blocks.items()):
            members = self.layout.stripes[s].members
            if not all(i in b.arrived and b.arrived[i].complete for i in range(len(members))):
                errors.append(CorruptShardError(
                    f"parity block {b.block} of stripe {s} (members {list(members)}) of "
                    f"iteration {self.iteration}: not every member's shard arrived"))
                continue
            metadata = b.arrived[0].manifest.metadata if self.metadata is None \
                else self.metadata
            try:
                info = ParityInfo(self.layout.k, self.layout.m, s, b.block, members,
                                  tuple(self.sizes[r] for r in members),
                                  tuple(json.loads(b.arrived[i].meta)
                                        for i in range(len(members))))
                self.store.write(parity_manifest(self.store, self.iteration, self.world_size,
                                                 info, metadata), torch.from_numpy(b.acc.block))
            except Exception as exc:
                errors.append(exc)
                continue
            committed.append((s, b.block))
        if errors:
            raise errors[0]
        return committed


def parity_manifest(store: ShardStore, iteration: int, world_size: int, info: ParityInfo,
                    metadata: dict[str, Any]) -> ShardManifest:
    """The manifest of a parity block (its checksums are computed by the write)."""
    nbytes = max(info.sizes)
    chunk_nbytes, chunk_count = chunking(nbytes, store.chunk_nbytes)
    return ShardManifest(
        session_id=store.session_id, iteration=iteration,
        owner_rank=parity_slot(info.stripe, info.block), world_size=world_size,
        tensors=(TensorEntry("parity", "uint8", (nbytes,), 0, nbytes, "cpu"),),
        hollow={"T": 0}, container="plain", data_nbytes=nbytes, chunk_nbytes=chunk_nbytes,
        chunk_count=chunk_count, chunk_crc32c=(), identity=writer_identity(),
        format_version=PARITY_FORMAT_VERSION, metadata=metadata, parity=info)


class ShardRebuilder:
    """This rank's lost shard, rebuilt as ``rebuild``'s sources arrive (``nbytes``: its packed
    size, from a parity block's manifest). Use :meth:`sink`, then :meth:`commit`."""

    def __init__(self, store: ShardStore, rebuild: Rebuild, iteration: int, world_size: int,
                 nbytes: int, ring: PieceRing) -> None:
        self.store, self.rebuild, self.iteration = store, rebuild, iteration
        self.world_size, self.ring = world_size, ring
        self.out = np.zeros(nbytes, dtype=np.uint8)
        self._weights = {slot: w for slot, _, w in rebuild.sources}
        self._arrived: dict[int, _Incoming | _FromDisk] = {}

    def sink(self, t: Transfer, meta: bytes, nbytes: int) -> _Incoming:
        if t.owner not in self._weights or t.dst != self.rebuild.owner:
            raise CorruptShardError(f"rank {t.src} sent block {t.shard}, which the rebuild of "
                                    f"rank {self.rebuild.owner}'s shard does not use")
        weight, out = self._weights[t.owner], self.out
        # only the bytes the rebuilt shard has: a source's longer tail is never needed
        incoming = _Incoming(t, meta, nbytes, self.world_size, self.ring,
                             lambda start, view: fold(out, start, view, weight), len(out))
        self._arrived[t.owner] = incoming
        return incoming

    def fold_local(self, ref: ShardRef) -> None:
        """Fold in source ``ref`` from this node's own root (ranks moved between nodes, and the
        owner's new node keeps a block of its stripe): CorruptShardError for a damaged copy."""
        weight, out = self._weights[ref.owner_rank], self.out
        self._arrived[ref.owner_rank] = fold_from_disk(
            self.store, ref, self.ring, lambda start, view: fold(out, start, view, weight),
            len(out))

    def commit(self) -> ShardManifest:
        """Commit the rebuilt shard under its manifest, taken from a parity block that arrived;
        its chunks are checked against that manifest's CRCs (CorruptShardError: the blocks do
        not belong together, e.g. from different saves)."""
        if sorted(self._arrived) != sorted(self._weights) or not all(
                b.complete for b in self._arrived.values()):
            raise CorruptShardError(f"rebuild of rank {self.rebuild.owner}'s shard of iteration "
                                    f"{self.iteration}: not every block arrived")
        info = next(b.manifest.parity for b in self._arrived.values()
                    if b.manifest.parity is not None)
        where = (f"the manifest of rank {self.rebuild.owner}'s shard of iteration "
                 f"{self.iteration} in a parity block")
        manifest = ShardManifest.from_json_dict(info.manifests[self.rebuild.index], where)
        expected = (self.iteration, self.rebuild.owner, self.world_size, len(self.out))
        got = (manifest.iteration, manifest.owner_rank, manifest.world_size,
               manifest.chunk_count * manifest.chunk_nbytes)
        if got != expected:
            raise CorruptShardError(f"{where}: says (iteration, owner, world, bytes) = {got}, "
                                    f"expected {expected}")
        return self.store.write(manifest, torch.from_numpy(self.out))[1]
