"""Multi-process scenarios of an async save whose agreement runs on its own thread."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from agreement_scenarios import describe, load_any
from scenarios import _replicated_manager, make_state

from localckpt import AsyncCallsQueue
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
