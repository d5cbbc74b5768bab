"""Reading a shard onto a CUDA device through pinned host memory.

A chunk holding bytes of tensors bound for the device is read (and its CRC-32C checked, a window
at a time, on the reader thread) into a pinned host buffer of a slot; the slot's stream then
copies those bytes to the tensors while the thread reads its next chunk into another slot. There
is no pageable hop: a pageable host-to-device copy runs at a sixth of the pinned rate, and fresh
pageable memory costs a page fault per 4 KiB first.

A chunk with few pieces is copied piece by piece straight into the tensors; one with many small
tensors crosses once into a device buffer of the slot and is scattered on the device by one
batched copy (a host-to-device copy costs microseconds whatever its size).

Slots are made as readers need them, at most one per I/O thread and ``SPARE_SLOTS`` more, so a
small shard pins little; a reader takes the slot given back longest ago, whose copy (a third of a
millisecond for 16 MiB) is long complete. Their buffers come from torch's caching host
allocator: a second load in the same process reuses the pages.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..hollow import resolve_device
from .manifest import ShardManifest
from .views import byte_view

SPARE_SLOTS = 2  # beyond one per reader: a reader rarely waits for a copy to finish
_FEW_PIECES = 4  # up to this many pieces in a chunk: copied straight into the tensors


def cuda_destination(manifest: ShardManifest) -> torch.device | None:
    """The CUDA device most of ``manifest``'s bytes go back to, when it exists here; None when
    no entry goes to a CUDA device (or there is no CUDA)."""
    if not torch.cuda.is_available():
        return None
    by_name: dict[str, int] = {}
    for e in manifest.tensors:
        by_name[e.device] = by_name.get(e.device, 0) + e.nbytes
    cache: dict[str, torch.device] = {}
    nbytes: dict[torch.device, int] = {}
    for name, n in by_name.items():
        if n and name.startswith("cuda"):
            device = resolve_device(name, cache)
            if device.type == "cuda":
                nbytes[device] = nbytes.get(device, 0) + n
    return max(nbytes, key=nbytes.__getitem__) if nbytes else None


def _place(piece: tuple[torch.Tensor, int, int, int]) -> int:
    return piece[3]


@dataclass
class _Slot:
    pinned: torch.Tensor
    host: memoryview
    stream: torch.cuda.Stream
    event: torch.cuda.Event
    staging: torch.Tensor | None = None  # a chunk on the device, for a scatter of many pieces


class DeviceScatter:
    """Where each chunk's device-bound bytes go, and the slots that carry them there.

    Built on the loading thread; :meth:`take`, :meth:`copy_out` and :meth:`give` run on the
    reader threads, :meth:`finish` on the loading thread once every read returned (it blocks
    until every copy issued is complete, also after a failed read: no copy may still be writing
    when the tensors are handed back or dropped)."""

    def __init__(self, device: torch.device, targets: Sequence[tuple[int, torch.Tensor]],
                 chunk_nbytes: int, max_slots: int) -> None:
        """``targets``: (offset in the packed data, the tensor's bytes on ``device`` as
        :func:`localckpt.storage.views.device_bytes` gives them), not overlapping. The copies
        come after what the calling thread's current stream on ``device`` has queued."""
        self.device = device
        self.chunk_nbytes = chunk_nbytes
        self._max_slots = max(1, max_slots)
        # Copies on the slots' streams must come after whatever the loading thread's stream
        # still has queued on the memory the targets were allocated from: each chunk's copies
        # wait for it again (copy_out), since targets are added while chunks are read and
        # another thread may queue work on that stream in between.
        self._origin = torch.cuda.current_stream(device)
        # chunk -> (the target's bytes, [a, b) of them in this chunk, where they start in it)
        self._per_chunk: dict[int, list[tuple[torch.Tensor, int, int, int]]] = {}
        for off, view in targets:
            self.add(off, view)
        self._lock = threading.Condition()
        self._free: list[_Slot] = []
        self._made: list[_Slot] = []

    def add(self, off: int, view: torch.Tensor) -> None:
        """One more target (as in the constructor), added before its chunks' copies are
        queued (:meth:`copy_out`). Loading thread."""
        chunk_nbytes = self.chunk_nbytes
        n = view.numel()
        first, last = off // chunk_nbytes, (off + n - 1) // chunk_nbytes
        if first == last:  # most tensors: within one chunk
            self._per_chunk.setdefault(first, []).append((view, 0, n, off - first * chunk_nbytes))
            return
        for c in range(first, last + 1):
            lo = max(off, c * chunk_nbytes)
            hi = min(off + n, (c + 1) * chunk_nbytes)
            self._per_chunk.setdefault(c, []).append(
                (view, lo - off, hi - off, lo - c * chunk_nbytes))

    def holds(self, chunk: int) -> bool:
        """Whether ``chunk`` has bytes bound for the device."""
        return chunk in self._per_chunk

    def take(self) -> _Slot:
        """A slot whose earlier copies are complete (waits for one when all are in use)."""
        with self._lock:
            while not self._free and len(self._made) >= self._max_slots:
                self._lock.wait()
            slot = self._free.pop(0) if self._free else None
            if slot is None:
                pinned = torch.empty(self.chunk_nbytes, dtype=torch.uint8, pin_memory=True)
                slot = _Slot(pinned, byte_view(pinned),
                             torch.cuda.Stream(self.device),  # type: ignore[no-untyped-call]
                             torch.cuda.Event())  # type: ignore[no-untyped-call]
                self._made.append(slot)
        try:
            slot.event.synchronize()
        except BaseException:  # a CUDA error (sticky): the slot is not lost to the others
            self.give(slot)
            raise
        return slot

    def give(self, slot: _Slot) -> None:
        with self._lock:
            self._free.append(slot)
            self._lock.notify()

    def copy_out(self, slot: _Slot, chunk: int) -> None:
        """Queue the copies of ``chunk``'s device-bound bytes from ``slot``'s pinned buffer (the
        chunk, read and verified) on the slot's stream."""
        pieces = self._per_chunk.get(chunk)
        if not pieces:
            return
        pieces.sort(key=_place)  # added in allocation order, not offset order
        slot.stream.wait_stream(self._origin)  # after all queued once its targets existed
        with torch.cuda.stream(slot.stream):
            try:
                self._copy(slot, pieces)
            finally:  # what was queued before a failure is waited for like the rest
                slot.event.record(slot.stream)

    def _copy(self, slot: _Slot, pieces: list[tuple[torch.Tensor, int, int, int]]) -> None:
        if len(pieces) <= _FEW_PIECES:
            for view, a, b, at in pieces:
                view[a:b].copy_(slot.pinned[at : at + b - a], non_blocking=True)
            return
        if slot.staging is None:
            slot.staging = torch.empty(self.chunk_nbytes, dtype=torch.uint8, device=self.device)
        lo, hi = pieces[0][3], pieces[-1][3] + pieces[-1][2] - pieces[-1][1]
        slot.staging[lo:hi].copy_(slot.pinned[lo:hi], non_blocking=True)
        # The sources cut in one call, the destinations sliced only where a tensor spans chunks:
        # a chunk of small tensors holds hundreds. Gaps between sources (alignment padding) are
        # cut as pieces of their own only where there are any: each piece is a view to make.
        sizes = [b - a for _, a, b, _ in pieces]
        pos, gaps = lo, []
        for _, a, b, at in pieces:
            gaps.append(at - pos)
            pos = at + b - a
        if any(gaps):
            pairs = zip(gaps, sizes, strict=True)
            cut = torch.split_with_sizes(slot.staging[lo:hi], [n for p in pairs for n in p])
            sources = cut[1::2]
        else:
            sources = torch.split_with_sizes(slot.staging[lo:hi], sizes)
        torch._foreach_copy_([view if a == 0 and b == view.numel() else view[a:b]
                              for view, a, b, _ in pieces], list(sources))

    def finish(self) -> None:
        """Block until everything queued on the slots' streams is complete (every slot's, even
        if one raises: then the first error is raised after); the slots' buffers go back to the
        allocators."""
        with self._lock:
            made, self._made, self._free = self._made, [], []
        error: BaseException | None = None
        for slot in made:
            try:
                slot.stream.synchronize()
            except BaseException as exc:  # the others are still waited for
                error = error or exc
        if error is not None:
            raise error
