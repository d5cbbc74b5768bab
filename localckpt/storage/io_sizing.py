"""How many I/O threads a rank uses by default: its share of the cores it may run on.

tmpfs writes and reads scale with writers (on a 16-core H100 host: 2.0 GB/s with one writer,
14.7 GB/s with eight, measured for issue 22), and each chunk is checksummed on the thread that
writes or reads it, so a rank alone on a many-core node should use several threads; ranks that
share cores share them. Two threads stay the least (what a 2-core runner measured best), twelve
the most: tmpfs writes alone stopped scaling at eight on that host, but a load also checksums
every chunk and copies it to the GPU, and on the H100 host a 4 GiB load took 215 ms on twelve
threads against 280 ms on eight (a save to finalized 408 against 421 ms, 161 against 217 ms
with 15 % small tensors).

Which ranks share cores is decided from what each rank reports at start-up (:func:`cpu_set`):
ranks of one node with the same CPU set (a container's cpuset, or no pinning at all) share it;
ranks pinned to sets of their own (``taskset``, NUMA binding) each have theirs.
"""

from __future__ import annotations

import math
import os
import zlib

MIN_IO_THREADS = 2
MAX_IO_THREADS = 12
_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "<quota> <period>" or "max <period>"


def usable_cores() -> tuple[int, str]:
    """(cores this process may use, a key naming its CPU set). The count is that of the
    affinity mask, lowered by a cgroup CPU quota when there is one."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        allowed = list(range(os.cpu_count() or 1))
    cores = len(allowed)
    quota = _cgroup_quota()
    if quota is not None:
        cores = max(1, min(cores, math.ceil(quota)))
    return cores, format(zlib.crc32(",".join(map(str, allowed)).encode()), "08x")


def _cgroup_quota() -> float | None:
    try:
        with open(_CPU_MAX) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def cpu_set() -> str:
    """What a rank reports at start-up: the key of its CPU set."""
    return usable_cores()[1]


def default_io_threads(sharing: int, cores: int | None = None) -> int:
    """``cores`` (default: this process's, :func:`usable_cores`) divided among the ``sharing``
    ranks that run on them, between MIN_IO_THREADS and MAX_IO_THREADS. Pure given ``cores``."""
    if cores is None:
        cores = usable_cores()[0]
    return max(MIN_IO_THREADS, min(MAX_IO_THREADS, cores // max(1, sharing)))


def ranks_sharing(rank: int, nodes: list[str], cpu_sets: list[str | None]) -> int:
    """How many ranks of ``rank``'s node report its CPU set (itself included). Pure."""
    return sum(1 for node, cpus in zip(nodes, cpu_sets, strict=True)
               if node == nodes[rank] and cpus == cpu_sets[rank])
