"""The session's lineage on a node root: a counter of job runs. Every run takes one past the
highest its ranks' roots hold (at construction), records it in each save's manifest, and raises
a root's counter to the number of any copy before committing it there. A later run's save of an
iteration number thus outranks an earlier run's (a rollback's save again, a resume from an older
iteration), whatever the wall clocks of the two runs' rank 0 said.

The counter is the highest N of the empty files ``lineage-N`` in the session directory. Raising
it creates a file (exclusively, then an fsync of the directory) and removes the lower ones: no
read-modify-write, so writers that race (ranks sharing a root, a write-back beside a save) never
lower it, and a crash leaves a whole name or none. None there: 0 (a root older than lineages;
the saves of one number are then ordered by clock, as before).
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .fsutil import fsync_dir

LINEAGE_RE = re.compile(r"lineage-([0-9]{1,18})")  # no iteration, leftover or session looks so


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


def _counters(session_path: Path) -> list[int]:
    try:
        with os.scandir(session_path) as entries:
            return [int(m.group(1)) for e in entries if (m := LINEAGE_RE.fullmatch(e.name))]
    except (FileNotFoundError, NotADirectoryError):
        return []


def read_lineage(session_path: Path) -> int:
    """The counter in ``session_path``; 0 when there is none."""
    return max(_counters(session_path), default=0)


def raise_lineage(session_path: Path, run: int) -> None:
    """Make the counter in ``session_path`` at least ``run``, durably. Raises OSError."""
    if read_lineage(session_path) >= run:
        return
    with contextlib.suppress(FileExistsError):  # another rank of the run made it
        os.close(os.open(session_path / f"lineage-{run}",
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    fsync_dir(session_path)
    for lower in _counters(session_path):
        if lower < run:
            with contextlib.suppress(OSError):  # gone already; any left over is never the max
                os.unlink(session_path / f"lineage-{lower}")


def is_lineage(name: str) -> bool:
    return LINEAGE_RE.fullmatch(name) is not None
