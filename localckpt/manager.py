"""LocalCheckpointManager: save, find_latest and load of node-local checkpoints.

Names and call pattern follow NVIDIA's local checkpoint manager so users can switch:
``save(state_dict, iteration)``, ``find_latest() -> int`` (-1 when none),
``load() -> (state_dict, (iteration, rank, session_id))``. Every public method is collective: all
ranks of the job call it, in the same order. Collectives run on the manager's own gloo group with
``timeout``; a failure on any rank raises the same exception on every rank.

This module is the facade: arguments, bootstrap, and the verbs. The save path is
:mod:`localckpt.save.saver`, the load path :mod:`localckpt.load.loader`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from replication import ReplicationStrategy, make_strategy, strategy_names

from .control.bootstrap import join_job
from .control.collectives import checked_timeout
from .control.durable_config import DurableTier
from .control.retention import KeepPolicy
from .control.schedule import SavePolicy, Schedule
from .control.settings import agreed_settings
from .errors import CheckpointingError, CollectiveError, ConfigurationError, InvalidIterationError
from .load.from_durable import within
from .load.loader import LoadPath
from .ops.metrics import MetricHook, Metrics, as_metrics
from .save.async_calls import AsyncRequest
from .save.persist import Persister
from .save.saver import SavePath
from .storage.durable import DurableStore
from .storage.layout import session_dir
from .storage.peer_io import PIECE_TARGET_NBYTES
from .storage.rollback_fence import Fence
from .storage.space import DEFAULT_CHUNK_NBYTES

logger = logging.getLogger(__name__)

CkptID = tuple[int, int, str]


class LocalCheckpointManager:
    """Saves each rank's shard to node-local storage and restores the newest complete one.

    Args:
        root_local_ckpt_dir: node-local directory (tmpfs such as /dev/shm, or NVMe). Created if
            missing (0700). Ranks of one node may share it. Refused if it is a symbolic link or
            owned by another user, unless ``allow_unsafe_root``.
        session_id: separates jobs sharing a root; "" is the default session.
        repl_strategy: None (no replicas), a ReplicationStrategy, or the registered name of one
            built with its defaults (``replication.strategy_names()``). ``"erasure"`` (or
            ``ErasureCodingStrategy(k, m)``) keeps parity blocks instead of replicas: any m
            lost nodes per stripe of k shards are rebuilt (docs/erasure.md).
        keep_last: complete iterations kept after a successful save (>= 1).
        keep_every: also keep each complete iteration that is a positive multiple of this (None:
            none), e.g. every 1000th for post-mortems. ``localckpt gc --keep-every`` keeps the
            same.
        keep_best, best_metric, best_mode, keep_without_metric: also keep the ``keep_best``
            iterations with the best ``metrics[best_metric]`` given to ``save`` ("min" or
            "max"), and (unless ``keep_without_metric`` is False) those saved without it.
        keep_predicate: also keep each iteration ``keep_predicate(iteration, metrics or None)``
            is true for.
        keep_interval: also keep one iteration per this many seconds (the first saved in each
            interval, by rank 0's clock). What the rules keep is the union; the newest complete
            iteration is always kept (see localckpt.control.retention.KeepPolicy).
        save_policy: a :class:`localckpt.SavePolicy`: ``should_save(step)`` answers from it, and
            ``save`` skips (returns None) a step it does not choose unless ``force=True``.
        preemption_signals: signals (e.g. ``[signal.SIGTERM, signal.SIGUSR1]``; True:
            SIGTERM) that mean the scheduler preempts the job: handled from construction to
            ``close`` (the handler before is called after ours when it is Python code), agreed
            by ``reached_preemption`` (and ``should_save``).
        timeout: seconds any collective of the manager may take before it raises.
        chunk_nbytes: target size of the data chunk files.
        io_threads: threads that checksum and write / read chunk files in parallel (None: the
            rank's share of the cores it may run on: its affinity mask, capped by a cgroup CPU
            quota, divided among the ranks of its node with the same mask; 2 to 12).
        node_id: this rank's node, for placement (default $LOCALCKPT_NODE_ID, else hostname).
        busy: what an async save does while the previous one is in flight: "wait" for it, or
            "skip" this save (decided alike on every rank).
        metrics: a :class:`localckpt.Metrics` or a callable receiving each
            :class:`~localckpt.PhaseMetric` (per-phase seconds and bytes); records also
            go to the ``localckpt.metrics`` logger and to ``$LOCALCKPT_METRICS_FILE`` if set.
        strict: raise ConfigurationError, instead of logging a warning, when the replication
            strategy leaves some shard without a copy on another node.
        allow_unsafe_root: accept a root (or session directory) that is a symbolic link or is
            owned by another user.
        reshard: let ``find_latest`` and ``load`` use checkpoints saved by a job of another
            world size (an elastic restart): DTensor leaves are reassembled onto this job's
            layout, plain per-rank state is that of old rank ``rank % old_world_size`` (see
            docs/fsdp2.md). Off: such checkpoints are ignored (and reported). At the same world
            size DTensors are always reassembled onto ``into``'s mesh when it differs.
        dedupe_replicated: store a replicated DTensor shard (a Replicate placement: HSDP,
            tensor-parallel norms) once per replica group, by one member chosen per leaf, not by
            every rank (see localckpt.save.dedupe; ``load`` assembles the others' from it).
        durable: a :class:`localckpt.DurableTier` (a directory on a shared file system): every
            ``persist_every``-th finalized save is copied there in the background, and
            ``find_latest`` / ``load`` restore from it when the node-local tiers cannot serve a
            newer iteration (a whole job restarted on empty nodes). See docs/durable.md.
        recycle_files: retention keeps the chunk files of the shards it deletes in a pool of the
            node root and later saves write over them (on tmpfs nearly twice as fast as into
            new files, and no pages are freed); between saves the node then holds one retired
            iteration more (see localckpt.storage.recycle).

    Construction is collective when torch.distributed is initialised (it creates two gloo groups
    from the default group and runs one exchange); without it the manager runs as a world of
    one. It holds a shared lock on the session directory until :meth:`close` (``localckpt gc``
    refuses to delete in a session a live job holds).
    """

    def __init__(self, root_local_ckpt_dir: str | os.PathLike[str], session_id: str = "",
                 repl_strategy: ReplicationStrategy | str | None = None, *, keep_last: int = 1,
                 keep_every: int | None = None, keep_best: int | None = None,
                 best_metric: str | None = None, best_mode: str = "min",
                 keep_without_metric: bool = True,
                 keep_predicate: Callable[[int, Any], bool] | None = None,
                 keep_interval: float | None = None,
                 save_policy: SavePolicy | None = None,
                 preemption_signals: Sequence[int] | bool | None = None,
                 timeout: float = 300.0, chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
                 io_threads: int | None = None, node_id: str | None = None,
                 busy: str = "wait", metrics: Metrics | MetricHook | None = None,
                 strict: bool = False, allow_unsafe_root: bool = False,
                 reshard: bool = False, dedupe_replicated: bool = True,
                 recycle_files: bool = False, durable: DurableTier | None = None) -> None:
        # Arguments: the same on every rank, so checked before any collective.
        metrics_ = as_metrics(metrics)
        strategy = make_strategy(repl_strategy) if isinstance(repl_strategy, str) \
            else repl_strategy
        if strategy is not None and not isinstance(strategy, ReplicationStrategy):
            raise ConfigurationError("repl_strategy: expected None, a ReplicationStrategy or one "
                                     f"of {strategy_names()}, got {type(repl_strategy).__name__}")
        if busy not in ("wait", "skip"):
            raise ConfigurationError(f"busy: expected 'wait' or 'skip', got {busy!r}")
        keep = KeepPolicy(keep_last, keep_every, keep_best, best_metric, best_mode,
                          keep_without_metric, keep_predicate,
                          keep_interval)  # ConfigurationError on a bad value
        if durable is not None and not isinstance(durable, DurableTier):
            raise ConfigurationError(f"durable: expected None or a DurableTier, got "
                                     f"{type(durable).__name__}")
        if save_policy is not None and not isinstance(save_policy, SavePolicy):
            raise ConfigurationError(f"save_policy: expected None or a SavePolicy, got "
                                     f"{type(save_policy).__name__}")
        if preemption_signals is not None and type(preemption_signals) is not bool:
            try:  # once: an iterator read by the settings would reach the schedule spent
                preemption_signals = list(preemption_signals)
            except TypeError:
                raise ConfigurationError(
                    "preemption_signals: expected None, a bool or signals (e.g. "
                    f"[signal.SIGTERM]), got {preemption_signals!r}") from None
        checked_timeout(timeout, "LocalCheckpointManager")
        if type(chunk_nbytes) is not int or chunk_nbytes < 4096:
            raise ConfigurationError(f"chunk_nbytes: expected an int >= 4096, got {chunk_nbytes!r}")
        if type(reshard) is not bool:
            raise ConfigurationError(f"reshard: expected a bool, got {reshard!r}")
        if type(dedupe_replicated) is not bool:
            raise ConfigurationError(
                f"dedupe_replicated: expected a bool, got {dedupe_replicated!r}")
        if type(recycle_files) is not bool:
            raise ConfigurationError(f"recycle_files: expected a bool, got {recycle_files!r}")
        if io_threads is not None and (type(io_threads) is not int or io_threads < 1):
            raise ConfigurationError(
                f"io_threads: expected None or an int >= 1, got {io_threads!r}")
        root = Path(root_local_ckpt_dir)
        session_dir(root, session_id)  # a bad session id is a ConfigurationError
        self.root, self.session_id, self.keep_last, self.busy = root, session_id, keep_last, busy
        self.repl_strategy = strategy
        self.node_id = node_id
        self.timeout = float(timeout)
        self.metrics = metrics_
        self._closed = False

        # What construction took so far, released in reverse if a later step refuses (a bad
        # setting on one rank, preemption_signals it cannot handle): nothing stays held.
        undo: list[Callable[[], object]] = []
        # What every rank must be given alike (compared in the start-up exchange).
        settings = agreed_settings(
            session_id=session_id, keep_last=keep_last, keep_every=keep_every,
            keep_best=keep_best, best_metric=best_metric, best_mode=best_mode,
            keep_without_metric=keep_without_metric, keep_interval=keep_interval,
            keep_predicate=keep_predicate is not None, busy=busy, strict=strict,
            reshard=reshard, dedupe_replicated=dedupe_replicated, timeout=self.timeout,
            save_policy=save_policy, preemption_signals=preemption_signals, strategy=strategy,
            durable=durable)
        try:
            joined = join_job(root, session_id, node_id, timeout=self.timeout, strategy=strategy,
                              strict=strict, settings=settings, metrics=metrics_,
                              allow_unsafe_root=allow_unsafe_root, recycle_files=recycle_files,
                              durable=durable, io_threads=io_threads,
                              chunk_nbytes=chunk_nbytes, undo=undo)
            self._ctx, self._lock, self._run = joined.ctx, joined.lock, joined.run
            self.rank, self.world_size = self._ctx.rank, self._ctx.world_size
            self.topology = self._ctx.topology
            self._job_identity = joined.identity
            self._save = SavePath(self._ctx, keep, busy)
            undo.append(self._save.close)
            self._save.agreement.any_world = reshard
            self._save.retainer.any_world = reshard
            self._save.dedupe_replicated = dedupe_replicated
            self.reshard = reshard
            self._load = LoadPath(self._ctx, self._save, reshard, self._job_identity)
            self._schedule = Schedule(self._ctx, save_policy, preemption_signals,
                                      self._save.finalize_over)
            undo.append(self._schedule.close)
            self.durable = durable
            tier = joined.tier  # opened when durable is given
            if durable is not None and tier is not None:  # no request made yet: an unreachable
                # store fails no rank here
                self._load.durable = tier
                persister = Persister(self._ctx, tier, durable.persist_every, durable.keep,
                                      durable.commit_timeout or self.timeout, self._run,
                                      interval=durable.persist_interval,
                                      keep_every=durable.keep_every, any_world=reshard)
                self._save.persister = persister
                self._save.retainer.pinned = persister.pinned
                self._save.agreement.discard_durable = partial(_discard_newer_in, tier,
                                                               self.timeout / 2)
        except BaseException:
            for release in reversed(undo):
                with contextlib.suppress(Exception):
                    release()
            raise

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Wait for an async save's local work (its shard is then committed; finalizing it needs
        every rank and happens through the AsyncCallsQueue, so close the queue first), then
        release the I/O threads, the process groups and the session lock. Not collective.
        Every later collective of this manager raises CollectiveError."""
        self._closed = True
        ended = True
        try:
            self.wait_for_write_back()
        except CollectiveError as exc:  # logged; closing goes on
            logger.error("rank %d: close: %s", self.rank, exc)
            ended = self._load.stop_write_back(self.timeout)
        ended = self._save.close() and ended
        # A save thread still running past its bound commits nothing from now on: it would
        # replace what a later manager of the session commits under the same name.
        self._ctx.store.stop_commits()
        if self._save.persister is not None:
            self._save.persister.close(self.timeout)
        self._schedule.close()
        self._ctx.ring.release()
        self._ctx.store.close(wait=ended)  # a write stuck in its pool is not waited for
        self._ctx.data_group.close()
        self._ctx.group.close()
        if ended:
            self._lock.release()
        else:  # gc must not delete under a thread that may still write (freed at exit)
            logger.error("rank %d: close: a save or write-back thread is still running; the "
                         "session lock is kept until this process exits", self.rank)

    def __enter__(self) -> LocalCheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def latest_iteration(self) -> int:
        """The newest complete iteration as last seen by find_latest, load or a finalized save
        (-1 when none was seen)."""
        return self._save.latest_iteration

    @latest_iteration.setter
    def latest_iteration(self, iteration: int) -> None:
        self._save.latest_iteration = iteration

    # ------------------------------------------------------------------ the verbs

    def save(self, state_dict: Any, iteration: int, is_async: bool = False, *,
             custom_metadata: dict[str, Any] | None = None,
             metrics: dict[str, float] | None = None,
             force: bool = False) -> AsyncRequest | None:
        """Save this rank's ``state_dict`` as its shard of ``iteration``. Collective.

        ``state_dict`` is a TensorAwareStateDict or a plain nested dict/list/tuple (wrapped
        automatically); it is never mutated. Its leaves may be DTensors (each rank saves its
        local shard and the layout) and Stateful objects (saved through ``state_dict()``; see
        docs/fsdp2.md). Its tensors are copied into the staging arena before
        ``save`` returns: from then on training may modify or free them (on CUDA the copies are
        complete too; see docs/async.md).

        Synchronous (default): blocks until the shard is written, replicated and finalized (the
        iteration is complete on every rank, older iterations beyond ``keep_last`` removed).
        ``is_async=True``: returns after staging with an :class:`AsyncRequest`. Write and
        replication start at once on a thread of the manager, on its own data group; the
        request's ``async_fn`` only waits for them (from a thread, or from a process forked
        after the save: Megatron's queue). Schedule it on an :class:`AsyncCallsQueue` (or
        Megatron's), whose ``maybe_finalize_async_calls`` finalizes it; a request nobody
        finalizes is finalized by the next save, ``find_latest`` or ``load``. A previous async
        save still in flight is waited for and finalized first (``busy="skip"``: this save is
        skipped on every rank and None returned instead).

        Raises, on every rank alike: InvalidIterationError (not an int, negative, >= 10**10, not
        newer than the latest complete iteration), InsufficientSpaceError (checked before
        writing, replicas counted), RankTypeError (unsupported leaf on some rank), the failing
        rank's error for any failure while staging, IncompleteCheckpointError or the failing
        rank's error when a write or a transfer failed, CollectiveError /
        CollectiveTimeoutError. An async save agrees on its own thread, so that ``save``
        returns as soon as this rank has staged, without waiting for the other ranks: all of
        these are then raised by the request's finalize step (on every rank, nothing of it
        written); ``save`` itself raises only what finalizing the previous save raises. A failed
        save's shards are removed only when every rank agreed it failed; nothing committed
        earlier is touched.
        """
        schedule = self._schedule
        # A bad iteration is every rank's error inside the policy's exchange when it has one.
        # A policy without one is asked locally: a bad iteration then goes to the save's own
        # agreement, which ranks that were told "not due" do not join (the same iteration on
        # every rank is the caller's part, as for any collective).
        if schedule.policy is not None and not force and (
                schedule.collective or (type(iteration) is int and iteration >= 0)) and \
                not schedule.should_save(iteration, "iteration", InvalidIterationError, "save"):
            return None
        self._load.forget_listing()  # the disk changes: a load must list again
        self.wait_for_write_back()
        request = self._save.save(state_dict, iteration, is_async, custom_metadata, metrics)
        if request is not None or not is_async:  # a save skipped (busy="skip") is no save
            self._schedule.saved()
        return request

    def should_save(self, step: int) -> bool:
        """Whether to save at ``step``, by ``save_policy`` (ConfigurationError without one), or
        because a preemption was noticed: True on every rank alike. Collective when the policy
        has ``every_seconds`` or preemption signals are handled (one small exchange: rank 0's
        clock, every rank's flag, after waiting for a save's finalize another thread is
        running); otherwise local and free."""
        return self._schedule.should_save(step)

    def reached_preemption(self, step: int) -> bool:
        """Whether a preemption signal reached any rank: True on every rank at the same call,
        after finalizing an async save in flight (its failure is logged, not raised: the loop
        must still save), so the loop saves ``step`` (``save(..., force=True)``) and exits.
        Collective (one exchange of a flag: about a millisecond on a few ranks, after waiting
        for a save's finalize another thread is running; call it every step, or every few when
        the job has thousands of ranks); False at once, and not collective, without
        ``preemption_signals``."""
        if self._schedule.reached_preemption(step):
            try:
                self._save.settle()
            except CheckpointingError as exc:  # the preemption save must still be made
                logger.error("rank %d: the async save in flight at the preemption failed (%s); "
                             "saving step %d now", self.rank, exc, step)
            return True
        return False

    def find_latest(self) -> int:
        """The newest loadable iteration, or -1. Collective. Waits for (and finalizes) an async
        save in flight first.

        Lists committed shards (no data is read), all-gathers the inventories and picks the
        newest iteration whose every owner's shard is held by some rank (or, with erasure
        coding, can be rebuilt from the blocks of its stripe)
        (:func:`localckpt.control.coverage.choose_latest`). Shards of another world size are
        reported in a warning and ignored. Checksums are verified by ``load``.
        """
        return self._load.find_latest()

    def metadata(self, iteration: int) -> dict[str, Any]:
        """``{"iteration", "custom", "metrics", "saved_unix"}`` of ``iteration``: what its save
        was given as ``custom_metadata`` and ``metrics`` (None where nothing), and when it was
        saved (rank 0's clock; None for a shard of an older localckpt), rank 0's. Collective (a rank
        that holds no shard of it gets a peer's answer). NoCheckpointError when no rank holds a
        readable shard of it; InvalidIterationError for no non-negative int."""
        return self._load.metadata(iteration)

    def iterations(self) -> list[int]:
        """Every complete iteration this job can load, oldest first (the same list on every
        rank). Collective. Waits for (and finalizes) an async save in flight first. Lists
        committed shards (no data is read): a corrupt copy is found by ``load``."""
        return self._load.iterations()

    def load(self, into: Any = None, *, iteration: int | None = None,
             discard_newer: bool = False) -> tuple[Any, CkptID]:
        """Load this rank's shard of the latest complete iteration, or of ``iteration``.
        Collective.

        Calls ``find_latest`` first if it has not been called (or found nothing). Returns the
        state dict in the form it was saved (a plain dict, or a BasicTensorAwareStateDict when a
        TensorAwareStateDict was saved), tensors on their original devices (CPU, with a warning,
        where that device is absent), and ``(iteration, rank, session_id)``.

        A copy that fails verification is quarantined (a warning names the file) and replaced
        by a replica; when no copy of some shard is left, every rank falls back to the newest
        older complete iteration in the same call, and the returned id says which.

        ``iteration=N`` (rollback, e.g. after a loss spike): that iteration, through the same
        path (peer fetch, another holder's copy for a corrupt one), never another: when it is
        not complete, or no good copy of some shard is left, NoCheckpointError /
        CorruptShardError name it on every rank. Only at this job's world size. A later save
        must be newer than the newest complete iteration, unless ``discard_newer=True``: then
        every rank deletes the newer iterations once N is loaded, and saves go on from N.

        ``into``: a state dict like the one saved (e.g. the freshly built model's and optimizer's
        ``state_dict()``): each saved tensor whose key path, dtype and shape match a tensor of
        ``into`` is loaded into that tensor in place (on CPU read straight into it, with no
        allocation; on another device copied into it), and the returned state dict holds those
        very tensors. The others are allocated as without ``into``. Tensors of ``into`` that
        share memory (tied weights) are filled by a copy once read, when the values saved for
        them agree (else returned fresh, with a warning). They must be writable and left alone while
        ``load`` runs: a checksum that fails there is blamed on them (ConfigurationError), never
        on the copy. If ``load`` raises, or falls back to an older iteration, tensors of
        ``into`` the returned state does not hold may keep data of the iteration it gave up.
        A DTensor of ``into`` is loaded into through its local shard when the saved shard lies
        at the same place on a mesh of the same shape; a saved DTensor without one at its path
        is wrapped on a mesh of ``into`` of the same shape and dim names. A Stateful object of
        ``into`` gets ``load_state_dict`` with what was loaded for it and is returned in place.

        With ``reshard=True`` and a checkpoint saved by a job of another world size, every
        DTensor leaf needs a DTensor in ``into`` (its layout says what this rank holds now);
        plain state is that of old rank ``rank % old_world_size``; see docs/fsdp2.md. At this
        world size, DTensors of ``into`` on another mesh, and replicated shards another member
        of their group stored, are assembled the same way (plain state from the rank's own).

        Raises on every rank: InvalidIterationError / ConfigurationError for a bad
        ``iteration`` / ``discard_newer`` on any rank, or ranks passing different ones (checked
        with the load's first exchange: before anything is deleted or returned, though another
        rank's first step may have read into its ``into`` already); NoCheckpointError when no
        iteration was ever complete, CorruptShardError naming the quarantined files
        when no complete iteration is left, UnsupportedFormatError, CollectiveError; the failing
        rank's TypeError when its ``into`` has a leaf ``save`` would refuse; ConfigurationError
        for a saved DTensor ``into`` gives no mesh (or, resharding, no layout) for, or whose old
        boxes do not cover the new one; the failing rank's error from a Stateful's
        ``load_state_dict``.
        """
        manifest, state = self._load.load(into, iteration, discard_newer)
        return state, (manifest.iteration, self.rank, self.session_id)

    def reserve(self, state_dict: Any) -> int:
        """Allocate and touch now the memory saves of ``state_dict`` will use (the staging
        arena; with replication, the buffers replicas are received into), so the first save
        stalls no longer than later ones. Not collective; call it once the state exists (after
        building the model and optimizer). Returns the bytes one save stages. Raises TypeError
        for a leaf ``save`` would refuse, CollectiveError after :meth:`close` (as every verb)."""
        if self._closed:  # it would allocate again what close freed, and write pool files
            raise CollectiveError("reserve: the LocalCheckpointManager was closed: its memory, "
                                  "file pool and session lock are released; build a new one")
        nbytes = self._save.reserve(state_dict)
        if any(self._ctx.placement.holders) or self._ctx.erasure is not None:
            # a piece is at most the shard, at most this
            self._ctx.ring.reserve(min(nbytes, PIECE_TARGET_NBYTES))
        return nbytes

    def persist(self, iteration: int | None = None) -> None:
        """Copy ``iteration`` (default: the latest finalized or loaded) to the durable tier in
        the background, as ``DurableTier.persist_every`` does. Call it on every rank with the
        same iteration (rank 0 commits it once every rank's copy is there). Not collective;
        returns once a load's write-back is over. An iteration not newer than one requested
        before is ignored (logged), and a rank whose shard of it is missing logs the failure:
        neither raises. ConfigurationError without a durable tier; InvalidIterationError for
        an ``iteration`` that is no non-negative int (alike on every rank)."""
        persister = self._save.persister
        if persister is None:
            raise ConfigurationError("persist: this manager has no durable tier "
                                     "(LocalCheckpointManager(..., durable=DurableTier(...)))")
        if iteration is not None and (type(iteration) is not int or iteration < 0):
            raise InvalidIterationError(f"persist: iteration: expected None or a non-negative "
                                        f"int, got {iteration!r}")
        self.wait_for_write_back()  # a replaced node's own shard comes back with it
        it = self.latest_iteration if iteration is None else iteration
        if it >= 0:
            persister.request(it)

    def wait_for_persist(self, timeout: float | None = None) -> bool:
        """Whether no persist is running or waiting on this rank, waiting up to ``timeout``
        seconds. Not collective."""
        persister = self._save.persister
        return persister is None or persister.wait_idle(timeout)

    def wait_for_write_back(self) -> None:
        """Block until the last ``load``'s write-back is over: the shards a replaced node must
        hold again (its ranks' own, its replicas) are committed there, or their failure logged
        after retries. Returns at once when none is running. Not collective (every rank's
        write-back takes part in the same transfers, so a lone caller may wait for the others'
        next call). ``save``, ``find_latest``, ``load`` and ``close`` call it first. Raises
        CollectiveTimeoutError when it overran every bound (the groups are then unusable)."""
        self._load.wait_for_write_back()


def _discard_newer_in(tier: DurableStore, seconds: float, fence: Fence) -> None:
    """Rank 0: the durable tier's iterations a rollback's ``fence`` hides removed (a rollback
    a failure interrupted), within ``seconds`` (a hung mount: an error, not a hung rank)."""
    within(seconds, lambda: tier.discard_hidden(fence))
