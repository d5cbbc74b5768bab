"""How shard data is cut into chunk files, and the disk space a shard takes and a root has."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import InsufficientSpaceError

DEFAULT_CHUNK_NBYTES = 16 << 20


def chunking(data_nbytes: int, target_chunk_nbytes: int = DEFAULT_CHUNK_NBYTES) -> tuple[int, int]:
    """(chunk_nbytes, chunk_count) splitting ``data_nbytes`` into near-equal chunks of at most
    ``target_chunk_nbytes``. Equal chunks keep zarr's padded edge chunk under ``chunk_count``
    bytes instead of up to a whole chunk."""
    if data_nbytes == 0:
        return 1, 0
    count = -(-data_nbytes // target_chunk_nbytes)
    return -(-data_nbytes // count), count


def check_free_space(root: Path, needed: int) -> None:
    """Raise InsufficientSpaceError if ``root`` has fewer than ``needed`` free bytes."""
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    if free < needed:
        total = st.f_blocks * st.f_frsize
        raise InsufficientSpaceError(
            f"checkpoint root {root} has {free / 2**20:.1f} MiB free (of {total / 2**20:.1f} MiB), "
            f"this save needs {needed / 2**20:.1f} MiB. Enlarge the file system (for /dev/shm in "
            "Docker: `docker run --shm-size=<size>`; for a tmpfs: `mount -o remount,size=<size>`), "
            "lower keep_last, or choose another root."
        )


def bytes_needed(manifest_estimate: int, chunk_nbytes: int, chunk_count: int) -> int:
    """Disk bytes a shard takes: chunk files with their checksums, each in whole 4 KiB blocks
    (the 4-byte trailer of a 4 KiB chunk takes a block of its own), metadata, slack for
    inodes."""
    block = 4096
    return chunk_count * -(-(chunk_nbytes + 4) // block) * block + manifest_estimate + 64 * 1024
