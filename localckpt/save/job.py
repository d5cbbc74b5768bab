"""One save after staging: the part that can run in the background.

``SaveJob.run`` (for an async save, after taking part in the save's agreement) writes the rank's
shard from the staged payload and replicates it; it never raises (the error is kept for the
finalize step, which agrees on it across ranks) and sets ``done`` when it is finished. It only
uses the manager's *data* group, so it can run on a background thread while the main thread uses
the control group or the training group.

An async save starts ``run`` on a thread of its own (:meth:`SaveJob.start`); the request it
returns only waits for ``done`` (:meth:`DoneSignal.wait`), in a thread of the process or in
another process, as Megatron's queue runs a request.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.util
import os
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from replication import ExchangePlan, Transfer

from ..errors import CheckpointingError, CollectiveError
from ..ops.metrics import Metrics
from ..storage.manifest import ShardManifest
from ..storage.parity_io import ParityFolder
from ..storage.peer_io import StoreReceiver, built_or_draining, exchange_shards

if TYPE_CHECKING:
    from ..control.context import Context
    from .prepare import AgreedSave

logger = logging.getLogger(__name__)

# Exchanges an agreement may take (request, replicated shards, free space after deletions),
# each bounded by the timeout: how long a waiter gives an async save's agreement.
AGREEMENT_STEPS = 3


class DoneSignal:
    """Set once; waited for from threads of this process (an Event), or from another process:
    one forked from this one, or one it was sent to pickled (Megatron's queue runs a request's
    ``async_fn`` in a forked process, or a spawned persistent worker). Those watch for a file
    that :meth:`set` creates in a directory of this process under the temporary directory, or,
    when that fails (full, unwritable), under /dev/shm (named now, made then: building a signal
    touches no file system, so it cannot fail on one rank). The file goes when the signal is
    collected in this process, and the directory with every file left in it when the process
    exits."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._pid = os.getpid()
        name = uuid.uuid4().hex
        self.paths = tuple(os.path.join(d, name) for d in _signal_dirs())
        weakref.finalize(self, _remove, self.paths, self._pid).atexit = False

    def set(self) -> None:
        if not self._event.is_set():
            self._event.set()
            errors = []
            for path in self.paths:
                try:
                    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
                    open(path, "xb").close()
                    return
                except OSError as exc:  # never let the signal fail the save: the next place
                    errors.append(f"{path}: {exc}")
            logger.error("localckpt: cannot create a signal file for a waiting process (%s); "
                         "it waits until this process exits", "; ".join(errors))

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the signal is set, waiting up to ``timeout`` seconds (None: for ever)."""
        if os.getpid() == self._pid:
            return self._event.wait(timeout)
        return RemoteDone(self.paths, self._pid).wait(timeout)

    def __reduce__(self) -> tuple[Any, ...]:
        return RemoteDone, (self.paths, self._pid)


@dataclass(frozen=True)
class RemoteDone:
    """A :class:`DoneSignal` seen from another process: the places of its file, and the process
    that sets it (when that one is gone, nothing will: the wait ends)."""

    paths: tuple[str, ...]
    owner: int = 0

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not any(os.path.exists(path) for path in self.paths):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            if self.owner and os.getppid() != self.owner and not _alive(self.owner):
                return False
            time.sleep(0.005)
        return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


_dir_lock = threading.Lock()
_dirs: tuple[int, tuple[str, ...]] | None = None  # (pid, directories) of this process's signals


def _signal_dirs() -> tuple[str, ...]:
    """This process's directories of signal files, in the order tried: names only (made by the
    first set that needs them)."""
    global _dirs
    with _dir_lock:
        if _dirs is None or _dirs[0] != os.getpid():
            try:
                base = tempfile.gettempdir()
            except OSError:
                base = "/tmp"
            name = f"localckpt-signals-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            bases = [base] + [b for b in ("/dev/shm",)
                              if os.path.isdir(b) and os.path.realpath(b) !=
                              os.path.realpath(base)]
            _dirs = (os.getpid(), tuple(os.path.join(b, name) for b in bases))
            for d in _dirs[1]:
                # After multiprocessing joined this process's children at exit (a forked
                # waiter may still be watching for a file), not before: a lower priority.
                multiprocessing.util.Finalize(None, _remove_dir, args=(d, os.getpid()),
                                              exitpriority=-1)
        return _dirs[1]


def _remove(paths: tuple[str, ...], pid: int) -> None:
    if os.getpid() == pid:  # a forked child's copy of a signal is not its to remove
        for path in paths:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _remove_dir(path: str, pid: int) -> None:
    """At this process's exit: its signal files go with their directory. A waiter in another
    process then stops watching as the owner is gone (RemoteDone.wait); what it is told does
    not matter, the save's outcome is the finalize step's to report."""
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)


def wait_for_save(done: DoneSignal | RemoteDone) -> None:
    """An async save's ``async_fn``: returns once the save's background work is over (its
    outcome is the finalize step's to report)."""
    done.wait()


@dataclass(eq=False)
class SaveJob:
    """A staged shard on its way to disk and to its replica holders.

    Built either agreed (a synchronous save agreed on the training thread: ``manifest`` and
    ``plan`` set) or with ``agree`` (an async save): then :meth:`run` first takes part in the
    agreement on the data group, and ``manifest``, ``plan`` and ``wait_steps`` are set from it.
    """

    iteration: int
    manifest: ShardManifest  # checksums not yet known; the agreed one once ``agreed`` is set
    payload: torch.Tensor  # the staging arena's bytes: must not be restaged before ``done``
    plan: ExchangePlan | None = None
    agree: Callable[[], AgreedSave] | None = None  # None: agreed already
    parity: ExchangePlan | None = None  # erasure coding: shards to the parity holders
    sizes: tuple[int, ...] = ()  # every rank's packed bytes (what parity is folded over)
    error: BaseException | None = None
    # The agreement's verdict against this save, the same on every rank that reached it
    # (nothing was written): what finalize reports for this rank.
    agreed_error: Exception | None = None
    agreed: threading.Event = field(default_factory=threading.Event)
    # Whether this rank passed the agreement (iteration validated): only then may a failed
    # save's shards of ``iteration`` here be deleted, as this save wrote them.
    passed_agreement: bool = False
    done: DoneSignal = field(default_factory=DoneSignal)
    finalized: bool = False
    finalize_error: BaseException | None = None  # what finalizing it raised, on every rank
    # Units of work (chunks written, pieces on the wire along the replica schedule), each
    # bounded by the timeout, that the slowest rank may still have ahead when a fast one agrees.
    wait_steps: int = 2
    # When its staging began (time.monotonic_ns): recycled files older than that and not
    # written over by it are surplus once it is finalized (see storage/recycle.py).
    started_ns: int = field(default_factory=time.monotonic_ns)
    metrics: Metrics = field(default_factory=Metrics)
    thread: threading.Thread | None = field(default=None, repr=False)  # :meth:`start`'s

    def __post_init__(self) -> None:
        if self.agree is None:
            self.passed_agreement = True
            self.agreed.set()

    def bound(self, timeout: float) -> float:
        """How long :meth:`wait` may take with ``timeout``: the agreement, then the work agreed
        (known once agreed)."""
        return timeout * (AGREEMENT_STEPS + self.wait_steps)

    def wait(self, timeout: float) -> bool:
        """Whether the job is done, waiting up to ``timeout`` (seconds per unit of work) for
        its agreement (AGREEMENT_STEPS units), then for the work agreed (``wait_steps``); once
        done, its thread has ended too (``close`` leaves no save thread behind)."""
        if not (self.agreed.wait(waitable(timeout * AGREEMENT_STEPS))
                and self.done.wait(waitable(timeout * self.wait_steps))):
            return False
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)  # done is set last: the thread is only returning
        return True

    def start(self, ctx: Context) -> None:
        """Run :meth:`run` on a thread of its own. Not a daemon: at interpreter exit the shard
        is still committed (every step of it is bounded by the timeout)."""
        thread = threading.Thread(target=self.run, args=(ctx,),
                                  name=f"localckpt-save-{self.iteration}")
        thread.start()
        self.thread = thread  # only once started: one that never started is not joined

    def run(self, ctx: Context) -> None:
        """Agree (if not yet agreed), write, then replicate (this rank's part of the plan) on
        ``ctx.data_group``. Never raises; sets ``agreed``, then ``done``."""
        try:
            if self.agree is not None:
                try:
                    agreed = self.agree()
                    self.manifest, self.plan, self.wait_steps = \
                        agreed.manifest, agreed.plan, agreed.wait_steps
                    self.parity, self.sizes = agreed.parity, agreed.sizes
                    self.passed_agreement = True
                except CollectiveError as exc:  # no agreement: finalize finds out what holds
                    self.error = exc
                    return
                except CheckpointingError as exc:  # a verdict on the gathered input: agreed
                    self.agreed_error = exc
                    return
                except Exception as exc:  # this rank's alone (e.g. its group torn down)
                    self.error = CollectiveError(
                        f"save of iteration {self.iteration}: the agreement failed on rank "
                        f"{ctx.rank}: {type(exc).__name__}: {exc}")
                    self.error.__cause__ = exc
                    return
                finally:  # after the agreed bound (wait_steps) is set: finalize reads it
                    self.agreed.set()
            self._write_and_replicate(ctx)
        except BaseException as exc:  # never let the worker die silently
            self.error = self.error or exc
        finally:
            self.agreed.set()
            self.done.set()

    def _write_and_replicate(self, ctx: Context) -> None:
        metrics, store = self.metrics, ctx.store
        rank, session = ctx.rank, self.manifest.session_id
        committed: ShardManifest | None = None
        try:
            with metrics.timed("write", rank, self.iteration, session,
                               self.manifest.data_nbytes):
                _, committed = store.write(self.manifest, self.payload)
        except Exception as exc:
            self.error = exc
            logger.error("rank %d: writing shard of iteration %d failed: %s",
                         rank, self.iteration, exc)
        def source(t: Transfer) -> tuple[ShardManifest, torch.Tensor]:
            if committed is None:
                raise RuntimeError(f"rank {rank} has no shard to send: {self.error}")
            return committed, self.payload

        if self.plan is not None:
            received: dict[tuple[int, int], StoreReceiver] = {}
            sent = sum(1 for t in self.plan.transfers if t.src == rank)
            try:
                with metrics.timed("replicate", rank, self.iteration, session) as box:
                    exchange_shards(self.plan, ctx.data_group, store, ctx.world_size,
                                    source, ctx.ring, received)
                    box["nbytes"] = sent * self.manifest.data_nbytes + sum(
                        r.manifest.data_nbytes for r in received.values())
            except Exception as exc:
                self.error = self.error or exc
        if self.parity is not None and ctx.erasure is not None:
            try:
                with metrics.timed("parity", rank, self.iteration, session) as box:
                    layout = ctx.erasure
                    # A block of an earlier save of this iteration (saved again after a
                    # failure) must not outlive a fold that dies: missing, a load's
                    # write-back folds it again; left, it would pass for this save's.
                    for s, j, slot in layout.slots():
                        if layout.stripes[s].parity[j] == rank:
                            store.delete(store.ref(self.iteration, slot, ctx.world_size),
                                         background=True)
                    folder, sink = built_or_draining(lambda: ParityFolder(
                        store, layout, self.iteration, rank, ctx.world_size,
                        dict(enumerate(self.sizes)), ctx.ring, self.manifest.metadata))
                    exchange_shards(self.parity, ctx.data_group, store, ctx.world_size, source,
                                    ctx.ring, sink=sink)
                    box["nbytes"] = sum(self.sizes[t.src] for t in self.parity.transfers
                                        if rank in (t.src, t.dst))
                    folder().commit()
            except Exception as exc:
                self.error = self.error or exc


def waitable(seconds: float) -> float:
    """``seconds`` as a threading wait takes it: a bound of many units of work times a long
    timeout (1e6 s) passes threading.TIMEOUT_MAX, where a wait raises OverflowError."""
    return min(seconds, threading.TIMEOUT_MAX)
