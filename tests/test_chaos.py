"""End to end: the chaos harness's CI set on a real 2-node torchrun job (scripts/chaos.py).

Every fault point and every fault kind at least once; every scenario must end with bit-identical
weights, the right resume iteration, no leftovers and redundancy restored. The soak mode
(``--soak N``) is not run here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from localckpt.ops.faults import POINTS

REPO = Path(__file__).resolve().parent.parent
KINDS = {"kill_rank", "kill_node", "wipe_node", "flip_byte", "truncate", "enospc", "slow_rank",
         "leftovers"}


def test_ci_chaos_set_has_no_violations(tmp_path: Path) -> None:
    report = tmp_path / "chaos.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "chaos.py"), "--jobs", "3",
                           "--json", str(report)], capture_output=True, text=True, timeout=600)
    result = json.loads(report.read_text())
    rows = result["scenarios"]
    assert proc.returncode == 0 and result["violations"] == 0, proc.stdout + proc.stderr
    assert len(rows) >= 20
    assert {r["point"] for r in rows} >= set(POINTS)
    assert {r["kind"] for r in rows} == KINDS
    assert all(r["bit_identical"] for r in rows)
