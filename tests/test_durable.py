"""The durable tier: persist in the background, restore a whole job from it on empty nodes."""

from __future__ import annotations

import json
import shutil
import threading
import time
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
    assert sorted(p.name for p in (durable / "job").iterdir() if p.name.startswith("iter_")) \
        == ["iter_0000000002", "iter_0000000004"]
    assert (_iter_dir(durable, 4) / commit_name(2)).is_file()
    shutil.rmtree(root)  # every node lost, replaced by empty ones
    for r in run_ranks(sc.restore, 2, tmp_path, str(root), str(durable)):
        assert r.ok, r.message
        v = r.value
        assert v["error"] is None, v
        assert v["latest"] == 4 and v["loaded"] == 4 and v["digest"] == v["expected"]
        assert 4 in v["local"]  # fetched into the node root: the local tier holds it again
        assert v["after"] == 100


def test_a_restore_from_the_durable_tier_brings_the_replicas_back_too(
        tmp_path: Path, root: Path) -> None:
    durable = tmp_path / "shared"
    _persist_run(tmp_path, root, durable)
    shutil.rmtree(root)
    for r in run_ranks(sc.restore_and_wait, 2, tmp_path, str(root), str(durable)):
        assert r.ok, r.message
        # node_spread F=2 on two nodes: each node holds both shards again, not only its own
        assert r.value == {"loaded": 4, "held": [(4, 0), (4, 1)]}, r.value


@pytest.mark.parametrize("new_world", [1, 3])
def test_a_whole_job_restarts_from_the_durable_tier_at_another_world_size(
        tmp_path: Path, root: Path, new_world: int) -> None:
    durable = tmp_path / "shared"
    _persist_run(tmp_path, root, durable)  # world 2: iterations 2 and 4 committed
    shutil.rmtree(root)
    results = run_ranks(sc.restore_at_another_world, new_world, tmp_path, str(root),
                        str(durable), 2)
    for r in results:
        assert r.ok, r.message
        v = r.value
        assert v["latest"] == 4 and v["loaded"] == 4, v
        assert v["digest"] == v["expected"], v  # plain state of old rank (rank % 2)
        assert v["failures"] == [], v
        # the fetched old shards went with the node roots' retention once superseded
        assert v["other_world_local"] == [], v
    # keep=1: the new job's newest; the old world's iterations, older than it, went too
    assert results[0].value["complete"] == [(11, new_world)], results[0].value


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

    def slow_put(self: DurableStore, *args: Any) -> Any:
        started.set()
        assert gate.wait(30)
        return real_put(self, *args)
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


def test_durable_retention_keeps_every_nth_as_well(root: Path, tmp_path: Path) -> None:
    with LocalCheckpointManager(root, keep_last=1, durable=DurableTier(
            tmp_path / "d", keep=1, keep_every=2)) as mgr:
        for it in (1, 2, 3, 4, 5):
            mgr.save({"w": torch.full((3,), float(it))}, it)
            assert mgr.wait_for_persist(30)
        assert DurableStore(tmp_path / "d", "", 0).complete(1) == [2, 4, 5]


def test_persist_on_demand(root: Path, tmp_path: Path) -> None:
    with LocalCheckpointManager(root, keep_last=2, durable=DurableTier(
            tmp_path / "d", persist_every=None)) as mgr:
        mgr.save({"w": torch.ones(3)}, 1)
        mgr.save({"w": torch.ones(3)}, 2)
        assert mgr.wait_for_persist(5) and not (tmp_path / "d" / "_default").exists()
        mgr.persist(1)
        assert mgr.wait_for_persist(30)
        with pytest.raises(InvalidIterationError, match="non-negative"):
            mgr.persist("7")  # type: ignore[arg-type]
        mgr.persist(7)  # no shard of 7 here: logged and counted, not raised
        assert mgr.wait_for_persist(30)
        persister = mgr._save.persister
        assert persister is not None and [f[0] for f in persister.failures] == [7]
        mgr.persist(1)  # not newer than 7: ignored
        assert mgr.wait_for_persist(30) and persister.persisted == [1]
        doc = json.loads((tmp_path / "d" / "_default" / "iter_0000000001" /
                          commit_name(1)).read_text())
        assert doc["iteration"] == 1 and set(doc["shards"]) == {"0"}
    with LocalCheckpointManager(root) as plain, pytest.raises(ConfigurationError,
                                                              match="durable tier"):
        plain.persist()


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"root": ""}, "root"), ({"root": 3}, "root"), ({"root": "x", "persist_every": 0},
                                                    "persist_every"),
    ({"root": "x", "keep": 0}, "keep"), ({"root": "x", "keep_every": 0}, "keep_every"),
    ({"root": "x", "commit_timeout": -1}, "commit_timeout"),
    ({"root": "x", "commit_timeout": float("inf")}, "commit_timeout"),
    ({"root": "x", "commit_timeout": True}, "commit_timeout"),
    ({"root": "x", "commit_timeout": float("nan")}, "commit_timeout"),
])
def test_bad_settings_are_refused(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigurationError, match=says):
        DurableTier(**kwargs)


def test_a_numpy_float_commit_timeout_is_accepted() -> None:
    import numpy as np

    assert DurableTier("x", commit_timeout=np.float64(600.0)).commit_timeout == 600.0




@pytest.mark.parametrize("where", ["same", "in-session", "mount-inside", "parent"])
def test_a_durable_directory_overlapping_the_node_root_is_refused(root: Path, tmp_path: Path,
                                                                  where: str) -> None:
    """Refused when one tier's session directory holds the other's (before: accepted; the
    node root's shards counted as persisted, and durable retention (keep=1) deleted what
    keep_last kept); a separate directory inside the node root, or its parent, is another
    copy (each tier writes under <root>/<session> only). Decided without touching the
    durable path: a hung mount must not hang construction."""
    root.mkdir(parents=True, exist_ok=True)
    shared = {"same": root, "in-session": root / "s" / "durable",
              "mount-inside": root / "shared", "parent": root.parent}[where]
    refused = where in ("same", "in-session")
    if refused:
        with pytest.raises(ConfigurationError, match="node root"):
            LocalCheckpointManager(root, "s", durable=DurableTier(shared, keep=1))
    else:
        LocalCheckpointManager(root, "s", durable=DurableTier(shared, keep=1)).close()
    with LocalCheckpointManager(root, "s", keep_last=3) as mgr:  # nothing was taken
        mgr.save({"w": torch.ones(2)}, 1)


def test_the_manager_refuses_another_type(root: Path) -> None:
    with pytest.raises(ConfigurationError, match="DurableTier"):
        LocalCheckpointManager(root, durable="/shared")  # type: ignore[arg-type]


# ---------------------------------------------------------------- from an attacker review


def test_a_rollback_reaches_the_durable_tier(root: Path, tmp_path: Path) -> None:
    durable = DurableTier(tmp_path / "d", keep=5)
    with LocalCheckpointManager(root, keep_last=5, durable=durable) as mgr:
        for it in (1, 2, 3, 4):
            mgr.save({"w": torch.full((3,), float(it))}, it)
            assert mgr.wait_for_persist(30)
        mgr.load(iteration=2, discard_newer=True)
        tier = DurableStore(tmp_path / "d", "", 0)
        assert tier.complete(1) == [1, 2]  # 3 and 4 would come back at the next find_latest
        assert mgr.find_latest() == 2
        mgr.save({"w": torch.full((3,), 30.0)}, 3)  # a new timeline from 2
        assert mgr.wait_for_persist(30)
        assert tier.complete(1) == [1, 2, 3]  # committed, and kept by durable retention
    shutil.rmtree(root)
    with LocalCheckpointManager(root, durable=durable) as fresh:
        assert fresh.find_latest() == 3 and float(fresh.load()[0]["w"][0]) == 30.0


def test_a_corrupt_local_copy_of_the_durable_iteration_is_copied_again(
        tmp_path: Path, root: Path) -> None:
    """Node 1 lost, and node 0's replica of rank 1's shard of 2 too; node 0's own shard of 2
    has the committed manifest and a corrupt chunk. The restore from the durable tier copies
    that shard again instead of keeping it as it was (before: it was kept unchecked, the load
    quarantined it, found no other copy and told the job it could start afresh)."""
    durable = str(tmp_path / "shared")
    for r in run_ranks(sc.save_and_persist, 2, tmp_path, str(root), durable, [1, 2], 1):
        assert r.ok and r.value["persisted"] == [1, 2], (r.value, r.message)
    shutil.rmtree(root / "node1")
    it2 = root / "node0" / "job" / "iter_0000000002"
    shutil.rmtree(it2 / "rank_00001_of_00002")
    _flip_a_byte(it2 / "rank_00000_of_00002" / "data" / "c" / "0")
    for r in run_ranks(sc.restore, 2, tmp_path, str(root), durable):
        assert r.ok and r.value["error"] is None, (r.value, r.message)
        assert r.value["loaded"] == 2 and r.value["digest"] == r.value["expected"], r.value


def _flip_a_byte(chunk: Path) -> None:
    """Damage a chunk file in place: its checksum no longer matches."""
    raw = bytearray(chunk.read_bytes())
    raw[10] ^= 0xFF
    chunk.write_bytes(bytes(raw))


def _persisted_1_and_2_then_lost(root: Path, tmp_path: Path) -> DurableTier:
    """Iterations 1 and 2 saved and persisted, then the node root lost; the tier."""
    durable = DurableTier(tmp_path / "d", keep=5)
    with LocalCheckpointManager(root, durable=durable) as mgr:
        for it in (1, 2):
            mgr.save({"w": torch.full((3,), float(it))}, it)
            assert mgr.wait_for_persist(30)
    shutil.rmtree(root)
    return durable


def test_a_store_failing_every_copy_is_unavailable_not_an_empty_tier(
        root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job lost; the store lists its iterations but every read fails (connection refused):
    DurableTierUnavailableError after the first candidate, not NoCheckpointError after each
    one in turn (which a job may take for "nothing saved" and start afresh)."""
    from localckpt.errors import DurableTierUnavailableError
    from localckpt.storage.durable_dir import DirectoryBackend

    durable = _persisted_1_and_2_then_lost(root, tmp_path)
    tried: list[int] = []

    def refused(self: Any, manifest: Any, index: int, out: Any) -> None:
        tried.append(manifest.iteration)
        raise ConnectionRefusedError("connection refused (injected)")
    monkeypatch.setattr(DirectoryBackend, "fill_chunk", refused)
    with LocalCheckpointManager(root, durable=durable, timeout=5) as fresh, \
            pytest.raises(DurableTierUnavailableError, match="connection refused"):
        fresh.load()
    assert set(tried) == {2}


def test_a_shard_the_tier_refuses_to_read_falls_back_to_an_older_iteration(
        root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PermissionError on one iteration's objects (a wrong umask, a 403 on one key) is that
    iteration's problem, not the store's: the older one is restored, as before."""
    from localckpt.storage.durable_dir import DirectoryBackend

    durable = _persisted_1_and_2_then_lost(root, tmp_path)
    real = DirectoryBackend.fill_chunk

    def refused(self: Any, manifest: Any, index: int, out: Any) -> None:
        if manifest.iteration == 2:
            raise PermissionError(13, "Permission denied (injected)")
        real(self, manifest, index, out)
    monkeypatch.setattr(DirectoryBackend, "fill_chunk", refused)
    with LocalCheckpointManager(root, durable=durable, timeout=5) as fresh:
        state, (iteration, _, _) = fresh.load()
    assert iteration == 1 and float(state["w"][0]) == 1.0


def test_close_returns_after_a_copy_from_a_hung_store_was_given_up(
        root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk read that never returns (a hung mount): the copy is given up after its bound,
    the load falls back, and close() returns (before: it waited for the hung read for good)."""
    from localckpt.storage.durable_dir import DirectoryBackend

    durable = DurableTier(tmp_path / "d", keep=5)
    with LocalCheckpointManager(root, durable=durable, keep_last=2) as mgr:
        for it in (1, 2):
            mgr.save({"w": torch.full((3,), float(it))}, it)
            assert mgr.wait_for_persist(30)
    for shard in root.glob("*/iter_0000000002"):
        shutil.rmtree(shard)  # 2 only in the tier: its copy hangs, 1 loads from here
    release = threading.Event()

    def hung(self: Any, manifest: Any, index: int, out: Any) -> None:
        release.wait(60)
        raise OSError("released")
    monkeypatch.setattr(DirectoryBackend, "fill_chunk", hung)
    closed = threading.Event()
    try:
        fresh = LocalCheckpointManager(root, durable=durable, timeout=1)
        assert fresh.load()[1][0] == 1
        threading.Thread(target=lambda: (fresh.close(), closed.set()), daemon=True).start()
        assert closed.wait(10), "close() hung on the given-up copy"
    finally:
        release.set()


def test_the_rollback_point_itself_can_be_persisted(root: Path, tmp_path: Path) -> None:
    """Rolled back to 3, which was never persisted (only 2 and 4 were): persist(3) copies it
    (before: ignored as 'requested already', and a job lost then restored 2, not 3)."""
    durable = DurableTier(tmp_path / "d", keep=5, persist_every=2)
    with LocalCheckpointManager(root, keep_last=5, durable=durable) as mgr:
        for it in (1, 2, 3, 4):
            mgr.save({"w": torch.full((3,), float(it))}, it)
            assert mgr.wait_for_persist(30)
        tier = DurableStore(tmp_path / "d", "", 0)
        assert tier.complete(1) == [2, 4]
        mgr.load(iteration=3, discard_newer=True)
        mgr.persist(3)
        assert mgr.wait_for_persist(30)
        assert tier.complete(1) == [2, 3]


def test_a_shard_of_another_save_of_the_same_iteration_is_never_committed(
        tmp_path: Path, root: Path) -> None:
    durable = str(tmp_path / "shared")
    # Timeline A: 1 and 2 committed; rank 0's copy of 3 fails, so rank 1's copy of 3 stays
    # there, uncommitted.
    for r in run_ranks(sc.save_timeline, 2, tmp_path, str(root), durable, [1, 2, 3], 0, 0, 3):
        assert r.ok, r.message
    shutil.rmtree(root)  # the job lost; it restarts from 2 and saves 3 again (timeline B),
    # and now rank 1's copy of 3 fails: rank 1's old copy must not be taken for its new one
    results = run_ranks(sc.save_timeline, 2, tmp_path, str(root), durable, [3], 1000, 1, 3)
    for r in results:
        assert r.ok, r.message
        assert r.value["start"] == 2, r.value
    assert 3 in results[0].value["failures"], results[0].value  # rank 0 never committed 3
    shutil.rmtree(root)
    loaded = [r.value for r in run_ranks(sc.restore_timeline, 2, tmp_path, str(root), durable)]
    assert [v["timeline"] for v in loaded] == ["A2", "A2"], loaded


def test_a_stale_local_shard_is_not_taken_for_the_committed_one(
        tmp_path: Path, root: Path) -> None:
    durable = str(tmp_path / "shared")
    for r in run_ranks(sc.save_timeline, 2, tmp_path, str(root), durable, [1, 2, 3], 1000, -1,
                       -1):
        assert r.ok, r.message
    shutil.rmtree(root)
    # node 0 holds its own shard of 3 from another save (timeline A), node 1 nothing
    other = tmp_path / "other"
    for r in run_ranks(sc.local_only_saves, 2, tmp_path, str(other), [3]):
        assert r.ok, r.message
    stale = other / "node0" / "job" / "iter_0000000003" / "rank_00000_of_00002"
    target = root / "node0" / "job" / "iter_0000000003" / "rank_00000_of_00002"
    target.parent.mkdir(parents=True)
    shutil.copytree(stale, target)
    loaded = [r.value for r in run_ranks(sc.restore_timeline, 2, tmp_path, str(root), durable)]
    assert [v["timeline"] for v in loaded] == ["B3", "B3"], loaded


def test_an_older_persist_after_a_newer_one_is_ignored(tmp_path: Path, root: Path) -> None:
    results = run_ranks(sc.persist_older_after_newer, 2, tmp_path, str(root),
                        str(tmp_path / "shared"))
    for r in results:
        assert r.ok, r.message
        assert r.value["persisted"] == [3] and r.value["failures"] == [], r.value
    assert results[0].value["complete"] == [3]  # rank 0's persist ends with the commit


def test_rank_0_gives_up_at_once_on_a_copy_a_rank_went_past(tmp_path: Path,
                                                            root: Path) -> None:
    import time

    from localckpt.storage.store import ShardStore

    with LocalCheckpointManager(root, keep_last=5) as mgr:
        mgr.save({"w": torch.ones(4)}, 1)
    local = ShardStore(root, "", 0)
    tier = DurableStore(tmp_path / "d", "", 0)
    try:
        manifest = tier.put(local, 1, 0, 1)
        save_id = manifest.metadata["save_id"]
        tier.mark_progress(1, "run", 2)  # rank 1 of this run copies 2: it skipped 1
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="went on"):
            tier.commit(1, 2, save_id, wait=60,
                        gone_past=lambda r: tier.progress(r, "run") > 1)
        assert time.monotonic() - started < 10
        assert tier.progress(1, "another run") == -1  # a record of another run says nothing
    finally:
        local.close()
        tier.close()


def test_a_hung_durable_listing_does_not_hold_find_latest(
        root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    with LocalCheckpointManager(root, timeout=2, durable=DurableTier(tmp_path / "d")) as mgr:
        mgr.save({"w": torch.ones(2)}, 1)
        assert mgr.wait_for_persist(30)
        monkeypatch.setattr(DurableStore, "complete_any", lambda self: time.sleep(60))
        started = time.monotonic()
        assert mgr.find_latest() == 1  # the local tier's, after half a timeout
        assert time.monotonic() - started < 5


def test_a_save_fault_point_never_fires_in_a_persist(root: Path, tmp_path: Path) -> None:
    from localckpt.ops import faults

    with LocalCheckpointManager(root, keep_last=5, durable=DurableTier(
            tmp_path / "d", persist_every=None)) as mgr:
        mgr.save({"w": torch.ones(2)}, 1)
        armed = [faults.Fault("local_write", "raise", iteration=1),
                 faults.Fault("before_commit", "raise", iteration=1)]
        faults.arm(*armed)
        try:
            mgr.persist(1)
            assert mgr.wait_for_persist(30)
        finally:
            faults.disarm()
        persister = mgr._save.persister
        assert persister is not None and persister.persisted == [1], persister.failures
        assert [f.times for f in armed] == [1, 1]  # not consumed by the durable copy


def _persisted_run(root: Path, shared: Path) -> Path:
    """Iterations 1-3 of session "run", each persisted to ``shared`` and committed."""
    with LocalCheckpointManager(root, "run", keep_last=3,
                                durable=DurableTier(shared, keep=3)) as mgr:
        for it in (1, 2, 3):
            mgr.save({"w": torch.full((4,), float(it))}, it)
            assert mgr.wait_for_persist(30)
    return shared


def test_the_cli_shows_checks_and_collects_a_durable_root(
        root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from localckpt.ops.cli import main

    shared = _persisted_run(root, tmp_path / "d")
    assert main(["ls", str(shared), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["iteration"], r["durable_committed"]) for r in rows] == [
        (it, [str(shared)]) for it in (1, 2, 3)]
    assert main(["ls", str(root), "--json"]) == 0  # a node root: nothing committed as a job
    assert all(r["durable_committed"] == [] for r in json.loads(capsys.readouterr().out))
    assert main(["verify", str(shared)]) == 0
    capsys.readouterr()
    assert main(["gc", str(shared), "--keep-last", "1", "--json"]) == 0
    capsys.readouterr()
    tier = DurableStore(shared, "run", 0)
    assert tier.complete(1) == [3] and tier.uncommitted() == []  # commit files went first
    with LocalCheckpointManager(tmp_path / "empty", "run",
                                durable=DurableTier(shared)) as fresh:
        assert fresh.find_latest() == 3 and float(fresh.load()[0]["w"][0]) == 3.0


# ---------------------------------------------------------------- a second attacker review


def test_gc_on_a_durable_root_counts_only_committed_iterations(
        root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from localckpt.ops.cli import main

    shared = _persisted_run(root, tmp_path / "d")
    (shared / "run" / "iter_0000000003" / commit_name(1)).unlink()  # 3: copied, not committed
    assert main(["ls", str(shared), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["iteration"], r["complete"]) for r in rows] == [(1, True), (2, True), (3, False)]
    assert main(["gc", str(shared), "--keep-last", "1", "--json"]) == 0
    capsys.readouterr()
    assert DurableStore(shared, "run", 0).complete(1) == [2]  # the newest committed is kept
    with LocalCheckpointManager(tmp_path / "empty", "run",
                                durable=DurableTier(shared)) as fresh:
        assert fresh.find_latest() == 2


def test_saves_after_find_latest_make_the_durable_offer_stale(root: Path,
                                                              tmp_path: Path) -> None:
    durable = DurableTier(tmp_path / "d", keep=5)
    with LocalCheckpointManager(root, keep_last=5, durable=durable) as mgr:
        for it in (1, 2, 3, 4):
            mgr.save({"w": torch.full((3,), float(it))}, it)
            assert mgr.wait_for_persist(30)
    shutil.rmtree(root)
    with LocalCheckpointManager(root, keep_last=5, durable=durable) as mgr:
        assert mgr.find_latest() == 4  # from the durable tier
        mgr.save({"w": torch.full((3,), 50.0)}, 5)  # training went on without loading
        state, (iteration, _, _) = mgr.load()
        assert iteration == 5 and float(state["w"][0]) == 50.0


def test_a_hung_mount_fails_a_rollback_alike_instead_of_hanging_rank_0(
        root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from localckpt.errors import CheckpointingError

    with LocalCheckpointManager(root, keep_last=5, timeout=2,
                                durable=DurableTier(tmp_path / "d", keep=5)) as mgr:
        for it in (1, 2, 3):
            mgr.save({"w": torch.full((3,), float(it))}, it)
            assert mgr.wait_for_persist(30)
        monkeypatch.setattr(DurableStore, "complete_any", lambda self: time.sleep(60))
        started = time.monotonic()
        with pytest.raises(CheckpointingError, match="durable tier"):
            mgr.load(iteration=1, discard_newer=True)
        assert time.monotonic() - started < 10
        # nothing local was discarded
        assert {r.iteration for r in mgr._ctx.store.committed()} == {1, 2, 3}


def test_an_unlistable_durable_tier_with_nothing_local_is_an_error_not_a_fresh_start(
        root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from localckpt.errors import DurableTierUnavailableError

    def unreachable(self: DurableStore) -> list[tuple[int, int]]:
        raise OSError(116, "Stale file handle")
    monkeypatch.setattr(DurableStore, "complete_any", unreachable)
    with LocalCheckpointManager(root, durable=DurableTier(tmp_path / "d")) as mgr, \
            pytest.raises(DurableTierUnavailableError, match="not starting over"):
        mgr.find_latest()
    with LocalCheckpointManager(root, durable=DurableTier(tmp_path / "d")) as mgr:
        mgr.save({"w": torch.ones(2)}, 1)
        assert mgr.find_latest() == 1  # the local tier's, with the durable one unlisted


def test_a_persist_of_a_save_already_there_writes_nothing_again(root: Path,
                                                               tmp_path: Path) -> None:
    shared = tmp_path / "d"
    with LocalCheckpointManager(root, keep_last=2, durable=DurableTier(shared)) as mgr:
        mgr.save({"w": torch.ones(2)}, 1)
        assert mgr.wait_for_persist(30)
    shard = shared / "_default" / "iter_0000000001" / "rank_00000_of_00001"
    before = shard.stat().st_ino
    with LocalCheckpointManager(root, keep_last=2, durable=DurableTier(shared)) as mgr:
        mgr.persist(1)  # a new job asks again: the copy is there, committed
        assert mgr.wait_for_persist(30)
        persister = mgr._save.persister
        assert persister is not None and persister.persisted == [1] and not persister.failures
    assert shard.stat().st_ino == before


def test_a_new_commit_after_a_rollback_is_not_given_up(tmp_path: Path, root: Path) -> None:
    results = run_ranks(sc.rollback_then_save, 2, tmp_path, str(root), str(tmp_path / "shared"))
    for r in results:
        assert r.ok, r.message
        assert r.value["failures"] == [], r.value
    assert 3 in results[0].value["complete"], results[0].value


def test_stale_replicas_of_a_restored_iteration_are_dropped(tmp_path: Path, root: Path) -> None:
    durable = str(tmp_path / "shared")
    b = tmp_path / "b"  # timeline B, persisted: 1-3 committed
    for r in run_ranks(sc.save_timeline, 2, tmp_path, str(b), durable, [1, 2, 3], 1000, -1, -1):
        assert r.ok, r.message
    a = tmp_path / "a"  # timeline A, node roots only
    for r in run_ranks(sc.local_only_saves, 2, tmp_path, str(a), [3]):
        assert r.ok, r.message
    # node 0 holds only A's replica of rank 1's shard of 3; node 1 nothing
    replica = "job/iter_0000000003/rank_00001_of_00002"
    (root / "node0" / replica).parent.mkdir(parents=True)
    shutil.copytree(a / "node0" / replica, root / "node0" / replica)
    loaded = [r.value for r in run_ranks(sc.restore_timeline, 2, tmp_path, str(root), durable)]
    assert [v["timeline"] for v in loaded] == ["B3", "B3"], loaded
    shutil.rmtree(root / "node1")  # node 1 lost again: its shard must not come from A's copy
    loaded = [r.value for r in run_ranks(sc.restore_timeline, 2, tmp_path, str(root), durable)]
    assert [v["timeline"] for v in loaded] == ["B3", "B3"], loaded


def test_a_tier_fault_while_checking_a_local_replica_keeps_the_replica(
        tmp_path: Path, root: Path) -> None:
    """Node 0 holds its healthy replica of rank 1's shard of 3 but not its own shard; 3 comes
    from the durable tier. Reading the tier's manifest of rank 1's shard fails (a tier fault):
    the replica cannot be told from another save's, so it stays (a load resolves copies of two
    saves by their save ids) rather than being deleted as if it were stale."""
    durable = str(tmp_path / "shared")
    b = tmp_path / "b"
    for r in run_ranks(sc.save_timeline, 2, tmp_path, str(b), durable, [1, 2, 3], 1000, -1, -1):
        assert r.ok, r.message
    replica = "job/iter_0000000003/rank_00001_of_00002"
    (root / "node0" / replica).parent.mkdir(parents=True)
    shutil.copytree(b / "node0" / replica, root / "node0" / replica)
    before = (root / "node0" / replica).stat().st_ino
    loaded = [r.value for r in run_ranks(sc.restore_timeline_tier_flaky_for, 2, tmp_path,
                                         str(root), durable, 1)]
    assert [v["timeline"] for v in loaded] == ["B3", "B3"], loaded
    # the same directory, not one the load's replication wrote again after deleting it
    assert (root / "node0" / replica).stat().st_ino == before, "the replica was deleted"


def test_durable_retention_keeps_the_lineage_across_world_sizes(tmp_path: Path,
                                                                root: Path) -> None:
    durable = tmp_path / "shared"
    _persist_run(tmp_path, root, durable)  # world 2: iterations 2 and 4 committed
    shutil.rmtree(root)
    (r,) = run_ranks(sc.restore_at_another_world, 1, tmp_path, str(root), str(durable), 2, 3)
    assert r.ok, r.message
    # keep=3 over the lineage 2, 4, 10, 11: the old world size's 4 is among the newest three
    assert r.value["complete"] == [(4, 2), (10, 1), (11, 1)], r.value


def test_a_job_that_does_not_reshard_leaves_other_world_sizes_in_the_durable_tier(
        tmp_path: Path, root: Path) -> None:
    durable = tmp_path / "shared"
    _persist_run(tmp_path, root, durable)  # world 2: iterations 2 and 4 committed
    with LocalCheckpointManager(tmp_path / "solo", keep_last=1, durable=DurableTier(
            durable, keep=1), session_id="job") as mgr:
        for it in (7, 8):
            mgr.save({"w": torch.full((3,), float(it))}, it)
            assert mgr.wait_for_persist(30)
    # not this job's to judge: a job of 2 ranks may come back to them
    assert DurableStore(durable, "job", 0).complete_any() == [(2, 2), (4, 2), (8, 1)]


def test_a_durable_iteration_that_failed_to_fetch_is_not_offered_again_to_a_resharding_load(
        tmp_path: Path, root: Path) -> None:
    durable = tmp_path / "shared"
    _persist_run(tmp_path, root, durable)  # world 2: 2 and 4
    for r in run_ranks(sc.save_and_persist, 3, tmp_path, str(tmp_path / "w3"), str(durable),
                       [5, 6], 1):  # world 3, no reshard: 5 and 6, the world-2 ones kept
        assert r.ok, r.message
    chunk = sorted((_iter_dir(durable, 6) / "rank_00002_of_00003" / "data" / "c").iterdir())[0]
    data = bytearray(chunk.read_bytes())
    data[3] ^= 1
    chunk.write_bytes(bytes(data))  # 6 cannot be fetched: 5 is the newest that can
    for r in run_ranks(sc.restore_at_another_world, 1, tmp_path, str(tmp_path / "empty"),
                       str(durable), 3):
        assert r.ok, r.message
        assert r.value["loaded"] == 5 and r.value["digest"] == r.value["expected"], r.value


def test_a_fetch_given_up_never_commits_later(root: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy into the node root that its caller stopped waiting for (a hung mount that
    recovers later) must not commit afterwards: it could replace a newer save's shard."""
    import threading
    from functools import partial

    from localckpt.load.from_durable import within
    from localckpt.storage.durable import GiveUp
    from localckpt.storage.durable_dir import DirectoryBackend
    from localckpt.storage.store import ShardStore

    with LocalCheckpointManager(root, "job", chunk_nbytes=4096, durable=DurableTier(
            tmp_path / "d")) as mgr:
        mgr.save({"w": torch.arange(10_000, dtype=torch.float32)}, 1)
        assert mgr.wait_for_persist(30)
    release = threading.Event()
    real = DirectoryBackend.fill_chunk

    def stalled(self: DirectoryBackend, manifest: Any, index: int, out: Any) -> None:
        if index == 0:
            release.wait(30)
        real(self, manifest, index, out)
    monkeypatch.setattr(DirectoryBackend, "fill_chunk", stalled)
    tier = DurableStore(tmp_path / "d", "job", 0)
    fresh = ShardStore(tmp_path / "fresh", "job", writer_rank=0)
    try:
        stop = GiveUp()
        with pytest.raises(TimeoutError):
            within(0.3, partial(tier.get, fresh, 1, 0, 1, stop), stop)
        release.set()  # the mount recovers
        time.sleep(1.0)
        assert fresh.committed() == []  # the copy stopped instead of committing
    finally:
        release.set()
        tier.close()
        fresh.close()


def test_a_forged_deeply_nested_record_is_corrupt_not_a_recursion_error(
        root: Path, tmp_path: Path) -> None:
    from localckpt.errors import CorruptShardError
    from localckpt.storage.durable import PROGRESS_DIR, commit_path

    with LocalCheckpointManager(root, durable=DurableTier(tmp_path / "d")) as mgr:
        mgr.save({"w": torch.ones(2)}, 1)
        assert mgr.wait_for_persist(30)
    tier = DurableStore(tmp_path / "d", "", 0)
    try:
        deep = "[" * 200_000 + "]" * 200_000
        commit_path(tmp_path / "d", "", 1, 1).write_text(deep)
        with pytest.raises(CorruptShardError, match="no valid commit record"):
            tier.commit_record(1, 1)
        tier.mark_progress(0, "run", 1)
        (tmp_path / "d" / "_default" / PROGRESS_DIR / "rank_00000.json").write_text(deep)
        assert tier.progress(0, "run") == -1
    finally:
        tier.close()


def _persisted_1_and_2_then_2_corrupt(root: Path, tmp_path: Path,
                                      keep_last: int) -> DurableTier:
    """One rank: iterations 1 and 2 saved and persisted, the node root keeping ``keep_last``
    of them; then 2's local copy damaged (a chunk). The tier."""
    durable = DurableTier(tmp_path / "d", keep=5)
    with LocalCheckpointManager(root, durable=durable, keep_last=keep_last) as mgr:
        for it in (1, 2):
            mgr.save({"w": torch.full((3000,), float(it))}, it)
            assert mgr.wait_for_persist(30)
    _flip_a_byte(next(root.glob("*/iter_0000000002/rank_00000_of_00001/data/c/0")))
    return durable


def test_the_newest_iteration_corrupt_in_every_local_copy_is_restored_from_the_tier(
        root: Path, tmp_path: Path) -> None:
    """Iterations 1 and 2 persisted; the node root keeps both, but 2's only local copy has a
    corrupt chunk. The load quarantines it and would fall back to 1, although the durable tier
    holds 2 intact: it restores 2 from the tier instead (the newest checkpoint is not lost)."""
    durable = _persisted_1_and_2_then_2_corrupt(root, tmp_path, keep_last=2)
    with LocalCheckpointManager(root, durable=durable, keep_last=2) as fresh:
        state, (iteration, _, _) = fresh.load()
        assert iteration == 2 and torch.equal(state["w"], torch.full((3000,), 2.0))
        assert fresh.find_latest() == 2  # a good copy of it is local again


def test_every_copy_of_a_rank_s_newest_shard_corrupt_is_restored_from_the_tier(
        tmp_path: Path, root: Path) -> None:
    """Two ranks on two nodes, replication factor 2: rank 1's shard of iteration 2 is corrupt in
    both node roots (its own copy and the replica). Every rank loads 2 from the durable tier
    instead of falling back to 1."""
    durable = str(tmp_path / "shared")
    for r in run_ranks(sc.save_and_persist, 2, tmp_path, str(root), durable, [1, 2], 1):
        assert r.ok and r.value["persisted"] == [1, 2], (r.value, r.message)
    copies = sorted(root.glob("node*/job/iter_0000000002/rank_00001_of_00002/data/c/0"))
    assert len(copies) == 2
    for chunk in copies:
        _flip_a_byte(chunk)
    for r in run_ranks(sc.restore, 2, tmp_path, str(root), durable):
        assert r.ok and r.value["error"] is None, (r.value, r.message)
        assert r.value["loaded"] == 2 and r.value["digest"] == r.value["expected"], r.value


def test_the_only_local_iteration_corrupt_is_restored_from_the_tier(
        root: Path, tmp_path: Path) -> None:
    """keep_last=1: the node root holds iteration 2 alone, corrupt; the tier holds 1 and 2.
    The load copies 2 from the tier (it raised CorruptShardError: nothing left locally)."""
    durable = _persisted_1_and_2_then_2_corrupt(root, tmp_path, keep_last=1)
    with LocalCheckpointManager(root, durable=durable, keep_last=1) as fresh:
        state, (iteration, _, _) = fresh.load()
    assert iteration == 2 and torch.equal(state["w"], torch.full((3000,), 2.0))


def test_a_resharding_load_takes_the_newest_iteration_from_the_tier_when_local_copies_fail(
        tmp_path: Path, root: Path) -> None:
    """Two ranks saved and persisted 1 and 2; a job of one rank (reshard=True) restarts on
    node 0, whose copy of rank 0's shard of 2 (the one its plain state comes from) is corrupt.
    The resharding load quarantined it and, with no other local iteration, gave up although the
    tier held 2 intact: it restores 2 from the tier."""
    durable = str(tmp_path / "shared")
    for r in run_ranks(sc.save_and_persist, 2, tmp_path, str(root), durable, [1, 2], 1):
        assert r.ok and r.value["persisted"] == [1, 2], (r.value, r.message)
    (chunk,) = root.glob("node0/job/iter_0000000002/rank_00000_of_00002/data/c/0")
    _flip_a_byte(chunk)
    (r,) = run_ranks(sc.restore_at_another_world, 1, tmp_path, str(root), durable, 2, 5)
    assert r.ok, r.message
    assert r.value["loaded"] == 2 and r.value["digest"] == r.value["expected"], r.value


def test_a_resharding_load_asks_the_tier_again_as_it_falls_back_further(
        tmp_path: Path, root: Path) -> None:
    """Persisted: 2. Local only: 4 and 5, rank 0's shards of both corrupt on node 0. The first
    fallback (from 5 to 4) finds nothing newer in the tier; the second (from 4 to 1) must ask
    again and restore 2, not load 1."""
    durable = str(tmp_path / "shared")
    for r in run_ranks(sc.save_kept, 2, tmp_path, str(root), durable, [1, 2], 2):
        assert r.ok, r.message
    for d in root.glob("node*/job/iter_0000000002"):
        shutil.rmtree(d)
    for r in run_ranks(sc.save_kept, 2, tmp_path, str(root), durable, [4, 5], None):
        assert r.ok, r.message
    for it in (4, 5):
        _flip_a_byte(next(root.glob(f"node0/job/iter_{it:010d}/rank_00000_of_00002/data/c/0")))
    (r,) = run_ranks(sc.restore_resharding_on_node0, 1, tmp_path, str(root), durable)
    assert r.ok and r.value == {"loaded": 2}, (r.value, r.message)


def test_a_resharding_load_with_nothing_left_and_the_tier_failing_says_unavailable(
        tmp_path: Path, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks persisted 1 and 2; on node 0 only 2 is left, rank 0's shard of it corrupt, and
    the tier lists its iterations but every read fails. A one-rank resharding job must raise
    DurableTierUnavailableError ("retry once the store is back"), not CorruptShardError."""
    from localckpt.errors import DurableTierUnavailableError
    from localckpt.storage.durable_dir import DirectoryBackend

    durable = str(tmp_path / "shared")
    for r in run_ranks(sc.save_and_persist, 2, tmp_path, str(root), durable, [1, 2], 1):
        assert r.ok and r.value["persisted"] == [1, 2], (r.value, r.message)
    for d in root.glob("node0/job/iter_0000000001"):
        shutil.rmtree(d)
    _flip_a_byte(next(root.glob("node0/job/iter_0000000002/rank_00000_of_00002/data/c/0")))

    def refused(self: Any, manifest: Any, index: int, out: Any) -> None:
        raise ConnectionRefusedError("connection refused (injected)")
    monkeypatch.setattr(DirectoryBackend, "fill_chunk", refused)
    with LocalCheckpointManager(root / "node0", "job", timeout=5, chunk_nbytes=8192,
                                node_id="node0", reshard=True,
                                durable=DurableTier(durable, keep=5)) as mgr, \
            pytest.raises(DurableTierUnavailableError, match="connection refused"):
        mgr.load()


def test_durable_retention_never_deletes_what_it_just_committed_for_a_newer_number(
        root: Path, tmp_path: Path) -> None:
    """Retention ranked the tier's iterations by number alone: after a load fell back past a
    damaged durable 3 to a local 1, the new run's commit of 2 was deleted at once in favour of
    the unloadable 3 (keep=1), and a node loss then found nothing to restore."""
    durable = tmp_path / "shared"
    tier = DurableTier(durable, keep=1)
    with LocalCheckpointManager(root, durable=tier, keep_last=5) as mgr:
        for it in (1, 2, 3):
            mgr.save({"w": torch.full((3,), float(it))}, it)
            assert mgr.wait_for_persist(30)
    for it in (2, 3):  # the node root lost its newer iterations
        shutil.rmtree(root / "_default" / f"iter_{it:010d}")
    chunk = sorted((durable / "_default" / "iter_0000000003").rglob("c/*"))[-1]
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with LocalCheckpointManager(root, durable=tier, keep_last=5, timeout=5) as mgr:
        assert mgr.load()[1][0] == 1  # the tier's 3 is unusable
        mgr.save({"w": torch.full((3,), 20.0)}, 2)
        assert mgr.wait_for_persist(30)
    shutil.rmtree(root)  # the node is lost
    with LocalCheckpointManager(root, durable=tier, timeout=5) as mgr:
        state, (it, _, _) = mgr.load()
    assert it == 2 and torch.equal(state["w"], torch.full((3,), 20.0))


def test_durable_retention_removes_what_a_crash_left_hidden(root: Path, tmp_path: Path) -> None:
    """A deletion killed between its rename and its rmtree left a whole shard in the tier's
    session as .trash-*, which no later run removed."""
    durable = tmp_path / "shared"
    tier = DurableTier(durable, keep=1)
    with LocalCheckpointManager(root, durable=tier, keep_last=2) as mgr:
        mgr.save({"w": torch.ones(1000)}, 1)
        assert mgr.wait_for_persist(30)
        leftover = durable / "_default" / ".trash-iter_0000000000-rank_00000_of_00001-w00000-x"
        (leftover / "data").mkdir(parents=True)
        (leftover / "data" / "0").write_bytes(b"x" * 4096)
        mgr.save({"w": torch.ones(1000)}, 2)
        assert mgr.wait_for_persist(30)
    assert not leftover.exists()


def test_a_rollback_a_node_died_in_never_comes_back_from_the_durable_tier(
        tmp_path: Path, root: Path) -> None:
    """Rank 1 is killed right after writing its rollback fence, before anything was discarded
    anywhere (the durable tier still commits 3). The restarted job must load 2, not the
    tier's 3, and its next save finishes the rollback there too."""
    durable = tmp_path / "shared"
    results = run_ranks(sc.save_keeping_all, 2, tmp_path, str(root), str(durable))
    assert all(r.ok for r in results), [r.message for r in results]
    old = DurableStore(durable, "job", 0)
    try:
        discarded = old.commit_record(3, 2)["save_id"]
    finally:
        old.close()
    run_ranks(sc.rollback_dies_at_fence, 2, tmp_path, str(root), str(durable))
    for r in run_ranks(sc.restart_save, 2, tmp_path, str(root), str(durable)):
        assert r.ok, r.message
        assert r.value == {"loaded": 2, "identical": True}, r.value
    tier = DurableStore(durable, "job", 0)
    try:  # the discarded 3 went before the new one was persisted
        assert tier.complete_any() == [(1, 2), (2, 2), (3, 2)]
        assert tier.commit_record(3, 2)["save_id"] != discarded
    finally:
        tier.close()


def test_a_panic_in_a_persist_fails_that_persist_not_every_later_one(
        root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The persist thread caught Exception only: a BaseException from the store's client (a
    pyo3 PanicException from obstore is one) ended the thread, and every later request then
    waited for ever (wait_for_persist always False, rollbacks failing)."""
    class Panic(BaseException):
        pass

    real = DurableStore.put
    calls = []

    def put(self: DurableStore, *args: Any, **kwargs: Any) -> Any:
        calls.append(args[1])
        if len(calls) == 1:
            raise Panic("the client panicked")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DurableStore, "put", put)
    with LocalCheckpointManager(root, keep_last=2, durable=DurableTier(tmp_path / "d")) as mgr:
        mgr.save({"w": torch.ones(3)}, 1)
        assert mgr.wait_for_persist(30)
        mgr.save({"w": torch.ones(3)}, 2)
        assert mgr.wait_for_persist(30)
        persister = mgr._save.persister
        assert persister is not None and persister.persisted == [2]
        assert [f[0] for f in persister.failures] == [1] and "Panic" in persister.failures[0][1]


def test_a_rank_that_never_delivers_leaves_a_bounded_uncommitted_trail(
        tmp_path: Path, root: Path) -> None:
    """Uncommitted iterations were removed only after a successful commit: a rank whose copies
    always fail left the other ranks' shards of every persist in the tier, without bound."""
    durable = tmp_path / "shared"
    results = run_ranks(sc.one_rank_never_delivers, 2, tmp_path, str(root), str(durable))
    assert all(r.ok for r in results) and results[1].value == 4, [r.message for r in results]
    left = sorted(p.name for p in (durable / "job").glob("iter_*"))
    assert len(left) <= 2, left


def test_a_commit_wait_stops_at_its_deadline_within_a_pass(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The deadline was checked only between passes; a pass reads every copy not confirmed
    yet, each as slow as the store, so a slow store overran commit_timeout many times over."""
    import time

    tier = DurableStore(tmp_path / "d", "", 0)
    monkeypatch.setattr(DurableStore, "shards_present", lambda self, it, w: list(range(w)))

    def slow(self: DurableStore, *args: Any) -> Any:
        time.sleep(0.2)
        raise FileNotFoundError("not there yet")

    monkeypatch.setattr(DurableStore, "read_with_digest", slow)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="not there after"):
        tier.commit(1, 20, "save", wait=0.5, poll=0.01)
    assert time.monotonic() - started < 1.5
    tier.close()
