"""End to end: the README's demo. A 2-node torchrun job loses node 1 (agent and ranks killed, root
wiped) mid-run; an empty replacement joins; the job resumes from the newest complete checkpoint
with the lost shard fetched from the other node, and ends bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
