"""Async save: the request/queue semantics (no processes) and the manager's async path."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from scenarios import digest, make_state

from localckpt import LocalCheckpointManager
from localckpt.errors import RankFailureError
from localckpt.save.async_calls import AsyncCallsQueue, AsyncRequest


def test_queue_runs_in_background_and_finalizes_in_order() -> None:
    gate, log = threading.Event(), []
    q = AsyncCallsQueue(timeout=30)
    first = AsyncRequest(lambda: (gate.wait(30), log.append("a1")), (),
                         finalize_fns=(lambda: log.append("f1"),))
    i0 = q.schedule_async_request(first)
    i1 = q.schedule_async_request(AsyncRequest(log.append, ("a2",)).add_finalize_fn(
        lambda: log.append("f2")))
    assert (i0, i1) == (0, 1)
    assert q.maybe_finalize_async_calls(blocking=False) == []  # still running
    assert q.get_num_unfinalized_calls() == 2 and log == []
    gate.set()
    assert q.maybe_finalize_async_calls(blocking=True) == [0, 1]
    assert log == ["a1", "a2", "f1", "f2"]
    q.close()


def test_async_failure_is_raised_at_finalization_after_finalize_fns() -> None:
    seen: list[str] = []
    q = AsyncCallsQueue(timeout=30)

    def boom() -> None:
        raise KeyError("disk on fire")

    q.schedule_async_request(AsyncRequest(boom, (), finalize_fns=(lambda: seen.append("f"),)))
    with pytest.raises(RankFailureError, match="disk on fire"):
        q.maybe_finalize_async_calls(blocking=True)
    assert seen == ["f"] and q.get_num_unfinalized_calls() == 0
    q.close()


def test_close_drains_pending_calls() -> None:
    done: list[int] = []
    q = AsyncCallsQueue(timeout=30)
    q.schedule_async_request(AsyncRequest(lambda: (time.sleep(0.2), done.append(1)), ()))
    q.close()
    assert done == [1]


def test_execute_sync_runs_everything_in_order() -> None:
    log: list[str] = []
    AsyncRequest(log.append, ("a",), finalize_fns=(lambda: log.append("f"),),
                 preload_fn=lambda: log.append("p")).execute_sync()
    assert log == ["p", "a", "f"]


def test_async_save_returns_after_staging_and_snapshots(root: Path) -> None:
    q = AsyncCallsQueue(timeout=30)
    w = torch.arange(1000, dtype=torch.float32)
    with LocalCheckpointManager(root, timeout=30) as mgr:
        req = mgr.save({"w": w}, 5, is_async=True)
        assert isinstance(req, AsyncRequest)
        w.add_(1)  # training goes on while the write runs
        q.schedule_async_request(req)
        assert q.maybe_finalize_async_calls(blocking=True) == [0]
        assert mgr.latest_iteration == 5
        loaded, _ = mgr.load()
    assert torch.equal(loaded["w"], torch.arange(1000, dtype=torch.float32))
    q.close()


def _slow_writes(mgr: LocalCheckpointManager, gate: threading.Event) -> None:
    real = mgr._ctx.store.write

    def slow(*args: Any, **kwargs: Any) -> Any:
        gate.wait(30)
        return real(*args, **kwargs)
    mgr._ctx.store.write = slow  # type: ignore[method-assign]


def test_second_save_waits_for_the_one_in_flight(root: Path) -> None:
    q, gate = AsyncCallsQueue(timeout=30), threading.Event()
    with LocalCheckpointManager(root, keep_last=2, timeout=30) as mgr:
        _slow_writes(mgr, gate)
        q.schedule_async_request(mgr.save(make_state(0, 1), 1, is_async=True))
        threading.Timer(0.3, gate.set).start()
        started = time.monotonic()
        q.schedule_async_request(mgr.save(make_state(0, 2), 2, is_async=True))
        assert time.monotonic() - started >= 0.25  # it waited for iteration 1
        assert mgr.latest_iteration == 1  # ... and finalized it
        assert q.maybe_finalize_async_calls(blocking=True) == [0, 1]
        assert mgr.find_latest() == 2
        assert digest(mgr.load()[0]) == digest(make_state(0, 2))
    q.close()


def test_busy_skip_skips_instead_of_waiting(root: Path) -> None:
    q, gate = AsyncCallsQueue(timeout=30), threading.Event()
    with LocalCheckpointManager(root, timeout=30, busy="skip") as mgr:
        _slow_writes(mgr, gate)
        q.schedule_async_request(mgr.save(make_state(0, 1), 1, is_async=True))
        assert mgr.save(make_state(0, 2), 2, is_async=True) is None
        gate.set()
        q.maybe_finalize_async_calls(blocking=True)
        assert mgr.find_latest() == 1
    q.close()


def test_a_skipped_save_does_not_restart_the_every_seconds_clock(root: Path) -> None:
    from localckpt import SavePolicy

    q, gate = AsyncCallsQueue(timeout=30), threading.Event()
    with LocalCheckpointManager(root, timeout=30, busy="skip",
                                save_policy=SavePolicy(every_seconds=3600)) as mgr:
        _slow_writes(mgr, gate)
        q.schedule_async_request(mgr.save(make_state(0, 1), 1, is_async=True, force=True))
        last = mgr._schedule._last_save
        time.sleep(0.01)
        assert mgr.save(make_state(0, 2), 2, is_async=True, force=True) is None  # skipped
        assert mgr._schedule._last_save == last
        gate.set()
        q.maybe_finalize_async_calls(blocking=True)
    q.close()


@pytest.mark.parametrize("world,per_node", [(2, 1), (4, 2), (2, 0)])
def test_async_round_trip_alongside_training_collectives(tmp_path: Path, root: Path, world: int,
                                                         per_node: int) -> None:
    from dist_harness import run_ranks
    from scenarios import async_saves

    results = run_ranks(async_saves, world, tmp_path, str(root), per_node, [2, 4, 6])
    for r in results:
        assert r.ok, r.message
        assert r.value["errors"] == [] and r.value["all_reduce_ok"]
        assert r.value["dirs"] == ["iter_0000000006"]
        assert r.value["latest"] == 6 and r.value["digest"] == r.value["expected"]


def test_background_failure_on_one_rank_raises_everywhere_and_keeps_previous(
        tmp_path: Path, root: Path) -> None:
    from dist_harness import run_ranks
    from scenarios import async_saves

    results = run_ranks(async_saves, 4, tmp_path, str(root), 2, [3, 5], 2, 5)
    for r in results:
        assert r.ok, r.message
        assert len(r.value["errors"]) == 1, r.value["errors"]
        _, bases, msg = r.value["errors"][0]
        # the root cause on rank 2, and its consequence on the rank expecting its replica
        assert "CheckpointingError" in bases
        assert "rank 2: " in msg and "injected in the background" in msg
        assert r.value["dirs"] == ["iter_0000000003"]  # the partial iteration 5 is gone
        assert r.value["latest"] == 3 and r.value["digest"] == r.value["expected"]


def test_pending_async_save_is_drained_at_interpreter_exit(tmp_path: Path, root: Path) -> None:
    import subprocess
    import sys
    import textwrap

    program = textwrap.dedent(f"""
        import time, torch
        from localckpt import LocalCheckpointManager
        from localckpt.save.async_calls import AsyncCallsQueue
        queue = AsyncCallsQueue(timeout=30)
        mgr = LocalCheckpointManager({str(root)!r}, "exit", timeout=30)
        real = mgr._ctx.store.write
        def slow(*a, **k):
            time.sleep(1.0)  # still writing when the interpreter starts to exit
            return real(*a, **k)
        mgr._ctx.store.write = slow
        queue.schedule_async_request(mgr.save({{"w": torch.arange(10.0)}}, 7, is_async=True))
        print("exiting", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "exiting" in proc.stdout, proc.stderr
    with LocalCheckpointManager(root, "exit", timeout=30) as mgr:
        assert mgr.find_latest() == 7
        assert torch.equal(mgr.load()[0]["w"], torch.arange(10.0))


def test_the_queue_never_reports_success_for_a_save_back_pressure_found_failed(
        root: Path) -> None:
    """The next save finalizes the one in flight first (back-pressure) and raises its failure;
    the queue, finalizing the same call later, must say it failed too, not return its index."""
    q = AsyncCallsQueue(timeout=30)
    with LocalCheckpointManager(root, timeout=30) as mgr:
        mgr.save(make_state(0, 1), 1)
        real = mgr._ctx.store.write

        def broken(*args: Any, **kwargs: Any) -> Any:
            mgr._ctx.store.write = real  # type: ignore[method-assign]
            raise OSError(5, "Input/output error (injected)")
        mgr._ctx.store.write = broken  # type: ignore[method-assign]
        q.schedule_async_request(mgr.save(make_state(0, 2), 2, is_async=True))
        with pytest.raises(OSError, match="injected"):
            mgr.save(make_state(0, 3), 3)  # back-pressure finalizes iteration 2 first
        with pytest.raises(OSError, match="injected"):
            q.maybe_finalize_async_calls(blocking=True)
        assert mgr.find_latest() == 1
    q.close()


def test_add_finalize_fn_adds_in_place_as_megatrons_request_does() -> None:
    """Megatron-LM calls ``request.add_finalize_fn(fn)`` and ignores what it returns (its own
    request adds in place): the function must still run once the call is finalized."""
    log: list[str] = []
    q = AsyncCallsQueue(timeout=30)
    request = AsyncRequest(log.append, ("a",))
    request.add_finalize_fn(lambda: log.append("f"))
    q.schedule_async_request(request)
    request.add_finalize_fn(lambda: log.append("late"))  # scheduled requests are frozen copies
    assert q.maybe_finalize_async_calls(blocking=True) == [0]
    assert log == ["a", "f"]
    q.close()
    frozen = request.freeze()
    with pytest.raises(RuntimeError, match="frozen"):
        frozen.add_finalize_fn(lambda: None)
    assert len(frozen.finalize_fns) == 2 and frozen.is_frozen and not request.is_frozen


def test_waiting_for_a_large_save_with_the_largest_timeout_does_not_overflow() -> None:
    """A save agreed with more than about 9,220 units of work (chunks and pieces), waited for
    with the largest timeout accepted (1e6 s), raised OverflowError from threading on the
    rank still saving: its peers were never told and sat in the finalize exchange (from an
    attacker review)."""
    from localckpt.control.collectives import MAX_TIMEOUT
    from localckpt.save.job import SaveJob

    job = SaveJob(7, None, None, agree=lambda: None)
    job.agreed.set()
    job.wait_steps = 2 + 9000 + 300  # 9,000 chunks and 300 pieces
    threading.Timer(0.2, job.done.set).start()
    assert job.wait(MAX_TIMEOUT)
