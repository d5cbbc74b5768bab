"""An async save's agreement runs on the save's own thread: its stall is the staging copy alone,
and whatever the agreement refuses is raised by the finalize step, on every rank alike."""

from __future__ import annotations

from pathlib import Path

import deferred_scenarios as sc
import pytest
from dist_harness import run_ranks


def test_an_async_save_returns_before_its_peers_have_staged(tmp_path: Path, root: Path) -> None:
    results = run_ranks(sc.async_returns_before_peers_stage, 2, tmp_path, str(root),
                        str(tmp_path / "rank0-returned"))
    for r in results:
        assert r.ok, r.message
        assert r.value["seen"], "rank 0's async save waited for rank 1 to stage"
        assert r.value["finalized"] == 2
        assert r.value["latest"] == 2 and r.value["digest"] == r.value["expected"]


@pytest.mark.parametrize(("what", "error", "says"), [
    ("stage", "CheckpointingError", "injected"),
    ("leaf", "TypeError", "object"),
    ("space", "InsufficientSpaceError", "free"),
    ("old", "InvalidIterationError", "newer"),
])
def test_an_async_save_refused_by_the_agreement_fails_at_finalize_on_every_rank(
        tmp_path: Path, root: Path, what: str, error: str, says: str) -> None:
    results = run_ranks(sc.async_failure_raised_at_finalize, 2, tmp_path, str(root), what)
    names = set()
    for r in results:
        assert r.ok, r.message
        v = r.value
        assert v["save_error"] is None, v  # save() returned a request on every rank
        e = v["finalize_error"]
        assert e is not None and error in e["bases"] and says in e["message"].lower(), e
        names.add(e["name"])
        assert v["dirs"] == ["iter_0000000001"], v  # nothing of the refused save was written
        assert v["latest"] == 3 and v["digest"] == v["expected"]
    assert len(names) == 1, names  # the same exception on every rank


def test_a_refused_resave_that_cannot_agree_keeps_the_finalized_iteration(
        tmp_path: Path, root: Path) -> None:
    for r in run_ranks(sc.refused_resave_with_broken_data_group, 2, tmp_path, str(root)):
        assert r.ok, r.message
        assert r.value["error"] is not None and "CollectiveError" in r.value["error"]["bases"]
        assert r.value["dirs"] == ["iter_0000000001"], r.value
        assert r.value["latest"] == 1 and r.value["digest"] == r.value["expected"]


def test_an_agreement_that_failed_on_one_rank_only_fails_alike_and_deletes_nothing(
        tmp_path: Path, root: Path) -> None:
    results = run_ranks(sc.split_agreement, 2, tmp_path, str(root))
    names = set()
    for r in results:
        assert r.ok, r.message
        v = r.value
        assert v["error"] is not None, v
        names.add(v["error"]["name"])
        assert "injected" in v["error"]["message"] and v["seconds"] < 20, v  # no timeout wait
        assert v["dirs"] == ["iter_0000000001"], v
        assert v["save3"] is None, v  # the groups are still usable: iteration 3 is saved
        assert v["latest"] == 3 and v["digest"] == v["expected"]
    assert len(names) == 1, names


@pytest.mark.parametrize("via", ["save", "settle"])
def test_a_late_peer_and_a_slow_write_each_within_the_timeout_do_not_time_out(
        tmp_path: Path, root: Path, via: str) -> None:
    for r in run_ranks(sc.late_peer_slow_write, 2, tmp_path, str(root), via):
        assert r.ok, r.message
        assert r.value["error"] is None, r.value
        assert r.value["latest"] == (3 if via == "save" else 2)


def test_close_waits_for_the_agreement_and_keeps_a_local_failure_local(
        tmp_path: Path, root: Path) -> None:
    first, second = run_ranks(sc.close_while_agreeing, 2, tmp_path, str(root))
    assert first.ok and second.ok, (first.message, second.message)
    assert first.value["threads"] == [], first.value  # the save's thread ended before close
    assert first.value["agreed_error"] == "None", first.value
    assert first.value["error"] in ("CollectiveError", "CollectiveTimeoutError"), first.value
    assert first.value["dirs"] == second.value["dirs"] == ["iter_0000000001"]


def test_the_agreed_wait_bound_is_set_before_a_waiter_can_read_it() -> None:
    from localckpt.save.job import SaveJob
    from localckpt.save.prepare import AgreedSave

    seen: list[int] = []
    job = SaveJob(5, None, None, agree=lambda: AgreedSave(None, None, 50))  # type: ignore[arg-type]
    real_set = job.agreed.set

    def observed_set() -> None:
        seen.append(job.wait_steps)
        real_set()
    job.agreed.set = observed_set  # type: ignore[method-assign]
    job.run(None)  # type: ignore[arg-type]  # the write then fails: no store
    assert seen and seen[0] == 50 and job.passed_agreement and job.error is not None


def test_a_queue_waits_as_long_as_a_slow_healthy_save_may_take(tmp_path: Path,
                                                               root: Path) -> None:
    for r in run_ranks(sc.slow_save_through_a_queue_of_the_managers_timeout, 2, tmp_path,
                       str(root)):
        assert r.ok, r.message
        assert r.value == {"error": None, "latest": 5}, r.value
