"""The PyTorch Lightning drop-in (issue 20, item 2): LocalCkptIO and LocalCkptDDPStrategy."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pytorch_lightning.utilities.parsing import AttributeDict

from localckpt import ConfigurationError, LocalCheckpointManager, NoCheckpointError
from localckpt.integrations import lightning as pl_io
from localckpt.integrations.lightning import LATEST, LocalCkptIO

REPO = Path(__file__).resolve().parent.parent


def _checkpoint(step: int) -> dict[str, object]:
    return {"global_step": step, "epoch": 0, "state_dict": {"w": torch.full((3,), float(step))},
            "hyper_parameters": AttributeDict(lr=0.1, nested=AttributeDict(depth=2)),
            "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}]}


def test_saves_loads_and_keeps_markers(root: Path, tmp_path: Path,
                                       caplog: pytest.LogCaptureFixture) -> None:
    io = LocalCkptIO(root, "job", keep_last=2)
    with pytest.raises(NoCheckpointError):
        io.load_checkpoint(LATEST)
    io.save_checkpoint(_checkpoint(4), tmp_path / "epoch=0-step=4.ckpt")
    io.save_checkpoint(_checkpoint(4), tmp_path / "last.ckpt")  # same step: a marker only
    io.save_checkpoint(_checkpoint(6), tmp_path / "epoch=1-step=6.ckpt")
    io.remove_checkpoint(tmp_path / "epoch=0-step=4.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=1-step=6.ckpt", "last.ckpt"]
    assert json.loads((tmp_path / "last.ckpt").read_text())["iteration"] == 4
    io.teardown()
    assert sorted(p.name for p in (root / "job").iterdir()) == ["iter_0000000004",
                                                               "iter_0000000006"]
    io = LocalCkptIO(root, "job")
    loaded = io.load_checkpoint(LATEST)
    assert loaded["global_step"] == 6 and torch.equal(loaded["state_dict"]["w"],
                                                      torch.full((3,), 6.0))
    assert loaded["hyper_parameters"] == {"lr": 0.1, "nested": {"depth": 2}}
    with caplog.at_level(logging.WARNING, logger=pl_io.__name__):
        assert io.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 6
    assert "names iteration 4; loaded the newest complete one, 6" in caplog.text
    io.teardown()


def test_bad_arguments_are_clear_errors(root: Path) -> None:
    with pytest.raises(ConfigurationError, match="a root or a manager_factory"):
        LocalCkptIO()
    with pytest.raises(ConfigurationError, match="a root or a manager_factory"):
        LocalCkptIO(root, manager_factory=lambda: LocalCheckpointManager(root))
    io = LocalCkptIO(root)
    with pytest.raises(ConfigurationError, match="'global_step'"):
        io.save_checkpoint({"state_dict": {}}, root / "x.ckpt")
    io.teardown()


def test_lightnings_ddp_strategy_is_refused_before_any_collective(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's DDPStrategy calls the plugin on rank 0 alone: a collective save there would
    wait for ranks that never come. The plugin says so at once instead."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    io = LocalCkptIO(root)
    with pytest.raises(ConfigurationError, match="LocalCkptDDPStrategy"):
        io.save_checkpoint(_checkpoint(1), root / "x.ckpt")
    assert not (root / "x.ckpt").exists()


def _example(tmp: Path, epochs: int, *extra: str) -> dict[str, object]:
    report = tmp / f"report-{epochs}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
         str(REPO / "scripts" / "lightning_example.py"), "--root", str(tmp / "node{node}"),
         "--markers", str(tmp / "markers"), "--epochs", str(epochs), "--report", str(report),
         *extra], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(report.read_text())  # type: ignore[no-any-return]


def test_ddp_job_resumes_after_a_node_loss_bit_identical(tmp_path: Path) -> None:
    """scripts/lightning_example.py under torchrun (2 ranks on 2 simulated nodes, async saves):
    a job stopped after 2 epochs whose node 1 is then wiped resumes from the markers' "last"
    and ends with the weights of a job that never stopped."""
    straight = _example(tmp_path / "straight", 4)
    _example(tmp_path / "stopped", 2, "--async-save")
    shutil.rmtree(tmp_path / "stopped" / "node1")
    resumed = _example(tmp_path / "stopped", 4, "--async-save")
    assert straight["resumed_from"] is None and resumed["resumed_from"] == 8
    assert resumed["global_step"] == straight["global_step"] == 16
    assert resumed["digest"] == straight["digest"]
    assert (tmp_path / "stopped" / "node1" / "lightning-example" / "iter_0000000016").is_dir()
