"""A tensor's bytes as a buffer sharing its memory, without a copy; small tensors' bytes copied
out of a buffer they were read into with others."""

from __future__ import annotations

import bisect
import ctypes
from collections.abc import Sequence

import torch


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor (any dtype, pinned included) as a writable
    memoryview sharing its memory: what os.write / preadv / crc32c take without a copy. The view
    keeps ``t`` alive. Raises ValueError for a non-contiguous or non-CPU tensor."""
    if not (t.is_cpu and t.is_contiguous()):
        raise ValueError(f"byte_view: expected a contiguous CPU tensor, got one on {t.device} "
                         f"with strides {t.stride()}")
    # ctypes instead of tensor.view(uint8).numpy(): a third of the cost per tensor, which is
    # what a 10,000-tensor load pays 10,000 times.
    array = (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())
    array.owner = t  # type: ignore[attr-defined]
    return memoryview(array).cast("B")


def device_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 tensor sharing its memory."""
    # One view instead of two for a 1-D tensor (most small ones: biases, norms, their moments):
    # each costs microseconds, which a load of 30,000 tensors pays 30,000 times.
    return t.view(torch.uint8) if t.dim() == 1 else t.reshape(-1).view(torch.uint8)


# A fresh host tensor up to this size is not read into through a buffer of its own: it is read
# with the bytes around it into scratch memory and copied out (:func:`copy_out`). Each buffer
# object costs microseconds (a ctypes array, a memoryview, a preadv piece, a CRC call), which a
# load of 10,000 small tensors pays 10,000 times; a memmove from the cache costs less below this
# (40 MB in tensors of 4 / 16 / 32 / 64 KiB, read directly and copied out on this 2-core
# machine: 58 / 29 / 18 / 14 ms and 47 / 27 / 19 / 16 ms).
COPY_OUT_MAX_NBYTES = 16 << 10

# (offset in the packed data, address, nbytes) of host memory this process allocated
SmallTarget = tuple[int, int, int]


def address_of(view: memoryview) -> int:
    """The address of the first byte of a writable buffer."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def copy_out(small: Sequence[SmallTarget], starts: Sequence[int], lo: int, hi: int, src: int,
             base: int) -> None:
    """Copy into each target of ``small`` (sorted by offset, ``starts`` their offsets) the part
    of packed bytes [lo, hi) it covers, from memory at address ``src`` that holds packed byte
    ``base`` at its start. The targets must be memory this process allocated for them (a
    memmove into a read-only page would crash the process where a read raises EFAULT)."""
    memmove = ctypes.memmove
    k = max(bisect.bisect_right(starts, lo) - 1, 0)
    while k < len(small):
        off, address, nbytes = small[k]
        if off >= hi:
            break
        begin, end = max(off, lo), min(off + nbytes, hi)
        if end > begin:
            memmove(address + (begin - off), src + (begin - base), end - begin)
        k += 1


def writable_memory(anonymous: bool = False) -> list[tuple[int, int]] | None:
    """The address ranges this process may write, sorted, adjacent ones merged (from
    /proc/self/maps, about half a millisecond); None where that cannot be read (not Linux).
    ``anonymous``: only private memory backed by no file (the heap, what torch allocates): a
    file's mapping may be cut short by another process, and a store into it then kills this
    one (SIGBUS) where a read into it fails (EFAULT)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    ranges: list[tuple[int, int]] = []
    for line in lines:
        fields = line.split(maxsplit=5)
        span, perms = fields[0], fields[1]
        if perms[1:2] == b"w" and (not anonymous or (
                perms[3:4] == b"p" and len(fields) > 4 and fields[4] == b"0")):
            lo, hi = (int(x, 16) for x in span.split(b"-"))
            if ranges and ranges[-1][1] == lo:
                ranges[-1] = (ranges[-1][0], hi)
            else:
                ranges.append((lo, hi))
    return ranges


def outside(spans: Sequence[tuple[int, int]], writable: Sequence[tuple[int, int]]) -> int | None:
    """The index of the first of ``spans`` ([start, end) addresses, sorted by start) not wholly
    inside one of ``writable`` (as :func:`writable_memory` gives them); None when all are."""
    j, n = 0, len(writable)
    for k, (start, end) in enumerate(spans):
        while j < n and writable[j][1] <= start:
            j += 1
        if j == n or start < writable[j][0] or end > writable[j][1]:
            return k
    return None


def first_read_only_span(spans: Sequence[tuple[int, int]]) -> int | None:
    """The index of the first of ``spans`` (sorted [start, end) addresses) this process may
    not write (see :func:`outside`); None when every one may be written, or it cannot be told
    (/proc/self/maps is read only when there is a span)."""
    writable = writable_memory() if spans else None
    return None if writable is None else outside(spans, writable)


def first_read_only(tensors: Sequence[torch.Tensor]) -> int | None:
    """The index of the first host tensor of ``tensors`` whose memory this process may not
    write; None when every one may be written, or it cannot be told."""
    spans = []
    for k, t in enumerate(tensors):
        if t.is_cpu and t.numel():
            start = t.data_ptr()
            spans.append((start, start + extent(t) * t.element_size(), k))
    spans.sort()
    found = first_read_only_span([s[:2] for s in spans])
    return None if found is None else spans[found][2]


def extent(t: torch.Tensor) -> int:
    """Elements from ``t``'s first to its last in memory (views and strides included: a
    transpose spans what it covers, an expanded tensor less than its numel); 0 when empty."""
    if not t.numel():
        return 0
    if t.is_contiguous():
        return t.numel()
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))


def distinct_elements(t: torch.Tensor) -> bool:
    """Whether no two elements of ``t`` are one memory location (an expanded or unfolded view's
    are; such a tensor cannot hold another's values): its dims of more than one element, by
    stride, each step past all the elements the smaller ones reach (a slice, a step, a
    transpose do). False for a layout that interleaves dims without overlap: never one a
    model's tensor has."""
    if t.is_contiguous():
        return True
    reach = 1  # elements spanned by the dims taken so far
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True)
                               if n > 1):
        if stride < reach:
            return False
        reach += stride * (size - 1)
    return True


# Tensors whose spans overlap are compared byte by byte over at most this many bytes (a mask
# of their span); larger spans are taken to overlap.
SHARED_BYTES_MAX_SPAN = 1 << 28


def sharing(views: Sequence[torch.Tensor]) -> list[bool]:
    """For each of ``views`` (tensors of distinct elements whose [first, last] address spans
    chain into one range, on one device), whether it shares a byte of memory with another: the
    column slices of one matrix, or the even and odd elements of one buffer, span each other
    without sharing any. Every one is taken to share (True) when the range is over
    SHARED_BYTES_MAX_SPAN bytes, or there are more views than a byte can count; identical
    views (tied weights) share without a mask."""
    first = views[0]
    if all(v.data_ptr() == first.data_ptr() and v.shape == first.shape and
           v.stride() == first.stride() and v.element_size() == first.element_size()
           for v in views[1:]):
        return [True] * len(views)
    lo = min(v.data_ptr() for v in views)
    hi = max(v.data_ptr() + v.element_size() * extent(v) for v in views)
    if hi - lo > SHARED_BYTES_MAX_SPAN or len(views) > 255:
        return [True] * len(views)
    # Of addresses only: nothing is read. A slot per element when every view has elements of
    # one size on one grid (a quarter of the work for fp32), else per byte.
    unit = first.element_size()
    if any(v.element_size() != unit or (v.data_ptr() - lo) % unit for v in views):
        unit = 1
    mask = torch.zeros(-(-(hi - lo) // unit), dtype=torch.uint8)

    def bytes_of(v: torch.Tensor) -> torch.Tensor:
        size = v.element_size() // unit
        return mask.as_strided((*v.shape, size), (*(s * size for s in v.stride()), 1),
                               (v.data_ptr() - lo) // unit)

    for v in views:
        bytes_of(v).add_(1)
    return [bool(bytes_of(v).max() > 1) for v in views]


def past_storage(t: torch.Tensor) -> tuple[int, int] | None:
    """(bytes its storage holds, bytes the tensor spans from the storage's start) when a CPU or
    CUDA tensor reaches past the end of its storage (freed or shrunk with
    ``untyped_storage().resize_()``, as FSDP frees unsharded parameters: reading or writing it
    touches memory it does not own); None otherwise."""
    if not (t.is_cpu or t.is_cuda) or not t.numel():
        return None
    have = t.untyped_storage().nbytes()
    span = (t.storage_offset() + extent(t)) * t.element_size()
    return (have, int(span)) if span > have else None


def refuse_past_storage(t: torch.Tensor, what: str) -> None:
    """TypeError naming ``what`` when ``t`` reaches past its storage (see past_storage)."""
    found = past_storage(t)
    if found is not None:
        have, span = found
        raise TypeError(f"{what}: its storage holds {have} bytes, the tensor spans {span} "
                        "(freed or shrunk with untyped_storage().resize_(), as FSDP frees "
                        "unsharded parameters): use it while its storage is allocated, or the "
                        "sharded state")
