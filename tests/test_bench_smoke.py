"""The benchmark runs end to end with tiny sizes, so it never rots (figures are not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_script(name: str, *args: str, timeout: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "scripts" / name), *args],
                          capture_output=True, text=True, timeout=timeout)


def test_bench_quick_writes_report(tmp_path: Path) -> None:
    proc = run_script("bench.py", "--quick", "--out", str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "benchmarks.json").read_text())
    rows = {(r["case"], r["world"], r["factor"]): r for r in data["rows"]}
    assert set(rows) == {("uniform", 2, 1), ("uniform", 2, 2), ("uniform", 4, 2),
                         ("small", 2, 2), ("transformer", 2, 2), ("fsdp2", 4, 1)}, (
        data["skipped"], proc.stderr[-3000:])  # why a configuration is missing
    fsdp2 = rows["fsdp2", 4, 1]
    for phase in ("localckpt_save", "localckpt_load_into", "dcp_save", "dcp_load",
                  "localckpt_load_resharded", "dcp_load_resharded"):
        assert len(fsdp2["samples_s"][phase]) == 2 and fsdp2["median_s"][phase] > 0, phase
    assert fsdp2["ratios"]["fsdp2_save_to_dcp"] > 0 and fsdp2["ratios"]["fsdp2_load_to_dcp"] > 0
    replicated = rows["uniform", 4, 2]
    for phase in ("memcpy", "tmpfs_write_fresh", "gloo_save_schedule", "stall", "write",
                  "replicate", "finalize", "find_latest", "load_local", "load_after_node_loss",
                  "torch_save", "torch_load", "torch_save_and_replicate", "dcp_save",
                  "dcp_async_save", "dcp_load"):
        assert len(replicated["samples_s"][phase]) == 2, phase
        assert replicated["median_s"][phase] > 0, phase
    for ratio in ("stall_to_memcpy", "write_to_raw_write", "replicate_to_raw_gloo",
                  "node_loss_to_raw", "async_to_torch_save_and_replicate"):
        assert replicated["ratios"][ratio] > 0, ratio
    assert "replicate" not in rows["uniform", 2, 1]["median_s"]  # F=1: nothing to replicate
    assert rows["small", 2, 2]["tensors"] == 200
    text = (tmp_path / "benchmarks.md").read_text()
    assert "## Targets" in text and "transformer" in text and "localckpt against DCP" in text
    # the report renders again from the JSON alone (no re-run)
    again = tmp_path / "again"
    proc = run_script("bench.py", "--report-from", str(tmp_path / "benchmarks.json"), "--out",
                      str(again), "--no-plot", timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (again / "benchmarks.md").read_text().split("## Targets")[1] == \
        text.split("## Targets")[1]


def test_bench_planning_quick_writes_report(tmp_path: Path) -> None:
    proc = run_script("bench_planning.py", "--quick", "--out", str(tmp_path), timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "benchmarks-planning.json").read_text())["rows"]
    assert [r["world"] for r in rows] == [64, 256]
    assert all(r["retrieval_after_node_loss"]["remote"] > 0 for r in rows)
    assert "Planning at scale" in (tmp_path / "benchmarks-planning.md").read_text()


def test_cuda_bench_runs_or_says_why_not_and_its_section_renders(tmp_path: Path) -> None:
    import torch

    proc = run_script("bench_cuda.py", "--quick", "--out", str(tmp_path / "cuda"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if not torch.cuda.is_available():
        assert "no CUDA device" in proc.stdout and not (tmp_path / "cuda").exists()
    # Every path of the bench on the CPU: floors, Adam workloads, saves, checked loads.
    proc = run_script("bench_cuda.py", "--quick", "--device", "cpu", "--out",
                      str(tmp_path / "cpu"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "cpu" / "benchmarks-cuda.json").read_text())
    assert result["keep_last"] == 1 and result["device"] == "cpu"
    assert [r["case"] for r in result["rows"]] == ["adam 1% small", "adam 15% small", "uniform"]
    for r in result["rows"]:
        assert set(r["ratios"]) >= {"stall_to_d2h_pinned", "finalized_to_floor", "load_to_floor"}
        assert all(v > 0 for v in r["ratios"].values()), r
        assert {"d2h_pinned", "h2d_pinned", "tmpfs_write_1", "tmpfs_read_1"} <= set(
            r["median_s"])
    assert "÷ floor" in (tmp_path / "cpu" / "benchmarks-cuda.md").read_text()
    # The GPU figures recorded in docs/ are embedded in benchmarks.md by the CPU-side report
    # (a run from before the floors were measured renders as it did).
    for name in ("benchmarks.json", "benchmarks-cuda.json"):
        (tmp_path / name).write_text((REPO / "docs" / name).read_text())
    proc = run_script("bench.py", "--report-from", str(tmp_path / "benchmarks.json"), "--out",
                      str(tmp_path), "--no-plot", timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "## CUDA" in (tmp_path / "benchmarks.md").read_text()
    section = (tmp_path / "benchmarks.md").read_text().split("## CUDA")[1]
    assert "NVIDIA" in section


def test_bench_control_quick_writes_report(tmp_path: Path) -> None:
    proc = run_script("bench_control.py", "--quick", "--out", str(tmp_path), timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "benchmarks-control.json").read_text())["rows"]
    assert [r["world"] for r in rows] == [4]
    for figure in ("find_latest", "save", "raw_all_gather", "raw_save", "save_write",
                   "save_replicate", "save_finalize"):
        assert rows[0][figure]["median"] > 0, figure
    assert "Control plane" in (tmp_path / "benchmarks-control.md").read_text()


def test_bench_preemption_small_writes_report(tmp_path: Path) -> None:
    out = tmp_path / "preemption.md"
    proc = run_script("bench_preemption.py", "--mib", "4", "--step-ms", "5", "--calls", "5",
                      "--out", str(out), timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["plain_save_s"] > 0 and 0 < figures["signal_to_finalized_s"] < 60
    assert "signal to a finalized checkpoint on every rank" in out.read_text()


def test_bench_durable_small_writes_report(tmp_path: Path) -> None:
    proc = run_script("bench_durable.py", "--mib", "4", "--repeats", "1", "--durable-dir",
                      str(tmp_path), "--out", str(tmp_path / "out"), timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "out" / "benchmarks-durable.json").read_text())
    assert [t["tier"] for t in result["tiers"]] == ["dir", "s3"]
    for tier in result["tiers"]:
        assert tier["failures"] == []
        assert set(tier["ratios"]) == {"persist_to_raw_copy", "restore_to_raw_read",
                                       "restore_to_dcp_load"}
        assert all(v > 0 for v in tier["ratios"].values())
    text = (tmp_path / "out" / "benchmarks-durable.md").read_text()
    assert "whole job on empty nodes" in text and "| bucket | `persist`" in text


def test_bench_erasure_small_writes_report(tmp_path: Path) -> None:
    proc = run_script("bench_erasure.py", "--mib", "1", "--e2e-mib", "1", "--repeats", "1",
                      "--out", str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "benchmarks-erasure.json").read_text())
    assert [r["layout"] for r in result["rates"]] == ["3+1", "4+2"]
    assert all(r["encode_gbs"] > 0 and r["rebuild_gbs"] > 0 for r in result["rates"])
    memory = {r["layout"]: r["shards_per_node"] for r in result["memory"]}
    # 8 nodes of 4 ranks: full replicas keep F shards per own shard; 3+1 and 4+2 keep 1.5
    assert memory == {"node_spread F=2": 8, "node_spread F=3": 12, "erasure 3+1": 6,
                      "erasure 4+2": 6}
    e2e = {r["layout"]: r for r in result["e2e"]}
    assert list(e2e) == ["node_spread F=2", "erasure 3+1", "node_spread F=3", "erasure 4+2"]
    assert all(r["save_s"] > 0 and r["stall_s"] > 0 and r["restore_s"] > 0
               for r in e2e.values())
    # on disk, each erasure node root holds less than the replicas' (a shard and a third, or
    # a shard and a half, against two or three shards)
    assert e2e["erasure 3+1"]["tmpfs_per_node_mib"] < e2e["node_spread F=2"]["tmpfs_per_node_mib"]
    assert e2e["erasure 4+2"]["tmpfs_per_node_mib"] < e2e["node_spread F=3"]["tmpfs_per_node_mib"]
    assert "restart ÷ replicas'" in (tmp_path / "benchmarks-erasure.md").read_text()
