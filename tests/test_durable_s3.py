"""The durable tier in object storage: an S3-protocol server the tests start on 127.0.0.1."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import durable_scenarios as sc
import pytest
import torch
from dist_harness import run_ranks

from localckpt import DurableTier, LocalCheckpointManager
from localckpt.errors import ConfigurationError
from localckpt.storage.durable import DurableStore, commit_name

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _objects(s3: Any, bucket: str, prefix: str = "") -> dict[str, int]:
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}


def _persist_run(s3: Any, tmp_path: Path, roots: Path, url: str) -> list[Any]:
    results = run_ranks(sc.save_and_persist, 2, tmp_path, str(roots), url, [1, 2, 3, 4, 5], 2,
                        env=s3.env)
    for r in results:
        assert r.ok, r.message
        assert r.value["idle"] and r.value["failures"] == [], r.value
    return [r.value for r in results]


def _iter_key(iteration: int) -> str:
    return f"ckpt/job/iter_{iteration:010d}"


def test_a_whole_job_lost_restarts_on_empty_nodes_from_a_bucket(
        s3: Any, tmp_path: Path, root: Path) -> None:
    import shutil

    bucket = s3.bucket()
    url = f"s3://{bucket}/ckpt"
    values = _persist_run(s3, tmp_path, root, url)
    assert all(v["persisted"] == [2, 4] for v in values), values
    keys = _objects(s3, bucket)
    assert {k.split("/")[2] for k in keys if "/iter_" in k} == {"iter_0000000002",
                                                                "iter_0000000004"}
    assert f"{_iter_key(4)}/{commit_name(2)}" in keys
    shutil.rmtree(root)  # every node lost, replaced by empty ones
    for r in run_ranks(sc.restore, 2, tmp_path, str(root), url, env=s3.env):
        assert r.ok, r.message
        v = r.value
        assert v["error"] is None, v
        assert v["latest"] == 4 and v["loaded"] == 4 and v["digest"] == v["expected"]
        assert 4 in v["local"]  # fetched into the node root
        assert v["after"] == 100


def test_plain_zarr_reads_a_persisted_shard_from_the_bucket(s3: Any, root: Path) -> None:
    import zarr
    from obstore.store import S3Store
    from zarr.storage import ObjectStore

    bucket = s3.bucket()
    state = {"w": torch.arange(5000, dtype=torch.float32)}
    with LocalCheckpointManager(root, "job", chunk_nbytes=4096, durable=DurableTier(
            f"s3://{bucket}/ckpt", options={"endpoint": s3.endpoint})) as mgr:
        mgr.save(state, 3)
        assert mgr.wait_for_persist(30)
        assert mgr._save.persister is not None and mgr._save.persister.persisted == [3]
        local = mgr._ctx.store.read(mgr._ctx.store.ref(3, 0, 1))[1]
    store = ObjectStore(S3Store(bucket, endpoint=s3.endpoint, region="us-east-1",
                                access_key_id="test", secret_access_key="test",
                                client_options={"allow_http": True}), read_only=True)
    group = zarr.open_group(store, path="ckpt/job/iter_0000000003/rank_00000_of_00001", mode="r")
    data = group["data"][:]  # every chunk's CRC-32C checked by zarr's codec
    assert torch.equal(torch.from_numpy(data), local)
    assert "localckpt" in group.attrs


@pytest.mark.parametrize("damage", ["uncommitted", "corrupt_chunk", "truncated_chunk"])
def test_a_damaged_newest_iteration_in_the_bucket_falls_back_to_the_older_one(
        s3: Any, tmp_path: Path, root: Path, damage: str) -> None:
    import shutil

    bucket = s3.bucket()
    url = f"s3://{bucket}/ckpt"
    _persist_run(s3, tmp_path, root, url)
    client = s3.client()
    if damage == "uncommitted":  # killed before rank 0 committed it
        client.delete_object(Bucket=bucket, Key=f"{_iter_key(4)}/{commit_name(2)}")
    else:
        key = max(k for k in _objects(s3, bucket, f"{_iter_key(4)}/rank_00001_of_00002/data/c/"))
        data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        if damage == "corrupt_chunk":
            data[len(data) // 2] ^= 0xFF
        else:
            del data[-10:]
        client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    shutil.rmtree(root)
    for r in run_ranks(sc.restore, 2, tmp_path, str(root), url, env=s3.env):
        assert r.ok, r.message
        v = r.value
        assert v["loaded"] == 2 and v["digest"] == v["expected"], v
        assert 4 not in v["local"], v


def test_an_unreachable_object_store_never_stops_training(
        tmp_path: Path, root: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1"}
    started = time.monotonic()
    results = run_ranks(sc.save_and_persist, 2, tmp_path, str(root), "s3://nowhere/ckpt",
                        [1, 2, 3], 1, env=env)
    for r in results:
        assert r.ok, r.message
        assert r.value["latest"] == 3 and r.value["persisted"] == [], r.value
        assert r.value["failures"], r.value  # logged and counted, not raised
    assert time.monotonic() - started < 100
    for r in run_ranks(sc.restore, 2, tmp_path, str(root), "s3://nowhere/ckpt", env=env):
        assert r.ok, r.message
        assert r.value["loaded"] == 3 and r.value["digest"] == r.value["expected"]


def test_the_commit_protocol_on_a_bucket(s3: Any, root: Path) -> None:
    """Shards first, the commit record last; retention and rollback remove through the same
    protocol (the record first), and uncommitted leftovers go whole."""
    bucket = s3.bucket()
    with LocalCheckpointManager(root, "job", keep_last=5, chunk_nbytes=4096, durable=DurableTier(
            f"s3://{bucket}/p", keep=2)) as mgr:
        for it in (1, 2, 3):
            mgr.save({"w": torch.full((3000,), float(it))}, it)
            assert mgr.wait_for_persist(30)
    tier = DurableStore(f"s3://{bucket}/p", "job", 0)
    try:
        assert tier.complete(1) == [2, 3] and tier.uncommitted() == []
        assert not any(k.startswith("p/job/iter_0000000001") for k in _objects(s3, bucket))
        manifest, payload = tier.read_shard(3, 0, 1)
        assert manifest.iteration == 3 and manifest.chunk_count > 1
        assert payload.numel() == manifest.chunk_count * manifest.chunk_nbytes
        tier.backend.write("iter_0000000009/rank_00000_of_00001/data/c/0", b"half a copy")
        assert tier.uncommitted() == [9]
        tier.remove_uncommitted(9)
        with pytest.raises(ValueError, match="committed"):
            tier.remove_uncommitted(3)
        tier.discard_newer(2)
        assert tier.complete(1) == [2]
        assert not any(k.startswith("p/job/iter_0000000003") for k in _objects(s3, bucket))
    finally:
        tier.close()


def test_a_bucket_timeline_survives_a_rollback_and_a_new_save(s3: Any, tmp_path: Path,
                                                              root: Path) -> None:
    url = f"s3://{s3.bucket()}/ckpt"
    results = run_ranks(sc.rollback_then_save, 2, tmp_path, str(root), url, env=s3.env)
    for r in results:
        assert r.ok, r.message
        assert r.value["failures"] == [], r.value
    assert results[0].value["complete"] == [1, 2, 3], results[0].value  # rank 0 committed it


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"root": "gs://bucket/x"}, "s3://"), ({"root": "s3://"}, "no bucket"),
    ({"root": "/shared", "options": {"endpoint": "x"}}, "options"),
    ({"root": "s3://b", "options": ["endpoint"]}, "options"),
    ({"root": "x", "persist_interval": 0}, "persist_interval"),
    ({"root": "x", "persist_interval": True}, "persist_interval"),
])
def test_bad_object_store_settings_are_refused(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigurationError, match=says):
        DurableTier(**kwargs)


def test_persist_by_the_clock(root: Path, tmp_path: Path) -> None:
    for run in range(2):  # every run's first finalized save is due: short runs persist too
        with LocalCheckpointManager(root, keep_last=1, durable=DurableTier(
                tmp_path / "d", persist_every=None, persist_interval=1.0, keep=5)) as mgr:
            base = 10 * run
            mgr.save({"w": torch.ones(3)}, base + 1)  # due: the first of the run
            mgr.save({"w": torch.ones(3)}, base + 2)  # not due
            time.sleep(1.1)
            mgr.save({"w": torch.ones(3)}, base + 3)  # due
            mgr.save({"w": torch.ones(3)}, base + 4)  # not due again yet
            assert mgr.wait_for_persist(30)
            persister = mgr._save.persister
            assert persister is not None, persister
            assert persister.persisted == [base + 1, base + 3], persister.failures


def test_a_store_that_never_answers_costs_a_persist_its_timeout_not_training(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    listener = socket.socket()  # accepts connections (the kernel does), never answers
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    tier = DurableTier("s3://hung/x", options={
        "endpoint": f"http://127.0.0.1:{listener.getsockname()[1]}"})
    try:
        with LocalCheckpointManager(root, timeout=2, durable=tier) as mgr:
            started = time.monotonic()
            mgr.save({"w": torch.ones(3)}, 1)
            mgr.save({"w": torch.ones(3)}, 2)
            assert time.monotonic() - started < 2  # training never waits for the store
            assert mgr.wait_for_persist(30)
            persister = mgr._save.persister
            assert persister is not None and persister.persisted == []
            # 1 failed too, unless it was still waiting when 2 came (requests coalesce: seen
            # on a loaded machine)
            assert [f[0] for f in persister.failures] in ([1, 2], [2]), persister.failures
            assert mgr.find_latest() == 2  # the listing gives up; the local tier serves
    finally:
        listener.close()


def test_the_cli_lists_verifies_and_collects_a_bucket(
        s3: Any, root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from localckpt.ops.cli import main

    bucket = s3.bucket()
    url = f"s3://{bucket}/p"
    with LocalCheckpointManager(root, "job", keep_last=5, chunk_nbytes=4096,
                                durable=DurableTier(url, keep=5)) as mgr:
        for it in (1, 2, 3):
            mgr.save({"w": torch.full((3000,), float(it))}, it, metrics={"loss": 1.0 / it})
            assert mgr.wait_for_persist(30)
    tier = DurableStore(url, "job", 0)
    tier.backend.write("iter_0000000000/rank_00000_of_00001/data/c/0", b"an abandoned copy")
    tier.close()
    capsys.readouterr()
    assert main(["ls", url, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["iteration"], r["complete"]) for r in rows] == [(0, False), (1, True), (2, True),
                                                               (3, True)]
    assert rows[3]["metrics"] == {"loss": pytest.approx(1 / 3)} and rows[3]["bytes"] > 12000
    assert main(["verify", url]) == 1  # the abandoned copy has no manifest
    assert "1 corrupt" in capsys.readouterr().out
    assert main(["gc", url, "--keep-last", "2", "--dry-run", "--json"]) == 0
    doomed = json.loads(capsys.readouterr().out)["removed"]
    assert len(doomed) == 2 and any("iter_0000000001" in d for d in doomed)
    assert len(_objects(s3, bucket, "p/job/iter_0000000001/")) > 0  # a dry run
    assert main(["gc", url, "--keep-last", "2"]) == 0
    assert not _objects(s3, bucket, "p/job/iter_0000000001/")
    assert not _objects(s3, bucket, "p/job/iter_0000000000/")
    assert main(["verify", url]) == 0
    key = max(_objects(s3, bucket, "p/job/iter_0000000003/rank_00000_of_00001/data/c/"))
    client = s3.client()
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[7] ^= 1
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    capsys.readouterr()
    assert main(["verify", url]) == 1
    assert "checksum mismatch" in capsys.readouterr().out
    assert main(["ls", url, str(tmp_path)]) == 2  # a bucket is listed alone
    assert "alone" in capsys.readouterr().err


def test_settings_one_rank_cannot_use_fail_every_rank_at_start(tmp_path: Path,
                                                                root: Path) -> None:
    results = run_ranks(sc.bad_settings_on_one_rank, 2, tmp_path, str(root), 1)
    for r in results:
        assert r.ok, r.message
        error = r.value["error"]
        assert error is not None and "ConfigurationError" in error["bases"], r.value
        assert "no_such_setting" in error["message"], r.value


def test_a_restore_from_a_bucket_brings_the_replicas_back_too(s3: Any, tmp_path: Path,
                                                             root: Path) -> None:
    import shutil

    url = f"s3://{s3.bucket()}/ckpt"
    _persist_run(s3, tmp_path, root, url)
    shutil.rmtree(root)
    for r in run_ranks(sc.restore_and_wait, 2, tmp_path, str(root), url, env=s3.env):
        assert r.ok, r.message
        assert r.value == {"loaded": 4, "held": [(4, 0), (4, 1)]}, r.value


@pytest.mark.parametrize("kind", ["directory", "bucket"])
def test_a_local_chunk_corrupt_at_persist_time_is_never_committed(
        s3: Any, root: Path, tmp_path: Path, kind: str) -> None:
    url = f"s3://{s3.bucket()}/p" if kind == "bucket" else str(tmp_path / "d")
    with LocalCheckpointManager(root, "job", keep_last=2, chunk_nbytes=4096, durable=DurableTier(
            url, persist_every=None)) as mgr:
        mgr.save({"w": torch.arange(40_000, dtype=torch.float32)}, 1)
        chunk = mgr._ctx.store.path_of(1, 0, 1) / "data" / "c" / "17"
        data = bytearray(chunk.read_bytes())
        data[100] ^= 1
        chunk.write_bytes(bytes(data))
        mgr.persist(1)
        assert mgr.wait_for_persist(30)
        persister = mgr._save.persister
        assert persister is not None and persister.persisted == []
        assert "checksum mismatch" in persister.failures[0][1], persister.failures
        tier = DurableStore(url, "job", 0)
        try:
            assert tier.complete(1) == []
            assert not tier.holds(1, 0, 1, None)  # no manifest: the copy is not there
        finally:
            tier.close()


# ---------------------------------------------------------------- from an attacker review


def _persisted_once(url: str, root: Path, state: dict[str, torch.Tensor]) -> None:
    with LocalCheckpointManager(root, "job", chunk_nbytes=4096, durable=DurableTier(url)) as mgr:
        mgr.save(state, 5)
        assert mgr.wait_for_persist(30)
        assert mgr._save.persister is not None and mgr._save.persister.persisted == [5]


def _failing_chunk_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    from localckpt.storage.durable_object import ObjectBackend

    real = ObjectBackend.write

    def write(self: ObjectBackend, key: str, data: Any) -> None:
        if key.endswith("/data/c/2"):
            raise OSError("injected: PUT failed after its retries")
        real(self, key, data)
    monkeypatch.setattr(ObjectBackend, "write", write)


@pytest.mark.parametrize("kind", ["directory", "bucket"])
def test_a_failed_copy_of_another_save_never_leaves_a_commit_naming_broken_shards(
        s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """A later run saves iteration 5 again (another save) and its persist fails halfway: the
    commit record of the first save went before anything was written over (with several
    ranks, a directory's shards are replaced one rank at a time), so the tier says the
    iteration is no longer complete instead of naming shards that are not all there."""
    url = f"s3://{s3.bucket()}/p" if kind == "bucket" else str(tmp_path / "d")
    state = {"w": torch.arange(20_000, dtype=torch.float32)}
    _persisted_once(url, tmp_path / "a", state)
    from localckpt.storage.durable_dir import DirectoryBackend

    real_put = DirectoryBackend.put_shard

    def failing_put(self: DirectoryBackend, manifest: Any, fill: Any, each: Any) -> None:
        def bad_fill(index: int, out: torch.Tensor) -> None:
            if index == 2:
                raise OSError("injected: the copy failed")
            fill(index, out)
        real_put(self, manifest, bad_fill, each)
    with monkeypatch.context() as patched:
        _failing_chunk_writes(patched)
        patched.setattr(DirectoryBackend, "put_shard", failing_put)
        with LocalCheckpointManager(tmp_path / "b", "job", chunk_nbytes=4096,
                                    durable=DurableTier(url)) as mgr:
            mgr.save({"w": state["w"] + 1}, 5)
            assert mgr.wait_for_persist(30)
            assert mgr._save.persister is not None
            assert [f[0] for f in mgr._save.persister.failures] == [5]
    tier = DurableStore(url, "job", 0)
    try:
        for it in tier.complete(1):  # whatever the tier calls complete loads
            manifest, _ = tier.read_shard(it, 0, 1)
            assert manifest.iteration == it
        assert tier.complete(1) == []
    finally:
        tier.close()


def test_a_store_that_cannot_tell_whether_a_copy_is_there_is_not_written_over(
        s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """persist() of an iteration already committed by this save: a transient error reading
    the copy there fails the persist instead of writing over the committed shard."""
    url = f"s3://{s3.bucket()}/p"
    state = {"w": torch.arange(20_000, dtype=torch.float32)}
    with LocalCheckpointManager(tmp_path / "a", "job", chunk_nbytes=4096, keep_last=2,
                                durable=DurableTier(url, persist_every=None)) as mgr:
        mgr.save(state, 5)
        mgr.persist(5)
        assert mgr.wait_for_persist(30)
        real = DurableStore.read_with_digest

        def flaky(self: DurableStore, *args: Any) -> Any:
            raise OSError("injected: 503 Slow Down")
        monkeypatch.setattr(DurableStore, "read_with_digest", flaky)
        _failing_chunk_writes(monkeypatch)
        mgr._save.persister._newest = -1  # type: ignore[union-attr]  # ask again for 5
        mgr.persist(5)
        assert mgr.wait_for_persist(30)
        monkeypatch.setattr(DurableStore, "read_with_digest", real)
    tier = DurableStore(url, "job", 0)
    try:
        assert tier.complete(1) == [5]
        _, data = tier.read_shard(5, 0, 1)  # intact
        assert data.numel() > 0
    finally:
        tier.close()


def test_a_failed_chunk_stops_the_copy(s3: Any, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The first failed PUT ends the copy: no chunk is sent after the persist failed (it would
    land after a rollback's fence, or hold close() for a timeout per chunk)."""
    url = f"s3://{s3.bucket()}/p"
    from localckpt.storage.durable_object import ObjectBackend

    sent: list[str] = []
    failed = threading.Event()
    real = ObjectBackend.write

    def write(self: ObjectBackend, key: str, data: Any) -> None:
        if key.endswith("/data/c/0"):
            failed.set()
            raise OSError("injected")
        if "/data/c/" in key:
            time.sleep(0.01)
            sent.append(key)
        real(self, key, data)
    monkeypatch.setattr(ObjectBackend, "write", write)
    with LocalCheckpointManager(tmp_path / "a", "job", chunk_nbytes=4096, durable=DurableTier(
            url, persist_every=None)) as mgr:
        mgr.save({"w": torch.arange(64 * 1024, dtype=torch.float32)}, 1)  # 64 chunks
        mgr.persist(1)
        assert mgr.wait_for_persist(30)
        count = len(sent)
        time.sleep(0.3)
        assert len(sent) == count and count < 63  # nothing after; the rest never sent
    assert failed.is_set()


def test_object_store_settings_users_write_work_or_are_refused(
        s3: Any, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("AWS_ENDPOINT_URL",):
        monkeypatch.delenv(key, raising=False)
    url = f"s3://{s3.bucket()}/p"
    for options in ({"endpoint_url": s3.endpoint}, {"aws_endpoint": s3.endpoint,
                                                    "allow_http": True, "timeout": "20s"}):
        with LocalCheckpointManager(root, "job", durable=DurableTier(url, options=options),
                                    keep_last=3) as mgr:
            mgr.save({"w": torch.ones(3)}, len(options))
            assert mgr.wait_for_persist(30)
            assert mgr._save.persister is not None and mgr._save.persister.failures == []
    with pytest.raises(ConfigurationError, match="another bucket"):
        LocalCheckpointManager(root, "job", durable=DurableTier(url, options={
            "bucket": "elsewhere", "endpoint": s3.endpoint}))
    with pytest.raises(ConfigurationError, match="a string"):
        DurableTier(Path("s3://bucket/x"))


def test_gc_of_a_bucket_keeps_an_iteration_whose_metrics_it_cannot_read(
        s3: Any, root: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from localckpt.ops.cli import main

    url = f"s3://{s3.bucket()}/p"
    with LocalCheckpointManager(root, "job", keep_last=3, durable=DurableTier(url, keep=5)) as mgr:
        for it, loss in ((1, 0.1), (2, 0.5), (3, 0.9)):
            mgr.save({"w": torch.ones(3)}, it, metrics={"loss": loss})
            assert mgr.wait_for_persist(30)
    real = DurableStore.committed_manifest

    def flaky(self: DurableStore, iteration: int, *args: Any) -> Any:
        if iteration == 1:
            raise OSError("injected: 503")
        return real(self, iteration, *args)
    monkeypatch.setattr(DurableStore, "committed_manifest", flaky)
    assert main(["gc", url, "--keep-last", "1", "--keep-best", "1", "--metric", "loss",
                 "--drop-without-metric", "--json"]) == 0
    removed = json.loads(capsys.readouterr().out)["removed"]
    # 3: the newest; 2: the best of those read; 1: its metrics unknown (a transient error),
    # kept rather than taken for one saved without the metric
    assert removed == [], removed


def test_verify_of_a_bucket_skips_names_of_no_shard(s3: Any, root: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from localckpt.ops.cli import main

    bucket = s3.bucket()
    url = f"s3://{bucket}/p"
    with LocalCheckpointManager(root, "job", durable=DurableTier(url)) as mgr:
        mgr.save({"w": torch.ones(3)}, 1)
        assert mgr.wait_for_persist(30)
    s3.client().put_object(Bucket=bucket, Key="p/job/iter_0000000001/rank_00005_of_00001/x",
                           Body=b"stray")
    assert main(["verify", url]) == 0
    assert "1 shards verified, 0 corrupt" in capsys.readouterr().out


@pytest.mark.parametrize("fault", ["refused", "no answer"])
def test_a_bucket_that_stops_answering_is_unavailable_not_an_empty_tier(
        s3: Any, root: Path, fault: str) -> None:
    """The job lost; the bucket lists its iterations, then stops answering (its connections
    refused, or accepted and never answered). DurableTierUnavailableError after the first
    candidate, not NoCheckpointError after each one in turn (which a job may take for "nothing
    was saved" and start afresh): obstore's errors must keep saying what they are."""
    import shutil
    import socket
    from datetime import timedelta

    from obstore.store import S3Store

    from localckpt.errors import DurableTierUnavailableError

    bucket = s3.bucket()
    durable = DurableTier(f"s3://{bucket}/ckpt", keep=5)
    with LocalCheckpointManager(root, durable=durable) as mgr:
        for it in (1, 2):
            mgr.save({"w": torch.full((3,), float(it))}, it)
            assert mgr.wait_for_persist(30)
    shutil.rmtree(root)  # every node lost
    with socket.socket() as server, LocalCheckpointManager(root, durable=durable,
                                                           timeout=4) as fresh:
        server.bind(("127.0.0.1", 0))
        if fault == "no answer":
            server.listen(16)  # the kernel accepts; nothing ever answers
        assert fresh.find_latest() == 2
        backend = fresh._load.durable.backend  # type: ignore[union-attr]
        backend._store = S3Store(  # the same bucket, now at an address that fails
            bucket, endpoint=f"http://127.0.0.1:{server.getsockname()[1]}", allow_http=True,
            region="us-east-1", skip_signature=True,
            client_options={"connect_timeout": timedelta(seconds=1),
                            "timeout": timedelta(seconds=1)},
            retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=1)})
        with pytest.raises(DurableTierUnavailableError, match="retry once the store is back"):
            fresh.load()


@pytest.mark.parametrize(("answer", "expected"), [
    ((503, b"<Error><Code>SlowDown</Code></Error>", 0, 0), ConnectionError),
    ((500, b"<Error><Code>InternalError</Code></Error>", 0, 0), ConnectionError),
    ((200, b"x" * 100, 1000, 0), ConnectionError),  # the connection closed mid-body
    ((200, b"x" * 100, 1000, 3), TimeoutError),  # the body stalls
    ((400, b"<Error><Message>upstream timed out;\nerror sending request; kind: Timeout"
           b"</Message></Error>", 0, 0), OSError),  # words in a body say nothing
    ((404, b"<Error><Code>NoSuchKey</Code></Error>", 0, 0), FileNotFoundError),
])
def test_the_store_s_errors_say_whether_it_serves(answer: tuple[int, bytes, int, int],
                                                  expected: type[OSError]) -> None:
    """What a restore decides by: a timeout or a store that does not serve (TimeoutError,
    ConnectionError: stop, the store is unavailable) or one object's trouble (another OSError:
    try an older iteration), read from obstore's structured error, never from a body."""
    import http.server
    import socket
    from datetime import timedelta

    import obstore
    from obstore.store import S3Store

    from localckpt.storage.durable_object import _translate

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:  # the name http.server calls
            code, body, missing, stall = answer
            self.send_response(code)
            self.send_header("Content-Length", str(len(body) + missing))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
            if stall:
                time.sleep(stall)
            elif missing:
                self.connection.shutdown(socket.SHUT_RDWR)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        store = S3Store("b", endpoint=f"http://127.0.0.1:{server.server_address[1]}",
                        skip_signature=True, region="us-east-1",
                        client_options={"allow_http": True, "timeout": timedelta(seconds=1)},
                        retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=1)})
        with pytest.raises(Exception) as raised:
            obstore.get(store, "k").bytes()
        got = _translate(raised.value, "s3://b/k")
    finally:
        server.shutdown()
    assert type(got) is expected, (got, str(raised.value)[:300])
