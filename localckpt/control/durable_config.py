"""The durable tier's settings, as users give them to the manager."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError

_OBJECT_SCHEMES = ("s3://", "s3a://")


@dataclass(frozen=True)
class DurableTier:
    """A second tier every rank reaches: a shared file system (Lustre, GPFS, NFS) or object
    storage (S3 and S3-compatible servers).

    ``root``: a directory, or ``"s3://bucket[/prefix]"``. ``options``: for object storage,
    obstore's S3 settings (``endpoint``, ``region``, ``access_key_id``, ``secret_access_key``...;
    what is not given comes from the ``AWS_*`` environment); an ``http://`` endpoint is allowed.
    ``persist_every``: persist every n-th finalized save (1: every one the store keeps up with;
    a request that arrives while one runs replaces the one waiting); ``None``: not by count.
    ``persist_interval``: also persist a finalized save once this many seconds have passed
    since the last persist was asked for, and the first of each run (rank 0's clock decides, for
    every rank). Neither: only
    on ``manager.persist()``. ``keep``: complete iterations kept there (the newest);
    ``keep_every``: also keep each complete iteration that is a multiple of it (post-mortems).
    ``commit_timeout``: how long rank 0 waits for every rank's copy before it commits an
    iteration (None: the manager's timeout); a persist that runs out of it is logged and
    dropped, never raised to training.
    """

    root: str | os.PathLike[str]
    persist_every: int | None = 1
    keep: int = 2
    commit_timeout: float | None = None
    persist_interval: float | None = None
    options: Mapping[str, Any] | None = field(default=None, repr=False)  # may hold secrets
    keep_every: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.root, (str, os.PathLike)) or not str(self.root):
            raise ConfigurationError(f"DurableTier: root: expected a path, got {self.root!r}")
        if not isinstance(self.root, str) and os.fspath(self.root).startswith(("s3:/", "s3a:/")):
            raise ConfigurationError(f"DurableTier: root: a bucket is named by a string "
                                     f"('s3://bucket/prefix'), got the path {self.root!r}")
        url = isinstance(self.root, str) and "://" in self.root
        if url and not self.is_object_store:
            raise ConfigurationError(f"DurableTier: root: expected a directory or "
                                     f"s3://bucket[/prefix], got {self.root!r}")
        if self.is_object_store and not str(self.root).split("://", 1)[1].strip("/"):
            raise ConfigurationError(f"DurableTier: root: expected s3://bucket[/prefix], got "
                                     f"{self.root!r} (no bucket)")
        if self.options is not None and not (
                isinstance(self.options, Mapping) and self.is_object_store
                and all(isinstance(k, str) for k in self.options)):
            raise ConfigurationError("DurableTier: options: expected a mapping of obstore S3 "
                                     "settings with an s3:// root, got "
                                     f"{type(self.options).__name__} with root {self.root!r}")
        if self.persist_interval is not None and not (
                isinstance(self.persist_interval, (int, float))
                and not isinstance(self.persist_interval, bool) and self.persist_interval > 0):
            raise ConfigurationError(f"DurableTier: persist_interval: expected None or seconds "
                                     f"> 0, got {self.persist_interval!r}")
        if self.persist_every is not None and (type(self.persist_every) is not int
                                               or self.persist_every < 1):
            raise ConfigurationError(f"DurableTier: persist_every: expected None or an int >= "
                                     f"1, got {self.persist_every!r}")
        if type(self.keep) is not int or self.keep < 1:
            raise ConfigurationError(f"DurableTier: keep: expected an int >= 1, got "
                                     f"{self.keep!r}")
        if self.keep_every is not None and (type(self.keep_every) is not int
                                            or self.keep_every < 1):
            raise ConfigurationError(f"DurableTier: keep_every: expected None or an int >= 1, "
                                     f"got {self.keep_every!r}")
        if self.commit_timeout is not None and not (  # inf: a rollback's wait overflows
                isinstance(self.commit_timeout, (int, float))
                and not isinstance(self.commit_timeout, bool)
                and 0 < self.commit_timeout < math.inf):
            raise ConfigurationError(f"DurableTier: commit_timeout: expected None or a finite "
                                     f"number of seconds > 0, got {self.commit_timeout!r}")

    def check_apart(self, node_root: Any, session_id: str) -> None:
        """ConfigurationError when a directory tier's session directory and the node root's
        are one, or one holds the other (each tier writes under ``<root>/<session>`` only):
        its shards would pass for persisted copies, and durable retention would delete what
        the node root's keep policy keeps. The durable path is compared as written (made
        absolute, never resolved): a hung mount must not hang the manager's construction."""
        if self.is_object_store:
            return
        from ..storage.layout import session_dir

        shared = session_dir(Path(os.path.abspath(self.root)), session_id)
        local = session_dir(Path(node_root).resolve(), session_id)
        if shared == local or shared in local.parents or local in shared.parents:
            raise ConfigurationError(
                f"durable: the durable tier's session directory {shared} and the node root's "
                f"{local} must be apart (neither inside the other): a second tier on the node "
                "root is no second copy")

    @property
    def is_object_store(self) -> bool:
        return isinstance(self.root, str) and self.root.startswith(_OBJECT_SCHEMES)
