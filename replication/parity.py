"""Parity built as the members' bytes arrive: what a parity holder runs during a save.

A parity block is a linear function of the stripe's members over GF(2^8): block j is the XOR over
members i of ``c[j][i] * member_i`` (byte by byte). So a holder can fold each member's bytes in as
they arrive, in any order and in pieces of any size, holding only the block itself, never the
members. For m = 1 every coefficient is 1 (plain XOR, as :func:`replication.codes.encode`); for
m >= 2 the coefficients are zfec's own (read off its encoder by encoding unit bytes, and checked
against this module's field on first use), so :func:`replication.codes.decode` rebuilds from
blocks made here.
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
        region = self.block[offset: offset + len(piece)]
        weight = self._weights[member]
        if weight != 1:
            piece = _times(weight)[piece]  # one table lookup per byte
        np.bitwise_xor(region, piece, out=region)
