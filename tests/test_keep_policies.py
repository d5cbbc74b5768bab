"""Keep policies by metric and predicate, and per-iteration metadata (issue 24, items 3 and 4):
one function (KeepPolicy) for a save's retention and `localckpt gc`; metrics and custom
metadata given at save, rank 0's, stored with the iteration."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_ranks
from test_cli import cli_json, run_cli

from localckpt import ConfigurationError, LocalCheckpointManager
from localckpt.control.retention import KeepPolicy

LOSSES = {1: 3.0, 2: 1.0, 3: 4.0, 4: 2.0, 5: 5.0}


def test_best_k_by_a_metric() -> None:
    metrics = {it: {"loss": v} for it, v in LOSSES.items()}
    assert KeepPolicy(1, best=2, best_metric="loss").keep(LOSSES, metrics=metrics) == {2, 4, 5}
    assert KeepPolicy(1, best=1, best_metric="loss", best_mode="max").keep(
        LOSSES, metrics=metrics) == {5}
    ties = {1: {"loss": 1.0}, 2: {"loss": 1.0}, 3: {"loss": 2.0}}
    assert KeepPolicy(1, best=1, best_metric="loss").keep([1, 2, 3], metrics=ties) == {2, 3}


def test_iterations_without_the_metric() -> None:
    metrics = {1: {"loss": 1.0}, 3: {"acc": 0.5}}
    assert KeepPolicy(1, best=1, best_metric="loss").keep([1, 2, 3, 4], metrics=metrics) == {
        1, 2, 3, 4}  # saved without it: kept by default, as Orbax does
    assert KeepPolicy(1, best=1, best_metric="loss", keep_without_metric=False).keep(
        [1, 2, 3, 4], metrics=metrics) == {1, 4}


def test_predicate_and_union_with_the_other_rules() -> None:
    metrics = {it: {"loss": v} for it, v in LOSSES.items()}
    policy = KeepPolicy(1, every=3, predicate=lambda it, m: m is not None and m["loss"] < 1.5)
    assert policy.keep(LOSSES, metrics=metrics) == {2, 3, 5}
    assert policy.needs_metadata and not KeepPolicy(2, every=3).needs_metadata


def test_unsure_iterations_as_good_as_the_kth_best_are_kept() -> None:
    metrics = {1: {"loss": 1.0}, 2: {"loss": 3.0}, 3: {"loss": 0.5}, 4: {"loss": 2.0}}
    policy = KeepPolicy(1, best=1, best_metric="loss", keep_without_metric=False)
    # 3 is better than the best complete one, and may be complete where gc cannot see
    assert policy.keep([1, 2, 4], unsure=[3], metrics=metrics) == {1, 3, 4}


@pytest.mark.parametrize("kwargs,match", [
    ({"best": 2}, "keep_best and best_metric"),
    ({"best_metric": "loss"}, "keep_best and best_metric"),
    ({"best": 0, "best_metric": "loss"}, "keep_best: expected None or an int >= 1"),
    ({"best": 1, "best_metric": "loss", "best_mode": "median"}, "best_mode"),
    ({"keep_without_metric": 1}, "keep_without_metric"),
    ({"predicate": 3}, "keep_predicate"),
])
def test_bad_policies_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        KeepPolicy(1, **kwargs)


def test_manager_keeps_the_best_and_returns_metadata(root: Path) -> None:
    with LocalCheckpointManager(root, keep_best=2, best_metric="loss") as mgr:
        for it, loss in LOSSES.items():
            mgr.save({"w": torch.full((2,), float(it))}, it, metrics={"loss": loss},
                     custom_metadata={"note": f"step {it}", "tokens": it * 1000})
        assert mgr.iterations() == [2, 4, 5]
        meta = mgr.metadata(4)
        assert meta.pop("saved_unix") > 1.7e9
        assert meta == {"iteration": 4, "custom": {"note": "step 4", "tokens": 4000},
                        "metrics": {"loss": 2.0}}
        mgr.save({"w": torch.zeros(2)}, 6)
        assert {k: v for k, v in mgr.metadata(6).items() if k != "saved_unix"} == {
            "iteration": 6, "custom": None, "metrics": None}
        assert mgr.iterations() == [2, 4, 6]  # 6: without the metric, kept; 5: not the best 2


@pytest.mark.parametrize("kwargs,match", [
    ({"custom_metadata": {"x": object()}}, "custom_metadata: expected JSON-serialisable"),
    ({"custom_metadata": {1: "a"}}, "custom_metadata: expected a dict with str keys"),
    ({"custom_metadata": {"t": (1, 2)}}, "JSON keeps as they are"),
    ({"custom_metadata": {"big": "x" * 70000}}, "at most 65536 bytes"),
    ({"custom_metadata": ["a"]}, "custom_metadata: expected a dict"),
    ({"metrics": {"loss": float("nan")}}, "metrics: expected a dict of str to finite"),
    ({"metrics": {"loss": "low"}}, "metrics: expected"),
])
def test_bad_metadata_is_refused_before_anything_is_written(root: Path, kwargs: dict[str, Any],
                                                            match: str) -> None:
    with LocalCheckpointManager(root) as mgr:
        mgr.save({"w": torch.ones(2)}, 1)
        with pytest.raises(ConfigurationError, match=match):
            mgr.save({"w": torch.zeros(2)}, 2, **kwargs)
        assert mgr.iterations() == [1] and not list(root.glob("*/iter_0000000002"))
        assert torch.equal(mgr.load()[0]["w"], torch.ones(2))


def _save_with_rank_metrics(rank: int, world: int, base: str) -> list[int]:
    with LocalCheckpointManager(Path(base) / f"node{rank}", "job", "node_spread",
                                node_id=f"node{rank}", keep_best=1, best_metric="loss") as mgr:
        for it, loss in LOSSES.items():  # rank 1's losses rank the other way: rank 0's decide
            mgr.save({"w": torch.ones(2)}, it, metrics={"loss": loss if rank == 0 else -loss})
        assert mgr.metadata(2)["metrics"] == {"loss": 1.0}  # rank 0's, on rank 1 too
        return mgr.iterations()


def test_ranks_keep_alike_by_rank_0s_metrics(tmp_path: Path) -> None:
    results = run_ranks(_save_with_rank_metrics, 2, tmp_path, str(tmp_path / "roots"))
    assert [r.value for r in results] == [[2, 5], [2, 5]], [r.message for r in results]
    for node in ("node0", "node1"):
        held = sorted(p.name for p in (tmp_path / "roots" / node / "job").iterdir())
        assert held == ["iter_0000000002", "iter_0000000005"]


def test_cli_shows_metrics_and_gc_keeps_what_the_library_keeps(
        capsys: pytest.CaptureFixture[str], root: Path) -> None:
    with LocalCheckpointManager(root, "job", keep_last=5) as mgr:
        for it, loss in LOSSES.items():
            mgr.save({"w": torch.ones(2)}, it, metrics={"loss": loss},
                     custom_metadata={"run": "a"})
    rows = cli_json(capsys, "ls", str(root))
    assert {r["iteration"]: r["metrics"] for r in rows} == {
        it: {"loss": v} for it, v in LOSSES.items()}
    code, out, _ = run_cli(capsys, "ls", str(root))
    assert code == 0 and "loss=4" in out
    code, out, _ = run_cli(capsys, "inspect", str(next(root.glob("job/iter_0000000003/rank_*"))))
    assert code == 0 and '{"loss": 4.0}' in out and '{"run": "a"}' in out
    code, _, err = run_cli(capsys, "gc", str(root), "--keep-best", "1")
    assert code == 2 and "--metric" in err
    done = cli_json(capsys, "gc", str(root), "--keep-best", "2", "--metric", "loss")
    assert len(done["removed"]) == 2
    assert sorted(int(p.name[5:]) for p in (root / "job").iterdir()) == sorted(
        KeepPolicy(1, best=2, best_metric="loss").keep(
            LOSSES, metrics={it: {"loss": v} for it, v in LOSSES.items()}))
    assert json.loads(json.dumps(rows))  # JSON output stays JSON


def test_one_per_interval_and_what_a_partial_view_keeps() -> None:
    times = {1: 0.0, 2: 50.0, 3: 70.0, 4: 200.0}
    policy = KeepPolicy(1, interval=60)
    assert policy.keep([1, 2, 3, 4], times=times) == {1, 3, 4}  # the first of each minute
    # gc without iteration 1's other shards: 1 may be complete, so it is kept, and so is 2
    assert policy.keep([2, 3, 4], unsure=[1], times=times) >= {1, 3, 4}
    with pytest.raises(ConfigurationError, match="keep_interval"):
        KeepPolicy(1, interval=0)


@pytest.mark.parametrize("interval,time", [(1e-300, 1.8e9), (0.5, 1.7e308)])
def test_an_interval_too_small_for_the_clock_keeps_each_iteration_apart(interval: float,
                                                                         time: float) -> None:
    """keep_interval=1e-300 was accepted, then every retention raised OverflowError (the
    interval's number, floor(inf)), was logged and retried, and nothing was ever deleted:
    keep_last was ignored until the node root filled up (from an attacker review). Times past
    the float range share one interval."""
    times = {1: time, 2: time, 3: time, 4: time}
    assert KeepPolicy(1, interval=interval).keep([1, 2, 3], unsure=[4], times=times) == {1, 3, 4}


def test_manager_keeps_one_per_interval_by_rank_0s_clock(root: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from localckpt.save import prepare

    clock = iter([0.0, 50.0, 70.0, 200.0, 210.0])
    monkeypatch.setattr(prepare, "wall_clock", lambda: next(clock))
    with LocalCheckpointManager(root, keep_interval=60) as mgr:
        for it in range(1, 6):
            mgr.save({"w": torch.ones(2)}, it)
        assert mgr.iterations() == [1, 3, 4, 5]
        assert mgr.metadata(3)["saved_unix"] == 70.0


def _rank0_predicate(rank: int, world: int, base: str) -> dict[str, Any]:
    """Bookkeeping on rank 0 only (a common pattern): the predicate reads what rank 0 filled."""
    protected: set[int] = set()
    with LocalCheckpointManager(Path(base) / f"node{rank}", "job", timeout=30,
                                node_id=f"node{rank}",
                                keep_predicate=lambda it, m: it in protected) as mgr:
        for it in (1, 2, 3, 4):
            mgr.save({"w": torch.full((4,), float(it))}, it)
            if rank == 0 and it == 2:
                protected.add(2)
        return {"iterations": mgr.iterations(),
                "two": float(mgr.load(iteration=2)[0]["w"][0])}


def test_a_predicate_that_answers_differently_per_rank_keeps_what_any_rank_keeps(
        tmp_path: Path) -> None:
    results = run_ranks(_rank0_predicate, 2, tmp_path, str(tmp_path / "roots"))
    assert [r.value for r in results] == [{"iterations": [2, 4], "two": 2.0}] * 2, \
        [r.message for r in results]


def _set_metadata(shard: Path, metadata: Any) -> None:
    """Rewrite a committed shard's manifest metadata with a valid CRC (another writer's)."""
    from localckpt.storage.manifest import _crc_of

    path = shard / "zarr.json"
    doc = json.loads(path.read_text())
    envelope = doc["attributes"]["localckpt"]
    envelope["manifest"]["metadata"] = metadata
    envelope["crc32c"] = _crc_of(envelope["manifest"])
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("metadata", [
    {"metrics": {"loss": 2.0}, "tags": ["a newer writer's key"]},
    {"metrics": {"loss": True, "acc": None, "huge": 10**400}},
    ["not", "a", "dict"],
], ids=["unknown-key", "odd-metrics", "not-a-dict"])
def test_odd_metadata_never_makes_an_intact_shard_corrupt(
        capsys: pytest.CaptureFixture[str], root: Path, metadata: Any) -> None:
    with LocalCheckpointManager(root, "job", keep_last=3) as mgr:
        for it in (1, 2):
            mgr.save({"w": torch.full((4,), float(it))}, it, metrics={"loss": float(it)})
    _set_metadata(next(root.glob("job/iter_0000000002/rank_*")), metadata)
    with LocalCheckpointManager(root, "job", keep_last=1, keep_best=1, best_metric="loss",
                                keep_without_metric=False) as mgr:
        state, (it, _, _) = mgr.load()
        assert it == 2 and state["w"][0] == 2.0  # not quarantined, no fallback
        mgr.save({"w": torch.full((4,), 3.0)}, 3, metrics={"loss": 3.0})
        assert mgr.iterations() == [1, 3]  # the best loss and the newest
    assert run_cli(capsys, "ls", str(root))[0] == 0
    assert run_cli(capsys, "gc", str(root), "--keep-best", "1", "--metric", "loss",
                   "--dry-run")[0] == 0


def test_a_metric_too_large_for_a_float_is_refused_at_save(root: Path) -> None:
    with LocalCheckpointManager(root) as mgr, pytest.raises(ConfigurationError, match="metrics"):
        mgr.save({"w": torch.ones(2)}, 1, metrics={"tokens": 10**400})


def test_a_rolled_back_and_saved_again_iteration_is_judged_by_its_new_metrics(
        root: Path) -> None:
    """keep_best must judge iteration 30 saved again after a rollback by its own loss (0.9),
    not by the discarded save's (0.1): it deleted the true best (20) before."""
    def held() -> list[int]:
        return sorted(int(p.name[5:]) for p in (root / "job").glob("iter_*"))

    with LocalCheckpointManager(root, "job", keep_last=2, keep_best=1,
                                best_metric="loss") as mgr:
        for it, loss in [(10, 0.3), (20, 0.4), (30, 0.1)]:
            mgr.save({"w": torch.full((4,), float(it))}, it, metrics={"loss": loss})
        mgr.load(iteration=20, discard_newer=True)
        mgr.save({"w": torch.full((4,), 30.0)}, 30, metrics={"loss": 0.9})
        for it, loss in [(40, 0.5), (50, 0.6)]:
            mgr.save({"w": torch.full((4,), float(it))}, it, metrics={"loss": loss})
        assert held() == [20, 40, 50]


def test_the_finalize_report_carries_what_the_policy_reads_not_custom_metadata(
        root: Path) -> None:
    """Every finalize sent every held iteration's whole metadata, custom included (up to 64
    KiB each): 2.4 MB per rank after 40 saves with keep_interval, all-gathered every save."""
    import json

    custom = {"notes": "x" * 60_000}
    with LocalCheckpointManager(root, "s", keep_last=1, keep_interval=0.001) as mgr:
        for it in range(1, 11):
            mgr.save({"w": torch.zeros(8)}, it, custom_metadata=custom, metrics={"loss": 1.0})
        doc = mgr._save.retainer.report(mgr._ctx.inventory())
        assert len(doc["metadata"]) == 10
        assert len(json.dumps(doc)) < 10_000, len(json.dumps(doc))
        assert mgr.metadata(3)["custom"] == custom  # still stored, and read where asked
