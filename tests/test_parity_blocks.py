"""Parity blocks on disk (no processes): their names and listing, their manifests (format 5),
completeness counting rebuildable shards, and folding and rebuilding through the sinks the
executor feeds, piece by piece."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from localckpt.control.coverage import Inventory, complete_from_listings, holders_of
from localckpt.errors import CorruptShardError
from localckpt.storage.layout import list_shards, shard_path
from localckpt.storage.manifest import ShardManifest
from localckpt.storage.parity_info import ParityInfo
from localckpt.storage.parity_io import ParityFolder, ShardRebuilder, parity_manifest
from localckpt.storage.peer_io import PieceRing, piece_nbytes, prefix_nbytes
from localckpt.storage.space import chunking
from localckpt.storage.store import ShardStore
from replication import Topology, Transfer, parity_slot
from replication.codes import encode
from replication.erasure import stripe_layout
from replication.executor import segments
from replication.stripe_plans import rebuild_plan


@pytest.fixture
def store(root: Path) -> ShardStore:
    s = ShardStore(root, "sess", writer_rank=0, chunk_nbytes=4096)
    yield s
    s.close()


def shard(store: ShardStore, iteration: int, owner: int, world: int, nbytes: int
          ) -> tuple[ShardManifest, torch.Tensor]:
    """A committed shard of ``nbytes`` random bytes and its payload."""
    chunk_nbytes, count = chunking(nbytes, store.chunk_nbytes)
    payload = torch.zeros(chunk_nbytes * count, dtype=torch.uint8)
    payload[:nbytes] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                                     generator=torch.Generator().manual_seed(owner))
    manifest = ShardManifest(store.session_id, iteration, owner, world, (), {"dict": []},
                             "plain", nbytes, chunk_nbytes, count, (),
                             metadata={"save_id": "abc"})
    return store.write(manifest, payload)[1], payload


def send(sink: Any, t: Transfer, manifest: ShardManifest, payload: torch.Tensor,
         damage: int | None = None) -> Any:
    """What the executor does on the receiving side for one transfer, piece by piece."""
    incoming = sink(t, manifest.encoded, payload.numel())
    piece = piece_nbytes(manifest) // 4  # several pieces even for small shards
    for index, start, end in segments(payload.numel(), max(piece, manifest.chunk_nbytes), ()):
        buf = incoming.piece_buffer(index, start, end)
        buf.copy_(payload[start:end])
        if damage is not None and start <= damage < end:
            buf[damage - start] ^= 1
        incoming.piece_received(index, start, end)
    incoming.finish()
    return incoming


def test_parity_blocks_are_named_and_listed_under_their_slots(root: Path) -> None:
    path = shard_path(root, "s", 4, parity_slot(3, 1), 8)
    assert path.name == "parity_00003_01_of_00008" and path.parent.name == "iter_0000000004"
    path.mkdir(parents=True)
    (path.parent / "parity_00009_00_of_00008").mkdir()  # stripe beyond the world: not listed
    assert [(r.iteration, r.owner_rank, r.world_size) for r in list_shards(root, "s")] == [
        (4, parity_slot(3, 1), 8)]


def test_the_inventory_carries_parity_slots_and_completeness_counts_rebuildable_shards() -> None:
    layout = stripe_layout(Topology.uniform(4, 1), 3, 1)  # members 0-2, parity on 3; 3: on 0
    held = [frozenset({(5, 0, 4), (5, parity_slot(1, 0), 4)}), frozenset({(5, 1, 4)}),
            frozenset(), frozenset({(5, 3, 4), (5, parity_slot(0, 0), 4)})]
    doc = Inventory(0, "s", held[0] | held[3]).to_json()
    assert Inventory.from_json(json.loads(json.dumps(doc)), 0).shards == held[0] | held[3]
    assert complete_from_listings(held, 4) == []  # rank 2's shard is held by no node
    assert complete_from_listings(held, 4, layout) == [5]  # but parity rebuilds it
    assert complete_from_listings(held[:3], 4, layout) == []  # not with node 3 lost too
    inventories = [Inventory(r, "s", s) for r, s in enumerate(held)]
    assert holders_of(inventories, 5, 4)[parity_slot(0, 0)] == [3]


def test_a_parity_manifest_round_trips_and_is_checked(store: ShardStore) -> None:
    member, _ = shard(store, 1, 0, 2, 5000)
    info = ParityInfo(1, 1, 1, 0, (1,), (8192,), (member.to_json_dict(),))
    m = parity_manifest(store, 1, 2, info, {"save_id": "abc"})
    ref, _ = store.write(m, torch.zeros(8192, dtype=torch.uint8))
    m = ShardManifest.from_json_bytes(store.read_manifest(ref).encoded, "here")
    assert m.parity == info and m.format_version == 5 and m.owner_rank == parity_slot(1, 0)
    body = m.to_json_dict()["manifest"]
    for change, match in [({"owner_rank": 0}, "owner rank 0"),
                          ({"data_nbytes": 100}, "parity block of 100 bytes"),
                          ({"parity": {**body["parity"], "block": 1}}, "block 1 of stripe 1"),
                          ({"parity": {**body["parity"], "members": [5]}}, "members")]:
        from localckpt.storage.manifest import _crc_of

        edited = {**body, **change}
        with pytest.raises(CorruptShardError, match=match):
            ShardManifest.from_json_dict({"manifest": edited, "crc32c": _crc_of(edited)}, "x")


@pytest.mark.parametrize("k,m", [(3, 1), (4, 2)])
def test_blocks_folded_from_streams_rebuild_a_lost_shard(store: ShardStore, k: int,
                                                         m: int) -> None:
    topo = Topology.uniform(k + m, 1)
    layout = stripe_layout(topo, k, m)
    world, ring = k + m, PieceRing()
    shards = {r: shard(store, 9, r, world, 3000 + 4500 * r) for r in layout.stripes[0].members}
    sizes = {r: p.numel() for r, (_, p) in shards.items()}
    holder = layout.stripes[0].parity[0]
    folder = ParityFolder(store, layout, 9, holder, world, sizes, ring, {"save_id": "abc"},
                          [(0, 0)])
    for r, (manifest, payload) in shards.items():
        send(folder.sink, Transfer(r, holder, 9, r), manifest, payload)
    assert folder.commit() == [(0, 0)]
    parity_ref = store.ref(9, parity_slot(0, 0), world)
    parity, block = store.read(parity_ref)
    assert parity.parity is not None and parity.parity.sizes == tuple(sizes.values())
    members = [p.numpy() for _, p in shards.values()]
    members += [np.zeros(0, np.uint8)] * (k - len(members))
    assert np.array_equal(block.numpy()[:parity.data_nbytes], encode(members, m)[0])
    # lose member 1 (and, with m = 2, member 2): rebuild member 1 from the rest and parity 0
    lost = {1} if m == 1 else {1, 2}
    holders = {r: [r] for r in range(world) if r not in lost} | {parity_slot(0, 0): [holder]}
    holders |= {slot: [-1] for s, _, slot in layout.slots() if s > 0}  # other stripes: whole
    if m == 2:  # block 1, folded the same way on its own holder
        other = layout.stripes[0].parity[1]
        folder = ParityFolder(store, layout, 9, other, world, sizes, ring, None, [(0, 1)])
        for r, (manifest, payload) in shards.items():
            send(folder.sink, Transfer(r, other, 9, r), manifest, payload)
        folder.commit()
        holders[parity_slot(0, 1)] = [other]
    planned = rebuild_plan(layout, 9, holders)
    assert planned is not None
    rebuild = next(r for r in planned[0] if r.owner == 1)
    expected = shards[1][1].clone()
    for r in lost:
        store.delete(store.ref(9, r, world))
    rebuilder = ShardRebuilder(store, rebuild, 9, world, sizes[1], ring)
    cut = []
    for slot, src, _ in rebuild.sources:
        manifest, payload = store.read(store.ref(9, slot, world))
        # a source is sent as far as the shard it rebuilds reaches, in whole chunks
        reach = prefix_nbytes(manifest, sizes[1])
        cut.append(reach < payload.numel())
        send(rebuilder.sink, Transfer(src, 1, 9, slot), manifest, payload[:reach])
    assert any(cut)  # the parity block (and longer members) reach past member 1
    rebuilt = rebuilder.commit()
    assert rebuilt == shards[1][0]
    assert torch.equal(store.read(store.ref(9, 1, world))[1], expected)


def test_a_block_damaged_on_the_wire_is_refused_and_no_parity_is_committed(
        store: ShardStore) -> None:
    layout = stripe_layout(Topology.uniform(4, 1), 3, 1)
    shards = {r: shard(store, 2, r, 4, 9000) for r in (0, 1, 2)}
    folder = ParityFolder(store, layout, 2, 3, 4, {r: p.numel() for r, (_, p) in shards.items()},
                          PieceRing(), {})
    send(folder.sink, Transfer(0, 3, 2, 0), *shards[0])
    with pytest.raises(CorruptShardError, match="chunk 1 failed its checksum on arrival"):
        send(folder.sink, Transfer(1, 3, 2, 1), *shards[1], damage=5000)
    send(folder.sink, Transfer(2, 3, 2, 2), *shards[2])
    with pytest.raises(CorruptShardError, match="not every member's shard arrived"):
        folder.commit()
    assert not store.ref(2, parity_slot(0, 0), 4).path.exists()
