"""Parity built as the members' bytes arrive (what a parity holder runs during a save), and a
lost member rebuilt the same way from any k blocks of its stripe (what its owner runs on a
restore).

A parity block is a linear function of the stripe's members over GF(2^8): block j is the XOR over
members i of ``c[j][i] * member_i`` (byte by byte). So a holder can fold each member's bytes in as
they arrive, in any order and in pieces of any size, holding only the block itself, never the
members. For m = 1 every coefficient is 1 (plain XOR, as :func:`replication.codes.encode`); for
m >= 2 the coefficients are zfec's own (read off its encoder by encoding unit bytes, and checked
against this module's field on first use), so :func:`replication.codes.decode` rebuilds from
blocks made here.

Decoding is linear too: with the k blocks S at hand, member i is the XOR over s in S of
``w[s] * block_s``, where w is row i of the inverse of the code's rows for S
(:func:`rebuild_weights`). So an owner folds in each source block as it streams in, holding only
the shard it rebuilds.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

_POLY = 0x11D  # x^8 + x^4 + x^3 + x^2 + 1: the field zfec (Rizzo's fec) computes in


def _gf_mul(a: int, b: int) -> int:
    product = 0
    while b:
        if b & 1:
            product ^= a
        a <<= 1
        if a & 0x100:
            a ^= _POLY
        b >>= 1
    return product


@functools.lru_cache(maxsize=256)
def _times(c: int) -> np.ndarray:
    """The 256-entry table of x -> c * x in GF(2^8)."""
    return np.array([_gf_mul(x, c) for x in range(256)], dtype=np.uint8)


@functools.lru_cache(maxsize=64)
def coefficients(k: int, m: int) -> tuple[tuple[int, ...], ...]:
    """``c[j][i]``: the weight of member i in parity block j of a k + m stripe."""
    if m == 1:
        return (tuple([1] * k),)
    import zfec

    encoder = zfec.Encoder(k, k + m)

    def parity_of(member: int, value: int) -> list[int]:
        blocks = [b"\0"] * k
        blocks[member] = bytes([value])
        return [block[0] for block in encoder.encode(blocks, list(range(k, k + m)))]

    coef = tuple(tuple(parity_of(i, 1)[j] for i in range(k)) for j in range(m))
    # zfec is linear over this field: a * e_i encodes to a * c[j][i] (checked once per layout)
    for i in range(k):
        for value in (2, 3, 87, 255):
            got = parity_of(i, value)
            if got != [_gf_mul(value, coef[j][i]) for j in range(m)]:
                raise RuntimeError("zfec computes in another field than GF(2^8) with "
                                   f"polynomial {_POLY:#x}: parity cannot be built piecewise")
    return coef


def _gf_inverse(a: int) -> int:
    """a^-1 in GF(2^8) (a^254), for a != 0."""
    result, power, e = 1, a, 254
    while e:
        if e & 1:
            result = _gf_mul(result, power)
        power = _gf_mul(power, power)
        e >>= 1
    return result


def code_row(k: int, m: int, block: int) -> tuple[int, ...]:
    """Block ``block``'s weights over the k members: a unit row for member ``block`` < k,
    parity block ``block - k``'s coefficients after."""
    if block < k:
        return tuple(int(i == block) for i in range(k))
    return coefficients(k, m)[block - k]


def rebuild_weights(k: int, m: int, sources: tuple[int, ...], member: int) -> tuple[int, ...]:
    """``w`` with member ``member`` = the XOR over i of ``w[i] * block sources[i]``: ``sources``
    are k distinct block numbers (members 0..k-1, parity k..k+m-1). ValueError when they are
    not k distinct blocks of the code (then they cannot rebuild it)."""
    if len(set(sources)) != k or not all(0 <= b < k + m for b in sources):
        raise ValueError(f"rebuild: expected {k} distinct blocks of a {k}+{m} code, got "
                         f"{list(sources)}")
    # Gauss-Jordan over GF(2^8) on [rows | I]: rows @ members = blocks, so members = inv @ blocks
    rows = [list(code_row(k, m, b)) + [int(i == r) for i in range(k)]
            for r, b in enumerate(sources)]
    for col in range(k):
        pivot = next((r for r in range(col, k) if rows[r][col]), None)
        if pivot is None:  # an MDS code never gets here
            raise ValueError(f"rebuild: blocks {list(sources)} do not determine the members")
        rows[col], rows[pivot] = rows[pivot], rows[col]
        scale = _gf_inverse(rows[col][col])
        rows[col] = [_gf_mul(x, scale) for x in rows[col]]
        for r in range(k):
            factor = rows[r][col]
            if r != col and factor:
                rows[r] = [x ^ _gf_mul(factor, y) for x, y in zip(rows[r], rows[col], strict=True)]
    return tuple(rows[member][k:])


FOLD_STEP = 1 << 20  # bytes multiplied at a time: the product stays in cache (2x faster here)


def fold(out: np.ndarray, offset: int, data: Any, weight: int) -> None:
    """``out[offset:offset + n] ^= weight * data`` in GF(2^8), for the part of ``data`` that
    falls inside ``out`` (a longer block's zero-padded tail beyond it is dropped)."""
    piece = np.frombuffer(data, dtype=np.uint8)[:max(0, len(out) - offset)]
    if not weight or not len(piece):
        return
    if weight == 1:
        region = out[offset: offset + len(piece)]
        np.bitwise_xor(region, piece, out=region)
        return
    table = _times(weight)
    product = np.empty(min(FOLD_STEP, len(piece)), dtype=np.uint8)
    for lo in range(0, len(piece), FOLD_STEP):
        part = piece[lo: lo + FOLD_STEP]
        np.take(table, part, out=product[:len(part)])  # one table lookup per byte
        region = out[offset + lo: offset + lo + len(part)]
        np.bitwise_xor(region, product[:len(part)], out=region)


class ParityAccumulator:
    """Parity block ``j`` of a ``k`` + ``m`` stripe, ``nbytes`` long (the longest member),
    built from members' pieces: ``add(i, offset, data)`` folds bytes [offset, offset + len) of
    member i in. Each member byte must be added exactly once (a repeat cancels it out)."""

    def __init__(self, k: int, m: int, j: int, nbytes: int) -> None:
        if not 0 <= j < m:
            raise ValueError(f"parity block {j}: expected 0 <= j < {m}")
        self.block = np.zeros(nbytes, dtype=np.uint8)
        self._weights = coefficients(k, m)[j]

    def add(self, member: int, offset: int, data: Any) -> None:
        if not 0 <= member < len(self._weights):
            raise ValueError(f"member {member}: expected 0 <= member < {len(self._weights)}")
        piece = np.frombuffer(data, dtype=np.uint8)
        if offset < 0 or offset + len(piece) > len(self.block):
            raise ValueError(f"member {member}: bytes [{offset}, {offset + len(piece)}) fall "
                             f"outside the {len(self.block)}-byte parity block")
        fold(self.block, offset, piece, self._weights[member])
