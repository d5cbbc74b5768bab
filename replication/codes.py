"""Parity codes for erasure-coded stripes: m = 1 as XOR, m >= 2 as Reed-Solomon (zfec).

A stripe's members may hold shards of different sizes. Each is taken as zero-padded to the
longest (the parity blocks' length) without being copied: XOR folds each member into the prefix
of the parity it covers, and Reed-Solomon runs piece by piece, where a member that has ended
contributes a shared zero piece (only a member's last, partial piece is copied, once, into a
piece-sized buffer).

Block numbering follows the code: blocks 0..k-1 are the members' shards in stripe order,
k..k+m-1 the parity blocks. ``encode`` returns the parity blocks; ``decode`` rebuilds the
members' shards from any k blocks. Both take buffers (bytes, memoryview, numpy arrays) and
never check integrity: every block is checksummed by whoever stored it, and a block that fails
its checksum is simply not given.

Reed-Solomon: zfec was measured against pyeclib (liberasurecode's and ISA-L's Vandermonde RS)
on this machine, 4+2, 64 MiB blocks: zfec encodes 1.13 GB/s of data and decodes two lost
blocks at 1.16 GB/s; pyeclib 0.52 / 0.45 (liberasurecode) and 0.71 / 0.74 (ISA-L). zfec is one
small wheel with a systematic, buffer-taking API; pyeclib's wheel bundles two C libraries and its
interface takes one contiguous object, so unequal shards would have to be copied together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

PIECE = 1 << 20  # bytes per Reed-Solomon call: inside a core's L2 cache, few Python calls


def _array(block: Any) -> np.ndarray:
    return np.frombuffer(block, dtype=np.uint8)


def _zfec() -> Any:
    try:
        import zfec
    except ImportError as exc:  # pragma: no cover - the extra is not installed
        raise ImportError("erasure coding with m >= 2 needs zfec: pip install "
                          "'localckpt[erasure]'") from exc
    return zfec


def xor_into(out: np.ndarray, blocks: Sequence[Any]) -> None:
    """``out`` = the XOR of ``blocks``, each zero-padded (or cut) to ``len(out)``: one pass over
    each block, the first bytes of each range copied rather than XORed into zeros."""
    filled = 0
    for block in blocks:
        data = _array(block)[:len(out)]
        n = min(len(data), filled)
        np.bitwise_xor(out[:n], data[:n], out=out[:n])
        if len(data) > filled:
            out[filled:len(data)] = data[filled:]
            filled = len(data)
    out[filled:] = 0


def parity_nbytes(sizes: Sequence[int]) -> int:
    """The length of every parity block of members of ``sizes`` bytes."""
    return max(sizes, default=0)


def encode(members: Sequence[Any], m: int, piece: int = PIECE) -> list[np.ndarray]:
    """The ``m`` parity blocks of ``members`` (their shards' bytes, any sizes)."""
    length = parity_nbytes([len(_array(b)) for b in members])
    if m == 1:
        out = np.empty(length, dtype=np.uint8)
        xor_into(out, members)
        return [out]
    k = len(members)
    encoder = _zfec().Encoder(k, k + m)
    parity = [np.empty(length, dtype=np.uint8) for _ in range(m)]
    arrays = [_array(b) for b in members]
    zeros = np.zeros(min(piece, length), dtype=np.uint8)
    for lo in range(0, length, piece):
        n = min(piece, length - lo)
        outs = encoder.encode([_piece(a, lo, n, zeros) for a in arrays], list(range(k, k + m)))
        for j, block in enumerate(outs):
            parity[j][lo: lo + n] = np.frombuffer(block, dtype=np.uint8)
    return parity


def decode(blocks: Mapping[int, Any], sizes: Sequence[int], m: int,
           piece: int = PIECE) -> dict[int, np.ndarray]:
    """The members' shards missing from ``blocks`` (block number -> bytes; members are
    0..k-1, parity k..k+m-1), rebuilt from any ``k = len(sizes)`` of them; ``sizes``: every
    member's shard size. ValueError when fewer than k blocks are given."""
    k = len(sizes)
    missing = [i for i in range(k) if i not in blocks]
    if not missing:
        return {}
    usable = sorted(i for i in blocks if 0 <= i < k + m)
    if len(usable) < k:
        raise ValueError(f"decode: {k} of the stripe's {k + m} blocks are needed, got "
                         f"{len(usable)} ({usable})")
    length = parity_nbytes(sizes)
    arrays = {i: _array(blocks[i]) for i in usable}
    for i in usable:
        want = sizes[i] if i < k else length
        if len(arrays[i]) != want:
            raise ValueError(f"decode: block {i} has {len(arrays[i])} bytes, expected {want}")
    out = {i: np.empty(sizes[i], dtype=np.uint8) for i in missing}
    if m == 1:  # one member lost: the parity XOR every other member
        (lost,) = missing
        xor_into(out[lost], [arrays[i] for i in usable])
        return out
    chosen = usable[:k]
    decoder = _zfec().Decoder(k, k + m)
    zeros = np.zeros(min(piece, length), dtype=np.uint8)
    for lo in range(0, length, piece):
        n = min(piece, length - lo)
        primary = decoder.decode([_piece(arrays[i], lo, n, zeros) for i in chosen], chosen)
        for i in missing:
            end = min(lo + n, sizes[i])
            if end > lo:
                out[i][lo:end] = np.frombuffer(primary[i], dtype=np.uint8)[:end - lo]
    return out


def _piece(data: np.ndarray, lo: int, n: int, zeros: np.ndarray) -> Any:
    """Bytes [lo, lo + n) of ``data`` zero-padded: a view when it is all there, the shared
    zero piece when ``data`` ended before ``lo``, else a padded copy of the tail."""
    if lo + n <= len(data):
        return data[lo: lo + n].data
    if lo >= len(data):
        return zeros[:n].data
    tail = np.zeros(n, dtype=np.uint8)
    tail[:len(data) - lo] = data[lo:]
    return tail.data
