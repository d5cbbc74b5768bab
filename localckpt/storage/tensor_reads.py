"""Reading a shard into a tensor per entry, the tensors allocated while the first chunks are read.

Allocating thousands of tensors is Python work on the loading thread (a CUDA allocation costs
about 7 us a call on an H200's host: 57 ms for 7,484 tensors), and reading is work of the I/O
threads: a chunk's read is queued as soon as every tensor with bytes in it exists, so the two
overlap. Entries of at least an eighth of a chunk come first (at most eight a chunk: cheap to
allocate, and most of the bytes), then the rest in manifest order, which for a save of many
small tensors is offset order (the staging packs them together). On an H200 this took a 4 GiB
load of 33,652 tensors from 1,071-1,083 to 906-1,021 ms; at 1 GiB the gain was lost in the
machine's drift, the readers' scatter of small tensors waiting for the interpreter lock the
allocations hold (docs/cuda-profile.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from operator import itemgetter
from pathlib import Path

import torch

from ..hollow import resolve_device
from .device_reader import DeviceScatter
from .host_memory import MIN_NBYTES, empty_host
from .manifest import ShardManifest, TensorEntry, dtype_from_name
from .shard_reader import ChunkReads, read_chunks_into
from .views import (
    COPY_OUT_MAX_NBYTES,
    SmallTarget,
    byte_view,
    device_bytes,
    outside,
    writable_memory,
)

_by_offset = itemgetter(0)


def fresh_or_given(manifest: ShardManifest, given: Sequence[torch.Tensor | None] | None,
                   device: torch.device | None = None) -> list[torch.Tensor]:
    """A tensor per entry of ``manifest`` to load into: ``given``'s (the caller's, or None for
    an entry), else a fresh one, on ``device`` for a non-empty entry saved from it (None: every
    fresh one on the CPU)."""
    if given is None and device is None:  # a plain load to the host: thousands of small ones
        empty = torch.empty
        return [empty(e.shape, dtype=dtype_from_name(e.dtype)) if e.nbytes < MIN_NBYTES
                else empty_host(e.shape, dtype_from_name(e.dtype)) for e in manifest.tensors]
    cache: dict[str, torch.device] = {}
    return [fresh(e, device, cache) if t is None else t
            for e, t in zip(manifest.tensors, given or [None] * len(manifest.tensors),
                            strict=True)]


def fresh(e: TensorEntry, device: torch.device | None,
          cache: dict[str, torch.device]) -> torch.Tensor:
    """An empty tensor for entry ``e``: on ``device`` when ``e`` was saved from it and holds
    bytes, else on the CPU."""
    here = device if (device is not None and e.nbytes and e.device.startswith("cuda")
                      and resolve_device(e.device, cache) == device) else None
    if here is None:
        return empty_host(e.shape, dtype_from_name(e.dtype))
    return torch.empty(e.shape, dtype=dtype_from_name(e.dtype), device=here)


def read_shard_tensors(chunk_dir: Path, manifest: ShardManifest,
                       given: Sequence[torch.Tensor | None] | None, device: torch.device | None,
                       pool: ThreadPoolExecutor | None, max_slots: int) -> list[torch.Tensor]:
    """A tensor per entry of ``manifest`` (checked), read from ``chunk_dir`` as in
    ShardStore.read_tensors: ``given``'s where not None (contiguous, of the entry's dtype and
    shape, on the CPU or on ``device``, not overlapping), else fresh (:func:`fresh`). Entries
    bound for ``device`` go through ``max_slots`` pinned slots, their tensors made while the
    chunks already covered are read; every copy is complete on return, and every read is over,
    also when one raised (its error is raised then).

    Raises CorruptShardError naming a bad file (of the first chunk queued that failed),
    ValueError for given tensors it cannot read into (before reading anything), and what
    allocating raises (OutOfMemoryError)."""
    entries = manifest.tensors
    if given is not None:  # refused before any read: nothing of the caller's is written then
        if len(given) != len(entries):
            raise ValueError(f"read_tensors: {len(given)} tensors given for a shard of "
                             f"{len(entries)} entries")
        for e, t in zip(entries, given, strict=True):
            if t is not None and e.nbytes and not (
                    t.is_cpu or (t.device == device and t.is_contiguous())):
                raise _not_readable(e, t, device)
    if device is None:
        return _read_to_host(chunk_dir, manifest, given, pool)
    size = manifest.chunk_nbytes
    tensors: list[torch.Tensor | None] = \
        list(given) if given is not None else [None] * len(entries)
    # chunk -> entries with bytes in it whose tensor does not exist yet
    waiting = [0] * manifest.chunk_count
    big: list[int] = []
    rest: list[int] = []
    for k, e in enumerate(entries):
        if e.nbytes:
            for c in range(e.offset // size, (e.offset + e.nbytes - 1) // size + 1):
                waiting[c] += 1
            (big if e.nbytes >= size >> 3 or tensors[k] is not None else rest).append(k)
    host: dict[int, list[tuple[int, memoryview]]] = {}
    small: dict[int, list[SmallTarget]] = {}
    scatter = DeviceScatter(device, (), size, max_slots)
    reads = ChunkReads(chunk_dir, manifest, pool, scatter)

    def submit(c: int) -> None:
        targets = sorted(host.pop(c, ()), key=_by_offset)
        copied = sorted(small.pop(c, ()))
        reads.submit(c, (targets, [off for off, _ in targets], copied,
                         [off for off, _, _ in copied]))

    cache: dict[str, torch.device] = {}
    try:
        for c, n in enumerate(waiting):
            if not n:  # padding only
                submit(c)
        for k in (*big, *rest):
            if reads.failed:
                break  # raised by wait()
            e = entries[k]
            t = tensors[k]
            mine = t is None
            if t is None:
                t = tensors[k] = fresh(e, device, cache)
            first, last = e.offset // size, (e.offset + e.nbytes - 1) // size
            if t.is_cpu:
                if mine and e.nbytes <= COPY_OUT_MAX_NBYTES:  # fresh: ours, writable
                    target = (e.offset, t.data_ptr(), e.nbytes)
                    for c in range(first, last + 1):
                        small.setdefault(c, []).append(target)
                else:
                    view = (e.offset, byte_view(t))
                    for c in range(first, last + 1):
                        host.setdefault(c, []).append(view)
            else:  # on the device, contiguous (checked above for given ones)
                scatter.add(e.offset, device_bytes(t))
            for c in range(first, last + 1):
                waiting[c] -= 1
                if not waiting[c]:
                    submit(c)
    finally:
        reads.wait()
    return [t if t is not None else fresh(e, device, cache)  # empty entries
            for e, t in zip(entries, tensors, strict=True)]


def _read_to_host(chunk_dir: Path, manifest: ShardManifest,
                  given: Sequence[torch.Tensor | None] | None,
                  pool: ThreadPoolExecutor | None) -> list[torch.Tensor]:
    """read_shard_tensors with no device: every tensor made first, then every chunk read. A
    host tensor costs a microsecond to make, and made while reading it would keep the readers'
    copies out of their windows waiting for the interpreter (10,000 tensors of 4 KiB on 2
    cores: 58 ms against 65)."""
    tensors = fresh_or_given(manifest, given)
    host: list[tuple[int, memoryview]] = []
    small: list[SmallTarget] = []
    # The caller's small tensors are filled alike once known private anonymous memory: a
    # memmove into a read-only page, or a file's mapping cut short, kills the process where a
    # read fails with EFAULT (10,000 of 4 KiB given on 2 cores: 70-84 ms a load(into=...)
    # before, 66-76 after).
    theirs: dict[int, SmallTarget] = {}
    for k, (e, t) in enumerate(zip(manifest.tensors, tensors, strict=True)):
        if not e.nbytes:
            continue
        if e.nbytes <= COPY_OUT_MAX_NBYTES and (given is None or given[k] is None):
            small.append((e.offset, t.data_ptr(), e.nbytes))  # fresh: ours, writable
        elif e.nbytes <= COPY_OUT_MAX_NBYTES and t.is_contiguous():
            theirs[k] = (e.offset, t.data_ptr(), e.nbytes)
        else:
            host.append((e.offset, byte_view(t)))
    if theirs and _all_writable(theirs.values()):
        small += theirs.values()
    else:
        host += [(off, byte_view(tensors[k])) for k, (off, _, _) in theirs.items()]
    read_chunks_into(chunk_dir, manifest, host, pool, small=small)
    return tensors


def _all_writable(targets: Iterable[SmallTarget]) -> bool:
    """Whether all of ``targets``' memory is private anonymous memory this process may write
    (False when that cannot be told: /proc/self/maps unreadable)."""
    writable = writable_memory(anonymous=True)
    spans = sorted((address, address + nbytes) for _, address, nbytes in targets)
    return writable is not None and outside(spans, writable) is None


def _not_readable(e: TensorEntry, t: torch.Tensor, device: torch.device | None) -> ValueError:
    return ValueError(f"read_tensors: {e.key_path!r} is to be read into a tensor on {t.device} "
                      f"(contiguous: {t.is_contiguous()}); expected a contiguous tensor on the "
                      f"CPU or on {device or 'the CPU'}")
