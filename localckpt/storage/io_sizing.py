"""How many I/O threads a rank uses by default: its share of the cores it may run on.

tmpfs writes and reads scale with writers (on a 16-core H100 host: 2.0 GB/s with one writer,
14.7 GB/s with eight, measured for issue 22), and each chunk is checksummed on the thread that
writes or reads it, so a rank alone on a many-core node should use several threads; ranks that
share a node share its cores. Two threads stay the least (what a 2-core runner measured best),
eight the most (where tmpfs stopped scaling on that host).
"""

from __future__ import annotations

import os

MIN_IO_THREADS = 2
MAX_IO_THREADS = 8


def usable_cores() -> tuple[int, bool]:
    """(cores this process may run on, whether it was pinned to fewer than the machine has).
    A pinned process (``taskset``, torchrun's ``--numa-binding``, a container's cpuset) already
    has its own share; an unpinned one shares the machine with the node's other ranks."""
    machine = os.cpu_count() or 1
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        return machine, False
    return allowed, allowed < machine


def default_io_threads(ranks_on_node: int, cores: int | None = None,
                       pinned: bool | None = None) -> int:
    """Pure given ``cores`` and ``pinned`` (else :func:`usable_cores`): the rank's share of the
    cores, between MIN_IO_THREADS and MAX_IO_THREADS."""
    if cores is None or pinned is None:
        cores, pinned = usable_cores()
    share = cores if pinned else cores // max(1, ranks_on_node)
    return max(MIN_IO_THREADS, min(MAX_IO_THREADS, share))
