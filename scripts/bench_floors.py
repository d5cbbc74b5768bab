"""Raw floors of a save and a load on one machine: the fastest raw operation on the same bytes.

Used by scripts/bench_cuda.py. Each is a median of ``repeats`` runs, in seconds:

- ``tmpfs_write(payload, root, threads)``: the bytes cut in chunk files of ``chunk_nbytes``
  (as a shard is), each written fresh and fsynced, ``threads`` files at a time;
- ``tmpfs_read(payload, root, threads)``: those files read back into preallocated memory,
  ``threads`` at a time;
- ``device_copies(payload, device)``: device-to-host into pinned memory, host-to-device from
  pinned memory (on CUDA; on the CPU both are plain copies, for a smoke run).

A floor is the fastest of the thread counts measured: the bench divides by it.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from localckpt.storage.views import byte_view

CHUNK_NBYTES = 16 << 20  # the manager's default chunk file size


def median_s(fn: Callable[[], Any], repeats: int, before: Callable[[], Any] | None = None,
             sync: Callable[[], Any] | None = None) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        if sync is not None:
            sync()
        t = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _pieces(nbytes: int, chunk_nbytes: int) -> list[tuple[int, int]]:
    return [(o, min(chunk_nbytes, nbytes - o)) for o in range(0, nbytes, chunk_nbytes)] or \
        [(0, 0)]


def _write_file(path: Path, view: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_file(path: Path, view: memoryview) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], done)
            if not n:
                raise OSError(f"{path}: short read")
            done += n
    finally:
        os.close(fd)


def tmpfs_write(payload: torch.Tensor, root: Path, threads: int, repeats: int,
                chunk_nbytes: int = CHUNK_NBYTES) -> float:
    """Median seconds to write ``payload`` (flat uint8, CPU) as fresh fsynced chunk files,
    ``threads`` at a time. Leaves the files in ``root`` for :func:`tmpfs_read`."""
    root.mkdir(parents=True, exist_ok=True)
    view = byte_view(payload)
    pieces = _pieces(payload.numel(), chunk_nbytes)
    paths = [root / f"floor-{i:05d}.bin" for i in range(len(pieces))]

    def clear() -> None:
        for p in paths:
            p.unlink(missing_ok=True)

    with ThreadPoolExecutor(threads) as pool:
        def write() -> None:
            list(pool.map(lambda i: _write_file(paths[i], view[pieces[i][0]:sum(pieces[i])]),
                          range(len(pieces))))
        return median_s(write, repeats, before=clear)


def tmpfs_read(payload: torch.Tensor, root: Path, threads: int, repeats: int,
               chunk_nbytes: int = CHUNK_NBYTES) -> float:
    """Median seconds to read the chunk files :func:`tmpfs_write` left into preallocated
    memory, ``threads`` at a time."""
    out = torch.empty_like(payload)
    out.fill_(0)  # faulted in once, as a restart's preallocated tensors are
    view = byte_view(out)
    pieces = _pieces(payload.numel(), chunk_nbytes)
    paths = [root / f"floor-{i:05d}.bin" for i in range(len(pieces))]
    with ThreadPoolExecutor(threads) as pool:
        def read() -> None:
            list(pool.map(lambda i: _read_file(paths[i], view[pieces[i][0]:sum(pieces[i])]),
                          range(len(pieces))))
        seconds = median_s(read, repeats)
    if not torch.equal(out, payload):
        raise AssertionError("the raw read did not give back the bytes written")
    return seconds


def remove_files(root: Path) -> None:
    for p in root.glob("floor-*.bin"):
        p.unlink()


def device_copies(payload: torch.Tensor, device: torch.device, repeats: int
                  ) -> dict[str, float]:
    """Median seconds of D2H into pinned memory and H2D from pinned memory of ``payload``'s
    bytes, and of a host memcpy (on the CPU: plain copies, a smoke run's stand-in)."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else None
    src = payload.to(device)
    pinned = torch.empty(payload.numel(), dtype=torch.uint8, pin_memory=cuda)
    pinned.fill_(0)
    back = torch.empty_like(src)
    pageable = torch.empty_like(payload)
    pageable.fill_(0)
    return {
        "d2h_pinned": median_s(lambda: pinned.copy_(src, non_blocking=cuda), repeats, sync=sync),
        "h2d_pinned": median_s(lambda: back.copy_(pinned, non_blocking=cuda), repeats, sync=sync),
        "memcpy": median_s(lambda: pageable.copy_(pinned), repeats, sync=sync),
    }
