"""Rank programs for tests/test_agreement.py: call orders, faults and layouts that must never lose
a finalized checkpoint or leave ranks out of step (run by dist_harness.run_ranks)."""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from scenarios import digest, make_state

from localckpt import AsyncCallsQueue, DurableTier, LocalCheckpointManager, SavePolicy
from localckpt.ops import faults
from replication import ErasureCodingStrategy, make_strategy


def describe(exc: BaseException) -> dict[str, Any]:
    return {"name": type(exc).__name__, "bases": [c.__name__ for c in type(exc).__mro__],
            "message": str(exc)}


class Captured(logging.Handler):
    """Every localckpt warning this rank logs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        logging.getLogger("localckpt").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def load_any(rank: int, base: str, per_node: int = 1, **kwargs: Any) -> dict[str, Any]:
    """find_latest + load on a fresh manager; the digest is checked against the iteration that
    was actually loaded (a fallback may load an older one)."""
    root = Path(base) / f"node{rank // per_node}"
    with LocalCheckpointManager(root, "job", timeout=20, **kwargs) as mgr:
        latest = mgr.find_latest()
        if latest < 0:
            return {"latest": latest, "loaded": -1}
        state, ckpt_id = mgr.load()
        after = mgr.find_latest()
    return {"latest": latest, "loaded": ckpt_id[0], "after": after, "digest": digest(state),
            "expected": digest(make_state(rank, ckpt_id[0]))}


def load_checked(rank: int, root: Path, session: str, **kwargs: Any) -> dict[str, Any]:
    """load() on a new manager: the error, or the iteration and whether the state is the one
    saved for it."""
    with LocalCheckpointManager(root, session, **kwargs) as mgr:
        try:
            state, ckpt_id = mgr.load()
        except Exception as exc:
            return {"error": describe(exc)}
    return {"error": None, "loaded": ckpt_id[0], "digest": digest(state),
            "expected": digest(make_state(rank, ckpt_id[0]))}


def close_manager_before_queue(rank: int, world: int, base: str) -> dict[str, Any]:
    """The natural ``with`` block, then the queue closed after it: the last async save must
    survive (its finalize cannot run on a closed manager, and must not delete anything)."""
    root = Path(base) / f"node{rank}"
    queue = AsyncCallsQueue(timeout=20)
    with LocalCheckpointManager(root, "job", timeout=20) as mgr:
        mgr.save(make_state(rank, 1), 1)
        queue.schedule_async_request(mgr.save(make_state(rank, 2), 2, is_async=True))
    error = None
    try:
        queue.close()
    except Exception as exc:
        error = describe(exc)
    return {"error": error, **load_any(rank, base)}


def killed_before_finalize(rank: int, world: int, base: str, victim: int) -> dict[str, Any]:
    """``victim`` is SIGKILLed after its async save of iteration 2 committed, before finalize:
    the survivors' finalize collective fails, and must delete nothing."""
    root = Path(base) / f"node{rank}"
    if rank == victim:
        faults.arm(faults.Fault("after_commit", "kill", iteration=2))
    queue = AsyncCallsQueue(timeout=20)
    mgr = LocalCheckpointManager(root, "job", timeout=20)
    mgr.save(make_state(rank, 1), 1)
    queue.schedule_async_request(mgr.save(make_state(rank, 2), 2, is_async=True))
    try:
        queue.maybe_finalize_async_calls(blocking=True)
        error = None
    except Exception as exc:
        error = describe(exc)
    queue.close(abort=True)
    mgr.close()
    return {"error": error, "dirs": sorted(p.name for p in (root / "job").iterdir()
                                           if p.name.startswith("iter_"))}


def staging_fails_on(rank: int, world: int, base: str, bad_rank: int,
                     what: str) -> dict[str, Any]:
    """Iteration 2 fails on ``bad_rank`` after the inputs were checked (copying into the arena,
    growing it, building the manifest): every rank must raise alike and iteration 3 must work."""
    from localckpt.ops import health
    from localckpt.save.staging import StagingArena
    from localckpt.storage import manifest

    root = Path(base) / f"node{rank}"
    real_buffer, real_identity = StagingArena.buffer, health.node_identity
    with LocalCheckpointManager(root, "job", timeout=20) as mgr:
        mgr.save(make_state(rank, 1), 1)
        if rank == bad_rank and what == "stage":
            faults.arm(faults.Fault("staging", "raise", iteration=2))
        elif rank == bad_rank and what == "grow":
            def no_memory(self: Any, nbytes: int, slack: int = 0) -> Any:
                raise RuntimeError("cannot allocate pinned host memory (injected)")
            StagingArena.buffer = no_memory  # type: ignore[method-assign]
        elif rank == bad_rank and what == "manifest":
            def no_identity(nvml: Any = None) -> dict[str, Any]:
                raise OSError(5, "cannot read the boot id (injected)")
            manifest._node_identity.cache_clear()
            health.node_identity = no_identity
        error = None
        try:
            mgr.save(make_state(rank, 2), 2)
        except Exception as exc:
            error = describe(exc)
        StagingArena.buffer, health.node_identity = real_buffer, real_identity  # type: ignore[method-assign]
        manifest._node_identity.cache_clear()
        mgr.save(make_state(rank, 3), 3)
    return {"error": error, **load_any(rank, base)}


def different_steps(rank: int, world: int, base: str) -> dict[str, Any]:
    """Rank 0 calls find_latest while rank 1 saves: both must raise, naming both steps."""
    root = Path(base) / f"node{rank}"
    with LocalCheckpointManager(root, "job", timeout=20) as mgr:
        mgr.save(make_state(rank, 1), 1)
        first = next_call = None
        try:
            if rank == 0:
                mgr.find_latest()
            else:
                mgr.save(make_state(rank, 2), 2)
        except Exception as exc:
            first = describe(exc)
        try:
            mgr.find_latest()
        except Exception as exc:
            next_call = describe(exc)
    return {"first": first, "next_call": next_call, **load_any(rank, base)}


def save_iterations(rank: int, world: int, base: str, iterations: list[int], keep_last: int,
                    strategy: str | None = None, per_node: int = 1) -> None:
    root = Path(base) / f"node{rank // per_node}"
    with LocalCheckpointManager(root, "job", strategy, keep_last=keep_last, timeout=20,
                                node_id=f"node{rank // per_node}") as mgr:
        for it in iterations:
            mgr.save(make_state(rank, it), it)


def load_with_warnings(rank: int, world: int, base: str, strategy: str | None = None,
                       per_node: int = 1) -> dict[str, Any]:
    captured = Captured()
    try:
        out = load_any(rank, base, per_node, node_id=f"node{rank // per_node}",
                       repl_strategy=strategy)
    except Exception as exc:
        out = {"error": describe(exc)}
    return {**out, "warnings": captured.lines}


def world_change(rank: int, world: int, base: str, per_node: int) -> dict[str, Any]:
    """A job of another world size on the same roots: find_latest reports the old shards, new
    saves work, and the old shards are left alone."""
    captured = Captured()
    root = Path(base) / f"node{rank // per_node}"
    with LocalCheckpointManager(root, "job", timeout=20, node_id=f"node{rank // per_node}") as mgr:
        latest = mgr.find_latest()
        warnings = list(captured.lines)
        mgr.save(make_state(rank, 2), 2)
        mgr.save(make_state(rank, 3), 3)
        again = mgr.find_latest()
    return {"latest": latest, "warnings": warnings, "again": again}


def construct(rank: int, world: int, base: str, per_node: int, strategy: str,
              kwargs: dict[str, Any], node_ids: bool = True, strict: bool = False
              ) -> dict[str, Any]:
    """Build a manager and report the warnings its construction logged."""
    from replication import make_strategy

    captured = Captured()
    if not node_ids:
        os.environ.pop("LOCALCKPT_NODE_ID", None)
    root = Path(base) / f"root{rank if not node_ids else rank // per_node}"
    node = f"node{rank // per_node}" if node_ids else None
    try:
        with LocalCheckpointManager(root, "job", make_strategy(strategy, **kwargs), timeout=20,
                                    node_id=node, strict=strict):
            pass
    except Exception as exc:
        return {"error": describe(exc), "warnings": captured.lines}
    return {"error": None, "warnings": captured.lines}


def device_restore_fails_on(rank: int, world: int, base: str, bad_rank: int) -> dict[str, Any]:
    """Moving the loaded tensors to their devices fails on one rank (a CUDA allocation, say):
    every rank must raise alike."""
    from localckpt import state_dict

    root = Path(base) / f"node{rank}"
    with LocalCheckpointManager(root, "job", timeout=20) as mgr:
        mgr.save(make_state(rank, 1), 1)
    if rank == bad_rank:
        def out_of_memory(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("CUDA out of memory (injected)")
        state_dict.restore_devices = out_of_memory  # type: ignore[assignment]
    with LocalCheckpointManager(root, "job", timeout=20) as mgr:
        try:
            mgr.load()
            return {"error": None}
        except Exception as exc:
            return {"error": describe(exc)}


def slow_restore(rank: int, world: int, base: str, timeout: float, delay: float
                 ) -> dict[str, Any]:
    """Node 0 is replaced; each replica it receives takes ``delay`` (< timeout) to write, and
    the rounds together take longer than one timeout: the restore must still succeed."""
    import shutil

    import torch.distributed as dist

    root = Path(base) / f"node{rank}"
    kwargs: dict[str, Any] = {"timeout": timeout, "node_id": f"n{rank}",
                              "repl_strategy": "node_spread"}
    with LocalCheckpointManager(root, "job", **kwargs) as mgr:
        mgr.save(make_state(rank, 1), 1)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root / "job")
        faults.arm(faults.Fault("replica_receive", "sleep", seconds=delay, times=10),
                   faults.Fault("local_write", "sleep", seconds=delay, times=10))
    dist.barrier()
    return load_checked(rank, root, "job", **kwargs)


def start_while_gc_holds(rank: int, world: int, base: str) -> dict[str, Any]:
    """An operator's ``localckpt gc`` holds node 0's session while the job starts."""
    import torch.distributed as dist

    from localckpt.storage.fsutil import make_private_dirs
    from localckpt.storage.session_lock import SessionLock

    root = Path(base) / f"node{rank}"
    lock = None
    if rank == 0:
        make_private_dirs(root / "job")
        lock = SessionLock(root / "job", exclusive=True)
    dist.barrier()
    try:
        LocalCheckpointManager(root, "job", timeout=6).close()
        return {"error": None}
    except Exception as exc:
        return {"error": describe(exc)}
    finally:
        if lock is not None:
            lock.release()


def slow_write_sync_save(rank: int, world: int, base: str, timeout: float,
                         delay: float) -> dict[str, Any]:
    """Rank 1's write takes ``delay`` > timeout; rank 0 waits for it in finalize."""
    root = Path(base) / f"node{rank}"
    if rank == 1:
        faults.arm(faults.Fault("local_write", "sleep", seconds=delay, iteration=2))
    with LocalCheckpointManager(root, "job", timeout=timeout) as mgr:
        mgr.save(make_state(rank, 1), 1)
        try:
            mgr.save(make_state(rank, 2), 2)
        except Exception as exc:
            return {"error": describe(exc)}
        return {"error": None, "latest": mgr.find_latest()}


def renamed_session_then_fetch(rank: int, world: int, base: str) -> dict[str, Any]:
    """The session directory is renamed on every node (job -> job2), then node 0 loses its own
    shard: it must be fetched from the replica although the manifests name the old session."""
    import shutil

    import torch.distributed as dist

    root = Path(base) / f"node{rank}"
    kwargs: dict[str, Any] = {"timeout": 20, "node_id": f"n{rank}",
                              "repl_strategy": "node_spread"}
    with LocalCheckpointManager(root, "job", **kwargs) as mgr:
        mgr.save(make_state(rank, 1), 1)
    dist.barrier()
    (root / "job").rename(root / "job2")
    if rank == 0:
        shutil.rmtree(root / "job2" / "iter_0000000001" / "rank_00000_of_00002")
    dist.barrier()
    return load_checked(rank, root, "job2", **kwargs)


def slow_pieces(rank: int, world: int, base: str, timeout: float, delay: float
                ) -> dict[str, Any]:
    """3 nodes; node 0 lost its own shard, which comes back in 4 pieces of ``delay`` each
    (each within the timeout, all together not); rank 2 has nothing to transfer."""
    import shutil

    import torch.distributed as dist

    from localckpt.storage import peer_io

    peer_io.PIECE_TARGET_NBYTES = 64 << 10
    root = Path(base) / f"node{rank}"
    kwargs: dict[str, Any] = {"timeout": timeout, "node_id": f"n{rank}",
                              "repl_strategy": "node_spread", "chunk_nbytes": 64 << 10}
    state = {"w": torch.arange(60_000, dtype=torch.float32) + rank}  # 4 chunks of 64 KiB
    with LocalCheckpointManager(root, "job", **kwargs) as mgr:
        mgr.save(state, 1)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root / "job" / "iter_0000000001" / "rank_00000_of_00003")
        real = peer_io.StoreReceiver.piece_received

        def slow(self: Any, *args: Any) -> None:
            time.sleep(delay)
            real(self, *args)
        peer_io.StoreReceiver.piece_received = slow  # type: ignore[method-assign]
    dist.barrier()
    with LocalCheckpointManager(root, "job", **kwargs) as mgr:
        try:
            loaded, _ = mgr.load()
        except Exception as exc:
            return {"error": describe(exc)}
    return {"error": None, "same": bool(torch.equal(loaded["w"], state["w"]))}


def execute_sync_with_a_slow_write(rank: int, world: int, base: str, timeout: float,
                                   delay: float) -> dict[str, Any]:
    """The documented AsyncRequest.execute_sync, while rank 1's write takes longer than the
    timeout: the finalize must wait for it as a synchronous save does."""
    root = Path(base) / f"node{rank}"
    with LocalCheckpointManager(root, "job", timeout=timeout) as mgr:
        mgr.save(make_state(rank, 1), 1)
        if rank == 1:
            faults.arm(faults.Fault("local_write", "sleep", iteration=2, seconds=delay))
        try:
            request = mgr.save(make_state(rank, 2), 2, is_async=True)
            assert request is not None
            request.execute_sync()
        except Exception as exc:
            return {"error": describe(exc)}
        return {"error": None, "latest": mgr.latest_iteration}


def damaged_by_the_file_system(rank: int, world: int, base: str, err: str) -> dict[str, Any]:
    """Reading rank 0's own chunks fails with ``err`` (EBADMSG: ext4 / XFS metadata checksum):
    the copy is unusable, and the replica on node 1 must serve."""
    import errno

    import torch.distributed as dist

    root = Path(base) / f"node{rank}"
    kwargs: dict[str, Any] = {"timeout": 20, "node_id": f"n{rank}",
                              "repl_strategy": "node_spread"}
    with LocalCheckpointManager(root, "job", **kwargs) as mgr:
        mgr.save(make_state(rank, 1), 1)
    dist.barrier()
    if rank == 0:
        real = os.preadv
        code = getattr(errno, err)
        damaged = {p.stat().st_ino for p in (root / "job" / "iter_0000000001" /
                                             "rank_00000_of_00002" / "data" / "c").iterdir()}

        def preadv(fd: int, buffers: Any, offset: int) -> int:
            if os.fstat(fd).st_ino in damaged:  # these files, not a rewritten copy
                raise OSError(code, os.strerror(code))
            return real(fd, buffers, offset)
        os.preadv = preadv  # type: ignore[assignment]
    try:
        out = load_any(rank, base, node_id=f"n{rank}", repl_strategy="node_spread")
    except Exception as exc:
        return {"error": describe(exc)}
    return {"error": None, **out}


def peer_dies_before_a_blocking_finalize(rank: int, world: int, base: str,
                                         timeout: float) -> dict[str, Any]:
    """Rank 2 dies; the others wait in the queue's blocking finalize, whose agreement may wait
    longer than the timeout: every survivor must notice at once, not only rank 0."""
    import signal

    root = Path(base) / f"node{rank}"
    queue = AsyncCallsQueue(timeout=timeout)
    mgr = LocalCheckpointManager(root, "job", timeout=timeout)
    queue.schedule_async_request(mgr.save(make_state(rank, 1), 1, is_async=True))
    time.sleep(1)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    try:
        queue.maybe_finalize_async_calls(blocking=True)
        error = None
    except Exception as exc:
        error = describe(exc)
    took = time.monotonic() - started
    if rank == 0:
        time.sleep(2 * timeout)  # rank 0 lingers, as a script logging the error would
    return {"error": error, "seconds": took}



def sync_save_interrupted(rank: int, world: int, root: str) -> dict[str, Any]:
    """Ctrl-C reaches rank 1 while its synchronous save of 2 writes: rank 1 gets the
    KeyboardInterrupt, rank 0 the save's failure at once (not after the finalize's wait)."""
    from localckpt.storage.store import ShardStore

    if rank == 1:
        real = ShardStore.write

        def interrupted(self: ShardStore, manifest: Any, payload: Any) -> Any:
            if manifest.iteration == 2:
                raise KeyboardInterrupt
            return real(self, manifest, payload)

        ShardStore.write = interrupted  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    with LocalCheckpointManager(Path(root) / f"node{rank}", "job", timeout=5,
                                node_id=f"node{rank}") as mgr:
        mgr.save(make_state(rank, 1), 1)
        started = time.monotonic()
        try:
            mgr.save(make_state(rank, 2), 2)
        except BaseException as exc:
            out["error"] = type(exc).__name__
        out["seconds"] = time.monotonic() - started
        if rank == 0:
            out["latest"] = mgr.find_latest()
        else:  # a handler that caught the interrupt and goes on (a graceful shutdown)
            out["latest"] = mgr.find_latest()
    return out


class _Interrupting:
    """A Stateful whose state_dict() is where Ctrl-C lands (a long user hook, say)."""

    def state_dict(self) -> dict[str, Any]:
        raise KeyboardInterrupt

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def staging_interrupted(rank: int, world: int, root: str, is_async: bool,
                        finalize: bool = True, busy: str = "wait") -> dict[str, Any]:
    """Ctrl-C reaches rank 1 while the save of 2 walks its state dict (before any agreement):
    rank 1 gets the KeyboardInterrupt, rank 0 the save's failure at once, and a handler on
    rank 1 that goes on (a graceful shutdown) finds the same checkpoint as rank 0. Without
    ``finalize`` rank 0 leaves its request to the next find_latest (back-pressure); with
    ``busy="skip"`` as well, to the next async save (its back-pressure asks whether the
    previous save is done)."""
    out: dict[str, Any] = {}
    with LocalCheckpointManager(Path(root) / f"node{rank}", "job", timeout=5,
                                node_id=f"node{rank}", busy=busy) as mgr:
        mgr.save(make_state(rank, 1), 1)
        state = make_state(rank, 2)
        if rank == 1:
            state["hook"] = _Interrupting()
        started = time.monotonic()
        try:
            request = mgr.save(state, 2, is_async=is_async)
            if request is not None and finalize:
                request.execute_sync()  # waits for the save, then finalizes it
        except BaseException as exc:
            out["error"] = type(exc).__name__
        out["seconds"] = time.monotonic() - started
        if busy == "skip":
            request = mgr.save(make_state(rank, 3), 3, is_async=True)
            out["skipped"] = request is None
            if request is not None:
                request.execute_sync()
        else:
            out["latest"] = mgr.find_latest()
            mgr.save(make_state(rank, 3), 3)  # the ranks are still in step
        out["after"] = mgr.find_latest()
    return out


def _plain(rank: int, root: str, **kwargs: Any) -> LocalCheckpointManager:
    return LocalCheckpointManager(Path(root) / f"node{rank}", "job", timeout=5,
                                  node_id=f"node{rank}", **kwargs)


def _outcome(fn: Any) -> Any:
    try:
        return fn()
    except BaseException as exc:
        return type(exc).__name__


def schedule_verbs_differ(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank 0 asks should_save(10), rank 1 reached_preemption(10): out of step, not paired."""
    import signal

    from localckpt import SavePolicy

    with _plain(rank, root, save_policy=SavePolicy(every_steps=5),
                preemption_signals=[signal.SIGUSR2]) as mgr:
        return {"asked": _outcome(lambda: mgr.should_save(10) if rank == 0
                                  else mgr.reached_preemption(10))}


def metadata_of_different_iterations(rank: int, world: int, root: str) -> dict[str, Any]:
    with _plain(rank, root, keep_last=3) as mgr:
        mgr.save(make_state(rank, 1), 1)
        mgr.save(make_state(rank, 2), 2)
        return {"asked": _outcome(lambda: mgr.metadata(1 + rank)),
                "after": _outcome(mgr.find_latest)}


def verbs_with_arguments_differ(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank 0 asks metadata(1) / load(iteration=1) while rank 1 is in find_latest / iterations:
    out of step, told so (not "different arguments"), and the group stays usable."""
    def told(fn: Any) -> str:
        try:
            fn()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    with _plain(rank, root, keep_last=3) as mgr:
        mgr.save(make_state(rank, 1), 1)
        mgr.save(make_state(rank, 2), 2)
        return {"asked": told(lambda: mgr.metadata(1) if rank == 0 else mgr.find_latest()),
                "loaded": told(lambda: mgr.load(iteration=1) if rank == 0 else mgr.iterations()),
                "after": _outcome(mgr.find_latest)}


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


class _Saboteur:
    """A Stateful object whose state_dict raises an exception that cannot be printed."""

    def state_dict(self) -> dict[str, Any]:
        raise _Unprintable()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def unprintable_failure_on_one_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank 1's state dict raises an exception whose str() raises: every rank must get the
    save's error at once, not wait out the timeout."""
    with _plain(rank, root) as mgr:
        state: dict[str, Any] = {"w": torch.ones(4)}
        if rank == 1:
            state["app"] = _Saboteur()
        started = time.monotonic()
        try:
            mgr.save(state, 1)
        except Exception as exc:
            error = type(exc).__name__, "_Unprintable" in repr(exc.args)
        else:
            error = None
        return {"error": error, "fast": time.monotonic() - started < 4,
                "after": _outcome(lambda: mgr.save({"w": torch.ones(4)}, 2))}


def async_save_after_the_group_broke(rank: int, world: int, root: str) -> dict[str, Any]:
    with _plain(rank, root, keep_last=3) as mgr:
        mgr.save(make_state(rank, 1), 1)
        broke = _outcome(mgr.find_latest if rank == 0 else mgr.iterations)
        saved = _outcome(lambda: mgr.save(make_state(rank, 7), 7, is_async=True))
        return {"broke": broke, "saved": saved,
                "on_disk": sorted(p.name for p in (Path(root) / f"node{rank}" / "job").iterdir()
                                  if p.name.startswith("iter_"))}


def settings_differ(rank: int, world: int, root: str, setting: str) -> dict[str, Any]:
    """Rank 1 is given another ``setting`` than rank 0."""
    values = {"keep_last": (1, 2), "reshard": (False, True), "strict": (False, True),
              "busy": ("wait", "skip"),
              "repl_strategy": (None, make_strategy("node_spread", replication_factor=2)),
              "erasure": (ErasureCodingStrategy(1, 1), None),
              "durable": (DurableTier(Path(root) / "durable"), None),
              "durable_keep": (DurableTier(Path(root) / "durable", keep=2),
                               DurableTier(Path(root) / "durable", keep=3)),
              # alike on both ranks: an interval of inf (no JSON number) and 60 / 60.0
              "same_durable": (DurableTier(Path(root) / "durable", persist_interval=math.inf,
                                           commit_timeout=60),
                               DurableTier(Path(root) / "durable", persist_interval=math.inf,
                                           commit_timeout=60.0)),
              "same_keep_interval": (60, 60.0),
              # an empty list watches nothing: was compared as "watching"
              "preemption_signals": ([], [signal.SIGUSR1]),
              "same_preemption_signals": (True, [signal.SIGTERM, signal.SIGTERM]),
              "same_save_policy": (SavePolicy(every_seconds=60), SavePolicy(every_seconds=60.0))
              }[setting]
    name = {"erasure": "repl_strategy", "durable_keep": "durable", "same_durable": "durable",
            "same_keep_interval": "keep_interval",
            "same_preemption_signals": "preemption_signals",
            "same_save_policy": "save_policy"}.get(setting, setting)
    try:
        with _plain(rank, root, **{name: values[rank]}):
            return {"made": True}
    except Exception as exc:
        return {"error": type(exc).__name__, "names": name in str(exc)}
