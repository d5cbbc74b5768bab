"""The session's lineage on a node root: a counter of job runs. Every run takes one past the
highest its ranks' roots hold (at construction), records it in each save's manifest, and raises
a root's counter to the number of any copy before committing it there. A later run's save of an
iteration number thus outranks an earlier run's (a rollback's save again, a resume from an older
iteration), whatever the wall clocks of the two runs' rank 0 said.

A small JSON file, written atomically (temporary file, fsync, rename, fsync of the directory);
missing or unreadable, it counts as 0 (a root older than lineages, or damaged: the save numbers
then order ties by clock, as before).
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from .fsutil import fsync_dir

LINEAGE_NAME = "lineage.json"  # no iteration, leftover or session directory looks so
MAX_LINEAGE = 1 << 62


@dataclass
class Lineage:
    """A job run's place in the session's lineage: ``run``, recorded in its saves. One past the
    highest its roots held at construction, and past the run of whatever it loads since (a copy
    restored from the durable tier was not counted by the roots)."""

    run: int = 0

    def follow(self, loaded: object) -> None:
        """After loading a save of run ``loaded`` (None: one written before lineages)."""
        if type(loaded) is int:
            self.run = max(self.run, loaded + 1)


def read_lineage(session_path: Path) -> int:
    """The counter in ``session_path``; 0 when there is none or it cannot be read."""
    try:
        with open(session_path / LINEAGE_NAME, "rb") as f:
            doc = json.loads(f.read(4096))
    except (OSError, ValueError):
        return 0
    run = doc.get("run") if type(doc) is dict else None
    return run if type(run) is int and 0 <= run < MAX_LINEAGE else 0


def raise_lineage(session_path: Path, run: int, tag: str) -> None:
    """Make the counter in ``session_path`` at least ``run``, durably (ranks sharing a root may
    do this at once: ``tag`` keeps their temporary files apart, and each writes a number at
    least what it read). Raises OSError."""
    if read_lineage(session_path) >= run:
        return
    tmp = session_path / f".trash-lineage-{tag}-{uuid.uuid4().hex}"  # a crash leftover
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        try:
            os.write(fd, json.dumps({"version": 1, "run": run}).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, session_path / LINEAGE_NAME)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(session_path)
