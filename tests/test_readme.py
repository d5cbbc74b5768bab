"""The README works as written (issue 20, item 5): each of its Python snippets runs as it is on
one machine (its checkpoint root moved into the test's directory), twice: the second run
resumes from what the first saved."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_readme_has_python_snippets() -> None:
    assert SNIPPETS


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_snippet_runs_as_written(tmp_path: Path, index: int) -> None:
    code = SNIPPETS[index].replace("/dev/shm/ckpt", str(tmp_path / "ckpt"))
    for run in (1, 2):
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, f"run {run}:\n{proc.stderr[-3000:]}"
    assert any((tmp_path / "ckpt").rglob("iter_*"))
