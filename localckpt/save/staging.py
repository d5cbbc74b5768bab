"""The staging arena: one reusable host buffer per rank that every tensor is packed into.

Staging is the only part of a save that blocks training. Tensors are copied (never aliased) into
aligned slots of a single uint8 buffer; that buffer is what the shard store writes and what
replication sends, so there are no per-tensor files or transfers. The buffer is kept across saves
and reallocated only when a save needs more than it holds. On CUDA the buffer is pinned and the
device-to-host copies run on a side stream, ordered after the work already queued on the current
stream and finished by an event; small CUDA tensors of one device and dtype are packed next to
each other, so that they are gathered on the GPU and cross to the host in one copy.

The copies of large tensors start while the state dict is still being walked
(:class:`localckpt.save.early_copies.EagerCopies`).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors

from ..errors import CorruptShardError
from ..storage.host_memory import MIN_NBYTES, advise_huge_pages, empty_host
from ..storage.manifest import dtype_name
from ..storage.views import refuse_past_storage

ALIGNMENT = 64  # bytes; every dtype view and vectorised copy is happy with this

# Below this a plain memmove beats a torch copy, whose dispatch and view building cost several
# microseconds per tensor (10,000 x 4 KiB: 77 -> 17 ms); above it torch's multi-threaded copy wins.
_MEMMOVE_MAX_NBYTES = 256 * 1024

# Each device-to-host copy costs ~15 us of launch and dispatch, whatever its size: 10,000 CUDA
# tensors of 4 KiB took 171 ms one by one on an H100, 40 MB at 53 GB/s take 0.8 ms. CUDA tensors
# up to this size are therefore gathered on the GPU (one kernel per run) and copied together;
# loads batch the copies back to the GPU the same way (state_dict.restore_devices).
GATHER_MAX_NBYTES = 1 << 20
GATHER_RUN_MAX_NBYTES = 64 << 20  # bounds the scratch a gathered copy needs


def aligned(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class PackedLayout:
    """Where each tensor goes in the arena. ``nbytes`` is the end of the last tensor.

    ``runs``: groups of tensor indices (one device, CUDA or the CPU, and dtype each) whose bytes
    lie back to back from an aligned offset, in the order listed: each run is staged as one
    copy.
    ``copied``: indices whose copy into the arena, queued while the state dict was walked, is
    their value (the stage copies every other tensor).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int
    runs: tuple[tuple[int, ...], ...] = ()
    copied: frozenset[int] = frozenset()  # copied into the arena already (EagerCopies)
    singles: tuple[int, ...] | None = None  # the indices in no run; None: every index


def _plain_memory(t: torch.Tensor) -> bool:
    # A conjugate or negative view's memory is not its value, and an efficient zero tensor has
    # none: only plain memory can be concatenated or copied ahead as it is.
    return not (t.is_conj() or t.is_neg() or t._is_zerotensor())


# Host tensors of these types only are concatenated in runs: a subclass's __torch_function__
# would see (and could change) torch.cat of them all.
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _gatherable(t: torch.Tensor, size: int) -> bool:
    """Whether ``t`` is staged in a run (one copy for many tensors): a small host tensor of a
    plain type (torch.cat takes any strides, and conjugate, negative and zero views by value),
    or a small contiguous CUDA tensor of plain memory."""
    if not 0 < size <= GATHER_MAX_NBYTES:
        return False
    if t.is_cpu:
        return type(t) in _PLAIN_TYPES
    return t.is_cuda and t.is_contiguous() and _plain_memory(t)


def _check_storable(t: torch.Tensor) -> None:
    """TypeError for a tensor whose dtype or kind a shard cannot hold."""
    if t.is_quantized:
        raise TypeError("quantized tensors are not supported: dequantize them before saving")
    dtype_name(t.dtype)


def plan_layout(tensors: Sequence[torch.Tensor], placed: Mapping[int, int] | None = None,
                start: int = 0, copied: frozenset[int] | None = None,
                paths: Sequence[str] | None = None) -> PackedLayout:
    """Offsets for ``tensors`` (pure): those in ``placed`` (index -> offset, all below
    ``start``: placed while the walk ran, see :class:`EagerCopies`; ``copied``, default all of
    them, need no copy at the stage) where they are; from ``start`` on, small tensors (CUDA, or
    host tensors of a plain type) back to back in runs of one device and dtype, then every other
    tensor in order, each at a 64-byte aligned offset. TypeError (naming its key in
    ``paths``) for a tensor that cannot be stored, or that reaches past its storage (a copy
    would read memory it does not own: a crash, or other objects' bytes saved): checked here,
    once the walk ran every Stateful's state_dict() and before anything is staged."""
    sizes = []
    groups: dict[Any, list[int]] = {}
    rest = []
    placed = placed or {}
    storable: set[torch.dtype] = set()  # checked once per dtype: 7,500 tensors take 0.5 us each
    def where(i: int) -> str:
        return f"state dict key {paths[i]!r}" if paths is not None and i < len(paths) \
            else f"tensor {i}"

    for i, t in enumerate(tensors):
        dtype = t.dtype
        if dtype not in storable:
            try:
                _check_storable(t)
            except TypeError as exc:
                raise TypeError(f"unsupported tensor at {where(i)}: {exc}") from None
            storable.add(dtype)
        size = t.nbytes
        sizes.append(size)
        cpu = t.is_cpu
        # The usual case inline (contiguous, inside its storage): 10,000 tensors pay it.
        if size and (cpu or t.is_cuda) and not (
                t.is_contiguous() and t.storage_offset() * dtype.itemsize + size
                <= t.untyped_storage().nbytes()):
            refuse_past_storage(t, f"unsupported tensor at {where(i)}")
        if placed and i in placed:
            continue
        if cpu:  # host runs keyed by dtype alone: no torch.device made
            if 0 < size <= GATHER_MAX_NBYTES and type(t) in _PLAIN_TYPES:  # _gatherable's
                groups.setdefault(dtype, []).append(i)
            else:
                rest.append(i)
        elif _gatherable(t, size):
            groups.setdefault((t.device, dtype), []).append(i)
        else:
            rest.append(i)
    offsets = [0] * len(tensors)
    end = start
    for i, off in placed.items():
        offsets[i] = off
        end = max(end, off + sizes[i])
    runs = [run for members in groups.values()
            for run in split_runs(members, [sizes[i] for i in members], GATHER_RUN_MAX_NBYTES)]
    for run in runs:
        end = aligned(end)
        for i in run:
            offsets[i] = end  # same dtype back to back: every offset a multiple of its size
            end += sizes[i]
    for i in rest:
        offsets[i] = aligned(end)
        end = offsets[i] + sizes[i]
    return PackedLayout(tuple(offsets), tuple(sizes), end, tuple(runs),
                        frozenset(placed) if copied is None else copied, (*placed, *rest))


def split_runs(items: Sequence[int], sizes: Sequence[int], limit: int) -> list[tuple[int, ...]]:
    """``items`` in consecutive runs of at most ``limit`` bytes (an item larger than ``limit``
    alone); none for no items."""
    runs: list[list[int]] = []
    total = 0
    for item, size in zip(items, sizes, strict=True):
        if not runs or total + size > limit:
            runs.append([])
            total = 0
        runs[-1].append(item)
        total += size
    return [tuple(run) for run in runs]


def _release_cached_pinned() -> None:
    """Give the pinned blocks torch keeps for reuse back to the system (a grown arena's old
    buffer among them: kept, it would hold the host memory of a shard twice). Where this torch
    has no such call, nothing happens."""
    release = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or \
        getattr(torch._C, "_host_emptyCache", None)
    if release is not None:
        with contextlib.suppress(RuntimeError):  # an optimization: a save never fails on it
            release()


def growth_slack(count: int, nbytes: int) -> int:
    """Bytes an arena grown for ``count`` tensors of ``nbytes`` in all takes beyond them: the
    same tensors in another order (large ones first, once they are copied early) pad
    differently, by up to ALIGNMENT each, and the chunking rounds the total up (by less than a
    byte per chunk: chunks are 4 KiB or more); a save that did not fit would allocate again
    and copy its early tensors twice."""
    return ALIGNMENT * count + max(64 << 10, nbytes >> 12)


def tensor_view(buffer: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype,
                shape: Sequence[int]) -> torch.Tensor:
    """A tensor of ``dtype``/``shape`` aliasing ``buffer[offset:offset + nbytes]`` (uint8)."""
    return buffer[offset : offset + nbytes].view(dtype).view(tuple(shape))


class StagingArena:
    """A host buffer reused across saves. Not thread-safe: one save stages at a time.

    ``pin`` None means: pin when CUDA is available.
    """

    def __init__(self, pin: bool | None = None) -> None:
        self._pin = torch.cuda.is_available() if pin is None else pin
        self._buffer: torch.Tensor | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.allocations = 0  # how many times the buffer was (re)allocated; for tests and metrics

    @property
    def capacity(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def reserve(self, nbytes: int, slack: int = 0) -> None:
        """Grow the arena to ``nbytes`` (and ``slack`` more) now and touch every page, so that
        the first save does not pay the page faults (on this machine they cost more than the
        copy itself)."""
        before = self.allocations
        self.buffer(nbytes, slack)
        if self.allocations != before:
            assert self._buffer is not None
            self._buffer.zero_()

    def buffer(self, nbytes: int, slack: int = 0) -> torch.Tensor:
        """The first ``nbytes`` of the arena, growing it if needed to ``nbytes + slack``
        (contents then undefined)."""
        if self._buffer is None or self._buffer.numel() < nbytes:
            grown = self._buffer is not None
            self._buffer = None  # free the old one before allocating the new one,
            if grown and self._pin:
                _release_cached_pinned()  # out of torch's cache of pinned blocks too
            # Kept across saves: one made inside a caller's inference_mode would be an
            # inference tensor, which no later save outside it may write into.
            with torch.inference_mode(False):
                self._buffer = torch.empty(max(nbytes + slack, 1), dtype=torch.uint8,
                                           pin_memory=self._pin)
                if not self._pin:  # (pinned memory is the CUDA host allocator's)
                    advise_huge_pages(self._buffer)
            self.allocations += 1
        return self._buffer[:nbytes]

    def stage(self, tensors: Sequence[torch.Tensor], layout: PackedLayout,
              total_nbytes: int) -> torch.Tensor:
        """Copy ``tensors`` into the arena at ``layout`` and return the arena's first
        ``total_nbytes`` (>= layout.nbytes; the tail is zeroed).

        Blocks until every copy is complete: on return the caller may modify or free the source
        tensors, and the returned buffer holds a snapshot.
        """
        buf, settle = self.stage_begin(tensors, layout, total_nbytes)
        settle()
        return buf

    def stage_begin(self, tensors: Sequence[torch.Tensor], layout: PackedLayout,
                    total_nbytes: int) -> tuple[torch.Tensor, Callable[[], None]]:
        """:meth:`stage` with the wait left to the caller: the copies from CUDA tensors may
        still run when this returns (CPU tensors are copied), and ``settle()`` blocks until
        they are complete. Until then the caller must not modify the source tensors, and must
        call it before the buffer is read or staged into again."""
        copied = layout.copied
        if copied and total_nbytes > self.capacity:
            # The buffer the early copies went to is replaced: they are made again into the
            # new one, once none of them can still write into the old one.
            self.synchronize()
            copied = frozenset()
        buf = self.buffer(total_nbytes, growth_slack(len(tensors), total_nbytes))
        buf[layout.nbytes :].zero_()
        events: list[torch.cuda.Event] = []
        by_device: dict[torch.device, list[int]] = {}
        singles = range(len(tensors)) if layout.singles is None else layout.singles
        for i in singles:
            t = tensors[i]
            if copied and i in copied:  # its device still gets an event below (covers it)
                by_device.setdefault(t.device, [])
            else:
                by_device.setdefault(t.device, []).append(i)
        runs_of: dict[torch.device, list[tuple[int, ...]]] = {}
        for run in layout.runs:
            runs_of.setdefault(tensors[run[0]].device, []).append(run)
            by_device.setdefault(tensors[run[0]].device, [])
        try:
            for device, indices in by_device.items():
                runs = runs_of.get(device, [])
                if device.type == "cuda":
                    events.append(self._stage_cuda(device, tensors, indices, runs, layout, buf))
                else:  # another accelerator's memory is no host address: torch copies it
                    _stage_cpu(tensors, indices, layout, buf, host=device.type == "cpu",
                               runs=runs)
        except BaseException:
            # Another device's copies may be queued already: none may still write into the
            # arena once this raised (the next save stages into it).
            self.synchronize()
            raise

        def settle() -> None:
            for event in events:
                event.synchronize()

        return buf, settle

    def synchronize(self) -> None:
        """Block until no copy queued into the arena can still write into it."""
        for stream in self._streams.values():
            stream.synchronize()

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The stream the copies from ``device`` run on (made on first use)."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return stream

    def _stage_cuda(self, device: torch.device, tensors: Sequence[torch.Tensor],
                    indices: list[int], runs: list[tuple[int, ...]], layout: PackedLayout,
                    buf: torch.Tensor) -> torch.cuda.Event:
        stream = self.side_stream(device)
        # The side stream must see every kernel already queued that writes these tensors.
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), torch.no_grad():
            for run in runs:
                start = layout.offsets[run[0]]
                end = layout.offsets[run[-1]] + layout.sizes[run[-1]]
                # Concatenated in C++ (no Python per tensor), on this stream: the scratch is
                # reused only by later work on the same stream, so freeing it here is safe.
                flat = _flatten_dense_tensors([tensors[i] for i in run])  # type: ignore[no-untyped-call]
                buf[start:end].view(flat.dtype).copy_(flat, non_blocking=self._pin)
            for i in indices:
                t = tensors[i]
                if t.is_conj() or t.is_neg():
                    # Materialized here first: a copy to the host of a lazy view applies the bit
                    # on the host, racing the asynchronous copy (seen on an H100: the memory,
                    # not the value, was staged).
                    t = t.resolve_conj().resolve_neg()
                dst = tensor_view(buf, layout.offsets[i], layout.sizes[i], t.dtype, t.shape)
                dst.copy_(t, non_blocking=self._pin)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        return event


def _stage_cpu(tensors: Sequence[torch.Tensor], indices: list[int], layout: PackedLayout,
               buf: torch.Tensor, host: bool = True,
               runs: Sequence[tuple[int, ...]] = ()) -> None:
    for run in runs:
        start = layout.offsets[run[0]]
        end = layout.offsets[run[-1]] + layout.sizes[run[-1]]
        members = [tensors[i] for i in run]
        # One torch.cat into the arena: its C++ loop costs a fraction of a microsecond a tensor,
        # a memmove from Python one and a half (10,000 x 4 KiB: 4.6 against 12 ms).
        with torch.no_grad():
            flat = [t if t.dim() == 1 else t.reshape(-1) for t in members]
            torch.cat(flat, out=buf[start:end].view(members[0].dtype))
    base = buf.data_ptr()
    offsets, sizes, memmove = layout.offsets, layout.sizes, ctypes.memmove
    for i in indices:
        t = tensors[i]
        size = sizes[i]
        # A conjugate or negative view's memory is not its value, and an efficient zero tensor
        # has none (data_ptr 0): only torch's copy resolves them.
        if host and size <= _MEMMOVE_MAX_NBYTES and t.is_contiguous() and not (
                t.is_conj() or t.is_neg()):
            src = t.data_ptr()
            if src:
                memmove(base + offsets[i], src, size)
                continue
        if size:
            tensor_view(buf, offsets[i], size, t.dtype, t.shape).copy_(t.detach())


def unpack(buffer: torch.Tensor,
           entries: Sequence[tuple[int, int, torch.dtype, Sequence[int]]]) -> list[torch.Tensor]:
    """Each (offset, nbytes, dtype, shape) of the packed uint8 CPU ``buffer`` copied into a
    tensor of its own storage (the inverse of :meth:`StagingArena.stage`)."""
    base = buffer.data_ptr()
    out = []
    for offset, nbytes, dtype, shape in entries:
        # Raw copies below: a manifest that disagrees with itself must not address other memory
        # (checked before allocating what it claims).
        if not (offset >= 0 and offset + nbytes <= buffer.numel() and min(shape, default=0) >= 0
                and math.prod(shape) * dtype.itemsize == nbytes):
            raise CorruptShardError(
                f"manifest entry ({offset=}, {nbytes=}, {dtype}, shape {tuple(shape)}) does not "
                f"fit its {buffer.numel()}-byte data")
        t = torch.empty(tuple(shape), dtype=dtype) if nbytes < MIN_NBYTES \
            else empty_host(tuple(shape), dtype)
        if nbytes <= _MEMMOVE_MAX_NBYTES:
            if nbytes:
                ctypes.memmove(t.data_ptr(), base + offset, nbytes)
        else:
            t.copy_(tensor_view(buffer, offset, nbytes, dtype, shape))
        out.append(t)
    return out
