"""The staging arena: one reusable host buffer per rank that every tensor is packed into.

Staging is the only part of a save that blocks training. Tensors are copied (never aliased) into
aligned slots of a single uint8 buffer; that buffer is what the shard store writes and what
replication sends, so there are no per-tensor files or transfers. The buffer is kept across saves
and reallocated only when a save needs more than it holds. On CUDA the buffer is pinned and the
device-to-host copies run on a side stream, ordered after the work already queued on the current
stream and finished by an event.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .manifest import dtype_name

ALIGNMENT = 64  # bytes; every dtype view and vectorised copy is happy with this


def aligned(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class PackedLayout:
    """Where each tensor goes in the arena. ``nbytes`` is the end of the last tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int


def plan_layout(tensors: Sequence[torch.Tensor]) -> PackedLayout:
    """Aligned offsets for ``tensors`` packed in order (pure)."""
    offsets, sizes = [], []
    end = 0
    for t in tensors:
        dtype_name(t.dtype)  # raises TypeError for a dtype we cannot store
        if t.is_quantized:
            raise TypeError("quantized tensors are not supported: dequantize them before saving")
        size = t.numel() * t.element_size()
        start = aligned(end)
        offsets.append(start)
        sizes.append(size)
        end = start + size
    return PackedLayout(tuple(offsets), tuple(sizes), end)


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

    def buffer(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the arena, growing it if needed (contents then undefined)."""
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None  # free the old one before allocating the new one
            self._buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self._pin)
            self.allocations += 1
        return self._buffer[:nbytes]

    def stage(self, tensors: Sequence[torch.Tensor], layout: PackedLayout,
              total_nbytes: int) -> torch.Tensor:
        """Copy ``tensors`` into the arena at ``layout`` and return the arena's first
        ``total_nbytes`` (>= layout.nbytes; the tail is zeroed).

        Blocks until every copy is complete: on return the caller may modify or free the source
        tensors, and the returned buffer holds a snapshot.
        """
        buf = self.buffer(total_nbytes)
        buf[layout.nbytes :].zero_()
        events = []
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(tensors):
            by_device.setdefault(t.device, []).append(i)
        for device, indices in by_device.items():
            if device.type == "cuda":
                events.append(self._stage_cuda(device, tensors, indices, layout, buf))
            else:
                for i in indices:
                    t = tensors[i]
                    tensor_view(buf, layout.offsets[i], layout.sizes[i], t.dtype, t.shape).copy_(
                        t.detach()
                    )
        for event in events:
            event.synchronize()
        return buf

    def _stage_cuda(self, device: torch.device, tensors: Sequence[torch.Tensor],
                    indices: list[int], layout: PackedLayout,
                    buf: torch.Tensor) -> torch.cuda.Event:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        # The side stream must see every kernel already queued that writes these tensors.
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for i in indices:
                t = tensors[i]
                dst = tensor_view(buf, layout.offsets[i], layout.sizes[i], t.dtype, t.shape)
                dst.copy_(t.detach(), non_blocking=self._pin)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        return event
