"""The durable tier's settings, as users give them to the manager."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigurationError


@dataclass(frozen=True)
class DurableTier:
    """A second tier on a shared file system every rank sees (Lustre, GPFS, NFS).

    ``root``: its directory. ``persist_every``: persist every n-th finalized save (1: every one
    the store keeps up with; a request that arrives while one runs replaces the one waiting);
    ``None``: only on ``manager.persist()``. ``keep``: complete iterations kept there (the
    newest). ``commit_timeout``: how long rank 0 waits for every rank's copy before it commits
    an iteration (None: the manager's timeout); a persist that runs out of it is logged and
    dropped, never raised to training.
    """

    root: str | os.PathLike[str]
    persist_every: int | None = 1
    keep: int = 2
    commit_timeout: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.root, (str, os.PathLike)) or not str(self.root):
            raise ConfigurationError(f"DurableTier: root: expected a path, got {self.root!r}")
        if self.persist_every is not None and (type(self.persist_every) is not int
                                               or self.persist_every < 1):
            raise ConfigurationError(f"DurableTier: persist_every: expected None or an int >= "
                                     f"1, got {self.persist_every!r}")
        if type(self.keep) is not int or self.keep < 1:
            raise ConfigurationError(f"DurableTier: keep: expected an int >= 1, got "
                                     f"{self.keep!r}")
        if self.commit_timeout is not None and not (
                isinstance(self.commit_timeout, (int, float)) and self.commit_timeout > 0):
            raise ConfigurationError(f"DurableTier: commit_timeout: expected None or seconds "
                                     f"> 0, got {self.commit_timeout!r}")

    @property
    def path(self) -> Path:
        return Path(self.root)
