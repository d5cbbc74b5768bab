"""Per-phase durations and bytes of saves and restores: hooks, logging, JSON lines.

Phases (one record each time one completes on a rank):

============== ============================================================ ===================
phase          what was timed                                               bytes
============== ============================================================ ===================
stall          the time inside ``save()`` (async: validation + staging)     staged tensor bytes
write          writing and committing the rank's own shard                  shard data bytes
replicate      this rank's part of the replica exchange of a save           bytes sent + received
parity         this rank's part of a save's parity exchange (erasure): its  bytes sent + folded
               shard to its parity holders, and folding and committing
               the blocks it keeps
rebuild        rebuilding this rank's lost shard from its stripe's blocks   shard bytes rebuilt
               during a restore (erasure)
finalize       agreeing the iteration is complete, retention, cleanup       0
find_latest    gathering inventories and choosing the iteration             0
load           the whole ``load()`` on this rank                            tensor bytes returned
fetch_from_peer  receiving shards from holders during a restore              bytes received
============== ============================================================ ===================

Every record goes to the ``localckpt.metrics`` logger at DEBUG, to each hook, and, when a path is
given (argument or ``$LOCALCKPT_METRICS_FILE``), as one JSON object per line to that file. A hook
that raises is logged and never breaks a save. ``write`` and ``replicate`` are reported from the
background thread of an async save: hooks must be thread-safe.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError

logger = logging.getLogger("localckpt.metrics")  # a stable name users configure

PHASES = ("stall", "write", "replicate", "parity", "finalize", "find_latest", "load",
          "fetch_from_peer", "rebuild")


@dataclass(frozen=True)
class PhaseMetric:
    """One completed phase on one rank."""

    phase: str
    rank: int
    iteration: int  # -1 where none applies (find_latest that found nothing)
    seconds: float
    nbytes: int
    session_id: str
    unix_time: float  # when the phase ended
    ok: bool = True  # False when the phase raised

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


MetricHook = Callable[[PhaseMetric], None]


class Metrics:
    """Where a manager's phase records go.

    Args:
        hooks: callables receiving each :class:`PhaseMetric` (thread-safe, quick).
        jsonl_path: append each record as a JSON line here (default ``$LOCALCKPT_METRICS_FILE``;
            none when unset). Each rank may use its own file or share one: lines are written
            whole with one ``write`` call in append mode.
    """

    def __init__(self, hooks: Iterable[MetricHook] = (),
                 jsonl_path: str | os.PathLike[str] | None = None) -> None:
        self._hooks = list(hooks)
        path = jsonl_path if jsonl_path is not None else os.environ.get("LOCALCKPT_METRICS_FILE")
        self.jsonl_path = Path(path) if path else None
        self._lock = threading.Lock()

    def add_hook(self, hook: MetricHook) -> None:
        self._hooks.append(hook)

    def emit(self, metric: PhaseMetric) -> None:
        """Log, call the hooks, append to the file. Never raises."""
        logger.debug("rank %d %s iteration %d: %.4fs %d bytes%s", metric.rank, metric.phase,
                     metric.iteration, metric.seconds, metric.nbytes,
                     "" if metric.ok else " (failed)")
        for hook in list(self._hooks):
            try:
                hook(metric)
            except Exception:
                logger.exception("metrics hook %r failed; ignored", hook)
        if self.jsonl_path is not None:
            line = json.dumps(metric.to_json()) + "\n"
            try:
                with self._lock, open(self.jsonl_path, "a") as f:
                    f.write(line)
            except OSError as exc:
                logger.warning("cannot append metrics to %s: %s", self.jsonl_path, exc)

    @contextlib.contextmanager
    def timed(self, phase: str, rank: int, iteration: int, session_id: str,
              nbytes: int = 0) -> Iterator[dict[str, int]]:
        """Time the body and emit one record; the body may set ``box["nbytes"]`` and
        ``box["iteration"]`` once it knows them. A record is emitted (ok=False) if it raises."""
        box = {"nbytes": nbytes, "iteration": iteration}
        started = time.perf_counter()
        ok = False
        try:
            yield box
            ok = True
        finally:
            self.emit(PhaseMetric(phase, rank, box["iteration"], time.perf_counter() - started,
                                  box["nbytes"], session_id, time.time(), ok))


def as_metrics(value: Metrics | MetricHook | None) -> Metrics:
    """The manager's ``metrics`` argument: a Metrics, a single hook, or None (logging and
    ``$LOCALCKPT_METRICS_FILE`` only)."""
    if value is None:
        return Metrics()
    if isinstance(value, Metrics):
        return value
    if callable(value):
        return Metrics([value])
    raise ConfigurationError(f"metrics: expected a localckpt.Metrics, a callable or None, "
                    f"got {type(value).__name__}")
