"""When to save: a save policy decided alike on every rank, and preemption signals noticed on
any rank and agreed by all.

:class:`SavePolicy` is pure over the step (every n steps, fixed steps, a predicate) except for
``every_seconds``, which is read on rank 0's clock and agreed (ranks' clocks differ). A
:class:`PreemptionWatch` installs signal handlers that only set a flag (and call the handler
that was there before, when it is Python code); the manager's ``reached_preemption`` agrees on
the flags. Which ranks call what: see :class:`localckpt.LocalCheckpointManager`.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from ..errors import ConfigurationError


@dataclass(frozen=True)
class SavePolicy:
    """Save when any rule says so: every ``every_steps`` steps (step % n == 0, step > 0), at the
    steps in ``at_steps``, once ``every_seconds`` passed since the last save (rank 0's clock),
    or when ``predicate(step)`` is true (it must answer alike on every rank)."""

    every_steps: int | None = None
    at_steps: Collection[int] = field(default_factory=frozenset)
    every_seconds: float | None = None
    predicate: Callable[[int], bool] | None = None

    def __post_init__(self) -> None:
        if self.every_steps is not None and (type(self.every_steps) is not int
                                             or self.every_steps < 1):
            raise ConfigurationError(f"SavePolicy.every_steps: expected None or an int >= 1, "
                                     f"got {self.every_steps!r}")
        try:  # taken once: an iterator checked, then stored, would be stored empty
            steps = frozenset(self.at_steps)
        except TypeError:
            raise ConfigurationError(f"SavePolicy.at_steps: expected a collection of "
                                     f"non-negative ints, got {self.at_steps!r}") from None
        if any(type(s) is not int or s < 0 for s in steps):
            raise ConfigurationError(f"SavePolicy.at_steps: expected non-negative ints, got "
                                     f"{sorted(map(repr, steps))[:10]}")
        object.__setattr__(self, "at_steps", steps)
        if self.every_seconds is not None and (
                not isinstance(self.every_seconds, (int, float)) or
                isinstance(self.every_seconds, bool) or not math.isfinite(self.every_seconds)
                or self.every_seconds <= 0):
            raise ConfigurationError(f"SavePolicy.every_seconds: expected None or seconds > 0, "
                                     f"got {self.every_seconds!r}")
        if self.predicate is not None and not callable(self.predicate):
            raise ConfigurationError(f"SavePolicy.predicate: expected None or a callable, got "
                                     f"{self.predicate!r}")

    def due_by_step(self, step: int) -> bool:
        """The rules that need no clock (the same on every rank)."""
        if self.every_steps is not None and step > 0 and step % self.every_steps == 0:
            return True
        if step in self.at_steps:
            return True
        return self.predicate is not None and bool(self.predicate(step))

    def due_by_time(self, seconds_since_save: float) -> bool:
        return self.every_seconds is not None and seconds_since_save >= self.every_seconds


class PreemptionWatch:
    """Handlers for ``signals`` that note a preemption. The handler that was installed before
    is called after ours when it is Python code; the default action (SIGTERM's: exit) is not,
    since it would end the process before the save; SIG_IGN is honoured by noting nothing.
    Installed from the main thread only (Python's rule); :meth:`close` puts the previous
    handlers back. Where ours stays installed after :meth:`close` (another watch was installed
    over it and closed later) or runs in a forked child (Megatron's async worker), it notes
    nothing and hands the signal to the previous handler, the default action included: a
    preemption notice is the watching process's alone."""

    def __init__(self, signals: Sequence[int]) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise ConfigurationError("preemption_signals: signal handlers can only be installed "
                                     "from the main thread; create the manager there")
        self._event = threading.Event()
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._pid = os.getpid()
        self._closed = False
        try:
            for sig in dict.fromkeys(signals):
                self._previous[sig] = signal.signal(sig, self._handle)
        except (ValueError, OSError, TypeError) as exc:
            self.close()
            raise ConfigurationError(f"preemption_signals: cannot handle {signals!r}: "
                                     f"{exc}") from None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # The top of the chain when installed; else another watch's previous handler.
        self._dispatch(signum, frame, top=signal.getsignal(signum) == self._handle)

    def _dispatch(self, signum: int, frame: FrameType | None, top: bool) -> None:
        previous = self._previous.get(signum)
        if self._closed or os.getpid() != self._pid:  # as if not there
            watch = getattr(previous, "__self__", None)
            if isinstance(watch, PreemptionWatch):
                watch._dispatch(signum, frame, top)
            elif callable(previous):
                previous(signum, frame)
            elif top and previous is not signal.SIG_IGN:  # the default action, once
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        if previous is signal.SIG_IGN:
            return
        self.received = signum
        self._event.set()
        if callable(previous):
            previous(signum, frame)

    @property
    def noticed(self) -> bool:
        return self._event.is_set()

    def close(self) -> None:
        self._closed = True
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous)


def watched_signals(signals: Sequence[int] | bool | None) -> Sequence[int]:
    """The signals a manager's ``preemption_signals`` watches (none: ``should_save`` decides
    locally, with no exchange)."""
    if signals is True:
        return [signal.SIGTERM]  # what schedulers send first (Kubernetes, SLURM)
    return signals or []


class Schedule:
    """A manager's save policy and preemption watch, and the agreement on both (on the
    manager's control group, from the training thread). ``before_exchange`` runs before each
    exchange (the manager's waits for a save's finalize running on another thread)."""

    def __init__(self, ctx: Any, policy: SavePolicy | None,
                 signals: Sequence[int] | bool | None,
                 before_exchange: Callable[[], None] = lambda: None) -> None:
        self.ctx, self.policy = ctx, policy
        self._before_exchange = before_exchange
        watched = watched_signals(signals)
        self.watch = PreemptionWatch(watched) if watched else None
        self._last_save = time.monotonic()

    def saved(self) -> None:
        self._last_save = time.monotonic()

    @property
    def collective(self) -> bool:
        """Whether :meth:`should_save` exchanges (a clock or preemption flags to agree on)."""
        return self.policy is not None and (self.policy.every_seconds is not None
                                            or self.watch is not None)

    def _agree(self, verb: str, step: Any, due: Callable[[], bool] = lambda: False,
               error: type[Exception] = ConfigurationError) -> tuple[bool, bool, float]:
        """(whether ``due()`` said so on any rank, whether any rank noticed a preemption, rank
        0's seconds since its last save). ``due`` runs inside the exchange: what it raises on
        one rank is every rank's error, and the group stays usable. ``verb`` names the step:
        ranks asking through different verbs are out of step, not paired."""
        watch = self.watch

        def local() -> dict[str, Any]:
            return {"step": step if type(step) is int else repr(step), "due": due(),
                    "preempted": watch is not None and watch.noticed,
                    "since": time.monotonic() - self._last_save}

        self._before_exchange()
        seen = self.ctx.group.exchange(f"schedule: {verb}", local)
        steps = sorted({repr(s["step"]) for s in seen})
        if len(steps) > 1:
            raise error(f"every rank must ask about the same step, got "
                        f"{ {r: s['step'] for r, s in enumerate(seen)} }")
        return (any(s["due"] for s in seen), any(s["preempted"] for s in seen),
                float(seen[0]["since"]))

    def should_save(self, step: int, what: str = "should_save: step",
                    error: type[Exception] = ConfigurationError,
                    verb: str = "should_save") -> bool:
        """See LocalCheckpointManager.should_save; ``what`` and ``error`` name a bad ``step``
        (``save`` asks with its iteration). Where it exchanges, the step is checked and the
        step rules (a predicate included) are asked inside the exchange: a rank's error is
        every rank's, and a step due on any rank is due on all."""
        policy = self.policy
        if policy is None:
            raise ConfigurationError("should_save: no save_policy was given to the manager")

        def due() -> bool:
            if type(step) is not int or step < 0:
                raise error(f"{what}: expected a non-negative int, got "
                            f"{type(step).__name__} {step!r}")
            return policy.due_by_step(step)

        if not self.collective:
            return due()
        due_somewhere, preempted, since = self._agree(verb, step, due, error)
        return due_somewhere or preempted or policy.due_by_time(since)

    def reached_preemption(self, step: int) -> bool:
        if self.watch is None:
            return False
        return self._agree("reached_preemption", step)[1]

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
