"""LocalCheckpointManager: save, find_latest and load of node-local checkpoints.

Names and call pattern follow NVIDIA's local checkpoint manager so users can switch:
``save(state_dict, iteration)``, ``find_latest() -> int`` (-1 when none),
``load() -> (state_dict, (iteration, rank, session_id))``. Every public method is collective: all
ranks of the job call it, in the same order. Collectives run on the manager's own gloo group with
``timeout``; a failure on any rank raises the same exception on every rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import zlib
from functools import partial
from pathlib import Path
from typing import Any

import torch

from replication import (
    NoReplication,
    ReplicationStrategy,
    Topology,
    local_node_name,
    make_strategy,
    save_plan,
    strategy_names,
)

from .control.collectives import CheckpointGroup
from .control.coverage import (
    Inventory,
    check_capacity,
    choose_latest,
    decode_inventories,
    retained_iterations,
    shards_to_delete,
    validate_save,
)
from .errors import (
    CollectiveTimeoutError,
    ConfigurationError,
    CorruptShardError,
    IncompleteCheckpointError,
    NoCheckpointError,
)
from .gc_pause import gc_paused
from .load.restore import restore
from .ops.faults import fault_point
from .ops.metrics import MetricHook, Metrics, PhaseMetric, as_metrics
from .save.async_calls import AsyncRequest
from .save.job import SaveJob
from .save.staging import StagingArena, plan_layout
from .state_dict import TensorAwareStateDict, as_tensor_aware, rebuild_state_dict
from .storage.manifest import (
    ShardManifest,
    TensorEntry,
    dtype_from_name,
    dtype_name,
    writer_identity,
)
from .storage.peer_io import PieceRing
from .storage.store import (
    DEFAULT_CHUNK_NBYTES,
    ShardRef,
    ShardStore,
    byte_view,
    bytes_needed,
    chunking,
    remove_leftovers,
    session_dir,
)

logger = logging.getLogger(__name__)

CkptID = tuple[int, int, str]


class LocalCheckpointManager:
    """Saves each rank's shard to node-local storage and restores the newest complete one.

    Args:
        root_local_ckpt_dir: node-local directory (tmpfs such as /dev/shm, or NVMe). Created if
            missing. Ranks of one node may share it.
        session_id: separates jobs sharing a root; "" is the default session.
        repl_strategy: None (no replicas), a ReplicationStrategy, or the registered name of one
            built with its defaults (``replication.strategy_names()``).
        keep_last: complete iterations kept after a successful save (>= 1).
        timeout: seconds any collective of the manager may take before it raises.
        chunk_nbytes: target size of the data chunk files.
        io_threads: threads that checksum and write / read chunk files in parallel.
        node_id: this rank's node, for placement (default $LOCALCKPT_NODE_ID, else hostname).
        busy: what an async save does while the previous one is in flight: "wait" for it, or
            "skip" this save (decided alike on every rank).
        metrics: a :class:`localckpt.Metrics` or a callable receiving each
            :class:`~localckpt.PhaseMetric` (per-phase seconds and bytes); records also
            go to the ``localckpt.metrics`` logger and to ``$LOCALCKPT_METRICS_FILE`` if set.

    Construction is collective when torch.distributed is initialised (it creates a gloo group from
    the default group); without it the manager runs as a world of one.
    """

    def __init__(self, root_local_ckpt_dir: str | os.PathLike[str], session_id: str = "",
                 repl_strategy: ReplicationStrategy | str | None = None, *, keep_last: int = 1,
                 timeout: float = 300.0, chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
                 io_threads: int = 2, node_id: str | None = None,
                 busy: str = "wait", metrics: Metrics | MetricHook | None = None) -> None:
        self.metrics = as_metrics(metrics)
        strategy = make_strategy(repl_strategy) if isinstance(repl_strategy, str) \
            else repl_strategy
        if strategy is not None and not isinstance(strategy, ReplicationStrategy):
            raise ConfigurationError("repl_strategy: expected None, a ReplicationStrategy or one "
                                     f"of {strategy_names()}, got {type(repl_strategy).__name__}")
        if busy not in ("wait", "skip"):
            raise ConfigurationError(f"busy: expected 'wait' or 'skip', got {busy!r}")
        if type(keep_last) is not int or keep_last < 1:
            raise ConfigurationError(f"keep_last: expected an int >= 1, got {keep_last!r}")
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigurationError(f"timeout: expected seconds > 0, got {timeout!r}")
        if type(chunk_nbytes) is not int or chunk_nbytes < 4096:
            raise ConfigurationError(f"chunk_nbytes: expected an int >= 4096, got {chunk_nbytes!r}")
        if type(io_threads) is not int or io_threads < 1:
            raise ConfigurationError(f"io_threads: expected an int >= 1, got {io_threads!r}")
        root = Path(root_local_ckpt_dir)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as exc:
            raise ConfigurationError(
                f"root_local_ckpt_dir: expected a directory, got {root} ({exc.strerror})"
            ) from exc
        if not os.access(root, os.W_OK | os.X_OK):
            raise ConfigurationError(f"root_local_ckpt_dir: {root} is not writable by this process")
        self.root = root
        self.session_id = session_id
        self.repl_strategy = strategy
        self.keep_last = keep_last
        self.busy = busy
        self.timeout = float(timeout)
        self._group = CheckpointGroup(self.timeout)  # control: agreement, main thread only
        self._data_group = CheckpointGroup(self.timeout)  # shard transfers, maybe background
        self.rank = self._group.rank
        self.world_size = self._group.world_size
        def start() -> str:
            # No rank of this job writes before this exchange completes, so every crash
            # leftover of the session can go, whichever rank left it: ranks move between nodes
            # when a node is replaced, and a leftover's writer may now live elsewhere.
            remove_leftovers(session_dir(root, session_id), None)
            return local_node_name(node_id)

        names = self._group.exchange("start", start)
        self.topology = Topology(tuple(names))
        # Recorded in every manifest; a shard written under another layout is warned about.
        self._job_identity = {"world_size": self.world_size, "nodes": self.topology.num_nodes,
                              "topology_crc32": zlib.crc32("\n".join(names).encode())}
        self._warned_foreign: set[int] = set()
        try:  # pure: every rank raises the same TopologyError
            self._placement = None if strategy is None or isinstance(strategy, NoReplication) \
                else strategy.place(self.topology)
        except Exception:
            self._data_group.close()
            self._group.close()
            raise
        self._store = ShardStore(root, session_id, writer_rank=self.rank, io_threads=io_threads,
                                 chunk_nbytes=chunk_nbytes)
        self._arena = StagingArena()
        self._ring = PieceRing()  # receive buffers for replicas, reused across saves
        self._inflight: SaveJob | None = None  # the async save not yet finalized
        self.latest_iteration = -1  # set by find_latest and by a successful save

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Wait for an async save's local work (its shard is then committed; finalizing it needs
        every rank and happens through the AsyncCallsQueue), then release the I/O threads and
        the manager's process groups. Not collective."""
        job = self._inflight
        if job is not None and job.scheduled and not job.done.wait(self.timeout):
            logger.error("rank %d: async save of iteration %d still running at close",
                         self.rank, job.iteration)
        self._store.close()
        self._data_group.close()
        self._group.close()

    def __enter__(self) -> LocalCheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ckpt_id(self, iteration: int) -> CkptID:
        return (iteration, self.rank, self.session_id)

    def _inventory(self) -> Inventory:
        shards = frozenset((s.iteration, s.owner_rank, s.world_size)
                           for s in self._store.committed())
        return Inventory(self.rank, self.session_id, shards)

    def _gather_inventories(self, step: str) -> list[Inventory]:
        docs = self._group.exchange(step, lambda: self._inventory().to_json())
        return decode_inventories(docs)

    # ------------------------------------------------------------------ save

    def save(self, state_dict: Any, iteration: int,
             is_async: bool = False) -> AsyncRequest | None:
        """Save this rank's ``state_dict`` as its shard of ``iteration``. Collective.

        ``state_dict`` is a TensorAwareStateDict or a plain nested dict/list/tuple (wrapped
        automatically); it is never mutated. Its tensors are copied into the staging arena before
        ``save`` returns: from then on training may modify or free them (on CUDA the copies are
        complete too; see docs/async.md).

        Synchronous (default): blocks until the shard is written, replicated and finalized (the
        iteration is complete on every rank, older iterations beyond ``keep_last`` removed).
        ``is_async=True``: returns after staging with an :class:`AsyncRequest`; schedule it on an
        :class:`AsyncCallsQueue`, whose ``maybe_finalize_async_calls`` finalizes it. Write and
        replication run in the background on the manager's own data group. A previous async save
        still in flight is waited for and finalized first (``busy="skip"``: this save is skipped
        on every rank and None returned instead).

        Raises, on every rank alike: InvalidIterationError, WorldSizeMismatchError,
        InsufficientSpaceError (checked before writing, replicas counted), RankTypeError
        (unsupported leaf on some rank), IncompleteCheckpointError or the failing rank's error
        when a write or a transfer failed (the iteration is then removed everywhere; for an async
        save this is raised by the finalize step), CollectiveError / CollectiveTimeoutError.
        Nothing committed earlier is touched by a failed save.
        """
        with self._timed("stall", iteration) as box, gc_paused():
            if not self._settle_inflight(skip=is_async and self.busy == "skip"):
                logger.info("rank %d: skipping save of iteration %s: the previous one is still "
                            "in flight", self.rank, iteration)
                return None
            job = self._stage(state_dict, iteration)
            box["nbytes"] = job.manifest.data_nbytes
            if not is_async:
                self._run_and_finalize(job)
        if is_async:
            self._inflight = job
            return AsyncRequest(job.run, (self._store, self._data_group, self._ring,
                                          self.world_size),
                                finalize_fns=(partial(self._finalize_job, job),),
                                preload_fn=job.mark_scheduled)
        return None

    def _run_and_finalize(self, job: SaveJob) -> None:
        job.run(self._store, self._data_group, self._ring, self.world_size)
        self._finalize_job(job)

    def _timed(self, phase: str, iteration: int, nbytes: int = 0) -> Any:
        it = iteration if type(iteration) is int else -1
        return self.metrics.timed(phase, self.rank, it, self.session_id, nbytes)

    def _stage(self, state_dict: Any, iteration: int) -> SaveJob:
        """Validate (collective), check capacity, copy the tensors into the arena."""
        prepared: dict[str, Any] = {}

        def prepare() -> dict[str, Any]:
            tasd = as_tensor_aware(state_dict)
            layout = plan_layout(tasd.tensors)
            chunk_nbytes, chunk_count = chunking(layout.nbytes, self._store.chunk_nbytes)
            prepared.update(tasd=tasd, layout=layout, chunking=(chunk_nbytes, chunk_count),
                            container="basic" if tasd is state_dict else "plain")
            self._store.wait_for_deletions()  # the previous save's retention frees space
            st = os.statvfs(self.root)
            return {"iteration": iteration if type(iteration) is int else repr(iteration),
                    "inventory": self._inventory().to_json(),
                    "nbytes": bytes_needed(256 * len(tasd.tensors) + 4096, chunk_nbytes,
                                           chunk_count),
                    "free": st.f_bavail * st.f_frsize}

        gathered = self._group.exchange("save: validation", prepare)
        inventories = decode_inventories([g["inventory"] for g in gathered])
        # Every rank reaches the same verdicts from the same gathered input.
        validate_save([g["iteration"] for g in gathered], inventories, self.world_size,
                      self._fetchable)
        plan = save_plan(self._placement, self.topology, iteration) if self._placement else None
        needed = [int(g["nbytes"]) for g in gathered]
        writes = list(needed)
        for t in plan.transfers if plan else ():
            writes[t.dst] += needed[t.src]
        check_capacity(writes, [int(g["free"]) for g in gathered], self.topology.node_of)

        tasd: TensorAwareStateDict = prepared["tasd"]
        layout = prepared["layout"]
        chunk_nbytes, chunk_count = prepared["chunking"]
        fault_point("staging", self.rank, iteration)
        payload = self._arena.stage(tasd.tensors, layout, chunk_nbytes * chunk_count)
        names: dict[Any, str] = {}  # dtype and device -> str, computed once per save
        entries = tuple(
            TensorEntry(key_path=path, dtype=names.get(t.dtype) or names.setdefault(
                            t.dtype, dtype_name(t.dtype)),
                        shape=tuple(t.shape), offset=off, nbytes=size,
                        device=names.get(t.device) or names.setdefault(t.device, str(t.device)))
            for t, path, off, size in zip(tasd.tensors, tasd.key_paths, layout.offsets,
                                          layout.sizes, strict=True)
        )
        manifest = ShardManifest(
            session_id=self.session_id, iteration=iteration, owner_rank=self.rank,
            world_size=self.world_size, tensors=entries, hollow=tasd.hollow_structure(),
            container=prepared["container"], data_nbytes=layout.nbytes,
            chunk_nbytes=chunk_nbytes, chunk_count=chunk_count, chunk_crc32c=(),
            identity={**writer_identity(), "job": self._job_identity},
        )
        return SaveJob(iteration, manifest, payload, plan, metrics=self.metrics)

    @property
    def _fetchable(self) -> bool:
        """Whether a rank can obtain shards held by other ranks (replication is on)."""
        return self._placement is not None

    def _settle_inflight(self, skip: bool = False) -> bool:
        """Back-pressure before anything that needs the arena or a settled disk: wait for the
        async save in flight (bounded by ``timeout``) and finalize it (collective). With ``skip``
        return False on every rank instead of waiting if it is not done on some rank."""
        job = self._inflight
        if job is None or job.finalized:
            self._inflight = None
            return True
        if not job.scheduled:
            raise ConfigurationError(
                f"the AsyncRequest of the async save of iteration {job.iteration} was never "
                "scheduled: pass it to AsyncCallsQueue.schedule_async_request (or call its "
                "execute_sync) before the next save, find_latest or load")
        if skip and not all(self._group.exchange("save: previous done?", job.done.is_set)):
            return False
        if not job.done.wait(self.timeout):
            raise CollectiveTimeoutError(
                f"the async save of iteration {job.iteration} did not finish within "
                f"{self.timeout:g}s (was its AsyncRequest scheduled on an AsyncCallsQueue?)")
        self._finalize_job(job)
        return True

    def _finalize_job(self, job: SaveJob) -> None:
        """Finalize ``job`` once (the queue may call this after back-pressure already did)."""
        if job.finalized:
            return
        job.finalized = True
        if self._inflight is job:
            self._inflight = None
        fault_point("after_commit", self.rank, job.iteration)
        with self._timed("finalize", job.iteration):
            self._finalize(job.iteration, job.error)

    def _finalize(self, iteration: int, write_error: BaseException | None) -> None:
        """Collective: agree the iteration is complete, then apply retention; or remove it."""
        def report() -> dict[str, Any]:
            if write_error is not None:
                raise write_error
            return self._inventory().to_json()

        try:
            inventories = decode_inventories(self._group.exchange("save: finalize", report))
            latest = choose_latest(inventories, self.world_size, self._fetchable)
            if latest != iteration:
                missing = [inv.rank for inv in inventories
                           if (iteration, inv.rank, self.world_size) not in inv.shards]
                raise IncompleteCheckpointError(
                    f"save of iteration {iteration}: expected a shard from every rank, ranks "
                    f"{missing} have none; the latest complete iteration is {latest}")
        except Exception:
            for ref in self._store.committed():  # the failed iteration, replicas included
                if ref.iteration == iteration:
                    self._store.delete(ref)
            self.latest_iteration = -1
            raise
        self.latest_iteration = iteration
        fault_point("finalize", self.rank, iteration)
        keep = retained_iterations(inventories, self.world_size, self.keep_last, self._fetchable)
        for it, owner, world in shards_to_delete(inventories[self.rank], keep):
            self._store.delete(ShardRef(it, owner, world, self._store.path_of(it, owner, world)),
                               background=True)
        self._store.remove_leftovers(background=True)

    # ------------------------------------------------------------------ restore

    def find_latest(self) -> int:
        """The newest loadable iteration, or -1. Collective. Waits for (and finalizes) an async
        save in flight first.

        Lists committed shards (no data is read), all-gathers the inventories and picks the
        newest complete iteration with
        :func:`localckpt.control.coverage.choose_latest`. Checksums are verified by ``load``.
        """
        self._settle_inflight()
        fault_point("find_latest", self.rank)
        with self._timed("find_latest", -1) as box, gc_paused():
            inventories = self._gather_inventories("find_latest")
            self.latest_iteration = choose_latest(inventories, self.world_size, self._fetchable)
            box["iteration"] = self.latest_iteration
        if self.latest_iteration >= 0:
            # Parsed once: load finds it in the store's manifest cache.
            ref = ShardRef(self.latest_iteration, self.rank, self.world_size,
                           self._store.path_of(self.latest_iteration, self.rank, self.world_size))
            with contextlib.suppress(Exception), gc_paused():  # load verifies; this only looks
                self._warn_if_foreign(self._store.read_manifest(ref))
        return self.latest_iteration

    def _warn_if_foreign(self, manifest: ShardManifest) -> None:
        """Warn (once per iteration) when a shard was written by another session or by a job
        laid out on other nodes: expected after a node was replaced, worth a look otherwise
        (data-loader and RNG states belong to the rank that wrote them)."""
        if manifest.iteration in self._warned_foreign:
            return
        job = manifest.identity.get("job")
        problems = []
        if manifest.session_id != self.session_id:
            problems.append(f"session {manifest.session_id!r}, this job's is {self.session_id!r}")
        if isinstance(job, dict) and job != self._job_identity:
            problems.append(f"topology {job}, this job's is {self._job_identity}")
        if problems:
            self._warned_foreign.add(manifest.iteration)
            logger.warning("rank %d: shard of iteration %d (owner %d) was written by a different "
                           "job: %s", self.rank, manifest.iteration, manifest.owner_rank,
                           "; ".join(problems))

    def load(self) -> tuple[Any, CkptID]:
        """Load this rank's shard of the latest complete iteration. Collective.

        Calls ``find_latest`` first if it has not been called (or found nothing). Returns the
        state dict in the form it was saved (a plain dict, or a BasicTensorAwareStateDict when a
        TensorAwareStateDict was saved), tensors on their original devices (CPU, with a warning,
        where that device is absent), and ``(iteration, rank, session_id)``.

        Raises on every rank: NoCheckpointError, CorruptShardError naming the bad file (checksum
        mismatch, truncation, missing chunk), UnsupportedFormatError, CollectiveError.
        """
        self._settle_inflight()
        if self.latest_iteration < 0:
            self.find_latest()
        with self._timed("load", self.latest_iteration) as box, gc_paused():
            manifest, tensors = self._load(self.latest_iteration)
            box["nbytes"] = manifest.data_nbytes
        self._warn_if_foreign(manifest)
        return _as_loaded(manifest, tensors), self._ckpt_id(manifest.iteration)

    def _load(self, iteration: int) -> tuple[ShardManifest, list[torch.Tensor]]:
        if iteration < 0:
            raise NoCheckpointError(
                f"no complete checkpoint of session {self.session_id!r} under {self.root} "
                f"for a world of {self.world_size} ranks")
        fault_point("load_retrieval", self.rank, iteration)

        if self._placement is not None:
            def fetched(seconds: float, nbytes: int) -> None:
                self.metrics.emit(PhaseMetric("fetch_from_peer", self.rank, iteration, seconds,
                                              nbytes, self.session_id, time.time()))

            return restore(iteration, self._group, self._store, self.topology, self._placement,
                           self._read_own, self._gather_inventories, self._ring, fetched)
        loaded: list[tuple[ShardManifest, list[torch.Tensor]]] = []

        def read() -> None:
            ref = ShardRef(iteration, self.rank, self.world_size,
                           self._store.path_of(iteration, self.rank, self.world_size))
            if not ref.path.is_dir():
                raise CorruptShardError(f"{ref.path}: shard disappeared after find_latest")
            loaded.append(self._read_own(ref))

        self._group.exchange(f"load of iteration {iteration}", read)
        return loaded[0]

    def _read_own(self, ref: ShardRef) -> tuple[ShardManifest, list[torch.Tensor]]:
        """Read a shard straight into fresh per-tensor storages (scatter read, verified)."""
        manifest = self._store.read_manifest(ref)
        tensors = [torch.empty(e.shape, dtype=dtype_from_name(e.dtype))
                   for e in manifest.tensors]
        self._store.read_into(ref, manifest, [
            (e.offset, byte_view(t)) for e, t in zip(manifest.tensors, tensors, strict=True)
            if e.nbytes
        ])
        return manifest, tensors


def _as_loaded(manifest: ShardManifest, tensors: list[torch.Tensor]) -> Any:
    """The state dict in the form it was saved, tensors on their recorded devices."""
    return rebuild_state_dict(manifest.hollow, tensors, [e.key_path for e in manifest.tensors],
                              [e.device for e in manifest.tensors], manifest.container == "plain")
