"""The examples of scripts/ run as users run them (issue 20, item 6): under torchrun, 2 ranks on
2 simulated nodes, a job that stops, loses a node (its root wiped) and resumes has the losses of
one that never stopped, bit for bit. (The Lightning example: tests/test_lightning.py; the FSDP2
one: tests/test_torchrun_e2e.py.)"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest
from dist_harness import torchrun

REPO = Path(__file__).resolve().parent.parent


def _losses(path: Path) -> list[tuple[int, float]]:
    return [(d["step"], d["loss"]) for d in map(json.loads, path.read_text().splitlines())]


def _torchrun(script: str, root: Path, log: Path, *extra: str) -> None:
    torchrun(["--nproc-per-node", "2", "--standalone", str(REPO / "scripts" / script),
              "--root", str(root / "{node}"), "--steps", "12", "--loss-log", str(log), *extra],
             log.parent / f"torchrun-{uuid.uuid4().hex[:8]}.out")


def _resumes_after_a_node_loss(script: str, tmp_path: Path,
                               straight: list[tuple[int, float]]) -> None:
    """A job stopped after step 7 whose node 1 is then lost (its root wiped: the replacement
    starts empty) resumes from step 6 with the losses of ``straight``, a job that never
    stopped."""
    _torchrun(script, tmp_path / "stopped", tmp_path / "stopped.jsonl", "--stop-after", "7")
    shutil.rmtree(tmp_path / "stopped" / "1")
    _torchrun(script, tmp_path / "stopped", tmp_path / "stopped.jsonl")
    stopped = _losses(tmp_path / "stopped.jsonl")
    assert [s for s, _ in stopped] == [0, 1, 2, 3, 4, 5, 6, 7, 6, 7, 8, 9, 10, 11]  # from 6
    assert stopped[8:] == straight[6:] and stopped[:8] == straight[:8]
    assert any((tmp_path / "stopped" / "1").rglob("iter_0000000012"))


def test_megatron_example_resumes_after_a_node_loss_bit_identical(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core.dist_checkpointing", reason="needs megatron-core")
    _torchrun("megatron_example.py", tmp_path / "straight", tmp_path / "straight.jsonl")
    _resumes_after_a_node_loss("megatron_example.py", tmp_path,
                               _losses(tmp_path / "straight.jsonl"))


def test_ddp_example_resumes_after_a_node_loss_and_rolls_back_bit_identical(
        tmp_path: Path) -> None:
    """The node loss as above; and after the straight run of 12 steps, --rollback-to 6 (kept
    by keep_every=6) discards 9 and 12 and trains from 6 again: the same losses as the first
    time. One straight run serves both (each launch costs seconds of imports)."""
    log = tmp_path / "straight.jsonl"
    _torchrun("ddp_example.py", tmp_path / "straight", log)
    straight = _losses(log)
    assert [s for s, _ in straight] == list(range(12))
    _resumes_after_a_node_loss("ddp_example.py", tmp_path, straight)
    _torchrun("ddp_example.py", tmp_path / "straight", log, "--rollback-to", "6")
    losses = _losses(log)
    assert [s for s, _ in losses] == list(range(12)) + list(range(6, 12))
    assert losses[12:] == losses[6:12]
