"""The benchmark runs end to end with tiny sizes, so it never rots (figures are not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_bench_quick_writes_report(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench.py"), "--quick",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "benchmarks.json").read_text())
    for key in ("write_ratio_to_raw_write", "read_ratio_to_raw_read", "stage_ratio_to_memcpy"):
        assert data["localckpt"][key] > 0
    assert "local shard write" in (tmp_path / "benchmarks.md").read_text()


def test_bench_replication_quick_writes_report(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_replication.py"),
                           "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "benchmarks-replication.json").read_text())
    assert data["replication_ratio_to_raw"] > 0 and data["restore_ratio_to_raw"] > 0
    assert "restore after node loss" in (tmp_path / "benchmarks-replication.md").read_text()


def test_bench_async_quick_writes_report(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_async.py"), "--quick",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "benchmarks-async.json").read_text())
    assert data["stall_ratio_to_memcpy"] > 0 and data["async_to_sync_ratio"] > 0


def test_bench_planning_quick_writes_report(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_planning.py"),
                           "--quick", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "benchmarks-planning.json").read_text())["rows"]
    assert [r["world"] for r in rows] == [64, 256]
    assert all(r["retrieval_after_node_loss"]["remote"] > 0 for r in rows)
    assert "Planning at scale" in (tmp_path / "benchmarks-planning.md").read_text()
