"""CRC-32C (Castagnoli), the checksum of every chunk and manifest: one function, the fastest
implementation installed that gives the ``crc32c`` package's values.

A load checks every byte it reads, a 1 MiB window at a time while the window is in the cache,
so on a core of its own it pays read + checksum. On one core of the 2-core x86_64 CI machine
(AVX-512 with VPCLMULQDQ), 1 MiB windows in the cache: crc32c-rs 85 GB/s (corsix's fast-crc32
kernels, chosen for the CPU at run time), awscrt 64 GB/s, the ``crc32c`` package 32 GB/s. Two
processes loading a 256 MiB shard each with ``load(into=...)`` at once took 1.15-1.17x a bare
read of the same files with crc32c-rs, 1.23-1.24x with awscrt (interleaved in the same two
processes). All three release the GIL, take any contiguous buffer without a copy and give the
value zarr's crc32c codec stores. Each candidate is checked against the ``crc32c`` package (a
dependency everywhere, the fallback) on import, and one that is missing or disagrees is passed
over. ``LOCALCKPT_CRC32C`` names the one to use (to compare them): ``crc32c_rs``, ``awscrt`` or
``crc32c``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

import crc32c as _package

CANDIDATES = ("crc32c_rs", "awscrt", "crc32c")  # fastest first
_MODULES = {"crc32c_rs": "crc32c_rs", "awscrt": "awscrt.checksums"}  # each one's crc32c


def _load(name: str) -> Callable[[Any, int], int] | None:
    """The implementation ``name`` if it is installed and gives the package's values."""
    if name == "crc32c":
        return _package.crc32c
    try:
        module = importlib.import_module(_MODULES[name])
    except Exception:  # not installed, or a native module that fails to load: the next one
        return None
    f = getattr(module, "crc32c", None)
    return f if callable(f) and _agrees(f) else None


def _agrees(f: Callable[[Any, int], int]) -> bool:
    """Whether ``f`` gives the package's values, as ints: lengths below and above the sizes
    where fast kernels change method, from an odd offset and continued from a nonzero value,
    and a whole 1 MiB window from the start (what a load checks at a time), from zero."""
    sample = memoryview(bytes(range(251)) * 4200)  # 1,054,200 bytes
    cases = [(sample[1 : 1 + n], 7) for n in (0, 1, 15, 63, 257, 4099, 65_539)]
    cases.append((sample[: 1 << 20], 0))
    try:
        for data, value in cases:
            got = f(data, value)
            if type(got) is not int or got != _package.crc32c(data, value):
                return False
    except Exception:  # an API that changed, a broken build: pass it over
        return False
    return True


def _choose() -> tuple[str, Callable[[Any, int], int]]:
    forced = os.environ.get("LOCALCKPT_CRC32C", "")
    if forced and forced not in CANDIDATES:
        raise ValueError(f"LOCALCKPT_CRC32C: expected one of {', '.join(CANDIDATES)} (or "
                         f"unset: the fastest installed), got {forced!r}")
    for name in (forced,) if forced else CANDIDATES:
        f = _load(name)
        if f is not None:
            return name, f
    raise ImportError(f"LOCALCKPT_CRC32C={forced}: that CRC-32C implementation is not "
                      "installed, or gives other values than the crc32c package")


#: Which implementation :func:`crc32c` is (one of CANDIDATES), for reports.
IMPLEMENTATION, _crc32c = _choose()


def crc32c(data: Any, value: int = 0) -> int:
    """CRC-32C of the bytes of ``data`` (any contiguous buffer: bytes, memoryview, numpy
    array), continuing from ``value`` (the CRC of the bytes before). TypeError for a str (awscrt
    would checksum its UTF-8 bytes, the crc32c package refuses it: text has no one encoding)."""
    if type(data) is str:
        raise TypeError("crc32c: expected a bytes-like object, got str")
    return _crc32c(data, value)
