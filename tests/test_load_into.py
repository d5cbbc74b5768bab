"""load(into=state_dict): saved tensors land in the caller's tensors in place (same objects,
no allocation on CPU), with a fresh tensor wherever the caller's does not fit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import into_scenarios
import torch
from dist_harness import run_ranks

from localckpt import LocalCheckpointManager


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(300, 200, generator=g),
                      "b": torch.randn(200, generator=g).to(torch.bfloat16),
                      "mask": torch.rand(40, generator=g) > 0.5},
            "optimizer": {"state": {0: {"step": torch.tensor(7.0),
                                        "exp_avg": torch.randn(300, 200, generator=g)}},
                          "param_groups": [{"lr": 0.1, "params": [0]}]},
            "step": 7}


def _zeros_like(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_zeros_like(v) for v in state]
    return torch.zeros_like(state) if isinstance(state, torch.Tensor) else state


def test_tensors_are_loaded_into_the_callers_own(root: Path) -> None:
    saved = _state(1)
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save(saved, 1)
    template = _zeros_like(saved)
    template["model"]["b"] = torch.zeros(199, dtype=torch.bfloat16)  # another shape: not used
    wrong_shape = template["model"]["b"]
    with LocalCheckpointManager(root, "s") as mgr:
        loaded, ckpt = mgr.load(into=template)
    assert ckpt[0] == 1
    for path in (("model", "w"), ("model", "mask"), ("optimizer", "state", 0, "exp_avg"),
                 ("optimizer", "state", 0, "step")):
        got, mine, want = loaded, template, saved
        for k in path:
            got, mine, want = got[k], mine[k], want[k]
        assert got is mine and torch.equal(got, want), path  # the caller's tensor, filled
    assert loaded["model"]["b"] is not wrong_shape and torch.equal(loaded["model"]["b"],
                                                                     saved["model"]["b"])
    assert torch.count_nonzero(wrong_shape) == 0  # left alone
    assert loaded["step"] == 7 and loaded["optimizer"]["param_groups"] == [{"lr": 0.1,
                                                                             "params": [0]}]


def test_tensors_sharing_memory_are_not_read_into(root: Path) -> None:
    saved = {"embed": torch.randn(64, 32), "head": torch.randn(64, 32), "x": torch.randn(5)}
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save(saved, 1)
    tied = torch.zeros(64, 32)
    template = {"embed": tied, "head": tied, "x": torch.zeros(5)}
    with LocalCheckpointManager(root, "s") as mgr:
        loaded, _ = mgr.load(into=template)
    assert loaded["x"] is template["x"]
    assert loaded["embed"] is not tied and loaded["head"] is not tied
    assert torch.equal(loaded["embed"], saved["embed"]) and torch.equal(loaded["head"],
                                                                          saved["head"])


def test_only_overlapping_destinations_are_left_out(root: Path) -> None:
    saved = {"a": torch.randn(10), "b": torch.randn(10), "c": torch.randn(10),
             "d": torch.randn(70)}
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save(saved, 1)
    base = torch.zeros(100)
    into = {"a": base[0:10], "b": base[10:20], "c": base[15:25], "d": base[30:100]}
    with LocalCheckpointManager(root, "s") as mgr:
        loaded, _ = mgr.load(into=into)
    assert [loaded[k] is into[k] for k in "abcd"] == [True, False, False, True]
    assert all(torch.equal(loaded[k], saved[k]) for k in "abcd")


def test_a_node_loss_restore_receives_into_the_callers_tensors(tmp_path: Path,
                                                               root: Path) -> None:
    assert all(r.ok for r in run_ranks(into_scenarios.save, 2, tmp_path, str(root)))
    import shutil
    shutil.rmtree(root / "node1")
    for r in run_ranks(into_scenarios.load_into, 2, tmp_path, str(root), -1):
        assert r.ok, r.message
        assert r.value == {"identical": True, "in_place": True}


def test_a_bad_into_on_one_rank_is_the_same_error_on_every_rank(tmp_path: Path,
                                                                root: Path) -> None:
    assert all(r.ok for r in run_ranks(into_scenarios.save, 2, tmp_path, str(root)))
    for r in run_ranks(into_scenarios.load_into, 2, tmp_path, str(root), 1):
        assert r.raised("TypeError"), (r.error, r.message)
        assert "rank 1" in r.message and "object" in r.message
