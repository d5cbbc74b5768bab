"""Call orders and interrupts around a save a user can make (one process, or two real ranks):
each once lost a checkpoint, a preemption save or a Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from localckpt import LocalCheckpointManager
from localckpt.ops import faults
from localckpt.save.async_calls import AsyncCallsQueue
from localckpt.storage.store import ShardStore


def test_ctrl_c_in_a_synchronous_save_is_not_turned_into_a_failed_save(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A training loop that catches a failed save and goes on must still stop on Ctrl-C (or a
    handler's sys.exit) arriving while a synchronous save writes."""
    with LocalCheckpointManager(root, "s", timeout=10) as mgr:
        mgr.save({"w": torch.ones(4)}, 1)
        real = ShardStore.write

        def interrupted(self: ShardStore, manifest: Any, payload: Any) -> Any:
            if manifest.iteration == 2:
                raise KeyboardInterrupt
            return real(self, manifest, payload)

        monkeypatch.setattr(ShardStore, "write", interrupted)
        with pytest.raises(KeyboardInterrupt):
            mgr.save({"w": torch.zeros(4)}, 2)
    with LocalCheckpointManager(root, "s", timeout=10) as mgr:
        assert mgr.find_latest() == 1


def test_a_skipped_save_handed_to_the_queue_schedules_nothing() -> None:
    """``queue.schedule_async_request(ckpt.save(..., is_async=True))`` (docs/async.md) with
    ``busy="skip"``: a skipped save returns None."""
    queue = AsyncCallsQueue(timeout=10)
    try:
        assert queue.schedule_async_request(None) == -1
        assert queue.get_num_unfinalized_calls() == 0
        assert queue.maybe_finalize_async_calls(blocking=True) == []
    finally:
        queue.close()


def test_metadata_of_an_iteration_the_save_in_flight_would_retire(root: Path) -> None:
    """metadata(1) finalizes the save of 2 in flight first; with keep_last=1 its retention
    deleted 1 before the question was answered (load(iteration=1) keeps it: so does this)."""
    with LocalCheckpointManager(root, "s", keep_last=1, timeout=10) as mgr:
        mgr.save({"w": torch.ones(4)}, 1, custom_metadata={"tag": "one"})
        mgr.save({"w": torch.zeros(4)}, 2, is_async=True)
        assert mgr.metadata(1)["custom"] == {"tag": "one"}
        assert mgr.iterations() == [1, 2]
        mgr.save({"w": torch.zeros(4)}, 3)
        assert mgr.iterations() == [3]  # held for the question only


def test_a_preemption_after_a_failed_async_save_still_saves_its_step(
        root: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The async save of 20 fails (no space); the preemption noticed at step 21 must still
    answer True so the loop saves 21, not raise the old failure and lose 11 steps."""
    faults.arm(faults.Fault("local_write", "enospc", iteration=20))
    try:
        with LocalCheckpointManager(root, "s", keep_last=5, timeout=10,
                                    preemption_signals=[signal.SIGUSR2]) as mgr:
            mgr.save({"w": torch.ones(4)}, 10)
            assert mgr.save({"w": torch.ones(4)}, 20, is_async=True) is not None
            os.kill(os.getpid(), signal.SIGUSR2)
            with caplog.at_level(logging.ERROR, logger="localckpt.manager"):
                assert mgr.reached_preemption(21)
            assert "the async save in flight at the preemption failed" in caplog.text
            mgr.save({"w": torch.zeros(4)}, 21, force=True)
            assert mgr.iterations() == [10, 21]
    finally:
        faults.disarm()


def test_a_save_thread_that_outlives_close_commits_nothing_and_keeps_the_lock(
        root: Path) -> None:
    """close() gives up on an async save stuck before its commit (a stalled fsync, here a
    sleep): the thread must not commit later (a later manager's shard of that name would be
    replaced by stale bytes), and gc must not get the session while it runs."""
    import fcntl
    import time

    faults.arm(faults.Fault("before_commit", "sleep", iteration=2, seconds=4))
    try:
        mgr = LocalCheckpointManager(root, "s", timeout=0.5, keep_last=2)
        mgr.save({"w": torch.ones(4)}, 1)
        assert mgr.save({"w": torch.zeros(4)}, 2, is_async=True) is not None
        mgr.close()  # gives up after the job's bound
        thread = mgr._save._inflight.thread  # type: ignore[union-attr]
        assert thread is not None and thread.is_alive()
        fd = os.open(root / "s", os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        thread.join(10)
        assert not thread.is_alive()
    finally:
        faults.disarm()
    time.sleep(0.1)
    late = root / "s" / "iter_0000000002"  # its empty directory is a leftover the next start
    assert not late.exists() or not list(late.iterdir())  # removes: no shard, no .tmp
    assert [p.name for p in (root / "s" / "iter_0000000001").iterdir()] == [
        "rank_00000_of_00001"]


@pytest.mark.parametrize("is_async", [False, True])
def test_ctrl_c_in_the_walk_is_raised_as_it_came_when_the_peers_cannot_be_told(
        root: Path, is_async: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agreement that tells the peers about an interrupted walk failed itself (its
    collective failed; async: the data group already broken): the caller got CollectiveError,
    the KeyboardInterrupt only its cause, and an ``except KeyboardInterrupt`` handler never
    ran."""
    from localckpt.errors import CollectiveError

    class Interrupting:
        def state_dict(self) -> dict[str, Any]:
            raise KeyboardInterrupt

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save({"w": torch.ones(4)}, 1)
        broken = CollectiveError("the group broke")
        if is_async:
            mgr._ctx.data_group.mark_broken(broken)
        else:  # the peer is lost during the agreement's collective
            def lost(*args: Any, **kwargs: Any) -> Any:
                raise broken

            monkeypatch.setattr(mgr._ctx.group, "all_gather_bytes", lost)
        with pytest.raises(KeyboardInterrupt) as info:
            mgr.save({"w": torch.ones(4), "hook": Interrupting()}, 2, is_async=is_async)
        assert isinstance(info.value.__context__ or info.value.__cause__, CollectiveError)
        monkeypatch.undo()


def test_close_gives_up_on_a_chunk_write_stuck_in_the_io_pool(root: Path) -> None:
    """A hung write or fsync in the I/O pool (here a sleep): close() gives up after the save's
    bound as it does for a stall on the save's thread, instead of waiting for the pool (with a
    write that never returns, close() never returned)."""
    import time

    faults.arm(faults.Fault("local_write", "sleep", iteration=2, seconds=8))
    try:
        mgr = LocalCheckpointManager(root, "s", timeout=0.5, keep_last=2)
        mgr.save({"w": torch.ones(4)}, 1)
        assert mgr.save({"w": torch.zeros(4)}, 2, is_async=True) is not None
        job = mgr._save._inflight
        assert job is not None
        started = time.monotonic()
        mgr.close()
        took = time.monotonic() - started
        assert took < job.bound(0.5) + 2, took  # not the 8 s of the stuck write
        assert job.thread is not None and job.thread.is_alive()
        job.thread.join(15)
    finally:
        faults.disarm()
    with LocalCheckpointManager(root, "s") as mgr:  # the late thread committed nothing
        assert mgr.iterations() == [1]


def test_ctrl_c_in_one_ranks_synchronous_save_fails_the_save_on_every_rank_at_once(
        tmp_path: Path) -> None:
    import agreement_scenarios
    from dist_harness import run_ranks

    results = run_ranks(agreement_scenarios.sync_save_interrupted, 2, tmp_path, str(tmp_path))
    assert all(r.ok for r in results), [r.message for r in results]
    zero, one = (r.value for r in results)
    assert one["error"] == "KeyboardInterrupt" and zero["error"] == "RankFailureError"
    assert zero["seconds"] < 4, zero  # told, not timed out (timeout 5 x the finalize's steps)
    assert zero["latest"] == one["latest"] == 1


@pytest.mark.parametrize("is_async", [False, True])
def test_ctrl_c_in_one_ranks_state_dict_walk_fails_the_save_on_every_rank_at_once(
        tmp_path: Path, is_async: bool) -> None:
    import agreement_scenarios
    from dist_harness import run_ranks

    results = run_ranks(agreement_scenarios.staging_interrupted, 2, tmp_path, str(tmp_path),
                        is_async)
    assert all(r.ok for r in results), [r.message for r in results]
    zero, one = (r.value for r in results)
    assert one["error"] == "KeyboardInterrupt" and zero["error"] == "RankInterruptedError"
    assert zero["seconds"] < 4, zero  # told, not timed out
    assert zero["latest"] == one["latest"] == 1
    assert zero["after"] == one["after"] == 3


def test_an_async_save_interrupted_on_one_rank_and_left_to_back_pressure_keeps_ranks_in_step(
        tmp_path: Path) -> None:
    """Rank 0 leaves the failed save's request unfinalized: its next find_latest finalized it
    and raised, with no exchange, while rank 1 (nothing in flight) exchanged: the two ranks'
    calls paired off by one, silently. Back-pressure now logs that failure; only the request
    raises it."""
    import agreement_scenarios
    from dist_harness import run_ranks

    results = run_ranks(agreement_scenarios.staging_interrupted, 2, tmp_path, str(tmp_path),
                        True, False)
    assert all(r.ok for r in results), [r.message for r in results]
    zero, one = (r.value for r in results)
    assert one["error"] == "KeyboardInterrupt" and "error" not in zero
    assert zero["latest"] == one["latest"] == 1
    assert zero["after"] == one["after"] == 3


def test_an_async_save_interrupted_on_one_rank_keeps_ranks_in_step_with_busy_skip(
        tmp_path: Path) -> None:
    """With busy="skip", the next async save asked the others whether the previous save was
    done only on the ranks that had one in flight: not on the interrupted rank, so the two
    ranks' calls paired off and both groups broke for good (from the attacker review of the
    async save path)."""
    import agreement_scenarios
    from dist_harness import run_ranks

    results = run_ranks(agreement_scenarios.staging_interrupted, 2, tmp_path, str(tmp_path),
                        True, False, "skip")
    assert all(r.ok for r in results), [r.message for r in results]
    zero, one = (r.value for r in results)
    assert one["error"] == "KeyboardInterrupt" and "error" not in zero
    assert zero["skipped"] is one["skipped"] is False
    assert zero["after"] == one["after"] == 3


@pytest.mark.parametrize("scenario", ["schedule_verbs_differ", "metadata_of_different_iterations",
                                      "async_save_after_the_group_broke",
                                      "verbs_with_arguments_differ"])
def test_ranks_out_of_step_are_told_not_paired(tmp_path: Path, scenario: str) -> None:
    """Two ranks asking through different schedule verbs were paired (one answer each, no
    error); metadata of different iterations per rank broke the group for good (load's
    iteration is a checked argument: so is this one); an async save after the group was found
    out of step still wrote and committed its shards, failing only at its finalize; a verb with
    checked arguments beside another verb was reported as different arguments."""
    import agreement_scenarios
    from dist_harness import run_ranks

    results = run_ranks(getattr(agreement_scenarios, scenario), 2, tmp_path, str(tmp_path))
    assert all(r.ok for r in results), [r.message for r in results]
    values = [r.value for r in results]
    if scenario == "schedule_verbs_differ":
        assert values == [{"asked": "CollectiveError"}] * 2
    elif scenario == "metadata_of_different_iterations":
        assert values == [{"asked": "ConfigurationError", "after": 2}] * 2
    elif scenario == "verbs_with_arguments_differ":
        # a verb whose arguments are compared was taken for the same call with none: rank 1,
        # in find_latest, was told its arguments to metadata were "nothing"
        assert values[0] == values[1], values
        assert values[0]["after"] == 2, values
        for key, verb, other in (("asked", "metadata", "find_latest"),
                                 ("loaded", "load", "iterations")):
            told = values[0][key]
            assert told.startswith("CollectiveError") and "different" in told, told
            assert verb in told and other in told, told
    else:
        assert values == [{"broke": "CollectiveError", "saved": "CollectiveError",
                           "on_disk": ["iter_0000000001"]}] * 2


def test_a_failure_that_cannot_be_printed_is_still_every_ranks_error(tmp_path: Path) -> None:
    """An exception whose str() raises (a user's, from a Stateful's state_dict) escaped the
    step before its rank joined the exchange: that rank raised the RuntimeError of str(), and
    the others waited out the timeout (from an attacker review)."""
    import agreement_scenarios
    from dist_harness import run_ranks

    results = run_ranks(agreement_scenarios.unprintable_failure_on_one_rank, 2, tmp_path,
                        str(tmp_path))
    assert all(r.ok for r in results), [r.message for r in results]
    for r in results:
        assert r.value == {"error": ("RankFailureError", True), "fast": True, "after": None}, \
            r.value


@pytest.mark.parametrize("setting", ["keep_last", "reshard", "strict", "busy", "repl_strategy",
                                     "erasure", "durable", "durable_keep",
                                     "preemption_signals"])
def test_ranks_given_different_settings_are_refused_on_every_rank(tmp_path: Path,
                                                                  setting: str) -> None:
    """Retention, resharding and the schedule are decided per rank from the settings: ranks
    given different ones kept different shards and answered find_latest differently, each
    without an error (or one rank refused while the other went on). A replication strategy on
    one rank only (or another erasure code) made find_latest answer differently and every save
    time out; a durable tier on one rank only, or kept differently, the same (from the attacker
    review of the control plane)."""
    import agreement_scenarios
    from dist_harness import run_ranks

    results = run_ranks(agreement_scenarios.settings_differ, 2, tmp_path, str(tmp_path),
                        setting)
    assert all(r.ok for r in results), [r.message for r in results]
    assert [r.value for r in results] == [{"error": "ConfigurationError", "names": True}] * 2


@pytest.mark.parametrize("setting", ["same_durable", "same_keep_interval", "same_save_policy",
                                     "same_preemption_signals"])
def test_ranks_given_the_same_settings_start_whatever_their_numbers(tmp_path: Path,
                                                                    setting: str) -> None:
    """A persist_interval of inf made the start exchange's JSON fail on every rank, and 60 and
    60.0 were different settings (from the attacker reviews of this session's diff)."""
    import agreement_scenarios
    from dist_harness import run_ranks

    results = run_ranks(agreement_scenarios.settings_differ, 2, tmp_path, str(tmp_path),
                        setting)
    assert [r.value for r in results] == [{"made": True}] * 2, [r.message for r in results]


@pytest.mark.parametrize("state", [{"s": "\ud83d\ude00"}, {"d": {"\ud83d\ude00": 1}},
                                   {"args": argparse.Namespace(**{"\ud83d\ude00": 1})}])
def test_a_str_that_would_load_back_changed_is_refused_and_a_lone_surrogate_is_kept(
        root: Path, state: dict[str, Any]) -> None:
    """A str holding a surrogate pair as two code points came back as the one character they
    pair into, without an error (from the attacker review of the erasure path; a Namespace's
    attribute name from the review of the state dict path)."""
    with LocalCheckpointManager(root, "s", timeout=10) as mgr:
        with pytest.raises(TypeError, match="surrogate pair"):
            mgr.save({**state, "t": torch.zeros(1)}, 1)
        kept = {"lone": "\ud800 and \udc00", "emoji": "\U0001f600", "t": torch.zeros(1)}
        mgr.save(kept, 2)
        loaded, _ = mgr.load()
    assert loaded["lone"] == kept["lone"] and loaded["emoji"] == kept["emoji"]


@pytest.mark.parametrize("timeout", [True, 0, -1, float("inf"), float("nan"), 1e300, "5", None,
                                     0.0005])
def test_a_timeout_that_is_no_number_of_seconds_is_refused_by_name(root: Path,
                                                                   timeout: Any) -> None:
    """True was taken for 1 s, inf and 1e300 reached gloo (an OverflowError there), and the
    queue took anything until its first collective. Gloo keeps whole milliseconds: 0.5 ms was
    0 ms, no timeout at all when the groups were made (a rank waited 68 s for a late peer)."""
    from localckpt import ConfigurationError

    with pytest.raises(ConfigurationError, match="timeout: expected seconds"):
        LocalCheckpointManager(root, "s", timeout=timeout)
    with pytest.raises(ConfigurationError, match="AsyncCallsQueue: timeout: expected seconds"):
        AsyncCallsQueue(timeout=timeout)


@pytest.mark.parametrize("where", ["value", "key"])
def test_an_int_json_cannot_carry_everywhere_is_refused_at_save_naming_its_key(
        root: Path, where: str) -> None:
    """An int of more than 4,300 digits failed the save late, in finalize, naming no key; a
    process that raised sys.set_int_max_str_digits saved it, and a load under the default
    limit then quarantined that healthy iteration as corrupt."""
    big = 10 ** 5000
    state = {"seed": big} if where == "value" else {"by_seed": {big: 1}}
    with LocalCheckpointManager(root, "s", timeout=10) as mgr:
        with pytest.raises(TypeError, match=r"seed.*an int of 16610 bits"):
            mgr.save({**state, "t": torch.zeros(1)}, 1)
        most = -(10 ** 4300 - 1)  # 4,300 digits: within the limit, kept
        mgr.save({"seed": most, "t": torch.zeros(1)}, 2)
        loaded, _ = mgr.load()
    assert loaded["seed"] == most


def test_seconds_compared_across_ranks_are_text_json_carries() -> None:
    """inf has no JSON number, and an int past any float made construction raise
    OverflowError (from the attacker review of this session's diff)."""
    import json as json_module

    from localckpt.control.settings import alike as _alike
    from localckpt.control.settings import seconds_text as _seconds_text

    assert _seconds_text(60) == _seconds_text(60.0) == "60.0"
    assert _seconds_text(math.inf) == "inf" and _seconds_text(10**400) == str(10**400)
    assert json_module.dumps(_alike([60, {"a": 2}, True])) == json_module.dumps(
        [60.0, {"a": 2.0}, True])
