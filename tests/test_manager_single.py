"""LocalCheckpointManager without torch.distributed (a world of one)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from scenarios import digest, make_state

from localckpt import (
    ConfigurationError,
    CorruptShardError,
    InsufficientSpaceError,
    InvalidIterationError,
    LocalCheckpointManager,
    NoCheckpointError,
)
from localckpt.storage import store as store_module


def iterations_on_disk(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("*/iter_*"))


def test_retention_keeps_last_n(root: Path) -> None:
    with LocalCheckpointManager(root, keep_last=2) as mgr:
        for it in (1, 2, 3, 4):
            mgr.save(make_state(0, it), it)
            assert mgr.latest_iteration == it
        assert iterations_on_disk(root) == [3, 4]


def test_load_without_any_checkpoint_raises(root: Path) -> None:
    with LocalCheckpointManager(root) as mgr:
        assert mgr.find_latest() == -1
        with pytest.raises(NoCheckpointError, match="no complete checkpoint"):
            mgr.load()


def test_load_calls_find_latest_when_needed(root: Path) -> None:
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save(make_state(0, 3), 3)
    with LocalCheckpointManager(root, "s") as mgr:
        loaded, ckpt_id = mgr.load()
    assert ckpt_id == (3, 0, "s") and digest(loaded) == digest(make_state(0, 3))


def test_invalid_iterations_leave_the_checkpoint_intact(root: Path) -> None:
    with LocalCheckpointManager(root) as mgr:
        mgr.save(make_state(0, 5), 5)
        for bad in (5, 4, -1, 6.0, True, "7"):
            with pytest.raises(InvalidIterationError):
                mgr.save(make_state(0, 9), bad)  # type: ignore[arg-type]
        assert iterations_on_disk(root) == [5]
        loaded, _ = mgr.load()
        assert digest(loaded) == digest(make_state(0, 5))


def test_insufficient_space_is_detected_before_writing(root: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    with LocalCheckpointManager(root) as mgr:
        mgr.save(make_state(0, 1), 1)
        full = SimpleNamespace(f_bavail=16, f_frsize=4096, f_blocks=1024)  # 64 KiB free
        monkeypatch.setattr(store_module.os, "statvfs", lambda path: full)
        with pytest.raises(InsufficientSpaceError, match="--shm-size"):
            mgr.save(make_state(0, 2), 2)
        monkeypatch.undo()
        assert iterations_on_disk(root) == [1]
        assert mgr.find_latest() == 1


def test_corrupt_shard_error_names_file(root: Path) -> None:
    with LocalCheckpointManager(root) as mgr:
        mgr.save({"w": torch.ones(1000)}, 1)
    chunk = next(root.rglob("data/c/0"))
    raw = bytearray(chunk.read_bytes())
    raw[0] ^= 1
    chunk.write_bytes(raw)
    with LocalCheckpointManager(root) as mgr, pytest.raises(CorruptShardError) as info:
        mgr.load()
    assert str(chunk) in str(info.value)


def test_staging_arena_is_reused_across_saves(root: Path) -> None:
    with LocalCheckpointManager(root) as mgr:
        for it in range(4):
            mgr.save(make_state(0, it), it)
        assert mgr._save._arena.allocations == 1
        mgr.save({"big": torch.zeros(1 << 20)}, 10)
        assert mgr._save._arena.allocations == 2


def test_many_small_tensors_are_packed_into_few_chunk_files(root: Path) -> None:
    state = {f"t{i}": torch.full((64,), float(i)) for i in range(3000)}
    with LocalCheckpointManager(root) as mgr:
        mgr.save(state, 1)
        loaded, _ = mgr.load()
    assert len(list(root.rglob("data/c/*"))) == 1
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_an_async_save_runs_and_is_finalized_without_a_queue(root: Path) -> None:
    """The save's work starts with the save: a request nobody schedules is finalized by the
    next call (and scheduling it late finalizes nothing twice)."""
    started = time.monotonic()
    with LocalCheckpointManager(root, timeout=60) as mgr:
        request = mgr.save({"w": torch.ones(1)}, 1, is_async=True)
        assert request is not None
        assert mgr.find_latest() == 1
        request.execute_sync()  # already finalized: a no-op
        mgr.save({"w": torch.ones(1)}, 2)
        assert mgr.find_latest() == 2
    assert time.monotonic() - started < 30


def test_bad_replication_strategies_are_rejected_clearly(root: Path) -> None:
    with pytest.raises(ConfigurationError, match="repl_strategy: expected None"):
        LocalCheckpointManager(root, repl_strategy=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"expected one of \['clique'.*got 'mirror'"):
        LocalCheckpointManager(root, repl_strategy="mirror")
    with pytest.raises(ConfigurationError, match=r"needs 2 nodes, the job has 1.*strict"):
        LocalCheckpointManager(root, repl_strategy="node_spread", strict=True)
    with LocalCheckpointManager(root, repl_strategy="none") as mgr:  # same as None
        mgr.save({"w": torch.ones(2)}, 1)
        assert mgr.load()[0]["w"].sum() == 2


@pytest.mark.parametrize("kwargs,text", [
    ({"keep_last": 0}, "keep_last"), ({"timeout": 0}, "timeout"),
    ({"chunk_nbytes": 10}, "chunk_nbytes"), ({"io_threads": 0}, "io_threads"),
    ({"session_id": "../up"}, "session_id"),
])
def test_bad_arguments_are_configuration_errors(root: Path, kwargs: dict[str, Any],
                                                text: str) -> None:
    with pytest.raises(ConfigurationError, match=text):
        LocalCheckpointManager(root, **kwargs)


def test_root_that_is_a_file_is_rejected(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.touch()
    with pytest.raises(ConfigurationError, match="expected a directory"):
        LocalCheckpointManager(f)


def test_empty_state_dict_roundtrips(root: Path) -> None:
    with LocalCheckpointManager(root) as mgr:
        mgr.save({}, 0)
        assert mgr.load()[0] == {}


def test_tensors_straddling_chunk_boundaries_load_exactly(root: Path) -> None:
    # 4 KiB chunks, odd tensor sizes: pieces of one tensor span chunks, gaps hold padding.
    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randint(-100, 100, (n,), generator=g, dtype=torch.int16)
             for i, n in enumerate([1, 2047, 2049, 5, 0, 6001, 3, 4096, 77])}
    with LocalCheckpointManager(root, chunk_nbytes=4096) as mgr:
        mgr.save(state, 1)
        loaded, _ = mgr.load()
    assert len(list(root.rglob("data/c/*"))) > 5
    assert digest(loaded) == digest(state)


def test_leftovers_of_any_writer_are_removed_when_a_job_starts(root: Path) -> None:
    """After a node replacement ranks may move between nodes: a leftover written by rank 1 on
    this node must not outlive the restart just because rank 1 now runs elsewhere."""
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save(make_state(0, 1), 1)
    it = root / "s" / "iter_0000000001"
    theirs = it / ".tmp-rank_00001_of_00002-w00001-0123456789ab"
    (theirs / "data").mkdir(parents=True)
    (it / ".trash-rank_00003_of_00004-w00003-0123456789ab").mkdir()
    with LocalCheckpointManager(root, "s") as mgr:
        assert not list(it.glob(".*"))
        assert mgr.find_latest() == 1


def test_round_trip_when_the_layout_is_not_in_state_dict_order(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, small CUDA tensors are packed first, ahead of their state-dict order; readers
    must not depend on offsets growing (made to happen here with small CPU tensors)."""
    from localckpt.save import staging
    from localckpt.state_dict import as_tensor_aware

    monkeypatch.setattr(staging, "GATHER_MAX_NBYTES", 4096)
    state = make_state(0, 1)
    offsets = staging.plan_layout(as_tensor_aware(state).tensors).offsets
    assert list(offsets) != sorted(offsets)
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save(state, 1)
    with LocalCheckpointManager(root, "s") as mgr:
        loaded, _ = mgr.load()
    assert digest(loaded) == digest(make_state(0, 1))


# ------------------------------------------------------------------ airtight core


def _flip(path: Path, at: int = 0) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x20
    path.write_bytes(raw)


def test_corrupt_newest_falls_back_to_the_older_kept_one_in_the_same_load(
        root: Path, caplog: pytest.LogCaptureFixture) -> None:
    with LocalCheckpointManager(root, "s", keep_last=2) as mgr:
        for it in (1, 2):
            mgr.save(make_state(0, it), it)
    chunk = root / "s" / "iter_0000000002" / "rank_00000_of_00001" / "data" / "c" / "0"
    _flip(chunk)
    with LocalCheckpointManager(root, "s", keep_last=2) as mgr:
        assert mgr.find_latest() == 2
        loaded, ckpt_id = mgr.load()
        assert ckpt_id == (1, 0, "s") and digest(loaded) == digest(make_state(0, 1))
        assert mgr.latest_iteration == 1
        assert mgr.find_latest() == 1  # a restart now would not choose it again
    assert str(chunk) in caplog.text and "quarantine" in caplog.text
    assert iterations_on_disk(root) == [1]  # the corrupt one moved aside, not listed
    with LocalCheckpointManager(root, "s", keep_last=2) as mgr:
        mgr.save(make_state(0, 3), 3)  # and the next save frees its space
    assert not list((root / "s").glob(".quarantine-*"))


def test_a_corrupt_only_checkpoint_is_reported_once_then_the_job_starts_fresh(root: Path) -> None:
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save(make_state(0, 4), 4)
    chunk = next(root.rglob("data/c/0"))
    _flip(chunk)
    with LocalCheckpointManager(root, "s") as mgr, pytest.raises(CorruptShardError) as info:
        mgr.load()
    assert str(chunk) in str(info.value)
    with LocalCheckpointManager(root, "s") as mgr:
        assert mgr.find_latest() == -1  # no restart loop on the same corrupt shard


def test_iterations_beyond_the_name_width_are_refused_up_front(root: Path) -> None:
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save(make_state(0, 1), 1)
        with pytest.raises(InvalidIterationError, match="10 digits"):
            mgr.save(make_state(0, 2), 10**10)
        mgr.save(make_state(0, 2), 10**10 - 1)  # the largest that fits
        assert mgr.find_latest() == 10**10 - 1
    assert sorted(p.name for p in (root / "s").iterdir() if p.name.startswith("iter_")) == [
        "iter_9999999999"]


def test_a_root_reached_through_a_symlink_is_refused_unless_allowed(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(ConfigurationError, match="symbolic link"):
        LocalCheckpointManager(link)
    with LocalCheckpointManager(link, allow_unsafe_root=True) as mgr:
        mgr.save({"w": torch.ones(3)}, 1)
    (real / "s2").symlink_to(tmp_path)  # a session directory planted as a link
    with pytest.raises(ConfigurationError, match="symbolic link"):
        LocalCheckpointManager(real, "s2")


def test_a_root_owned_by_another_user_is_refused_unless_allowed(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    if os.geteuid() == 0:
        os.chown(root, 4242, 4242)  # another (non-root) user's directory
        owner = 4242
    else:  # the directory is ours: this process pretends to be someone else
        owner = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: owner + 4242)
    with pytest.raises(ConfigurationError, match=f"owned by uid {owner}"):
        LocalCheckpointManager(root)
    with LocalCheckpointManager(root, allow_unsafe_root=True) as mgr:
        mgr.save({"w": torch.ones(3)}, 1)


def test_a_root_owned_by_root_is_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    """/dev/shm itself, or a Kubernetes emptyDir (root, 0777): root could read our files anyway.
    A root everyone may rename entries in is worth a warning, not a refusal."""
    import os
    import stat

    from localckpt.storage import fsutil

    shared = tmp_path / "emptydir"
    shared.mkdir()
    os.chmod(shared, 0o777)
    real_lstat = os.lstat

    def as_root_owned(path: Any) -> os.stat_result:
        st = real_lstat(path)
        if Path(str(path)) == shared:
            fields = list(st)
            fields[stat.ST_UID] = 0
            return os.stat_result(fields)
        return st

    monkeypatch.setattr(fsutil.os, "lstat", as_root_owned)
    monkeypatch.setattr(fsutil.os, "geteuid", lambda: 1000)
    fsutil.check_safe_dir(shared, "root_local_ckpt_dir", False)
    assert "writable by every user" in caplog.text


def test_links_are_checked_along_the_path_the_kernel_resolves(tmp_path: Path) -> None:
    """mine -> theirs -> real: the link of another user is on the way although the path names
    only mine."""
    import os

    from localckpt.storage.fsutil import check_safe_dir, links_followed

    real = tmp_path / "real"
    (real / "ck").mkdir(parents=True)
    theirs = tmp_path / "theirs"
    theirs.symlink_to(real)
    mine = tmp_path / "mine"
    mine.symlink_to(theirs)
    assert [link for link, _ in links_followed(mine / "ck")] == [mine, theirs]
    (tmp_path / "x").mkdir()
    assert [link for link, _ in links_followed(tmp_path / "x" / ".." / "mine" / "ck")] == [
        mine, theirs]
    if os.geteuid() == 0:  # only root can give a link to another user
        os.lchown(theirs, 4242, 4242)
        with pytest.raises(ConfigurationError, match=r"symbolic link .*theirs of uid 4242"):
            check_safe_dir(mine / "ck", "root_local_ckpt_dir", False)


def test_created_directories_are_made_durable(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """On NVMe a new directory entry is durable only once its parent is fsynced."""
    import os

    opened: dict[int, str] = {}
    synced: list[str] = []
    real_open, real_fsync = os.open, os.fsync

    def spy_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd = real_open(path, flags, *args, **kwargs)
        opened[fd] = str(path)
        return fd

    def spy_fsync(fd: int) -> None:
        synced.append(opened.get(fd, "?"))
        real_fsync(fd)

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "fsync", spy_fsync)
    root = tmp_path / "new" / "ckpt"
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save({"w": torch.ones(3)}, 1)
    assert str(root.parent) in synced  # the root's own entry
    assert str(root) in synced  # the session directory's entry
    assert str(root / "s") in synced  # the iteration directory's entry


def test_a_closed_manager_frees_its_memory_without_the_garbage_collector(root: Path) -> None:
    """No reference cycle holds a closed manager (and its staging arena, as large as a shard)
    until the cyclic collector runs: loads pause that collector."""
    import gc
    import weakref

    was = gc.isenabled()
    gc.disable()
    try:
        mgr = LocalCheckpointManager(root, "s")
        mgr.save({"w": torch.ones(1 << 20)}, 1)
        mgr.close()
        assert mgr._save._arena.capacity == 0
        ref = weakref.ref(mgr)
        del mgr
        assert ref() is None
    finally:
        if was:
            gc.enable()


def test_a_restart_load_is_one_collective_after_find_latest(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The load right after find_latest plans from the inventories find_latest gathered, and
    with every shard on its own node it verifies and builds in one step; a save in between
    makes the load list again."""
    from localckpt.control.collectives import CheckpointGroup

    steps: list[str] = []
    real = CheckpointGroup.gather_outcomes

    def spy(self: CheckpointGroup, step: str, *args: Any, **kwargs: Any) -> Any:
        steps.append(step)
        return real(self, step, *args, **kwargs)

    with LocalCheckpointManager(root, "s", keep_last=2) as mgr:
        mgr.save(make_state(0, 1), 1)
        mgr.save(make_state(0, 2), 2)
    monkeypatch.setattr(CheckpointGroup, "gather_outcomes", spy)
    with LocalCheckpointManager(root, "s", keep_last=2) as mgr:
        steps.clear()
        assert mgr.find_latest() == 2
        loaded, _ = mgr.load()
        assert steps == ["find_latest", "load of iteration 2: verify sources"]
        assert digest(loaded) == digest(make_state(0, 2))
        mgr.find_latest()
        mgr.save(make_state(0, 3), 3)
        steps.clear()
        mgr.load()
        assert steps[0] == "load of iteration 3: inventory"


def test_reserve_prepares_the_arena_so_the_first_save_allocates_nothing(root: Path) -> None:
    state = {"w": torch.randn(1 << 18), "b": torch.randn(10)}
    with LocalCheckpointManager(root) as mgr:
        nbytes = mgr.reserve(state)
        assert nbytes >= (1 << 20) + 40
        assert mgr._save._arena.allocations == 1 and mgr._save._arena.capacity >= nbytes
        assert not mgr._save._arena.buffer(nbytes).any()  # touched: zero-filled
        mgr.save(state, 1)
        assert mgr._save._arena.allocations == 1  # the save reused it
        assert mgr.reserve(state) == nbytes and mgr._save._arena.allocations == 1
        loaded, _ = mgr.load()
    assert torch.equal(loaded["w"], state["w"])
    with pytest.raises(TypeError, match="object"), LocalCheckpointManager(root) as mgr:
        mgr.reserve({"x": object()})


def test_the_receive_ring_is_reserved_whole() -> None:
    from localckpt.storage.peer_io import PieceRing

    ring = PieceRing()
    ring.reserve(1000)
    assert all(ring.slot(k, 1000).numel() == 1000 and not ring.slot(k, 1000).any()
               for k in range(ring.slots))


def test_reserving_the_ring_never_writes_into_a_buffer_already_handed_out() -> None:
    """``reserve`` may run while a load's write-back receives into the ring on its thread: a
    buffer that thread was given must never be zeroed under it (a chunk checksummed, then
    zeroed, then written would commit zeros under a matching trailer)."""
    from localckpt.storage.peer_io import PieceRing

    taken: list[torch.Tensor] = []

    class Interleaved(PieceRing):
        def slot(self, index: int, nbytes: int) -> torch.Tensor:
            buf = super().slot(index, nbytes)
            if not taken:  # the write-back thread takes the slot right now
                taken.append(super().slot(index, nbytes).fill_(7))
            return buf

    ring = Interleaved(slots=1)
    ring.reserve(4096)
    assert all(bool((b == 7).all()) for b in taken)
    assert ring.slot(0, 4096).numel() == 4096


class BlockedDeletions:
    """The reaper's rmtree, held until :meth:`release` (or a safety timer) lets it go."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import shutil
        import threading
        self.gate, self.done = threading.Event(), threading.Event()
        real = shutil.rmtree

        def held(path: Any, *args: Any, **kwargs: Any) -> None:
            self.gate.wait(30)
            real(path, *args, **kwargs)
            self.done.set()

        monkeypatch.setattr(store_module.shutil, "rmtree", held)
        self.timer = threading.Timer(20, self.gate.set)
        self.timer.start()

    def release(self) -> None:
        self.gate.set()
        self.timer.cancel()


def test_a_save_does_not_wait_for_the_previous_retention(root: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    with LocalCheckpointManager(root, keep_last=1) as mgr:
        mgr.save(make_state(0, 1), 1)
        blocked = BlockedDeletions(monkeypatch)
        mgr.save(make_state(0, 2), 2)  # its retention hides iteration 1 and deletes it: held
        mgr.save(make_state(0, 3), 3)
        returned_while_held = not blocked.gate.is_set()
        blocked.release()
        assert returned_while_held  # the training thread never waited on the reaper
        assert mgr.find_latest() == 3
    assert iterations_on_disk(root) == [3]


def test_a_save_that_fits_only_once_retention_freed_space_waits_for_it(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os as os_module
    import threading
    with LocalCheckpointManager(root, keep_last=1) as mgr:
        mgr.save(make_state(0, 1), 1)
        blocked = BlockedDeletions(monkeypatch)
        mgr.save(make_state(0, 2), 2)
        real_statvfs = os_module.statvfs
        full = SimpleNamespace(f_bavail=16, f_frsize=4096, f_blocks=1024)  # 64 KiB free

        def statvfs(path: Any) -> Any:
            return real_statvfs(path) if blocked.done.is_set() else full

        monkeypatch.setattr(store_module.os, "statvfs", statvfs)
        threading.Timer(0.3, blocked.release).start()
        mgr.save(make_state(0, 3), 3)  # no room until iteration 1's deletion is done
        assert blocked.done.is_set()
        monkeypatch.undo()
        assert mgr.find_latest() == 3


def test_a_replicating_strategy_on_one_machine_warns_and_saves_without_replicas(
        root: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The README's snippet, run as it is on one machine (issue 20, item 5).
    with caplog.at_level("WARNING", logger="localckpt"), \
            LocalCheckpointManager(root, repl_strategy="node_spread") as mgr:
        mgr.save(make_state(0, 1), 1)
        loaded, ckpt = mgr.load()
    assert ckpt[0] == 1 and digest(loaded) == digest(make_state(0, 1))
    assert "needs 2 nodes, the job has 1" in caplog.text and "losing it loses" in caplog.text


def test_a_manager_starting_beside_a_live_one_leaves_its_writes_alone(root: Path) -> None:
    """A second process of the session on this node (an evaluation job that loads the latest
    checkpoint) must not remove a live writer's temporary directory: that writer would then
    commit a shard whose chunk files are gone."""
    from localckpt.storage.layout import session_dir
    from localckpt.storage.session_lock import SessionLock

    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save(make_state(0, 1), 1)
    it = root / "s" / "iter_0000000002"
    live = it / ".tmp-rank_00000_of_00001-w00000-0123456789ab"
    (live / "data" / "c").mkdir(parents=True)
    (live / "data" / "c" / "0").write_bytes(b"x")
    holder = SessionLock(session_dir(root, "s"), exclusive=False)  # the live job's manager
    try:
        with LocalCheckpointManager(root, "s") as second:
            assert (live / "data" / "c" / "0").exists()
            assert second.find_latest() == 1
    finally:
        holder.release()
    with LocalCheckpointManager(root, "s"):  # alone again: the leftover goes
        assert not live.exists()


@pytest.mark.parametrize("signals", ["SIGTERM", [99999]])
def test_a_refused_preemption_setting_leaves_nothing_held(root: Path, signals: Any) -> None:
    from localckpt.errors import ConfigurationError
    from localckpt.storage.layout import session_dir
    from localckpt.storage.session_lock import SessionLock

    for _ in range(2):
        with pytest.raises(ConfigurationError, match="preemption_signals"):
            LocalCheckpointManager(root, "s", preemption_signals=signals)
    SessionLock(session_dir(root, "s"), exclusive=True).release()  # gc could go in


@pytest.mark.parametrize("bad, shown", [(True, "bool True"), (3.0, "float 3.0"),
                                        ("3", "str '3'")])
def test_a_bad_iteration_is_named_with_its_own_type(root: Path, bad: Any, shown: str) -> None:
    from localckpt.errors import InvalidIterationError

    with LocalCheckpointManager(root) as mgr, pytest.raises(InvalidIterationError,
                                                            match=f"got {shown}$"):
        mgr.save({"w": torch.ones(2)}, bad)


def _start_on_node(root: str, slow: bool, results: Any) -> None:
    import time as time_

    from localckpt.control import bootstrap

    if slow:  # a large crashed save's leftovers take a while to free
        real = bootstrap.remove_paths

        def slow_removal(*args: Any) -> None:
            time_.sleep(1.5)
            real(*args)
        bootstrap.remove_paths = slow_removal  # type: ignore[assignment]
    try:
        _, lock = bootstrap.open_node_root(Path(root), "job", "n0", True, 0.5)
        results.put((slow, "ok"))
        time_.sleep(2)
        lock.release()
    except Exception as exc:
        results.put((slow, f"{type(exc).__name__}: {exc}"))


def test_node_mates_are_not_held_up_by_a_slow_removal_of_leftovers(root: Path) -> None:
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    results = ctx.Queue()
    first = ctx.Process(target=_start_on_node, args=(str(root), True, results))
    first.start()
    time.sleep(0.3)
    second = ctx.Process(target=_start_on_node, args=(str(root), False, results))
    second.start()
    got = dict(results.get(timeout=30) for _ in range(2))
    first.join(30)
    second.join(30)
    assert got == {True: "ok", False: "ok"}, got
