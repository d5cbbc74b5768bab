"""Asynchronous requests and the queue that runs them: the names and semantics of Megatron's and
NVIDIA's async checkpointing utilities, on a persistent background thread.

An :class:`AsyncRequest` is ``async_fn(*async_fn_args, **async_fn_kwargs)`` (run in the
background) plus ``finalize_fns`` (run in the main thread once *every* rank finished its
``async_fn``). :class:`AsyncCallsQueue` runs requests in the order they were scheduled on one
persistent worker thread, and ``maybe_finalize_async_calls`` agrees across ranks, through a
collective with a timeout on the queue's own gloo group (never the training group), which
requests are done everywhere, then finalizes them in order.

Every rank must call ``schedule_async_request`` and ``maybe_finalize_async_calls`` in the same
order (they are collective unless ``no_dist=True``).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, ClassVar

from replication.topology import local_node_name

from ..control.collectives import CheckpointGroup
from ..errors import (
    CollectiveTimeoutError,
    ConfigurationError,
    describe_failure,
    error_from_failures,
)

logger = logging.getLogger(__name__)


@dataclass
class AsyncRequest:
    """What to run in the background and what to run once every rank finished it.

    ``preload_fn`` runs in the main thread when the request is scheduled (e.g. device-to-host
    staging). As Megatron's request: ``add_finalize_fn`` adds in place (and returns the request,
    so ``request = request.add_finalize_fn(fn)`` works too), ``freeze`` returns a copy that
    refuses more (RuntimeError), and a queue runs the frozen copy it makes when the request is
    scheduled. ``_fields`` and ``_asdict`` are those of a named tuple, so Megatron's
    AsyncCallsQueue takes the request as one of its own.
    """

    _fields: ClassVar[tuple[str, ...]] = ("async_fn", "async_fn_args", "finalize_fns",
                                          "async_fn_kwargs", "preload_fn")

    async_fn: Callable[..., Any] | None
    async_fn_args: tuple[Any, ...]
    finalize_fns: Sequence[Callable[[], Any]] = ()
    async_fn_kwargs: dict[str, Any] = field(default_factory=dict)
    preload_fn: Callable[[], Any] | None = None
    is_frozen: bool = False
    # Seconds the background part may take, asked again while waiting (a save knows its own
    # once agreed); a queue waits that long when it is more than the queue's timeout.
    bound: Callable[[], float] | None = None

    def __post_init__(self) -> None:
        self.finalize_fns = list(self.finalize_fns)  # its own: added to in place

    def add_finalize_fn(self, fn: Callable[[], Any]) -> AsyncRequest:
        if self.is_frozen:
            raise RuntimeError("Cannot add finalize functions to a frozen AsyncRequest "
                               "(a scheduled request, or one freeze() returned)")
        assert isinstance(self.finalize_fns, list)
        self.finalize_fns.append(fn)
        return self

    def freeze(self) -> AsyncRequest:
        return replace(self, is_frozen=True)

    def _asdict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._fields}

    def execute_sync(self) -> None:
        """Run everything in the calling thread: preload, async_fn, then the finalize fns."""
        if self.preload_fn is not None:
            self.preload_fn()
        if self.async_fn is not None:
            self.async_fn(*self.async_fn_args, **self.async_fn_kwargs)
        for fn in self.finalize_fns:
            fn()


@dataclass
class _Call:
    index: int
    request: AsyncRequest
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def _state_of(call: _Call) -> list[Any]:
    return [call.done.is_set(), describe_failure(call.error) if call.error else None]


_finalizing = threading.local()


def finalizing_agreed_calls() -> bool:
    """True while a queue runs the finalize fns of a call that every rank agreed is done (a
    finalize fn then needs not wait for slower ranks; ``execute_sync`` gives no such promise)."""
    return bool(getattr(_finalizing, "agreed", False))


def _drain_at_exit(ref: weakref.ReferenceType[AsyncCallsQueue]) -> None:
    q = ref()
    if q is not None:
        q._drain_locally()


class AsyncCallsQueue:
    """Runs scheduled requests in order on one persistent background thread.

    Construction is collective when torch.distributed is initialised: it creates the queue's own
    gloo group (``timeout`` bounds every collective) and gathers each rank's node (``node_id``,
    else $LOCALCKPT_NODE_ID, else the hostname, as the manager's), through whose lowest rank
    its agreements then go. At interpreter exit, requests still running
    are waited for (their local work completes, e.g. the shard is committed); finalization needs
    every rank and is left to the next run's ``find_latest``.
    """

    def __init__(self, persistent: bool = True, timeout: float = 300.0,
                 node_id: str | None = None) -> None:
        if not persistent:
            logger.info("AsyncCallsQueue: only the persistent thread worker is implemented")
        self._group = CheckpointGroup(timeout, owner="AsyncCallsQueue")  # checks the timeout
        try:  # agreements then go through node leaders (node_id as LocalCheckpointManager's)
            self._group.learn_nodes(local_node_name(node_id))
        except BaseException:
            self._group.close()
            raise
        self._timeout = self._group.timeout
        self._calls: list[_Call] = []
        self._next = 0
        self._work: queue.Queue[_Call | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="localckpt-async", daemon=True)
        self._worker.start()
        self._closed = False
        atexit.register(_drain_at_exit, weakref.ref(self))

    def _run(self) -> None:
        while (call := self._work.get()) is not None:
            try:
                req = call.request
                if req.async_fn is not None:
                    req.async_fn(*req.async_fn_args, **req.async_fn_kwargs)
            except BaseException as exc:  # reported at finalization, on every rank
                logger.error("async call %d failed: %s", call.index, exc)
                call.error = exc
            finally:
                call.done.set()

    def schedule_async_request(self, request: AsyncRequest | None) -> int:
        """Run ``request.preload_fn`` now, queue ``async_fn`` for the worker; returns the call's
        index. Does not block on earlier calls. None (a save skipped with ``busy="skip"``)
        schedules nothing: -1."""
        if self._closed:
            raise ConfigurationError("AsyncCallsQueue: schedule_async_request after close()")
        if request is None:
            return -1
        request = request.freeze()  # what runs is what was scheduled
        if request.preload_fn is not None:
            request.preload_fn()
        call = _Call(self._next, request)
        self._next += 1
        self._calls.append(call)
        self._work.put(call)
        return call.index

    def get_num_unfinalized_calls(self) -> int:
        return len(self._calls)

    def maybe_finalize_async_calls(self, blocking: bool = False,
                                   no_dist: bool = False) -> list[int]:
        """Finalize, oldest first, every call that is done on all ranks; return their indices.

        With ``blocking`` waits (up to the timeout per call) until all calls are done. Collective
        unless ``no_dist`` (then only this rank's completion counts). A call whose async_fn raised
        on any rank raises, on every rank, after its finalize fns ran (they see the failure
        through their own state, e.g. to remove a partial checkpoint).
        """
        finalized: list[int] = []
        while self._calls:
            call = self._calls[0]
            if blocking and not self._wait_done(call):
                err = CollectiveTimeoutError(f"async call {call.index} did not finish within "
                                             f"{self._bound(call):g}s on rank "
                                             f"{self._group.rank}")
                self._group.mark_broken(err)  # the other ranks time out waiting for us
                raise err
            if no_dist:
                everywhere = call.done.is_set()
                failures = {0: describe_failure(call.error)} if call.error else {}
            else:
                # Blocking: a rank whose call ended early waits for the others' (each bounded
                # by the timeout above), not only for one collective timeout.
                states = self._group.exchange(
                    f"async call {call.index}: done?", partial(_state_of, call),
                    wait=self._bound(call) + self._timeout if blocking else None)
                everywhere = all(done for done, _ in states)
                failures = {r: (str(e[0]), str(e[1])) for r, (_, e) in enumerate(states) if e}
            if not everywhere:
                break
            self._calls.pop(0)
            _finalizing.agreed = not no_dist
            try:
                for fn in call.request.finalize_fns:
                    fn()
            finally:
                _finalizing.agreed = False
            if failures:
                raise error_from_failures(f"async call {call.index}", failures) from call.error
            finalized.append(call.index)
        return finalized

    def _bound(self, call: _Call) -> float:
        """How long ``call``'s background part may take: the queue's timeout, or the request's
        own bound when it is longer (a save agreed with more work than one timeout covers)."""
        own = call.request.bound
        return max(self._timeout, own()) if own is not None else self._timeout

    def _wait_done(self, call: _Call) -> bool:
        """Wait for ``call`` as long as :meth:`_bound` says, asked again as the wait goes on."""
        started = time.monotonic()
        while not call.done.wait(1.0):
            if time.monotonic() - started >= self._bound(call):
                return call.done.is_set()
        return True

    def close(self, abort: bool = False) -> None:
        """Finalize everything pending (collective), unless ``abort``; stop the worker."""
        if self._closed:
            return
        try:
            if not abort:
                self.maybe_finalize_async_calls(blocking=True)
        finally:
            self._closed = True
            self._work.put(None)
            self._worker.join(timeout=self._timeout)
            self._group.close()

    def _drain_locally(self) -> None:
        """At interpreter exit: let running and queued calls finish (no collectives)."""
        if self._closed:
            return
        for call in list(self._calls):
            if not self._wait_done(call):
                logger.error("async call %d still running at exit after %gs", call.index,
                             self._bound(call))
                return
