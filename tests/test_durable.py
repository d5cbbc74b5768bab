"""The durable tier: persist in the background, restore a whole job from it on empty nodes."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import durable_scenarios as sc
import pytest
import torch
from dist_harness import run_ranks

from localckpt import DurableTier, LocalCheckpointManager
from localckpt.errors import ConfigurationError, InvalidIterationError
from localckpt.storage.durable import DurableStore, commit_name


def _persist_run(tmp_path: Path, roots: Path, durable: Path) -> list[Any]:
    results = run_ranks(sc.save_and_persist, 2, tmp_path, str(roots), str(durable),
                        [1, 2, 3, 4, 5], 2)
    for r in results:
        assert r.ok, r.message
        assert r.value["idle"] and r.value["failures"] == [], r.value
    return [r.value for r in results]


def _iter_dir(durable: Path, iteration: int) -> Path:
    return durable / "job" / f"iter_{iteration:010d}"


def test_a_whole_job_lost_restarts_on_empty_nodes_from_the_durable_tier(
        tmp_path: Path, root: Path) -> None:
    durable = tmp_path / "shared"
    values = _persist_run(tmp_path, root, durable)
    # every 2nd finalized save (2 and 4), the newest 2 complete kept
    assert all(v["persisted"] == [2, 4] for v in values), values
    assert sorted(p.name for p in (durable / "job").iterdir()) == [
        "iter_0000000002", "iter_0000000004"]
    assert (_iter_dir(durable, 4) / commit_name(2)).is_file()
    shutil.rmtree(root)  # every node lost, replaced by empty ones
    for r in run_ranks(sc.restore, 2, tmp_path, str(root), str(durable)):
        assert r.ok, r.message
        v = r.value
        assert v["error"] is None, v
        assert v["latest"] == 4 and v["loaded"] == 4 and v["digest"] == v["expected"]
        assert 4 in v["local"]  # fetched into the node root: the local tier holds it again
        assert v["after"] == 100


def test_the_persisted_form_is_a_zarr_group_plain_zarr_reads(tmp_path: Path, root: Path) -> None:
    import zarr

    durable = tmp_path / "shared"
    _persist_run(tmp_path, root, durable)
    group = zarr.open_group(str(_iter_dir(durable, 4) / "rank_00001_of_00002"), mode="r")
    assert list(group.array_keys())


def test_the_local_tier_is_preferred_when_it_is_as_new(tmp_path: Path, root: Path) -> None:
    durable = tmp_path / "shared"
    _persist_run(tmp_path, root, durable)  # local: 5 (keep_last=1); durable: 2, 4
    for r in run_ranks(sc.restore, 2, tmp_path, str(root), str(durable)):
        assert r.ok, r.message
        assert r.value["latest"] == 5 and r.value["loaded"] == 5, r.value


@pytest.mark.parametrize("damage", ["uncommitted", "corrupt_chunk", "shard_replaced"])
def test_a_damaged_newest_durable_iteration_falls_back_to_the_older_one(
        tmp_path: Path, root: Path, damage: str) -> None:
    durable = tmp_path / "shared"
    _persist_run(tmp_path, root, durable)
    newest = _iter_dir(durable, 4)
    if damage == "uncommitted":  # killed before rank 0 committed it
        (newest / commit_name(2)).unlink()
    elif damage == "corrupt_chunk":
        chunk = sorted((newest / "rank_00001_of_00002" / "data" / "c").rglob("*"))[-1]
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2] ^= 0xFF
        chunk.write_bytes(bytes(data))
    else:  # a shard that is not the one the commit names (copied over later)
        shutil.rmtree(newest / "rank_00001_of_00002")
        shutil.copytree(_iter_dir(durable, 2) / "rank_00001_of_00002",
                        newest / "rank_00001_of_00002")
    shutil.rmtree(root)
    for r in run_ranks(sc.restore, 2, tmp_path, str(root), str(durable)):
        assert r.ok, r.message
        v = r.value
        assert v["loaded"] == 2 and v["digest"] == v["expected"], v
        assert 4 not in v["local"], v  # no incomplete copy of 4 left in a node root


def test_an_unreachable_durable_tier_never_stops_training(tmp_path: Path, root: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the mount should be")
    durable = blocker / "shared"
    results = run_ranks(sc.save_and_persist, 2, tmp_path, str(root), str(durable), [1, 2, 3], 1)
    for r in results:
        assert r.ok, r.message
        assert r.value["latest"] == 3 and r.value["persisted"] == [], r.value
        assert r.value["failures"], r.value  # logged and counted, not raised
    for r in run_ranks(sc.restore, 2, tmp_path, str(root), str(durable)):
        assert r.ok, r.message
        assert r.value["loaded"] == 3 and r.value["digest"] == r.value["expected"]


def test_nothing_anywhere_is_a_clear_error(tmp_path: Path, root: Path) -> None:
    for r in run_ranks(sc.restore, 2, tmp_path, str(root), str(tmp_path / "empty")):
        assert r.ok, r.message
        assert r.value["latest"] == -1 and "NoCheckpointError" in r.value["error"]["bases"]


# ---------------------------------------------------------------- one process


def test_a_request_while_one_runs_replaces_the_one_waiting(
        root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate, started = threading.Event(), threading.Event()
    real_put = DurableStore.put

    def slow_put(self: DurableStore, *args: Any) -> None:
        started.set()
        assert gate.wait(30)
        real_put(self, *args)
    monkeypatch.setattr(DurableStore, "put", slow_put)
    with LocalCheckpointManager(root, keep_last=1,
                                durable=DurableTier(tmp_path / "d", keep=5)) as mgr:
        mgr.save({"w": torch.ones(3)}, 1)
        assert started.wait(30)
        for it in (2, 3, 4):
            mgr.save({"w": torch.full((3,), float(it))}, it)
            # the iteration still being copied stays in the node root (keep_last=1), and so
            # does the one waiting when the save was finalized
            assert {1, it} <= {r.iteration for r in mgr._ctx.store.committed()} <= {
                1, it - 1, it}
        gate.set()
        assert mgr.wait_for_persist(30)
        persister = mgr._save.persister
        assert persister is not None and persister.persisted == [1, 4]  # 2, 3 replaced
        assert DurableStore(tmp_path / "d", "", 0).complete(1) == [1, 4]
        mgr.save({"w": torch.zeros(3)}, 5)  # 1 is no longer pinned: retention removes it
        assert mgr.wait_for_persist(30)
        assert {r.iteration for r in mgr._ctx.store.committed()} == {5}


def test_persist_on_demand(root: Path, tmp_path: Path) -> None:
    with LocalCheckpointManager(root, keep_last=2, durable=DurableTier(
            tmp_path / "d", persist_every=None)) as mgr:
        mgr.save({"w": torch.ones(3)}, 1)
        mgr.save({"w": torch.ones(3)}, 2)
        assert mgr.wait_for_persist(5) and not (tmp_path / "d" / "_default").exists()
        mgr.persist(1)
        assert mgr.wait_for_persist(30)
        with pytest.raises(InvalidIterationError, match="holds"):
            mgr.persist(7)
        doc = json.loads((tmp_path / "d" / "_default" / "iter_0000000001" /
                          commit_name(1)).read_text())
        assert doc["iteration"] == 1 and set(doc["shards"]) == {"0"}
    with LocalCheckpointManager(root) as plain, pytest.raises(ConfigurationError,
                                                              match="durable tier"):
        plain.persist()


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"root": ""}, "root"), ({"root": 3}, "root"), ({"root": "x", "persist_every": 0},
                                                    "persist_every"),
    ({"root": "x", "keep": 0}, "keep"), ({"root": "x", "commit_timeout": -1}, "commit_timeout"),
])
def test_bad_settings_are_refused(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigurationError, match=says):
        DurableTier(**kwargs)


def test_the_manager_refuses_another_type(root: Path) -> None:
    with pytest.raises(ConfigurationError, match="DurableTier"):
        LocalCheckpointManager(root, durable="/shared")  # type: ignore[arg-type]
