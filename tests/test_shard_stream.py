"""Streaming a shard: the executor's segments, and TensorReceiver taking a shard's bytes into
its tensors (large ones in place) with every chunk's checksum checked on arrival. Pure: the
executor's calls are made here in the order it makes them."""

from __future__ import annotations

import pytest
import torch

from localckpt.errors import CorruptShardError
from localckpt.storage import shard_stream
from localckpt.storage.peer_io import PieceRing
from localckpt.storage.store import ShardStore
from replication import Transfer
from replication.executor import segments


def test_segments_cut_pieces_at_the_splits_and_cover_every_byte_once() -> None:
    assert segments(10, 4, ()) == [(0, 0, 4), (1, 4, 8), (2, 8, 10)]
    assert segments(10, 4, (2, 4, 9, 0, 10, 11)) == [
        (0, 0, 2), (0, 2, 4), (1, 4, 8), (2, 8, 9), (2, 9, 10)]
    assert segments(0, 4, (1,)) == []


def _saved(root, tensors: list[torch.Tensor]):  # type: ignore[no-untyped-def]
    """Save ``tensors`` in a world of one (64 KiB chunks); the store, shard and packed data."""
    from localckpt import LocalCheckpointManager

    with LocalCheckpointManager(root, "s", chunk_nbytes=1 << 16) as mgr:
        mgr.save({f"t{i}": t for i, t in enumerate(tensors)}, 1)
    store = ShardStore(root, "s", 0)
    ref = store.committed()[0]
    manifest, data = store.read(ref)
    return store, ref, manifest, data


def _mixed() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(10, generator=g), torch.randn(700_000, generator=g),  # 2.8 MB
            torch.randint(0, 255, (5,), dtype=torch.uint8, generator=g),
            torch.randn(300_000, generator=g).to(torch.bfloat16),  # 600 kB: below the cut
            torch.randn(3, 4, generator=g).double(), torch.randn(262_144, generator=g)]


def _receive(manifest, data: torch.Tensor, piece: int,  # type: ignore[no-untyped-def]
             splits: tuple[int, ...]) -> shard_stream.TensorReceiver:
    t = Transfer(0, 1, manifest.iteration, manifest.owner_rank)
    r = shard_stream.TensorReceiver(t, manifest.encoded, data.numel(), manifest.world_size,
                                    PieceRing())
    for index, (_, start, end) in enumerate(segments(data.numel(), piece, splits)):
        buf = r.piece_buffer(index, start, end)
        buf.copy_(data[start:end])
        r.piece_received(index, start, end)
    r.finish()
    return r


@pytest.mark.parametrize("piece", [1 << 16, 3 << 16, 64 << 20])
def test_a_shard_arrives_bit_identical_large_tensors_in_place(root, piece: int,  # type: ignore[no-untyped-def]
                                                              monkeypatch) -> None:
    tensors = _mixed()
    store, _, manifest, data = _saved(root, tensors)
    splits = shard_stream.tensor_splits(manifest)
    big = [e for e in manifest.tensors if e.nbytes >= shard_stream.DIRECT_MIN_NBYTES]
    assert len(big) == 2 and all(e.offset in splits for e in big)
    placed: list[bool] = []
    real = shard_stream.TensorReceiver.piece_buffer

    def spy(self, index, start, end):  # type: ignore[no-untyped-def]
        buf = real(self, index, start, end)
        placed.append(any(_inside(buf, t) for t in self.tensors))
        return buf

    monkeypatch.setattr(shard_stream.TensorReceiver, "piece_buffer", spy)
    r = _receive(manifest, data, piece, splits)
    for got, want in zip(r.tensors, tensors, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert any(placed) and not all(placed)  # big tensors in place, the rest through scratch
    store.close()


@pytest.mark.parametrize("piece", [1 << 16, 3 << 16])
def test_small_tensors_cut_by_pieces_arrive_bit_identical(root, piece: int) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(4)
    tensors = [torch.randn(1 + 3001 * (i % 3), generator=g) for i in range(120)]  # across pieces
    store, _, manifest, data = _saved(root, tensors)
    r = _receive(manifest, data, piece, shard_stream.tensor_splits(manifest))
    for got, want in zip(r.tensors, tensors, strict=True):
        assert torch.equal(got, want)
    store.close()


def _inside(buf: torch.Tensor, t: torch.Tensor) -> bool:
    lo = t.data_ptr()
    return lo <= buf.data_ptr() < lo + t.numel() * t.element_size()


def test_a_damaged_byte_fails_its_chunk_on_arrival(root) -> None:  # type: ignore[no-untyped-def]
    store, _, manifest, data = _saved(root, _mixed())
    bad = data.clone()
    bad[(1 << 16) * 5 + 7] ^= 1
    with pytest.raises(CorruptShardError, match="chunk 5 failed its checksum on arrival"):
        _receive(manifest, bad, 3 << 16, shard_stream.tensor_splits(manifest))
    store.close()


def test_a_manifest_for_another_shard_is_refused(root) -> None:  # type: ignore[no-untyped-def]
    store, _, manifest, data = _saved(root, _mixed())
    with pytest.raises(CorruptShardError, match="expected"):
        shard_stream.TensorReceiver(Transfer(0, 1, 2, 0), manifest.encoded, data.numel(), 1,
                                    PieceRing())
    store.close()


def test_reading_from_disk_gives_every_piece_and_names_a_corrupt_chunk(root) -> None:  # type: ignore[no-untyped-def]
    store, ref, manifest, data = _saved(root, _mixed())
    out = shard_stream.outgoing_from_disk(store, ref, manifest, PieceRing())
    got = [out.read(s, min(s + out.piece_nbytes, out.nbytes)).clone()
           for s in range(0, out.nbytes, out.piece_nbytes)]
    out.close()
    assert torch.equal(torch.cat(got), data)
    chunk = ref.path / "data" / "c" / "2"
    raw = bytearray(chunk.read_bytes())
    raw[3] ^= 0x10
    chunk.write_bytes(raw)
    store = ShardStore(root, "s", 0)  # no cached manifest
    out = shard_stream.outgoing_from_disk(store, ref, store.read_manifest(ref), PieceRing())
    with pytest.raises(CorruptShardError, match="c/2: checksum mismatch"):
        out.read(0, min(out.piece_nbytes, out.nbytes))
    out.close()
    store.close()


def test_the_messages_a_stream_from_disk_takes_are_counted_as_sent(root) -> None:  # type: ignore[no-untyped-def]
    """Waits for a fetch or a write-back allow one timeout per message: the count must be that
    of the stream (16 MiB pieces, cut again at every tensor of 1 MiB or more), not of a replica
    (64 MiB pieces)."""
    from localckpt.storage.peer_io import piece_count

    g = torch.Generator().manual_seed(5)
    store, ref, manifest, _ = _saved(root, [torch.randn(300_000, generator=g)
                                            for _ in range(12)])  # 12 x 1.2 MB
    try:
        for splits in ((), shard_stream.tensor_splits(manifest)):
            out = shard_stream.outgoing_from_disk(store, ref, manifest, PieceRing(), splits)
            sent = len(segments(out.nbytes, out.piece_nbytes, out.splits))
            out.close()
            assert shard_stream.wire_messages(manifest, splits) == sent
        assert sent > piece_count(manifest.chunk_nbytes, manifest.chunk_count)
    finally:
        store.close()
