"""End to end: the README's demo. A 2-node torchrun job loses node 1 (agent and ranks killed, root
wiped) mid-run; an empty replacement joins; the job resumes from the newest complete checkpoint
with the lost shard fetched from the other node, and ends bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dist_harness import torchrun

REPO = Path(__file__).resolve().parent.parent


def test_node_loss_demo_resumes_bit_identical(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "run_demo.py"), "--workdir",
         str(tmp_path / "work"), "--json", str(report)],
        capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(report.read_text())
    assert result["ok"] and result["replaced"] == [1] and result["expected_resume"] == 19
    for rank in result["ranks"]:
        assert rank["resumed_from"] == 19 and rank["digest"] == result["reference"]
    # The replacement node had nothing: its rank got its shard from the surviving node.
    assert [r["fetched_bytes"] > 0 for r in result["ranks"]] == [
        r["node"] == 1 for r in result["ranks"]]
    assert "bit-identical" in proc.stdout and "redundancy restored" in proc.stdout
    # Act 2: every node lost and replaced empty; the job resumed from the durable tier.
    lost = result["job_lost"]
    assert lost["ok"] and lost["replaced"] == [0, 1], lost
    assert lost["resumed"] == [19, 19] and lost["identical"] == [True, True]


def _losses(path: Path) -> list[tuple[int, float]]:
    return [(d["step"], d["loss"]) for d in map(json.loads, path.read_text().splitlines())]


def test_fsdp2_example_resumes_with_the_same_loss_curve(tmp_path: Path) -> None:
    """scripts/fsdp2_example.py under torchrun (4 ranks, a 2-D mesh, 2 simulated nodes): a job
    stopped after step 5 and started again resumes from its step-4 checkpoint, and its losses
    from there are those of a job that never stopped, bit for bit."""
    def run(root: Path, log: Path, *extra: str) -> None:
        torchrun(["--nproc-per-node", "4", "--standalone",
                  str(REPO / "scripts" / "fsdp2_example.py"), "--root", str(root / "{node}"),
                  "--steps", "10", "--loss-log", str(log), *extra],
                 log.with_suffix(f".{len(extra)}.out"), timeout=240)

    run(tmp_path / "straight", tmp_path / "straight.jsonl")
    run(tmp_path / "stopped", tmp_path / "stopped.jsonl", "--stop-after", "5")
    run(tmp_path / "stopped", tmp_path / "stopped.jsonl")
    straight, stopped = _losses(tmp_path / "straight.jsonl"), _losses(tmp_path / "stopped.jsonl")
    assert [s for s, _ in stopped] == [0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 8, 9]  # resumed at 4
    assert stopped[6:] == straight[4:] and stopped[:6] == straight[:6]
