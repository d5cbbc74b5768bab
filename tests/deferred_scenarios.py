"""Multi-process scenarios of an async save whose agreement runs on its own thread."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import torch
from agreement_scenarios import describe, load_any
from scenarios import _replicated_manager, make_state

from localckpt import AsyncCallsQueue, LocalCheckpointManager
from localckpt.ops import faults


def async_returns_before_peers_stage(rank: int, world: int, base: str, flag: str
                                     ) -> dict[str, Any]:
    """Rank 0's async save of iteration 2 must return before rank 1 has even called save: rank 1
    waits for rank 0's flag (10 s at most) before saving."""
    mgr = _replicated_manager(rank, base, "node_spread", {}, 1)
    queue = AsyncCallsQueue(timeout=30)
    mgr.save(make_state(rank, 1), 1)
    seen = True
    if rank == 0:
        queue.schedule_async_request(mgr.save(make_state(rank, 2), 2, is_async=True))
        Path(flag).touch()
    else:
        deadline = time.monotonic() + 10
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.01)
        seen = os.path.exists(flag)
        queue.schedule_async_request(mgr.save(make_state(rank, 2), 2, is_async=True))
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    latest = mgr.latest_iteration
    mgr.close()
    return {"seen": seen, "finalized": latest,
            **load_any(rank, base, node_id=f"node{rank}")}


def async_failure_raised_at_finalize(rank: int, world: int, base: str, what: str
                                     ) -> dict[str, Any]:
    """Iteration 2, saved async, fails on rank 1 only (``what``), or on every rank (``old``:
    an iteration not newer than the latest): save() must return a request on every rank, the
    finalize raise the same error on every rank, nothing of 2 be written, and iteration 3
    must then work."""
    mgr = _replicated_manager(rank, base, "node_spread", {}, 1)
    queue = AsyncCallsQueue(timeout=30)
    mgr.save(make_state(rank, 1), 1)
    state, iteration = make_state(rank, 2), 2
    real_statvfs = os.statvfs
    if what == "old":
        iteration = 1
    elif rank == 1 and what == "stage":
        faults.arm(faults.Fault("staging", "raise", iteration=2))
    elif rank == 1 and what == "leaf":
        state["sampler"] = object()  # no leaf localckpt can store
    elif rank == 1 and what == "space":
        class Full:
            f_bavail, f_frsize = 0, 4096
        os.statvfs = lambda path: Full()  # type: ignore[assignment,misc]
    save_error = finalize_error = None
    try:
        queue.schedule_async_request(mgr.save(state, iteration, is_async=True))
    except Exception as exc:
        save_error = describe(exc)
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except Exception as exc:
        finalize_error = describe(exc)
    os.statvfs = real_statvfs
    faults.disarm()
    dirs = sorted(p.name for p in (Path(base) / f"node{rank}" / "job").iterdir()
                  if p.name.startswith("iter_"))
    queue.schedule_async_request(mgr.save(make_state(rank, 3), 3, is_async=True))
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    mgr.close()
    return {"save_error": save_error, "finalize_error": finalize_error, "dirs": dirs,
            **load_any(rank, base, node_id=f"node{rank}")}


def _dirs(base: str, rank: int) -> list[str]:
    return sorted(p.name for p in (Path(base) / f"node{rank}" / "job").iterdir()
                  if p.name.startswith("iter_"))


def _save_and_finalize(mgr: Any, queue: AsyncCallsQueue, rank: int, iteration: int
                       ) -> dict[str, Any] | None:
    try:
        queue.schedule_async_request(mgr.save(make_state(rank, iteration), iteration,
                                              is_async=True))
        queue.maybe_finalize_async_calls(blocking=True)
    except Exception as exc:
        return describe(exc)
    return None


def refused_resave_with_broken_data_group(rank: int, world: int, base: str) -> dict[str, Any]:
    """Iteration 1 is finalized; the data group then breaks (as after a replica transfer that
    timed out); an async save of iteration 1 again cannot agree: it must fail on every rank
    and leave the finalized iteration 1 alone."""
    from localckpt.errors import CollectiveError

    mgr = _replicated_manager(rank, base, "node_spread", {}, 1)
    queue = AsyncCallsQueue(timeout=30)
    mgr.save(make_state(rank, 1), 1)
    mgr._ctx.data_group.mark_broken(CollectiveError("the data group broke earlier (injected)"))
    error = _save_and_finalize(mgr, queue, rank, 1)
    dirs = _dirs(base, rank)
    queue.close(abort=True)
    mgr.close()
    return {"error": error, "dirs": dirs, **load_any(rank, base, node_id=f"node{rank}")}


def split_agreement(rank: int, world: int, base: str) -> dict[str, Any]:
    """The agreement's exchange completes everywhere, but rank 1 takes it for failed (as a rank
    whose wait timed out while its peer's completed): an async re-save of iteration 1 must
    raise the same exception on both ranks at once, delete nothing, and iteration 3 work."""
    from localckpt.errors import CollectiveError
    from localckpt.save import prepare

    mgr = _replicated_manager(rank, base, "node_spread", {}, 1)
    queue = AsyncCallsQueue(timeout=30)
    mgr.save(make_state(rank, 1), 1)
    real = prepare.SaveAgreement.agree
    if rank == 1:
        def agree(self: Any, group: Any, staged: Any) -> Any:
            with contextlib.suppress(Exception):
                real(self, group, staged)
            raise CollectiveError("this rank's wait timed out (injected)")
        prepare.SaveAgreement.agree = agree  # type: ignore[method-assign]
    started = time.monotonic()
    error = _save_and_finalize(mgr, queue, rank, 1)
    seconds = time.monotonic() - started
    prepare.SaveAgreement.agree = real  # type: ignore[method-assign]
    dirs = _dirs(base, rank)
    save3 = _save_and_finalize(mgr, queue, rank, 3)
    queue.close()
    mgr.close()
    return {"error": error, "seconds": seconds, "dirs": dirs, "save3": save3,
            **load_any(rank, base, node_id=f"node{rank}")}


def late_peer_slow_write(rank: int, world: int, base: str, via: str) -> dict[str, Any]:
    """Rank 1 reaches save(2) 0.6 timeouts late and rank 0's commit of 2 takes 0.6 timeouts:
    each within its bound, so settling save 2 (by the next save, or by reached_preemption's
    path) must not time out."""
    from replication import make_strategy

    timeout = 2.0
    mgr = LocalCheckpointManager(Path(base) / f"node{rank}", "job",
                                 make_strategy("node_spread"), timeout=timeout,
                                 chunk_nbytes=8192, node_id=f"node{rank}")
    mgr.save(make_state(rank, 1), 1)
    if rank == 0:
        faults.arm(faults.Fault("before_commit", "sleep", rank=0, iteration=2,
                                seconds=0.6 * timeout))
    else:
        time.sleep(0.6 * timeout)
    mgr.save(make_state(rank, 2), 2, is_async=True)
    error = None
    try:
        if via == "save":
            mgr.save(make_state(rank, 3), 3)  # settles 2 first
        else:
            mgr._save.settle()
    except Exception as exc:
        error = describe(exc)
    faults.disarm()
    latest = mgr.latest_iteration
    mgr.close()
    return {"error": error, "latest": latest}


def close_while_agreeing(rank: int, world: int, base: str) -> dict[str, Any]:
    """Rank 0 saves 2 async and closes; rank 1 never saves 2. close() must wait for the save's
    thread (whose agreement times out), not tear the data group down under it, and the
    failure must be this rank's own (not taken for an agreed refusal)."""
    import threading

    from replication import make_strategy

    mgr = LocalCheckpointManager(Path(base) / f"node{rank}", "job", make_strategy("node_spread"),
                                 timeout=2.0, chunk_nbytes=8192, node_id=f"node{rank}")
    mgr.save(make_state(rank, 1), 1)
    out: dict[str, Any] = {}
    if rank == 0:
        mgr.save(make_state(rank, 2), 2, is_async=True)
        job = mgr._save._inflight
        mgr.close()
        out["threads"] = sorted(t.name for t in threading.enumerate()
                                if t.name.startswith("localckpt-save"))
        out["agreed_error"] = repr(job.agreed_error) if job else "no job"
        out["error"] = type(job.error).__name__ if job else "no job"
    else:
        time.sleep(5)
        mgr.close()
    out["dirs"] = _dirs(base, rank)
    return out


def slow_save_through_a_queue_of_the_managers_timeout(rank: int, world: int,
                                                      base: str) -> dict[str, Any]:
    """A queue whose timeout is the manager's (as LocalCkptIO builds it), and an async save in
    which rank 1 is slow twice, each within the manager's bounds: the queue must wait for the
    save as long as the save itself may take, not time out and break its group."""
    mgr = LocalCheckpointManager(Path(base) / f"node{rank}", "job", timeout=3,
                                 node_id=f"node{rank}")
    queue = AsyncCallsQueue(timeout=mgr.timeout)
    faults.arm(faults.Fault("local_write", "sleep", rank=1, seconds=2.5),
               faults.Fault("before_commit", "sleep", rank=1, seconds=2.5))
    error = None
    try:
        queue.schedule_async_request(mgr.save({"w": torch.ones(1000)}, 5, is_async=True))
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
    except Exception as exc:
        error = describe(exc)
    finally:
        faults.disarm()
    latest = mgr.find_latest()
    mgr.close()
    return {"error": error, "latest": latest}
