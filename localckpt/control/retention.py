"""What retention keeps: one pure function over iteration numbers, used by a save's finalize and
by ``localckpt gc`` alike (so an operator's gc never removes what the job would keep).

Which ranks call it: any; it runs no collective and touches no file.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from ..errors import ConfigurationError


@dataclass(frozen=True)
class KeepPolicy:
    """Keep the ``last`` newest complete iterations and, with ``every``, each iteration that is
    a positive multiple of it (``every=1000``: iterations 1000, 2000... stay for post-mortems).
    What the rules keep is the union of what each keeps; the newest complete iteration is always
    kept."""

    last: int = 1
    every: int | None = None

    def __post_init__(self) -> None:
        if type(self.last) is not int or self.last < 1:
            raise ConfigurationError(f"keep_last: expected an int >= 1, got {self.last!r}")
        if self.every is not None and (type(self.every) is not int or self.every < 1):
            raise ConfigurationError(
                f"keep_every: expected None or an int >= 1, got {self.every!r}")

    def keep(self, complete: Collection[int], unsure: Collection[int] = ()) -> set[int]:
        """The iterations to keep out of ``complete`` (complete across the job) and ``unsure``
        (iterations whose completeness the caller cannot tell: ``gc`` given some of a job's
        roots). An ``unsure`` one is kept when the policy would keep it were it complete, so a
        partial view never deletes what the whole job keeps."""
        newest = sorted(complete, reverse=True)[:self.last]
        kept = set(newest)
        if len(newest) < self.last:  # any unsure one could be among the last k
            kept.update(unsure)
        else:
            kept.update(it for it in unsure if it > newest[-1])
        if self.every is not None:  # 0 is no "n-th" iteration: the first save is not kept
            kept.update(it for it in (*complete, *unsure) if it > 0 and it % self.every == 0)
        return kept
