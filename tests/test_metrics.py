"""Per-phase metrics (hooks, logging, JSON lines) and warnings about shards of another job."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from scenarios import make_state

from localckpt import (
    AsyncCallsQueue,
    ConfigurationError,
    LocalCheckpointManager,
    Metrics,
    NoCheckpointError,
)
from localckpt.ops.metrics import PhaseMetric


def test_every_phase_reaches_hooks_and_the_jsonl_file(root: Path, tmp_path: Path) -> None:
    seen: list[PhaseMetric] = []
    jsonl = tmp_path / "metrics.jsonl"
    metrics = Metrics([seen.append], jsonl_path=jsonl)
    with LocalCheckpointManager(root, "m", metrics=metrics) as mgr:
        mgr.save(make_state(0, 1), 1)
        queue = AsyncCallsQueue()
        req = mgr.save(make_state(0, 2), 2, is_async=True)
        assert req is not None
        queue.schedule_async_request(req)
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
    with LocalCheckpointManager(root, "m", metrics=metrics) as mgr:
        assert mgr.find_latest() == 2
        mgr.load()
    by_phase: dict[str, list[PhaseMetric]] = {}
    for m in seen:
        by_phase.setdefault(m.phase, []).append(m)
    assert {p: [m.iteration for m in ms] for p, ms in by_phase.items()} == {
        "stall": [1, 2], "write": [1, 2], "finalize": [1, 2], "find_latest": [2], "load": [2]}
    nbytes = by_phase["write"][0].nbytes
    assert nbytes > 0 and by_phase["stall"][0].nbytes == nbytes == by_phase["load"][0].nbytes
    assert all(m.ok and m.seconds >= 0 and m.session_id == "m" and m.rank == 0 for m in seen)
    # The async save's stall is only staging: shorter than its own write plus finalize.
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [(d["phase"], d["iteration"]) for d in lines] == [(m.phase, m.iteration) for m in seen]


def test_a_failing_hook_never_breaks_a_save(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    def broken(_: PhaseMetric) -> None:
        raise RuntimeError("hook bug")

    with caplog.at_level(logging.ERROR), LocalCheckpointManager(root, metrics=broken) as mgr:
        mgr.save(make_state(0, 1), 1)
        assert mgr.find_latest() == 1
    assert "hook bug" in caplog.text


def test_failed_phase_is_reported_not_ok(root: Path) -> None:
    seen: list[PhaseMetric] = []
    with LocalCheckpointManager(root, metrics=seen.append) as mgr, pytest.raises(NoCheckpointError):
        mgr.load()
    assert [(m.phase, m.ok) for m in seen] == [("find_latest", True), ("load", False)]


def test_jsonl_path_from_environment(root: Path, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "env.jsonl"
    monkeypatch.setenv("LOCALCKPT_METRICS_FILE", str(path))
    with LocalCheckpointManager(root) as mgr:
        mgr.save(make_state(0, 1), 1)
    assert {json.loads(x)["phase"] for x in path.read_text().splitlines()} == {
        "stall", "write", "finalize"}


def test_bad_metrics_argument_is_a_configuration_error(root: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"metrics: expected .* got int"):
        LocalCheckpointManager(root, metrics=3)  # type: ignore[arg-type]


def test_shard_of_another_topology_is_warned_about_once(
        root: Path, caplog: pytest.LogCaptureFixture) -> None:
    with LocalCheckpointManager(root, "t", node_id="old-node") as mgr:
        mgr.save(make_state(0, 4), 4)
        manifest = mgr._ctx.store.read_manifest(mgr._ctx.store.committed()[0])
    assert manifest.identity["job"]["world_size"] == 1
    assert {"hostname", "boot_id", "gpu_uuids", "pid"} <= set(manifest.identity)
    with caplog.at_level(logging.WARNING, "localckpt"):
        with LocalCheckpointManager(root, "t", node_id="old-node") as same:
            same.load()
        assert "different job" not in caplog.text
        with LocalCheckpointManager(root, "t", node_id="new-node") as moved:
            assert moved.find_latest() == 4
            moved.load()
    warnings = [r.getMessage() for r in caplog.records if "different job" in r.getMessage()]
    assert len(warnings) == 1 and "topology" in warnings[0] and "iteration 4" in warnings[0]
