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
