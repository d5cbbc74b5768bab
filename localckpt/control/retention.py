"""What retention keeps: one pure function over iteration numbers (and their metrics), used by a
save's finalize and by ``localckpt gc`` alike (so an operator's gc never removes what the job
would keep).

Which ranks call it: any; it runs no collective and touches no file. Every rank of a job calls
it with the same gathered input (the metrics of an iteration are rank 0's, stored in every
shard's manifest), so every rank keeps the same iterations.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigurationError
from ..storage.manifest import finite

Metrics = Mapping[str, float]


@dataclass(frozen=True)
class KeepPolicy:
    """Which complete iterations retention keeps; the union of what each rule keeps, and the
    newest complete iteration always:

    - ``last``: the newest ``last``;
    - ``every``: each positive multiple of it (``every=1000``: 1000, 2000... for post-mortems);
    - ``best``: the ``best`` with the best value of metric ``best_metric`` (``best_mode``
      "min" or "max"; ties: the newer), among those saved with it (``save(..., metrics=...)``);
      those saved without it are kept too unless ``keep_without_metric`` is False;
    - ``predicate(iteration, metrics or None)``: those it returns True for (library only:
      ``localckpt gc`` has no code to call);
    - ``interval``: one per ``interval`` seconds: the first saved in each interval since the
      epoch (by rank 0's clock at the save, stored with the iteration).
    """

    last: int = 1
    every: int | None = None
    best: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"
    keep_without_metric: bool = True
    predicate: Callable[[int, Metrics | None], bool] | None = None
    interval: float | None = None

    def __post_init__(self) -> None:
        if type(self.last) is not int or self.last < 1:
            raise ConfigurationError(f"keep_last: expected an int >= 1, got {self.last!r}")
        if self.every is not None and (type(self.every) is not int or self.every < 1):
            raise ConfigurationError(
                f"keep_every: expected None or an int >= 1, got {self.every!r}")
        if self.best is not None and (type(self.best) is not int or self.best < 1):
            raise ConfigurationError(f"keep_best: expected None or an int >= 1, got "
                                     f"{self.best!r}")
        if (self.best is None) != (self.best_metric is None) or (
                self.best_metric is not None and type(self.best_metric) is not str):
            raise ConfigurationError(
                f"keep_best and best_metric: expected both (an int and a metric name) or "
                f"neither, got keep_best={self.best!r}, best_metric={self.best_metric!r}")
        if self.best_mode not in ("min", "max"):
            raise ConfigurationError(f"best_mode: expected 'min' or 'max', got "
                                     f"{self.best_mode!r}")
        if type(self.keep_without_metric) is not bool:
            raise ConfigurationError(f"keep_without_metric: expected a bool, got "
                                     f"{self.keep_without_metric!r}")
        if self.interval is not None and (not isinstance(self.interval, (int, float)) or
                                          isinstance(self.interval, bool) or
                                          not math.isfinite(self.interval) or
                                          self.interval <= 0):
            raise ConfigurationError(f"keep_interval: expected None or seconds > 0, got "
                                     f"{self.interval!r}")
        if self.predicate is not None and not callable(self.predicate):
            raise ConfigurationError(f"keep_predicate: expected None or a callable, got "
                                     f"{self.predicate!r}")

    @property
    def needs_metadata(self) -> bool:
        """Whether :meth:`keep` looks at metrics or save times (callers gather them only
        then)."""
        return self.best is not None or self.predicate is not None or self.interval is not None

    def keep(self, complete: Collection[int], unsure: Collection[int] = (),
             metrics: Mapping[int, Metrics] | None = None,
             times: Mapping[int, float] | None = None) -> set[int]:
        """The iterations to keep out of ``complete`` (complete across the job) and ``unsure``
        (iterations whose completeness the caller cannot tell: ``gc`` given some of a job's
        roots). An ``unsure`` one is kept when the policy would keep it were it complete, so a
        partial view never deletes what the whole job keeps. ``metrics``: by iteration, what
        it was saved with; ``times``: when (seconds since the epoch)."""
        metrics = metrics or {}
        newest = sorted(complete, reverse=True)[:self.last]
        kept = set(newest)
        if len(newest) < self.last:  # any unsure one could be among the last k
            kept.update(unsure)
        else:
            kept.update(it for it in unsure if it > newest[-1])
        everything = (*complete, *unsure)
        if self.every is not None:  # 0 is no "n-th" iteration: the first save is not kept
            kept.update(it for it in everything if it > 0 and it % self.every == 0)
        if self.best is not None:
            kept.update(self._best(complete, unsure, metrics))
        if self.predicate is not None:
            kept.update(it for it in everything if self.predicate(it, metrics.get(it)))
        if self.interval is not None:
            kept.update(self._one_per_interval(complete, unsure, times or {}))
        return kept

    def _one_per_interval(self, complete: Collection[int], unsure: Collection[int],
                          times: Mapping[int, float]) -> set[int]:
        """The oldest complete iteration of each interval; an unsure one older than every
        complete one of its interval (it would be that one were it complete)."""
        assert self.interval is not None
        # Floor division, not floor(a / b): a number of intervals past the float range (an
        # interval of 1e-300 s) is inf, one bucket, where floor raised OverflowError.
        first: dict[float, int] = {}
        for it in complete:
            if it in times:
                bucket = times[it] // self.interval
                first[bucket] = min(first.get(bucket, it), it)
        out = set(first.values())
        for it in unsure:
            if it in times:
                bucket = times[it] // self.interval
                if it < first.get(bucket, math.inf):
                    out.add(it)
        return out

    def _best(self, complete: Collection[int], unsure: Collection[int],
              metrics: Mapping[int, Metrics]) -> set[int]:
        name, sign = self.best_metric, 1 if self.best_mode == "min" else -1
        best = self.best or 0
        scored: list[tuple[float, int, int]] = []
        out: set[int] = set()
        for it in complete:
            value = _metric(metrics.get(it), name)
            if value is None:
                if self.keep_without_metric:
                    out.add(it)
            else:
                scored.append((sign * value, -it, it))
        scored.sort()
        out.update(it for _, _, it in scored[:best])
        threshold = scored[best - 1][0] if len(scored) >= best else math.inf
        for it in unsure:  # kept were it complete: as good as the k-th best, or no metric
            value = _metric(metrics.get(it), name)
            if (value is None and self.keep_without_metric) or \
                    (value is not None and sign * value <= threshold):
                out.add(it)
        return out


def _metric(values: Any, name: str | None) -> float | None:
    return finite(values.get(name)) if isinstance(values, Mapping) else None
