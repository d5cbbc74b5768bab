"""End to end: a real torchrun job crashes on one rank, torchrun restarts it, and it resumes from
the newest complete checkpoint with weights bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_crash_restart_resume_is_bit_identical(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "run_demo.py"), "--steps", "24",
         "--save-every", "8", "--crash-at-step", "13", "--workdir", str(tmp_path / "work"),
         "--json", str(report), "--timeout", "150"],
        capture_output=True, text=True, timeout=330)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(report.read_text())
    assert result["ok"] and result["expected_resume"] == 7
    for rank, ref in zip(result["ranks"], result["reference"], strict=True):
        assert rank["attempt"] == 1 and rank["resumed_from"] == 7
        assert rank["digest"] == ref["digest"]
