"""Retention's one function (KeepPolicy) and the two places that use it: a save's finalize and
``localckpt gc`` (issue 20, item 4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_cli import _present, _shard, cli_json, run_cli

from localckpt import ConfigurationError, LocalCheckpointManager
from localckpt.control.retention import KeepPolicy


def test_keep_last_only() -> None:
    assert KeepPolicy(2).keep([1, 5, 3, 4]) == {4, 5}
    assert KeepPolicy(1).keep([]) == set()


def test_keep_every_is_the_union_with_the_last_k() -> None:
    assert KeepPolicy(2, every=10).keep(range(1, 36)) == {10, 20, 30, 34, 35}
    assert KeepPolicy(1, every=1).keep([3, 7]) == {3, 7}
    assert KeepPolicy(1, every=1000).keep([0, 5, 999]) == {999}  # 0 is no 1000th iteration
    # the newest complete iteration is kept whatever it is a multiple of
    assert 33 in KeepPolicy(1, every=10).keep([10, 20, 33])


def test_unsure_iterations_are_kept_when_the_policy_could_keep_them() -> None:
    policy = KeepPolicy(2, every=5)
    # complete in view: 8 and 10; 9 may be complete elsewhere (so among the last 2), 11 may be a
    # save in progress, 5 is a multiple of 5; 6 is older than the oldest of the last 2
    assert policy.keep([8, 10], unsure=[5, 6, 9, 11]) == {5, 8, 9, 10, 11}
    assert KeepPolicy(3).keep([8], unsure=[2, 9]) == {2, 8, 9}  # fewer than 3 complete: all


@pytest.mark.parametrize("last,every", [(0, None), (1, 0), (1, -5), (1, 2.0), (True, None)])
def test_bad_values_are_refused(last: object, every: object) -> None:
    with pytest.raises(ConfigurationError, match="keep_"):
        KeepPolicy(last, every)  # type: ignore[arg-type]


def test_manager_keeps_every_nth(root: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"keep_every: expected None or an int >= 1"):
        LocalCheckpointManager(root, keep_every=0)
    with LocalCheckpointManager(root, keep_last=2, keep_every=3) as mgr:
        for it in range(1, 11):
            mgr.save({"w": torch.full((4,), float(it))}, it)
    present = sorted(int(p.name[5:]) for p in root.glob("*/iter_*"))
    assert present == [3, 6, 9, 10]
    with LocalCheckpointManager(root) as mgr:
        assert mgr.find_latest() == 10


def test_gc_keep_every_matches_the_library(capsys: pytest.CaptureFixture[str],
                                           tmp_path: Path) -> None:
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    for it in range(1, 9):
        _shard(node0, it, 0, 2)
        if it != 7:  # 7 is incomplete in view (rank 1's shard may live on a root not given)
            _shard(node1, it, 1, 2)
    code, _, err = run_cli(capsys, "gc", str(node0), "--keep-every", "0")
    assert code == 2 and "--keep-every" in err
    cli_json(capsys, "gc", str(node0), str(node1), "--keep-last", "1", "--keep-every", "4")
    assert sorted({it for it, _ in _present(node0, node1)}) == [4, 8]
    assert KeepPolicy(1, 4).keep(range(1, 9)) == {4, 8}


@pytest.mark.parametrize("stray", ["rank_00003_of_00001", "rank_00000_of_00000"])
def test_a_stray_shard_name_no_job_could_write_does_not_stop_retention(root: Path,
                                                                       stray: str) -> None:
    with LocalCheckpointManager(root, keep_last=1) as mgr:
        mgr.save({"w": torch.ones(4)}, 1)
        (root / "_default" / "iter_0000000001" / stray).mkdir()
        for it in range(2, 5):
            mgr.save({"w": torch.full((4,), float(it))}, it)
    shards = sorted(p.relative_to(root / "_default").as_posix()
                    for p in root.glob("_default/iter_*/rank_*"))
    assert shards == [f"iter_0000000001/{stray}", "iter_0000000004/rank_00000_of_00001"]
    with LocalCheckpointManager(root) as mgr:
        assert mgr.find_latest() == 4


def test_one_shard_that_cannot_be_deleted_does_not_keep_the_others(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from localckpt.storage.store import ShardStore

    real = ShardStore.delete

    def busy_for_1(self: ShardStore, ref: object, background: bool = False) -> None:
        if getattr(ref, "iteration", None) == 1:
            raise OSError(errno.EBUSY, "Device or resource busy")
        real(self, ref, background)  # type: ignore[arg-type]

    monkeypatch.setattr(ShardStore, "delete", busy_for_1)
    with LocalCheckpointManager(root, keep_last=1) as mgr:
        for it in range(1, 5):
            mgr.save({"w": torch.full((4,), float(it))}, it)
    assert sorted(p.name for p in root.glob("_default/iter_*")) == [
        "iter_0000000001", "iter_0000000004"]
