"""localckpt's own process group and the few collectives it needs.

Every collective runs on a gloo group created by the manager from the default group (never on the
training group), with a timeout, and exchanges JSON (never pickle: a peer's bytes are data, not
code). :meth:`CheckpointGroup.exchange` is the exception-robust collective every global decision
goes through: each rank runs a local step, all ranks gather (value or error), and either every rank
gets every value or every rank raises the same exception listing each failing rank's cause.

Every exchange carries its step name: ranks that reach different steps (one in ``find_latest``,
another in ``save``) would otherwise pair silently; they raise CollectiveError naming both steps,
and the group is unusable from then on, as after any failed collective. A call's arguments can
ride on its first exchange (:meth:`CheckpointGroup.arguments`): checked there on every rank before
the steps are compared, at no extra collective.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from ..errors import (
    CollectiveError,
    CollectiveTimeoutError,
    ConfigurationError,
    describe_failure,
    error_from_failures,
)
from .leaders import LeaderExchange

logger = logging.getLogger(__name__)
T = TypeVar("T")
_SLOT = 4096  # bytes per rank in the first all_gather round
_WAIT_TAG = 0x4C43  # point-to-point tag of _wait_for_all's messages (shard transfers use 0)
_RELEASE, _ABORT = 0, 1  # the words of _wait_for_all


class CheckpointGroup:
    """A gloo group spanning the default group's ranks, or a world of one without distributed.

    Construction is collective: every rank of the default group must create it, in the same order
    as any other ``new_group`` call. Once a collective failed (peer lost, timeout, ranks in
    different steps) the group is marked broken and every later call raises CollectiveError at
    once: a gloo group cannot be trusted to realign after a partial collective, so the job must
    restart. After :meth:`close` every call raises CollectiveError too (never a world of one).
    """

    def __init__(self, timeout: float, owner: str = "LocalCheckpointManager") -> None:
        self.timeout = checked_timeout(timeout, owner)
        self.owner = owner  # named in errors after close()
        self._broken: CollectiveError | None = None
        self._closed = False
        self.group: dist.ProcessGroup | None = None
        self._leaders: LeaderExchange | None = None  # set once the nodes are known
        self._arguments: dict[str, Any] | None = None  # see arguments()
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank()
            self.world_size = dist.get_world_size()
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        else:
            self.rank, self.world_size = 0, 1

    def close(self) -> None:
        """Release the group; every later collective raises CollectiveError. Not collective."""
        self._closed = True
        if self.group is not None and dist.is_initialized():
            try:
                dist.destroy_process_group(self.group)
            except (RuntimeError, ValueError) as exc:  # already torn down with the default group
                logger.debug("destroying localckpt group: %s", exc)
        self.group = None

    def use_nodes(self, node_of: Sequence[int]) -> None:
        """Gather through node leaders from now on (see :mod:`localckpt.control.leaders`):
        ``node_of[r]`` is rank r's node. Not collective, but every rank must call it with the
        same list between the same two collectives of this group."""
        if self.group is not None and len(node_of) == self.world_size:
            self._leaders = LeaderExchange(self.group, self.rank, node_of)

    def learn_nodes(self, node_name: str) -> None:
        """Collective: gather every rank's node name, then :meth:`use_nodes`. Raises like
        :meth:`all_gather_bytes`."""
        names = self.all_gather_bytes(node_name.encode(), "nodes of the job")
        index: dict[bytes, int] = {}
        self.use_nodes([index.setdefault(n, len(index)) for n in names])

    def check_usable(self, what: str) -> None:
        """Raise CollectiveError if the group was closed or broke earlier."""
        if self._closed:
            raise CollectiveError(
                f"{what}: the {self.owner} was closed, so localckpt's process group is gone; "
                "nothing was exchanged and nothing was deleted. Close the AsyncCallsQueue (which "
                "finalizes pending saves) before the LocalCheckpointManager; a save left "
                "unfinalized is found by the next find_latest if every rank committed it")
        if self._broken is not None:
            raise CollectiveError(f"{what}: localckpt's process group is unusable after an "
                                  f"earlier failure ({self._broken}); restart the job")

    def mark_broken(self, error: CollectiveError) -> None:
        """Make every later collective raise (the first cause is kept)."""
        if self._broken is None:
            self._broken = error

    def _wait_for_all(self, what: str, seconds: float) -> None:
        """A barrier whose every wait is bounded by ``seconds`` rather than the group's timeout:
        each rank reports to rank 0, which releases them all (2(N-1) one-byte messages on a tag
        of their own; gloo's monitored barrier bounds only rank 0's waits this way). When rank 0
        sees a peer fail, it tells every other rank at once (an abort token) instead of letting
        them wait out the bound."""
        self.check_usable(what)
        started = time.monotonic()

        def left() -> timedelta:
            return timedelta(seconds=max(0.001, seconds - (time.monotonic() - started)))

        def done(work: dist.Work | None) -> None:
            if work is not None:  # None only for a rank outside the group: never here
                work.wait(timeout=left())

        try:
            if self.rank == 0:
                peers = range(1, self.world_size)
                inbox = [torch.empty(1, dtype=torch.uint8) for _ in peers]
                try:
                    for work in [dist.irecv(b, r, group=self.group, tag=_WAIT_TAG)
                                 for b, r in zip(inbox, peers, strict=True)]:
                        done(work)
                except RuntimeError:
                    self._tell_peers(_ABORT)
                    raise
                self._tell_peers(_RELEASE, left)
            else:
                done(dist.isend(torch.tensor([_RELEASE], dtype=torch.uint8), 0,
                                group=self.group, tag=_WAIT_TAG))
                word = torch.empty(1, dtype=torch.uint8)
                done(dist.irecv(word, 0, group=self.group, tag=_WAIT_TAG))
                if int(word[0]) == _ABORT:
                    raise RuntimeError("rank 0 saw a peer fail in this step")
        except RuntimeError as exc:
            err = collective_error(what, exc, time.monotonic() - started, seconds)
            self.mark_broken(err)
            raise err from exc

    def _tell_peers(self, word: int, left: Callable[[], timedelta] | None = None) -> None:
        """Rank 0: send ``word`` to every other rank. An abort is best effort (some peers are
        gone): a failed or slow send is not waited for beyond a second."""
        token = torch.tensor([word], dtype=torch.uint8)
        works = [dist.isend(token, r, group=self.group, tag=_WAIT_TAG)
                 for r in range(1, self.world_size)]
        for work in works:
            if work is None:
                continue
            if left is not None:
                work.wait(timeout=left())
                continue
            with contextlib.suppress(RuntimeError):
                work.wait(timeout=timedelta(seconds=1))

    def all_gather_bytes(self, payload: bytes, what: str, seconds: float | None = None
                         ) -> list[bytes]:
        """Every rank's ``payload``, in rank order. Blocks until all ranks called it or
        ``seconds`` (default: the group's timeout) passed (CollectiveTimeoutError); a lost peer
        raises CollectiveError. Once the nodes are known, equal payloads of one node are one
        object."""
        self.check_usable(what)
        if self.group is None:
            return [payload]
        started = time.monotonic()
        # a wait that grows with the work is capped like the group's timeout: gloo's is a
        # count of milliseconds, and a manifest's recorded sizes may be forged
        bound = self.timeout if seconds is None else min(seconds, MAX_TIMEOUT)
        if self._leaders is not None:
            try:
                return self._leaders.all_gather(payload, bound)
            except RuntimeError as exc:
                err = collective_error(what, exc, time.monotonic() - started, bound)
                self.mark_broken(err)
                raise err from exc
            except BaseException as exc:  # out of memory, an interrupt: raised as it is, but
                # the peers were told and this group cannot realign: later calls raise
                self.mark_broken(collective_error(what, exc, time.monotonic() - started, bound))
                raise
        if bound > self.timeout:
            self._wait_for_all(what, bound)
            started = time.monotonic()
        try:
            # Round 1: a fixed slot carrying the length and, when it fits, the payload itself,
            # so small exchanges (validation, done?) cost one collective. Everyone sees every
            # length and so agrees whether round 2 (a slot of the longest payload) is needed.
            slot = torch.zeros(_SLOT, dtype=torch.uint8)
            slot[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
            if len(payload) <= _SLOT - 8 and payload:
                slot[8 : 8 + len(payload)] = torch.frombuffer(bytearray(payload),
                                                              dtype=torch.uint8)
            slots = [torch.empty(_SLOT, dtype=torch.uint8) for _ in range(self.world_size)]
            dist.all_gather(slots, slot, group=self.group)
            sizes = [int(s[:8].view(torch.int64).item()) for s in slots]
            if max(sizes) <= _SLOT - 8:
                return [bytes(s[8 : 8 + n].numpy()) for s, n in zip(slots, sizes, strict=True)]
            longest = max(sizes)
            mine = torch.zeros(longest, dtype=torch.uint8)
            if payload:
                mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
            dist.all_gather(out, mine, group=self.group)
        except RuntimeError as exc:  # gloo reports timeouts and lost peers as RuntimeError
            err = collective_error(what, exc, time.monotonic() - started, self.timeout)
            self.mark_broken(err)
            raise err from exc
        return [bytes(o[:n].numpy()) for o, n in zip(out, sizes, strict=True)]

    @contextlib.contextmanager
    def arguments(self, call: str, check: Callable[[], Any]) -> Iterator[None]:
        """Within the block, the first exchange also carries ``check()``'s result (this rank's
        arguments of ``call``, JSON-able) or its exception, and every rank compares them before
        anything else: the failing ranks' error (see :func:`error_from_failures`),
        ConfigurationError when ranks passed different arguments, or CollectiveError when some
        ranks are in another verb, is raised on every rank alike (the ranks may be in different
        steps by then, having taken different paths; each did one collective, so the group
        stays usable). A rank whose ``check()`` failed does that
        exchange at once, before the block, and raises there.
        """
        try:
            self._arguments = {"call": call, "ok": check()}
        except Exception as exc:
            self._arguments = {"call": call, "error": describe_failure(exc), "exc": exc}
        try:
            if "exc" in self._arguments:  # raises on every rank, at the others' first step
                self.exchange(f"{call}: arguments", lambda: None)
            yield
        finally:
            self._arguments = None

    def _check_arguments(self, gathered: list[Any], local_exc: BaseException | None) -> None:
        """Raise on every rank when the arguments some ranks' docs carry disagree (see
        :meth:`arguments`), or some ranks are in another verb (CollectiveError)."""
        carried = [d.get("arguments") for d in gathered]
        if all(c is None for c in carried):
            return
        call = next(str(c["call"]) for c in carried if c is not None)
        failures = {r: (str(c["error"][0]), str(c["error"][1]))
                    for r, c in enumerate(carried) if c is not None and "error" in c}
        if failures:
            raise error_from_failures(call, failures) from local_exc
        # Ranks in other verbs (no arguments, or another call's): out of step, not arguments
        # that differ. Each did this one exchange, so the group is still in step.
        verbs = [repr(str(d.get("step"))) if c is None else str(c["call"])
                 for c, d in zip(carried, gathered, strict=True)]
        if len(set(verbs)) > 1:
            by_verb: dict[str, list[int]] = {}
            for r, verb in enumerate(verbs):
                by_verb.setdefault(verb, []).append(r)
            raise CollectiveError(
                "localckpt's ranks called different methods: " + "; ".join(
                    f"{_ranks(ranks)} in {verb}" for verb, ranks in by_verb.items())
                + ". Every rank must call save, find_latest, load and the queue's methods in the "
                "same order (this call failed on every rank; the group is still usable)"
            ) from local_exc
        by_value: dict[str, list[int]] = {}
        for r, c in enumerate(carried):
            by_value.setdefault("nothing" if c is None else json.dumps(c["ok"]), []).append(r)
        if len(by_value) > 1:
            raise ConfigurationError(
                f"{call}: every rank must pass the same arguments; got " + "; ".join(
                    f"{v} on {_ranks(ranks)}" for v, ranks in by_value.items())) from local_exc

    def exchange(self, step: str, local: Callable[[], T],
                 wait: float | Callable[[], float] | None = None) -> list[T]:
        """Run ``local()`` on this rank, then gather every rank's JSON-able result.

        Returns all results in rank order, or raises on every rank the same exception built from
        each failing rank's error (see :func:`localckpt.errors.error_from_failures`); on the rank
        whose ``local()`` failed it is chained to the original exception. Raises CollectiveError
        when the collective itself fails (see :meth:`gather_outcomes`). ``wait``: see there.
        """
        outcome = self.gather_outcomes(step, local, wait)
        if outcome.failures:
            raise error_from_failures(step, outcome.failures) from outcome.local_error
        return outcome.values  # type: ignore[return-value]

    def gather_outcomes(self, step: str, local: Callable[[], T],
                        wait: float | Callable[[], float] | None = None) -> Outcome[T]:
        """Like :meth:`exchange`, but a failing ``local()`` is returned, not raised: every rank
        gets the same :class:`Outcome`. Raises only when no agreement was reached: the collective
        failed or timed out, or the ranks are in different steps (CollectiveError, and the group
        is unusable from then on). Callers that must tell "every rank agreed this failed" from
        "we could not agree" (finalize deletes data only in the first case) use this.

        ``wait``: seconds a rank may wait here for the slowest rank's ``local()`` (default: the
        group's timeout). A step whose local part moves data (transfers in rounds, a write)
        passes a bound that grows with the work, so that a rank with little to do does not time
        out while its peers legitimately still work; a dead peer is still noticed at once. A
        callable is asked once ``local()`` returned (a bound the local step learns).
        """
        local_exc: BaseException | None = None
        carried, self._arguments = self._arguments, None
        try:
            if carried is not None and "exc" in carried:
                raise carried.pop("exc")  # this rank's own arguments: nothing to run
            # a result JSON refuses is this rank's failure, told to every rank like any other
            payload = _encoded({"step": step, "ok": local()}, carried)
        except BaseException as exc:
            # Ctrl-C or an exit too: the others are told at once (they would wait out the
            # timeout, or pair their next step with this rank's), then it is raised here.
            local_exc = exc
            payload = _encoded({"step": step, "error": describe_failure(exc)}, carried)
        if callable(wait):
            wait = wait()
        try:
            payloads = self.all_gather_bytes(payload, step, wait if wait is not None
                                             and wait > self.timeout else None)
        except CollectiveError as exc:
            raise exc from local_exc
        parsed: dict[int, Any] = {}  # a node's equal payloads are one object: parsed once
        gathered = [parsed[id(b)] if id(b) in parsed else parsed.setdefault(id(b), json.loads(b))
                    for b in payloads]
        self._check_arguments(gathered, local_exc)
        steps = [str(d.get("step")) for d in gathered]
        if len(set(steps)) > 1:
            by_step: dict[str, list[int]] = {}
            for r, s in enumerate(steps):
                by_step.setdefault(s, []).append(r)
            err = CollectiveError(
                "localckpt's ranks called different steps: " + "; ".join(
                    f"{_ranks(ranks)} in {s!r}" for s, ranks in by_step.items())
                + ". Every rank must call save, find_latest, load and the queue's methods in the "
                "same order; the group is out of step, restart the job")
            self.mark_broken(err)
            raise err from local_exc
        if local_exc is not None and not isinstance(local_exc, Exception):
            raise local_exc  # the others raise this step's failure (Outcome.failures)
        failures = {r: (str(d["error"][0]), str(d["error"][1]))
                    for r, d in enumerate(gathered) if "error" in d}
        return Outcome([d.get("ok") for d in gathered], failures, local_exc)


@dataclass
class Outcome(Generic[T]):
    """Every rank's result of one step: ``values`` in rank order (None where the rank failed),
    ``failures`` rank -> (exception class name, message), and this rank's own exception."""

    values: list[T | None]
    failures: dict[int, tuple[str, str]]
    local_error: BaseException | None = None


def _encoded(doc: dict[str, Any], arguments: dict[str, Any] | None) -> bytes:
    """A step's document as sent, with the caller's arguments (CheckpointGroup.arguments)."""
    if arguments is not None:
        doc["arguments"] = arguments
    return json.dumps(doc, allow_nan=False).encode()


MAX_TIMEOUT = 1e6  # seconds (11.6 days): gloo's timeout is a timedelta of milliseconds
MIN_TIMEOUT = 1e-3  # less is 0 ms, which gloo takes for no timeout when a group is made


def checked_timeout(timeout: Any, owner: str) -> float:
    """``timeout`` as float seconds; ConfigurationError unless it is an int or float (not a
    bool) in [MIN_TIMEOUT, MAX_TIMEOUT]."""
    if type(timeout) not in (int, float) or not MIN_TIMEOUT <= timeout <= MAX_TIMEOUT:
        raise ConfigurationError(f"{owner}: timeout: expected seconds, an int or float in "
                                 f"[{MIN_TIMEOUT:g}, {MAX_TIMEOUT:g}], got {timeout!r}")
    return float(timeout)


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
    return f"rank {shown}" if len(ranks) == 1 else f"ranks [{shown}]"


def collective_error(what: str, exc: BaseException, elapsed: float,
                     timeout: float) -> CollectiveError:
    """The CollectiveError (or CollectiveTimeoutError) for a failed collective or transfer."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    timed_out = "timeout" in text.lower() or "timed out" in text.lower() or elapsed >= timeout
    cls = CollectiveTimeoutError if timed_out else CollectiveError
    return cls(
        f"{what}: collective on localckpt's gloo group failed after {elapsed:.1f}s "
        f"(timeout {timeout:g}s): {text}. A peer rank probably died or is stuck; "
        "restart the job (its last finalized checkpoint is intact)."
    )
