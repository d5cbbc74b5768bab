"""Save and keep decisions agreed by every rank, and a clean save on preemption (issue 24, items
1 and 2)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import Agent, run_ranks, start_torchrun

from localckpt import ConfigurationError, LocalCheckpointManager, SavePolicy

REPO = Path(__file__).resolve().parent.parent


def test_save_policy_rules() -> None:
    policy = SavePolicy(every_steps=5, at_steps={3}, predicate=lambda s: s == 11)
    assert [s for s in range(13) if policy.due_by_step(s)] == [3, 5, 10, 11]
    assert SavePolicy(every_seconds=2).due_by_time(2.5) and not SavePolicy().due_by_time(1e9)
    # an iterator is taken once, not checked and then stored empty
    assert SavePolicy(at_steps=iter([3, 7])).at_steps == {3, 7}
    for bad in ({"every_steps": 0}, {"at_steps": [-1]}, {"at_steps": 100}, {"every_seconds": 0},
                {"every_seconds": float("inf")}, {"predicate": 5}):
        with pytest.raises(ConfigurationError, match="SavePolicy"):
            SavePolicy(**bad)  # type: ignore[arg-type]


def test_save_asks_the_policy_unless_forced(root: Path) -> None:
    with LocalCheckpointManager(root, keep_last=10, save_policy=SavePolicy(every_steps=3)) as mgr:
        for step in range(1, 8):
            mgr.save({"w": torch.full((2,), float(step))}, step)
        mgr.save({"w": torch.zeros(2)}, 8, force=True)
        assert mgr.iterations() == [3, 6, 8]
        assert mgr.should_save(9) and not mgr.should_save(10)
    with LocalCheckpointManager(root) as mgr, pytest.raises(ConfigurationError,
                                                            match="no save_policy"):
        mgr.should_save(1)


def test_preemption_signal_is_noticed_and_the_previous_handler_chained(root: Path) -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        with LocalCheckpointManager(root, preemption_signals=[signal.SIGUSR1]) as mgr:
            assert not mgr.reached_preemption(0)
            os.kill(os.getpid(), signal.SIGUSR1)
            assert mgr.reached_preemption(1) and mgr.reached_preemption(2)
            assert seen == [signal.SIGUSR1]
        assert signal.getsignal(signal.SIGUSR1) is not None and seen == [signal.SIGUSR1]
        os.kill(os.getpid(), signal.SIGUSR1)  # ours is gone: the old one runs alone
        assert seen == [signal.SIGUSR1, signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)
    with LocalCheckpointManager(root) as mgr:
        assert not mgr.reached_preemption(0)  # not handled: False, no collective


def test_signals_given_as_an_iterator_are_watched(root: Path) -> None:
    """The settings compared across ranks read the signals first, so an iterator reached the
    schedule spent: a watch of nothing, and SIGUSR1 killed the process instead of asking for a
    save (from the review of this session's diff)."""
    previous = signal.signal(signal.SIGUSR1, lambda s, f: None)
    try:
        with LocalCheckpointManager(root, preemption_signals=iter([signal.SIGUSR1])) as mgr:
            os.kill(os.getpid(), signal.SIGUSR1)
            assert mgr.reached_preemption(1)
    finally:
        signal.signal(signal.SIGUSR1, previous)


def _agree(rank: int, world: int, base: str, skew: float) -> dict[str, Any]:
    """Rank 1's clock says it saved long ago; rank 0's decides (every_seconds=3600)."""
    with LocalCheckpointManager(Path(base) / f"node{rank}", "job", node_id=f"node{rank}",
                                save_policy=SavePolicy(every_seconds=3600),
                                preemption_signals=[signal.SIGUSR1]) as mgr:
        mgr._schedule._last_save -= skew * rank
        first = mgr.should_save(1)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # the scheduler preempts rank 1's node
        return {"should_save": first, "preempted": [mgr.reached_preemption(s) for s in (2, 3)],
                "saves_then": mgr.should_save(4)}


def test_time_and_preemption_decisions_are_agreed_across_ranks(tmp_path: Path) -> None:
    results = run_ranks(_agree, 2, tmp_path, str(tmp_path / "roots"), 7200.0)
    assert [r.value for r in results] == [
        {"should_save": False, "preempted": [True, True], "saves_then": True}] * 2, \
        [r.message for r in results]


def _one_rank_wrong(rank: int, world: int, base: str, what: str) -> dict[str, Any]:
    """Rank 1 alone gets something wrong in a collective schedule call: every rank must raise
    the same error, and the group must stay usable (a save right after works)."""
    def predicate(step: int) -> bool:
        if rank == 1 and what == "predicate":
            raise ValueError("the predicate failed")
        return False

    with LocalCheckpointManager(Path(base) / f"node{rank}", "job", node_id=f"node{rank}",
                                timeout=20, save_policy=SavePolicy(every_seconds=3600,
                                                                   predicate=predicate)) as mgr:
        try:
            if what == "predicate":
                mgr.should_save(1)
            elif what == "metadata":
                mgr.metadata(5 if rank == 0 else "5")  # type: ignore[arg-type]
            elif what == "different":
                mgr.save({"w": torch.ones(2)}, 3 + rank)
            else:
                mgr.save({"w": torch.ones(2)}, 3 if rank == 0 else "3")  # type: ignore[arg-type]
        except Exception as exc:
            error = [type(exc).__name__, str(exc)]
        else:
            error = None
        mgr.save({"w": torch.ones(2)}, 5, force=True)
        return {"error": error, "latest": mgr.find_latest()}


@pytest.mark.parametrize("what", ["predicate", "iteration", "metadata", "different"])
def test_a_schedule_call_wrong_on_one_rank_is_the_same_error_on_every_rank(
        tmp_path: Path, what: str) -> None:
    results = run_ranks(_one_rank_wrong, 2, tmp_path, str(tmp_path / "roots"), what)
    assert all(r.ok for r in results), [r.message for r in results]
    errors = [r.value["error"] for r in results]
    assert errors[0] is not None and errors[0][0] == errors[1][0], errors
    assert errors[0][0] == ("RankValueError" if what == "predicate" else
                            "InvalidIterationError"), errors
    assert what != "metadata" or "got str '5'" in errors[0][1], errors
    assert [r.value["latest"] for r in results] == [5, 5]


def _losses(path: Path) -> list[tuple[int, float]]:
    return [(d["step"], d["loss"]) for d in map(json.loads, path.read_text().splitlines())]


def _torchrun(root: Path, log: Path, *extra: str) -> Agent:
    return start_torchrun(
        ["--nproc-per-node", "2", "--standalone", str(REPO / "scripts" / "ddp_example.py"),
         "--root", str(root / "{node}"), "--steps", "30", "--save-every", "100",
         "--loss-log", str(log), *extra], log.parent / f"torchrun-{uuid.uuid4().hex[:8]}.out")


def test_sigterm_on_one_rank_saves_that_step_everywhere_and_the_job_resumes_from_it(
        tmp_path: Path) -> None:
    straight = _torchrun(tmp_path / "straight", tmp_path / "straight.jsonl")
    assert straight.wait(300) == 0, straight.output()
    log = tmp_path / "preempted.jsonl"
    job = _torchrun(tmp_path / "preempted", log, "--preemption", "--step-seconds", "0.2")
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and len(log.read_text().splitlines()) >= 5):
            assert time.monotonic() < deadline and job.poll() is None, job.output()
            time.sleep(0.05)
        os.kill(int(Path(f"{log}.pid1").read_text()), signal.SIGTERM)  # one rank of node 1
        assert job.wait(120) == 0, job.output()
    finally:  # a failed check must not leave the job running
        if job.poll() is None:
            job.kill()
    steps = [s for s, _ in _losses(log)]
    stopped = steps[-1] + 1
    assert 5 <= stopped < 30
    held = {p.name for p in (tmp_path / "preempted").rglob("iter_*")}
    assert held == {f"iter_{stopped:010d}"}  # the preempted step, on both nodes
    rest = _torchrun(tmp_path / "preempted", log)
    assert rest.wait(300) == 0, rest.output()
    resumed = _losses(log)
    assert [s for s, _ in resumed] == list(range(stopped)) + list(range(stopped, 30))
    assert resumed == _losses(tmp_path / "straight.jsonl")


def test_a_preemption_finalizes_the_async_save_in_flight_first(root: Path) -> None:
    from test_async_job import _slow_writes

    with LocalCheckpointManager(root, keep_last=5,
                                preemption_signals=[signal.SIGUSR2]) as mgr:
        _slow_writes(mgr, 0.5)
        request = mgr.save({"w": torch.ones(4)}, 1, is_async=True)
        assert request is not None  # never scheduled: reached_preemption finalizes it
        os.kill(os.getpid(), signal.SIGUSR2)
        assert mgr.reached_preemption(1)
        assert mgr._save._inflight is None and mgr.latest_iteration == 1
        mgr.save({"w": torch.zeros(4)}, 2, force=True)
        assert mgr.iterations() == [1, 2]


def test_watches_closed_in_any_order_hand_the_signal_back(root: Path) -> None:
    """Two managers watching one signal, closed in the order they were made: the handler left
    installed is the first one's, which must pass the signal on to what was there before."""
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        first = LocalCheckpointManager(root, "a", preemption_signals=[signal.SIGUSR1])
        second = LocalCheckpointManager(root, "b", preemption_signals=[signal.SIGUSR1])
        first.close()
        second.close()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_process_forked_from_a_watching_one_still_dies_of_the_signal(root: Path) -> None:
    """Megatron runs an async save's work in a forked process: it inherits the handler, but a
    preemption notice is its parent's, and SIGTERM must still end it."""
    import multiprocessing as mp

    with LocalCheckpointManager(root, preemption_signals=[signal.SIGTERM]):
        child = mp.get_context("fork").Process(target=time.sleep, args=(30,))
        child.start()
        time.sleep(0.2)
        child.terminate()
        child.join(10)
        alive = child.is_alive()
        if alive:
            child.kill()
            child.join()
    assert not alive and child.exitcode == -signal.SIGTERM


def test_a_watch_closed_while_a_later_one_still_watches_neither_kills_nor_hides(
        root: Path) -> None:
    """The first of two managers is closed, the second still watches: a SIGTERM must be noticed
    by the second and must not end the process (the closed one is only its previous handler)."""
    code = textwrap.dedent(f"""
        import os, signal, sys
        from localckpt import LocalCheckpointManager
        first = LocalCheckpointManager({str(root)!r}, "a", preemption_signals=True)
        second = LocalCheckpointManager({str(root)!r}, "b", preemption_signals=True)
        first.close()
        os.kill(os.getpid(), signal.SIGTERM)
        print("noticed", second.reached_preemption(1), flush=True)
        second.close()
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "noticed True" in proc.stdout, (proc.returncode,
                                                                    proc.stderr[-2000:])
