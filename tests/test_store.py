"""Shard store: commit, listing, leftovers, checksums, zarr interoperability (no processes)."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr

from localckpt.errors import ConfigurationError, CorruptShardError, InsufficientSpaceError
from localckpt.storage.layout import find_leftovers, list_shards
from localckpt.storage.manifest import ShardManifest
from localckpt.storage.space import check_free_space, chunking
from localckpt.storage.store import ShardStore
from localckpt.storage.views import byte_view


def _write(store: ShardStore, iteration: int, owner: int = 0, world: int = 1,
           nbytes: int = 10_000, seed: int = 0) -> tuple[torch.Tensor, Path]:
    chunk_nbytes, count = chunking(nbytes, store.chunk_nbytes)
    payload = torch.zeros(chunk_nbytes * count, dtype=torch.uint8)
    payload[:nbytes] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                                     generator=torch.Generator().manual_seed(seed))
    manifest = ShardManifest(store.session_id, iteration, owner, world, (), {"dict": []}, "plain",
                             nbytes, chunk_nbytes, count, ())
    ref, _ = store.write(manifest, payload)
    return payload, ref.path


@pytest.fixture
def store(root: Path) -> ShardStore:
    s = ShardStore(root, "sess", writer_rank=0, chunk_nbytes=4096)
    yield s
    s.close()


def test_chunking_splits_evenly_with_tiny_padding() -> None:
    assert chunking(0) == (1, 0)
    assert chunking(10, 4) == (4, 3)
    size, count = chunking(10_000_001, 1 << 20)
    assert count == 10 and 0 <= size * count - 10_000_001 < count


def test_commit_lists_and_reads_back(store: ShardStore) -> None:
    payload, _ = _write(store, 3)
    _write(store, 3, owner=1, world=2)
    refs = store.committed()
    assert [(r.iteration, r.owner_rank, r.world_size) for r in refs] == [(3, 0, 1), (3, 1, 2)]
    manifest, data = store.read(refs[0])
    assert torch.equal(data, payload) and manifest.chunk_count == 3


def test_plain_zarr_opens_the_group_and_reads_the_bytes(store: ShardStore) -> None:
    payload, path = _write(store, 1, nbytes=9000)
    group = zarr.open_group(str(path), mode="r")
    assert group.attrs["localckpt"]["manifest"]["iteration"] == 1
    data = group["data"][:]
    assert data.dtype == np.uint8 and np.array_equal(data, payload.numpy())


def test_listing_ignores_uncommitted_and_foreign_entries(store: ShardStore, root: Path) -> None:
    _write(store, 2)
    it = root / "sess" / "iter_0000000002"
    (it / ".tmp-rank_00001_of_00001-w00001-abc").mkdir()
    (it / "rank_1_of_1").mkdir()          # not our name format
    (it / "rank_00002_of_00003").touch()  # a file, not a directory
    (root / "sess" / "notes.txt").touch()
    (root / "sess" / "iter_12").mkdir()
    _write(ShardStore(root, "other-session", writer_rank=0, chunk_nbytes=4096), 9)
    assert [(r.iteration, r.owner_rank) for r in list_shards(root, "sess")] == [(2, 0)]
    assert list_shards(root / "missing", "sess") == []


def test_leftovers_never_block_a_resave_and_cleanup_removes_only_own(store: ShardStore,
                                                                     root: Path) -> None:
    it = root / "sess" / "iter_0000000004"
    mine = it / ".tmp-rank_00000_of_00001-w00000-dead"
    theirs = it / ".tmp-rank_00001_of_00002-w00001-beef"
    (mine / "data").mkdir(parents=True)
    theirs.mkdir()
    _, path = _write(store, 4)          # a shard with the same id committed before
    payload, path2 = _write(store, 4, seed=1)   # re-save of the same iteration replaces it
    assert path == path2
    assert torch.equal(store.read(store.committed()[0])[1], payload)
    removed = store.remove_leftovers()
    assert removed == [mine] and theirs.exists() and not mine.exists()


def test_background_delete_hides_at_once_and_frees_by_the_wait(store: ShardStore,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    import threading

    import localckpt.storage.store as store_module

    _write(store, 1)
    _write(store, 2)
    ref = next(r for r in store.committed() if r.iteration == 1)
    release = threading.Event()
    real_rmtree = store_module.shutil.rmtree

    def slow_rmtree(path: Path, ignore_errors: bool = False) -> None:
        release.wait(10)
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(store_module.shutil, "rmtree", slow_rmtree)
    store.delete(ref, background=True)
    # Hidden by the rename before delete returns, its iteration directory gone; the bytes
    # are still being freed.
    assert [r.iteration for r in store.committed()] == [2]
    assert not ref.path.parent.exists()
    trash = [p for p in store.session_path.iterdir() if p.name.startswith(".trash-")]
    assert len(trash) == 1 and (trash[0] / "zarr.json").exists()
    assert find_leftovers(store.session_path, 0) == trash  # a crash now leaves it for cleanup
    release.set()
    store.wait_for_deletions()
    assert not trash[0].exists()
    assert [r.iteration for r in store.committed()] == [2]


def test_a_failing_background_delete_is_logged_not_raised(store: ShardStore,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    import localckpt.storage.store as store_module

    _write(store, 1)
    ref = store.committed()[0]

    def broken(path: Path, ignore_errors: bool = False) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(store_module.shutil, "rmtree", broken)
    store.delete(ref, background=True)
    store.wait_for_deletions()
    assert "background deletion" in caplog.text and store.committed() == []


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "delete", "trailer"])
def test_damaged_chunk_raises_corruption_naming_the_file(store: ShardStore, damage: str) -> None:
    _write(store, 1)
    ref = store.committed()[0]
    chunk = ref.path / "data" / "c" / "1"
    raw = bytearray(chunk.read_bytes())
    if damage == "flip":
        raw[17] ^= 0x01
        chunk.write_bytes(raw)
    elif damage == "truncate":
        chunk.write_bytes(raw[:-100])
    elif damage == "extend":
        chunk.write_bytes(raw + b"\0")
    elif damage == "delete":
        chunk.unlink()
    else:
        raw[-1] ^= 0x80
        chunk.write_bytes(raw)
    with pytest.raises(CorruptShardError) as info:
        store.read(ref)
    assert str(chunk) in str(info.value)


def test_damaged_or_missing_manifest_is_corruption(store: ShardStore) -> None:
    _write(store, 1)
    ref = store.committed()[0]
    meta = ref.path / "zarr.json"
    data = meta.read_bytes()
    assert b'"iteration":1,' in data
    meta.write_bytes(data.replace(b'"iteration":1,', b'"iteration":2,'))
    with pytest.raises(CorruptShardError, match=r"zarr\.json"):
        store.read(ref)
    meta.unlink()
    with pytest.raises(CorruptShardError, match="manifest missing"):
        store.read(ref)



def test_manifest_is_parsed_once_until_the_shard_is_replaced(store: ShardStore) -> None:
    _write(store, 1, nbytes=10_000)
    ref = store.committed()[0]
    first = store.read_manifest(ref)
    assert store.read_manifest(ref) is first  # find_latest, then load: one parse
    _write(store, 1, nbytes=9000)  # a re-save commits a new directory at the same path
    assert store.read_manifest(store.committed()[0]).data_nbytes == 9000


def test_byte_view_shares_memory_and_refuses_strided_tensors() -> None:
    t = torch.zeros(4, dtype=torch.float32)
    view = byte_view(t)
    view[4:8] = torch.tensor([1.5]).numpy().tobytes()
    assert len(view) == 16 and t[1].item() == 1.5
    with pytest.raises(ValueError, match="expected a contiguous CPU tensor"):
        byte_view(torch.zeros(4, 4).t())


def test_delete_hides_atomically_and_removes_empty_iteration(store: ShardStore,
                                                             root: Path) -> None:
    _write(store, 6)
    ref = store.committed()[0]
    store.delete(ref)
    assert store.committed() == [] and not (root / "sess" / "iter_0000000006").exists()
    store.delete(ref)  # already gone: not an error


def test_free_space_check_explains_shm_size(root: Path) -> None:
    check_free_space(root, 1)
    with pytest.raises(InsufficientSpaceError) as info:
        check_free_space(root, 1 << 60)
    assert "--shm-size" in str(info.value) and str(root) in str(info.value)


def test_enospc_mid_write_leaves_nothing_behind(store: ShardStore, root: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _write(store, 1)
    real_write = os.write
    calls = {"n": 0}

    def failing_write(fd: int, data: bytes) -> int:
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", failing_write)
    with pytest.raises(InsufficientSpaceError, match="no space left"):
        _write(store, 2)
    monkeypatch.undo()
    assert [r.iteration for r in store.committed()] == [1]
    assert not [p for p in root.rglob(".tmp-*")]
    store.read(store.committed()[0])  # the committed one is intact


@pytest.mark.parametrize("bad", ["../x", ".hidden", "_default", "a/b", "x" * 200, " "])
def test_unsafe_session_ids_are_rejected(root: Path, bad: str) -> None:
    with pytest.raises(ConfigurationError, match="session_id"):
        ShardStore(root, bad, writer_rank=0)


# ------------------------------------------------------------------ airtight core


def test_shards_are_private_to_their_owner(root: Path) -> None:
    old = os.umask(0o022)
    try:
        store = ShardStore(root, "priv", writer_rank=0, chunk_nbytes=4096)
        _, path = _write(store, 1)
        store.close()
    finally:
        os.umask(old)
    for p in [root / "priv", path.parent, *path.rglob("*"), path]:
        mode = p.stat().st_mode & 0o777
        assert mode == (0o700 if p.is_dir() else 0o600), (p, oct(mode))


def test_background_leftover_removal_never_touches_a_later_write(
        store: ShardStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Finalize schedules the removal of this writer's leftovers; a load's write-back in the same
    process (rollback, in-process restart) starts before the reaper gets to it."""
    import threading

    import localckpt.storage.store as store_module

    _write(store, 1)
    _write(store, 2)
    release = threading.Event()
    real_rmtree = store_module.shutil.rmtree

    def slow_rmtree(path: Path, ignore_errors: bool = False) -> None:
        release.wait(10)  # the reaper is busy freeing a large shard
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(store_module.shutil, "rmtree", slow_rmtree)
    store.delete(next(r for r in store.committed() if r.iteration == 1), background=True)
    store.remove_leftovers(background=True)
    # a write-back of a fetched shard begins meanwhile
    nbytes = 5000
    chunk_nbytes, count = chunking(nbytes, store.chunk_nbytes)
    payload = torch.arange(chunk_nbytes * count, dtype=torch.int64).to(torch.uint8)
    manifest = ShardManifest("sess", 2, 1, 2, (), {"dict": []}, "plain", nbytes, chunk_nbytes,
                             count, ())
    writer = store.begin_write(manifest)
    view = byte_view(payload)
    for i in range(count):
        writer.submit_chunk(i, view[i * chunk_nbytes : (i + 1) * chunk_nbytes])
    release.set()
    store.wait_for_deletions()
    store.commit(writer)
    ref = next(r for r in store.committed() if r.owner_rank == 1)
    assert torch.equal(store.read(ref)[1], payload)


@pytest.mark.parametrize("fail_after", [0, 1, 2, 3])
def test_overwriting_a_shard_leaves_one_committed_whichever_step_fails(
        store: ShardStore, monkeypatch: pytest.MonkeyPatch, fail_after: int) -> None:
    """Re-saving a shard id that is already committed replaces it; a crash at any rename step of
    the replacement leaves the old or the new shard committed, never none."""
    old, _ = _write(store, 3, seed=1)
    calls = {"n": 0}

    def crash_after(fn):  # type: ignore[no-untyped-def]
        def step(*args: object) -> object:
            if calls["n"] >= fail_after:
                raise OSError(errno.EIO, "the process died here (injected)")
            calls["n"] += 1
            return fn(*args)
        return step

    monkeypatch.setattr(os, "rename", crash_after(os.rename))
    try:
        from localckpt.storage import fsutil
    except ImportError:
        pass
    else:
        monkeypatch.setattr(fsutil, "rename_exchange", crash_after(fsutil.rename_exchange))
    try:
        new, _ = _write(store, 3, seed=2)
    except OSError as exc:
        assert "injected" in str(exc)
    monkeypatch.undo()
    refs = store.committed()
    assert [(r.iteration, r.owner_rank) for r in refs] == [(3, 0)]
    data = store.read(refs[0])[1]
    new = torch.zeros_like(old)
    new[:10_000] = torch.randint(0, 256, (10_000,), dtype=torch.uint8,
                                 generator=torch.Generator().manual_seed(2))
    assert torch.equal(data, old) or torch.equal(data, new)


def test_without_an_atomic_exchange_a_failed_replacement_puts_the_old_shard_back(
        store: ShardStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel has no RENAME_EXCHANGE (NFS), a re-save moves the old shard aside, then
    renames the new one in. When that second rename failed (the temporary directory claimed by
    another process's cleanup, an I/O error), the old shard stayed aside, to be deleted: that
    shard id had no copy left (from the review of this session's diff)."""
    from localckpt.storage import fsutil

    old, _ = _write(store, 3, seed=1)
    monkeypatch.setattr(fsutil, "rename_exchange", lambda a, b: False)
    real = os.rename

    def rename(src: object, dst: object) -> None:
        if str(src).rsplit("/", 1)[-1].startswith(".tmp-") and not Path(str(dst)).exists():
            raise OSError(errno.ENOENT, "claimed meanwhile (injected)")
        real(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="injected"):
        _write(store, 3, seed=2)
    monkeypatch.undo()
    refs = store.committed()
    assert [(r.iteration, r.owner_rank) for r in refs] == [(3, 0)]
    assert torch.equal(store.read(refs[0])[1], old)


def _rewrite_manifest(ref_path: Path, edit: object) -> None:
    import json

    from localckpt.storage.manifest import _crc_of

    meta = ref_path / "zarr.json"
    doc = json.loads(meta.read_text())
    body = doc["attributes"]["localckpt"]["manifest"]
    edit(body)  # type: ignore[operator]
    doc["attributes"]["localckpt"]["crc32c"] = _crc_of(body)  # a consistent, valid checksum
    meta.write_text(json.dumps(doc))


def test_manifest_claiming_more_bytes_than_its_files_is_refused_before_allocating(
        store: ShardStore) -> None:
    _write(store, 1)
    ref = store.committed()[0]
    huge = 1 << 45  # 32 TiB

    def claim(body: dict) -> None:  # type: ignore[type-arg]
        body.update(chunk_nbytes=huge, data_nbytes=huge * body["chunk_count"])
        body["tensors"] = [{"key_path": "w", "dtype": "uint8", "shape": [huge], "offset": 0,
                            "nbytes": huge, "device": "cpu"}]
        body["hollow"] = {"dict": [["w", {"T": 0}]]}
    _rewrite_manifest(ref.path, claim)
    with pytest.raises(CorruptShardError, match="chunk") as info:
        store.read(ref)
    assert str(ref.path) in str(info.value)


def test_shard_names_out_of_the_listed_width_are_refused(root: Path) -> None:
    from localckpt.storage.layout import shard_path

    with pytest.raises(ValueError, match="iteration"):
        shard_path(root, "s", 10**10, 0, 1)
    with pytest.raises(ValueError, match="rank"):
        shard_path(root, "s", 1, 10**5, 10**5 + 1)


def test_names_with_other_scripts_digits_are_not_listed(store: ShardStore, root: Path) -> None:
    _write(store, 5)
    phantom = root / "sess" / ("iter_" + "\u0660" * 9 + "\u0669") / "rank_00000_of_00001"
    phantom.mkdir(parents=True)
    assert [r.iteration for r in store.committed()] == [5]


def test_a_shard_copied_under_another_session_name_is_not_corrupt(store: ShardStore,
                                                                  root: Path) -> None:
    import shutil

    payload, _ = _write(store, 3)
    shutil.copytree(root / "sess", root / "copy")
    copy = ShardStore(root, "copy", writer_rank=0, chunk_nbytes=4096)
    try:
        manifest, data = copy.read(copy.committed()[0])
    finally:
        copy.close()
    assert manifest.session_id == "sess" and torch.equal(data, payload)


def test_a_process_level_error_is_not_taken_for_corruption(store: ShardStore,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """EMFILE, EACCES... say nothing about the copy: never a CorruptShardError (which would
    quarantine a healthy shard)."""
    _write(store, 1)
    ref = store.committed()[0]
    real_open = os.open

    def no_descriptors(path: object, flags: int, *args: object) -> int:
        if str(path).endswith("zarr.json") or "/c/" in str(path):
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", no_descriptors)
    with pytest.raises(OSError) as info:
        store.read(ref)
    assert not isinstance(info.value, CorruptShardError)


def test_a_manifest_read_from_disk_sends_the_bytes_it_was_verified_from(root: Path) -> None:
    """``encoded`` of a manifest read back is the file's span (no second encoding on a restore's
    serving rank) and parses to the same manifest; a file with a second "localckpt" key (json
    keeps the last) is parsed whole, and what it sends is that manifest encoded again, not the
    span, which is no JSON."""
    writer = ShardStore(root, "sess", writer_rank=0, chunk_nbytes=4096)
    try:
        _, path = _write(writer, 1)
        first, = writer.committed()
    finally:
        writer.close()

    def fresh_read(ref: object) -> ShardManifest:
        store = ShardStore(root, "sess", writer_rank=0, chunk_nbytes=4096)
        try:
            return store.read_manifest(ref)  # type: ignore[arg-type]
        finally:
            store.close()

    manifest = fresh_read(first)
    data = (path / "zarr.json").read_bytes()
    assert data.find(manifest.encoded) > 0
    again = ShardManifest.from_json_bytes(manifest.encoded, "peer")
    assert again.to_json_dict() == manifest.to_json_dict()

    (path / "zarr.json").write_bytes(
        b'{"zarr_format": 3, "node_type": "group", "attributes": {"localckpt": '
        + manifest.encoded + b', "localckpt": ' + manifest.encoded + b"}}")
    seen = fresh_read(first)
    sent = ShardManifest.from_json_bytes(seen.encoded, "peer")  # JSON, not the odd span
    assert sent.to_json_dict() == seen.to_json_dict() == manifest.to_json_dict()


def test_a_manifest_file_with_more_than_its_checksum_covers_is_sent_as_verified(
        root: Path) -> None:
    """Only what the manifest's checksum covers is sent on: a key beside the manifest in its
    envelope is dropped (the manifest encoded again); nesting too deep for the encoder is a
    CorruptShardError, not a RecursionError."""
    store = ShardStore(root, "sess", writer_rank=0, chunk_nbytes=4096)
    try:
        _, path = _write(store, 1)
        ref, = store.committed()
        encoded = store.read_manifest(ref).encoded
    finally:
        store.close()
    prefix = b'{"zarr_format": 3, "node_type": "group", "attributes": {"localckpt": '
    (path / "zarr.json").write_bytes(prefix + encoded[:-1] + b', "unverified": [1, 2]}' + b"}}")
    fresh = ShardStore(root, "sess", writer_rank=0, chunk_nbytes=4096)
    try:
        sent = fresh.read_manifest(ref).encoded
    finally:
        fresh.close()
    assert b"unverified" not in sent
    ShardManifest.from_json_bytes(sent, "peer")

    nested: list[object] = []
    for _ in range(5000):  # parsed, but too deep for the encoder the checksum is taken with
        nested = [nested]
    with pytest.raises(CorruptShardError, match="cannot be checked"):
        ShardManifest.from_json_dict({"manifest": {"x": nested}, "crc32c": 0}, "peer")


def test_a_shard_whose_chunk_files_vanished_while_written_is_not_committed(
        store: ShardStore, root: Path) -> None:
    from localckpt.errors import CorruptShardError

    chunk_nbytes, count = chunking(20_000, store.chunk_nbytes)
    manifest = ShardManifest(store.session_id, 4, 0, 1, (), {"dict": []}, "plain", 20_000,
                             chunk_nbytes, count, ())
    payload = torch.zeros(chunk_nbytes * count, dtype=torch.uint8)
    writer = store.begin_write(manifest)
    view = memoryview(payload.numpy())
    for i in range(count):
        writer.submit_chunk(i, view[i * chunk_nbytes : (i + 1) * chunk_nbytes])
    writer.wait_chunk(count - 1)
    writer.wait_chunk(1)
    (writer.tmp / "data" / "c" / "1").unlink()  # another process's cleanup got to it
    with pytest.raises(CorruptShardError, match="chunk files"):
        store.commit(writer)
    assert list_shards(root, "sess") == [] and not writer.tmp.exists()


def test_leftover_cleanup_never_follows_a_linked_iteration_directory(root: Path,
                                                                     tmp_path: Path) -> None:
    from localckpt.storage.layout import remove_leftovers, session_dir

    victim = tmp_path / "victim"
    (victim / ".tmp-results").mkdir(parents=True)
    (victim / ".trash-old").mkdir()
    session = session_dir(root, "sess")
    session.mkdir(parents=True)
    (session / "iter_0000000009").symlink_to(victim)
    assert find_leftovers(session) == []
    remove_leftovers(session, None)
    assert (victim / ".tmp-results").is_dir() and (victim / ".trash-old").is_dir()


def test_a_write_refused_for_space_while_making_its_directories_leaves_none(
        store: ShardStore, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    from localckpt.errors import InsufficientSpaceError
    from localckpt.storage import shard_writer

    real = os.mkdir

    def full(path: Any, *args: Any) -> None:
        if str(path).endswith("/data"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, *args)

    monkeypatch.setattr(shard_writer.os, "mkdir", full)
    with pytest.raises(InsufficientSpaceError):
        _write(store, 6)
    monkeypatch.undo()
    assert find_leftovers(store.session_path, 0) == []


@pytest.mark.parametrize("chunk_nbytes", [4096, 65536])
def test_the_space_a_save_asks_for_covers_what_its_files_take(root: Path,
                                                              chunk_nbytes: int) -> None:
    """Every chunk file takes whole 4 KiB blocks (its 4-byte trailer one more): the estimate
    counts them (before: 1 MiB in 4 KiB chunks took 2.1 MB and was estimated at 1.1 MB, so a
    nearly full root failed mid-write instead of before writing)."""
    import os

    from localckpt import LocalCheckpointManager
    from localckpt.storage.space import bytes_needed

    nbytes = 1 << 20
    with LocalCheckpointManager(root, "s", chunk_nbytes=chunk_nbytes) as mgr:
        mgr.save({"w": torch.zeros(nbytes, dtype=torch.uint8)}, 1)
    used = sum(os.lstat(os.path.join(d, f)).st_blocks * 512
               for d, _, files in os.walk(next(root.glob("s/iter_*/rank_*"))) for f in files)
    assert bytes_needed(256 + 4096, chunk_nbytes, nbytes // chunk_nbytes) >= used


def test_copy_out_fills_each_target_with_its_part_of_a_window() -> None:
    from localckpt.storage.views import copy_out

    packed = torch.arange(200, dtype=torch.uint8)  # packed byte i holds i
    outs = [torch.zeros(n, dtype=torch.uint8) for n in (10, 30, 5, 40)]
    offsets = [0, 20, 60, 150]
    small = [(o, t.data_ptr(), t.numel()) for o, t in zip(offsets, outs, strict=True)]
    starts = [o for o, _, _ in small]
    for lo, hi in [(0, 25), (25, 64), (64, 155), (155, 200)]:  # windows cutting targets
        window = packed[lo:hi].clone()  # the window's bytes alone, packed byte lo at its start
        copy_out(small, starts, lo, hi, window.data_ptr(), lo)
    for o, t in zip(offsets, outs, strict=True):
        assert torch.equal(t, packed[o : o + t.numel()]), o


def test_a_rollback_fence_hides_newer_shards_until_they_are_deleted(store: ShardStore,
                                                                    root: Path) -> None:
    for it, world in ((10, 1), (20, 1), (30, 1), (30, 2), (40, 2)):
        _write(store, it, world=world)
    listed = lambda: [(r.iteration, r.world_size) for r in store.committed()]  # noqa: E731
    store.fence_rollback(20, 1, store.fence(), "r1")  # this world size only
    assert listed() == [(10, 1), (20, 1), (30, 2), (40, 2)]
    store.fence_rollback(20, None, store.fence(), "r2")  # every world size (a resharding
    # job's lineage)
    assert listed() == [(10, 1), (20, 1)]
    assert store.finish_rollback() == []
    store.wait_for_deletions()
    assert listed() == [(10, 1), (20, 1)]
    assert not (store.session_path / "rollback-fence.json").exists()
    _write(store, 30)  # a later save of 30 is listed: the fence is gone
    assert listed() == [(10, 1), (20, 1), (30, 1)]


def test_a_root_that_finished_a_rollback_shows_what_it_saved_after_it(store: ShardStore,
                                                                      root: Path) -> None:
    """A node away during a rollback comes back with its fence (the rollback stopped when it
    died) after the rest of the job finished the rollback and saved 40: the fence hid 40 on
    every root, and the next save deleted it. A root that finished a rollback records it, and
    that rollback's fence hides nothing of it again (attacker review)."""
    from localckpt.storage import rollback_fence

    for it in (10, 20, 30):
        _write(store, it)
    listed = lambda: [r.iteration for r in store.committed()]  # noqa: E731
    store.fence_rollback(20, 1, store.fence(), "r1")
    stale = store.fence()
    assert listed() == [10, 20] and stale == ((20, 1, "r1"),)
    assert store.finish_rollback() == []
    store.wait_for_deletions()
    assert store.rollbacks_done() == {("r1", 20, 1)} and store.fence() is None
    _write(store, 40)  # saved after the rollback
    assert store.discard_fenced(stale) == []  # the job's fence, from the node back with it
    store.wait_for_deletions()
    assert listed() == [10, 20, 40]
    store.lift_fence()
    assert store.fence() is None and listed() == [10, 20, 40]
    # a fence written before ids (or of a rollback this root never finished) hides as before
    rollback_fence.write_fence(store.session_path, ((20, 1, None), (30, 1, "r9")), "w00000")
    assert listed() == [10, 20]
    store.cancel_rollback()
    # a record that cannot be read is an error naming it, never taken for no record (a
    # fence would then hide, and the next save delete, what this root saved after it)
    (store.session_path / rollback_fence.DONE_NAME).write_text("{")
    with pytest.raises(CorruptShardError, match=r"rollbacks-done\.json: malformed record"):
        store.rollbacks_done()
    store.fence_rollback(20, 1, store.fence(), "r2")
    with pytest.raises(CorruptShardError, match=r"rollbacks-done\.json: malformed record"):
        store.committed()  # this root holds a fence: its listing reads the record
    assert store.discard_fenced() != []  # refused: 40 (saved after r1) is not deleted
    store.wait_for_deletions()
    assert (store.session_path / "iter_0000000040").is_dir()


def test_a_fence_that_cannot_be_read_is_an_error_not_ignored(store: ShardStore) -> None:
    _write(store, 10)
    (store.session_path / "rollback-fence.json").write_text('{"rollback_to": "x"}')
    with pytest.raises(CorruptShardError, match=r"rollback-fence\.json: malformed fence"):
        store.committed()


@pytest.mark.parametrize("name", ["rollback-fence.json", "rollbacks-done.json"])
def test_a_deeply_nested_fence_or_record_is_corrupt_not_a_recursion_error(
        store: ShardStore, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """json.loads raises RecursionError on 70,000 nested brackets: the listing, and with it
    `localckpt ls`, `gc` and `verify`, died with a traceback (from the attacker review)."""
    from localckpt.ops.cli import main
    from localckpt.storage import rollback_fence

    _write(store, 10)
    if name == "rollbacks-done.json":  # the record is read where the root holds a fence
        rollback_fence.write_fence(store.session_path, ((50, 1, "r1"),), "w00000")
    (store.session_path / name).write_text("[" * 70000)
    with pytest.raises(CorruptShardError, match=name.replace(".", r"\.") + ": malformed"):
        store.committed()
    for command in (["ls"], ["gc", "--dry-run"], ["verify"]):
        assert main([*command, str(store.root)]) == 2, command
        err = capsys.readouterr().err
        assert name in err and len(err.strip().splitlines()) == 1, (command, err)


def test_fences_of_rollbacks_at_two_world_sizes_hide_what_each_hid_and_no_more() -> None:
    """Merged into one entry, (10, world 1) and (40, world 2) became (10, every world size):
    world 2's 40 itself, the second rollback's target, was hidden and deleted."""
    from localckpt.storage.rollback_fence import hidden, merged

    fence = merged(((10, 1, None),), ((40, 2, None),))
    assert not hidden(fence, 40, 2) and hidden(fence, 41, 2)
    assert not hidden(fence, 10, 1) and hidden(fence, 11, 1) and not hidden(fence, 11, 3)
    assert merged(fence, ((5, None, None),)) == ((5, None, None), (10, 1, None), (40, 2, None))
    assert hidden(merged(fence, ((5, None, None),)), 6, 3)
    assert merged(((30, 2, None),), ((20, 2, None),)) == ((20, 2, None),)
    # rollbacks with ids: one entry each, so that finishing one lifts only its own
    assert merged(((30, 2, "a"),), ((20, 2, "b"),)) == ((20, 2, "b"), (30, 2, "a"))


def test_a_fence_half_written_by_a_killed_writer_is_a_leftover(store: ShardStore) -> None:
    """The fence's temporary file was named .tmp-fence-*: no leftover cleanup knew it."""
    from localckpt.storage import rollback_fence

    real = os.rename
    try:
        def killed(a: Any, b: Any) -> None:
            raise KeyboardInterrupt  # stands for a kill between the write and the rename
        os.rename = killed  # type: ignore[assignment]
        with pytest.raises(KeyboardInterrupt):
            rollback_fence.write_fence(store.session_path, ((3, 1, "r"),), "w00000")
    finally:
        os.rename = real
    assert [p.name[:19] for p in store.session_path.iterdir()] == [".trash-fence-w00000"]
    store.remove_leftovers()
    assert list(store.session_path.iterdir()) == []


def _iteration_3(store: ShardStore) -> ShardManifest:
    """The manifest of a 10,000-byte shard of iteration 3 of rank 0 (of 1)."""
    chunk_nbytes, count = chunking(10_000, store.chunk_nbytes)
    return ShardManifest("sess", 3, 0, 1, (), {"dict": []}, "plain", 10_000, chunk_nbytes,
                         count, ())


@pytest.mark.parametrize("spelled", ["alike", "relative"])
def test_two_stores_of_one_rank_in_one_process_leave_each_others_writes(
        root: Path, monkeypatch: pytest.MonkeyPatch, spelled: str) -> None:
    """A job that loads with a second manager while the saving one is open (scripts/bench.py
    does): both wrote temporary directories under one writer tag, and either one's retention
    took the other's write in progress for a crash leftover and removed it. The open stores
    were then told apart by the text of their session path: one given the root as a relative
    path still did (from an attacker review)."""
    monkeypatch.chdir(root.parent)
    a = ShardStore(root, "sess", writer_rank=0, chunk_nbytes=4096)
    b = ShardStore(root if spelled == "alike" else Path(root.name), "sess", writer_rank=0,
                   chunk_nbytes=4096)
    try:
        writer = a.begin_write(_iteration_3(a))
        assert b.remove_leftovers() == [] and writer.tmp.is_dir()
        writer.abort()
        dead = writer.tmp.parent / f".tmp-rank_00000_of_00001-w00000-{'0' * 12}"
        dead.mkdir()  # a crashed process's: still a leftover for either
        assert [p.resolve() for p in b.remove_leftovers()] == [dead] and not dead.exists()
    finally:
        a.close()
        b.close()


def _remove_through_an_open_handle(path: Path, meanwhile: Any) -> None:
    """What shutil.rmtree does: open the directory, then delete what is under that handle
    (``meanwhile()`` runs in between: another process renaming it)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    meanwhile()

    def under(dir_fd: int) -> None:
        for entry in os.scandir(dir_fd):
            if entry.is_dir(follow_symlinks=False):
                sub = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=dir_fd)
                try:
                    under(sub)
                finally:
                    os.close(sub)
                os.rmdir(entry.name, dir_fd=dir_fd)
            else:
                os.unlink(entry.name, dir_fd=dir_fd)

    try:
        under(fd)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):  # gone if renamed meanwhile: ignore_errors=True
        os.rmdir(path)


def test_a_cleanup_racing_a_commit_never_leaves_a_hollow_committed_shard(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process's leftover cleanup (a second job of the session on this node, the same
    writer rank) opened a temporary directory to delete it while its writer renamed it into
    place: the deletion went on inside the committed shard, whose save then finalized with no
    files (from an attacker review). The cleanup must claim what it deletes by a rename first:
    the writer then fails loudly, or commits a whole shard."""
    from types import SimpleNamespace

    from localckpt.storage import layout

    a = ShardStore(root, "sess", writer_rank=0, chunk_nbytes=4096)
    other = ShardStore(root, "sess", writer_rank=0, chunk_nbytes=4096)
    try:
        manifest = _iteration_3(a)
        writer = a.begin_write(manifest)
        chunk_nbytes, count = manifest.chunk_nbytes, manifest.chunk_count
        payload = torch.zeros(chunk_nbytes * count, dtype=torch.uint8)
        view = byte_view(payload)
        for i in range(count):
            writer.submit_chunk(i, view[i * chunk_nbytes: (i + 1) * chunk_nbytes])
        committed: list[BaseException | Path] = []

        def commit() -> None:
            try:
                committed.append(a.commit(writer))
            except Exception as exc:
                committed.append(exc)

        with monkeypatch.context() as m:  # as if the other store were another process's
            m.setattr(layout, "shutil", SimpleNamespace(
                rmtree=lambda path, ignore_errors=False:
                _remove_through_an_open_handle(Path(path), commit)))
            m.setattr("localckpt.storage.store._LIVE_WRITERS", {})
            other.remove_leftovers()
        [outcome] = committed
        listed = [r for r in a.committed() if r.iteration == 3]
        if isinstance(outcome, Path):  # the commit won: the shard is whole
            a.verify(listed[0])
        else:  # the cleanup won: the save fails, naming why, and nothing is listed
            assert listed == [], listed
            assert "removed" in str(outcome), outcome
    finally:
        a.close()
        other.close()
