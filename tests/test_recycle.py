"""recycle_files=True: retention keeps the chunk files of deleted shards in the node root's pool
and later saves write over them (localckpt/storage/recycle.py). Checked: files are really
reused, every iteration loads bit-exact, the pool never holds more than one retired iteration,
a save counts it as free space, a failure at every point of the commit keeps the retained
iteration and leaves nothing behind, and the pool is emptied by close, the next start and gc."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from scenarios import digest, make_state

from localckpt import LocalCheckpointManager
from localckpt.ops import faults
from localckpt.ops.faults import Fault
from localckpt.storage import store as store_module
from localckpt.storage.recycle import RECYCLE_DIR


def big_state(iteration: int, mib: int = 3) -> dict[str, Any]:
    g = torch.Generator().manual_seed(iteration)
    return {"w": torch.randn(mib << 18, generator=g), "step": iteration}


def chunk_inodes(root: Path, iteration: int) -> set[int]:
    return {p.stat().st_ino for p in root.glob(f"*/iter_{iteration:010d}/*/data/c/*")}


def pooled(root: Path) -> list[Path]:
    return sorted((root / RECYCLE_DIR).glob("*")) if (root / RECYCLE_DIR).is_dir() else []


def manager(root: Path, **kwargs: Any) -> LocalCheckpointManager:
    return LocalCheckpointManager(root, recycle_files=True, chunk_nbytes=1 << 20, **kwargs)


def test_later_saves_write_over_the_chunk_files_of_deleted_shards(root: Path) -> None:
    with manager(root, keep_last=1) as mgr:
        mgr.save(big_state(1), 1)
        first = chunk_inodes(root, 1)
        mgr.save(big_state(2), 2)  # retention moves iteration 1's chunk files into the pool
        mgr._ctx.store.wait_for_deletions()
        session = next(root.iterdir())
        assert len(pooled(session)) == len(first)
        mgr.save(big_state(3), 3)
        third = chunk_inodes(root, 3)
        assert third == first  # the same files, written over
        loaded, ckpt = mgr.load()
    assert ckpt[0] == 3 and torch.equal(loaded["w"], big_state(3)["w"])
    assert pooled(session) == []  # close empties the pool


def test_the_pool_holds_at_most_one_retired_iteration_and_is_freed_when_space_is_short(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with manager(root, keep_last=1) as mgr:
        mgr.save(big_state(1, mib=6), 1)
        session = next(root.iterdir())
        chunks = {1: len(chunk_inodes(root, 1))}
        for it in range(2, 6):  # shards shrinking and growing: surplus files are drained
            mib = 6 if it % 2 else 2
            mgr.save(big_state(it, mib), it)
            chunks[it] = len(chunk_inodes(root, it))
            mgr._ctx.store.wait_for_deletions()
            assert 0 < len(pooled(session)) <= chunks[it - 1], (it, chunks)
            loaded, ckpt = mgr.load()
            assert ckpt[0] == it and torch.equal(loaded["w"], big_state(it, mib)["w"])
        # No room while the pool holds the retired files: every rank agrees to free the pool
        # (a save may not take every pooled file), and the save fits.
        assert pooled(session)
        real = os.statvfs
        full = SimpleNamespace(f_bavail=0, f_frsize=4096, f_blocks=1024)
        monkeypatch.setattr(store_module.os, "statvfs",
                            lambda path: full if pooled(session) else real(path))
        mgr.save(big_state(9, mib=1), 9)
        monkeypatch.setattr(store_module.os, "statvfs", real)
        assert mgr.find_latest() == 9


@pytest.mark.parametrize("point", ["local_write", "before_commit", "after_commit"])
def test_a_failure_at_any_point_of_a_commit_over_recycled_files_keeps_the_retained_one(
        root: Path, point: str) -> None:
    with manager(root, keep_last=1) as mgr:
        mgr.save(big_state(1), 1)
        mgr.save(big_state(2), 2)
        mgr._ctx.store.wait_for_deletions()
        faults.arm(Fault(point, "raise", iteration=3))
        try:
            with pytest.raises(Exception, match=f"injected fault {point}:raise"):
                mgr.save(big_state(3), 3)
        finally:
            faults.disarm()
        assert mgr.find_latest() == 2
        loaded, ckpt = mgr.load()
        assert ckpt[0] == 2 and torch.equal(loaded["w"], big_state(2)["w"])
        mgr.save(big_state(4), 4)  # and the next save works, over what is left in the pool
        loaded, ckpt = mgr.load()
        assert ckpt[0] == 4 and torch.equal(loaded["w"], big_state(4)["w"])
    assert not list(root.glob("*/iter_*/.*"))  # no temporary or trash directories left


def test_a_pool_left_by_a_crash_is_used_or_removed_by_the_next_start(root: Path) -> None:
    mgr = manager(root, keep_last=1)
    mgr.save(make_state(0, 1), 1)
    mgr.save(make_state(0, 2), 2)
    mgr._ctx.store.wait_for_deletions()
    session = next(root.iterdir())
    assert pooled(session)
    mgr._ctx.store.files = None  # as if the process died: close() leaves the pool in place
    mgr.close()
    assert pooled(session)
    left = {p.stat().st_ino for p in pooled(session)}
    with manager(root, keep_last=1) as again:  # recycling on: its first save writes over them
        again.save(make_state(0, 3), 3)
        assert chunk_inodes(root, 3) & left
    with LocalCheckpointManager(root) as again:  # recycling off: the pool is a leftover
        assert not (session / RECYCLE_DIR).exists()
        loaded, ckpt = again.load()
    assert ckpt[0] == 3 and digest(loaded) == digest(make_state(0, 3))


def test_reserve_puts_the_first_saves_chunk_files_in_the_pool(root: Path) -> None:
    with manager(root, keep_last=1) as mgr:
        mgr.reserve(big_state(1))
        session = next(root.iterdir())
        reserved = {p.stat().st_ino for p in pooled(session)}
        assert len(reserved) == 3  # 3 MiB in 1 MiB chunks
        mgr.save(big_state(1), 1)
        assert chunk_inodes(root, 1) == reserved  # the fresh job's first save wrote over them
        loaded, _ = mgr.load()
        assert torch.equal(loaded["w"], big_state(1)["w"])


def test_reserve_after_close_is_refused_and_writes_nothing(root: Path) -> None:
    """reserve() after close() allocated a new staging arena and wrote a shard's worth of pool
    files into the session, which no lock covered and nothing removed until a later manager
    opened the session; every other verb refused (from an attacker review)."""
    from localckpt.errors import CollectiveError

    mgr = manager(root, keep_last=1)
    mgr.save(big_state(1), 1)
    mgr.close()
    before = sorted(p for p in root.rglob("*"))
    with pytest.raises(CollectiveError, match=r"reserve.*closed"):
        mgr.reserve(big_state(1))
    assert sorted(p for p in root.rglob("*")) == before


def test_a_pooled_file_is_published_only_once_complete(root: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # A file must never be takeable while preallocate still writes it (a take would write a
    # chunk over it and preallocate's zeros would land in a committed shard).
    from localckpt.storage import recycle

    pool = recycle.FilePool(root)
    real_write = os.write
    seen: list[int] = []

    def write(fd: int, data: Any) -> int:
        seen.extend(size for _, size in list(pool._pooled()))  # every takeable file, now
        return real_write(fd, data)

    monkeypatch.setattr(recycle.os, "write", write)
    pool.preallocate(3, (2 << 20) + 4)
    monkeypatch.undo()
    assert len(list(pool._pooled())) == 3
    assert seen and all(size == (2 << 20) + 4 for size in seen)  # never a partial one


def test_hard_linked_copies_of_a_session_are_never_written_through(root: Path) -> None:
    with manager(root, keep_last=1) as mgr:
        mgr.save(big_state(1), 1)
        copy = root / "snapshot"  # same file system (a link cannot cross one)
        copy.mkdir()
        originals = {}
        for i, chunk in enumerate(sorted(root.glob("*/iter_0000000001/*/data/c/*"))):
            os.link(chunk, copy / str(i))  # as `cp -al` would
            originals[i] = chunk.read_bytes()
        for it in (2, 3, 4):
            mgr.save(big_state(it), it)
            mgr._ctx.store.wait_for_deletions()
    assert {i: (copy / str(i)).read_bytes() for i in originals} == originals


@pytest.mark.parametrize("linked", ["data", "c"])
def test_a_linked_directory_in_a_retired_shard_is_never_emptied(root: Path,
                                                               linked: str) -> None:
    """An operator replaced a shard's data (or chunk) directory by a link to a backup: retiring
    that shard must not move the backup's files into the pool (its close deletes them)."""
    with manager(root, keep_last=1) as mgr:
        mgr.save(big_state(1), 1)
        shard = next(root.glob("*/iter_0000000001/rank_*"))
        backup = Path(tempfile.mkdtemp(dir=root.parent)) / "backup"  # one file system
        shutil.copytree(shard / "data", backup)
        target = shard / "data" if linked == "data" else shard / "data" / "c"
        shutil.rmtree(target)
        target.symlink_to(backup if linked == "data" else backup / "c")
        for it in (2, 3):
            mgr.save(big_state(it), it)
            mgr._ctx.store.wait_for_deletions()
    try:
        assert len(list((backup / "c").iterdir())) >= 1
    finally:
        shutil.rmtree(backup.parent)


def test_reserve_tops_the_pool_up_and_never_fails_a_job(root: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    with manager(root, keep_last=1) as mgr:
        session = next(root.iterdir())
        mgr.reserve(big_state(1))
        mgr.reserve(big_state(1))  # again (a restart after a crash): only the shortfall
        assert len(pooled(session)) == 3
        mgr._ctx.store.drain_all_recycled()
        full = SimpleNamespace(f_bavail=16, f_frsize=4096, f_blocks=1024)  # 64 KiB free
        monkeypatch.setattr(store_module.os, "statvfs", lambda path: full)
        mgr.reserve(big_state(1))  # no room: nothing allocated, nothing raised
        monkeypatch.undo()
        assert pooled(session) == []
        assert not list(session.glob(".recycle/.*"))  # no partial file left


def test_an_unusable_pool_only_costs_the_speed(root: Path) -> None:
    try:
        _unusable_pool(root)
    finally:
        shutil.rmtree(root.parent / f"{root.name}-elsewhere", ignore_errors=True)


def _unusable_pool(root: Path) -> None:
    with manager(root, keep_last=1) as mgr:
        mgr.save(big_state(1), 1)
        session = next(root.iterdir())
        pool = session / RECYCLE_DIR
        pool.mkdir(exist_ok=True)
        (pool / "a-directory").mkdir()  # a stray entry: drain goes past it
        target = root.parent / f"{root.name}-elsewhere"
        target.mkdir()
        mgr.save(big_state(2), 2)
        mgr._ctx.store.wait_for_deletions()
        for entry in list(pool.iterdir()):  # the pool replaced by a link to elsewhere
            os.rename(entry, target / entry.name)
        pool.rmdir()
        pool.symlink_to(target)
        mgr.save(big_state(3), 3)  # writes new files: nothing is taken through the link
        loaded, ckpt = mgr.load()
        assert ckpt[0] == 3 and torch.equal(loaded["w"], big_state(3)["w"])
        assert len(list(target.iterdir())) >= 3


def test_the_pool_forgets_files_taken_or_drained(tmp_path: Path) -> None:
    """Every name pooled stayed in the pool's own list until close: memory, and unlinks at
    close, grew with every chunk file ever retired in a long job."""
    from localckpt.storage.recycle import FilePool

    session = tmp_path / "s"
    session.mkdir()
    pool = FilePool(session)
    for save in range(20):
        shard = session / f".trash-{save}"
        (shard / "data" / "c").mkdir(parents=True)
        for i in range(4):
            (shard / "data" / "c" / str(i)).write_bytes(b"x" * 16)
        pool.add_chunks_of(shard)
        for i in range(3):  # the next save takes three, the last is drained
            target = session / f"taken-{save}-{i}"
            assert pool.take(target)
            target.unlink()
        pool.drain(None)
    assert pool._added == set()


def test_draining_the_pool_stops_at_its_deadline(tmp_path: Path) -> None:
    """The space check's retry drained the whole pool however long it took (0.4 s per GiB of
    tmpfs), inside an exchange whose peers wait one timeout."""
    import time

    from localckpt.storage.recycle import FilePool

    session = tmp_path / "s"
    session.mkdir()
    pool = FilePool(session)
    shard = session / ".trash-0"
    (shard / "data" / "c").mkdir(parents=True)
    for i in range(5):
        (shard / "data" / "c" / str(i)).write_bytes(b"x" * 16)
    pool.add_chunks_of(shard)
    pool.drain(deadline=time.monotonic() - 1)  # past already: nothing freed
    assert len(list(pool.path.iterdir())) == 5
    pool.drain(deadline=time.monotonic() + 60)
    assert list(pool.path.iterdir()) == []


def test_a_start_never_deletes_through_a_pool_that_is_a_link(root: Path, tmp_path: Path) -> None:
    """The pool replaced by a symbolic link (never used, as the pool's doc says): a start alone
    in the session removed every name beginning with a dot in the link's target (a home
    directory's .bashrc and .ssh) as half-made pool files."""
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / ".ssh").mkdir(parents=True)
    (elsewhere / ".bashrc").write_text("mine")
    (elsewhere / ".part-0123").write_text("looks like a half-made pool file")
    with LocalCheckpointManager(root, "job", recycle_files=True) as mgr:
        mgr.save({"w": torch.ones(1000)}, 1)
    pool = root / "job" / RECYCLE_DIR
    shutil.rmtree(pool, ignore_errors=True)
    pool.symlink_to(elsewhere)
    with LocalCheckpointManager(root, "job", recycle_files=True) as mgr:
        assert mgr.find_latest() == 1
    assert sorted(p.name for p in elsewhere.iterdir()) == [".bashrc", ".part-0123", ".ssh"]


def test_a_pool_holding_a_stray_entry_still_gives_its_files_back(tmp_path: Path) -> None:
    """A pool is removed whole only when it holds pool files alone; with a stray entry (an
    .nfs* file, something an operator put there) its files still go, the stray stays."""
    from localckpt.storage.layout import remove_leftovers

    pool = tmp_path / "s" / RECYCLE_DIR
    pool.mkdir(parents=True)
    files = [pool / f"{k:020d}-{k:012x}" for k in range(2)]
    for f in files:
        f.write_bytes(bytes(4096))
    (pool / ".nfs0000000001").write_text("held open elsewhere")
    removed = remove_leftovers(tmp_path / "s", None)
    assert sorted(removed) == sorted(files) and sorted(p.name for p in pool.iterdir()) == [
        ".nfs0000000001"]
    (pool / ".nfs0000000001").unlink()
    assert remove_leftovers(tmp_path / "s", None) == [pool] and not pool.exists()


def test_files_pooled_before_a_reboot_are_drained(root: Path) -> None:
    """Pooled files are named by time.monotonic_ns(), which starts again at a boot: on a root
    that survives one (NVMe), files pooled before it looked newer than every later save and
    were never drained (from an attacker review)."""
    import time

    from localckpt.storage.recycle import FilePool

    pool = FilePool(root)
    pool.path.mkdir(parents=True)
    save_started = time.monotonic_ns()
    before_boot = pool.path / f"{time.monotonic_ns() + 10**15:020d}-{'a' * 12}"
    current = pool.path / f"{time.monotonic_ns():020d}-{'b' * 12}"  # since the save started
    before_boot.write_bytes(b"x")
    current.write_bytes(b"x")
    pool.drain(before_ns=save_started)
    assert not before_boot.exists() and current.exists()
