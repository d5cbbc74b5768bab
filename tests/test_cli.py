"""The ``localckpt`` command against checkpoints made by real managers: a replicated 4-rank job
on 2 simulated nodes, a wiped node, a corrupted chunk, leftovers; text and --json output."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import scenarios
import torch
from dist_harness import run_ranks
from scenarios import make_state

from localckpt import LocalCheckpointManager
from localckpt.ops.cli import main
from localckpt.storage.manifest import FORMAT_VERSION


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Iterations 3 and 5 of a 4-rank job, node_spread F=2, 2 nodes, keep_last=2."""
    tmp = tmp_path_factory.mktemp("cli-job")
    results = run_ranks(scenarios.replicated_save, 4, tmp, str(tmp / "roots"), "node_spread",
                        {"replication_factor": 2}, 2, [3, 5], 2)
    assert all(r.ok for r in results), [r.message for r in results]
    return tmp / "roots"


@pytest.fixture
def roots(job: Path, tmp_path: Path) -> list[Path]:
    copy = tmp_path / "roots"
    shutil.copytree(job, copy)
    return [copy / "node0", copy / "node1"]


def test_ls_shows_coverage_copies_and_a_wiped_node(capsys: pytest.CaptureFixture[str],
                                                   roots: list[Path]) -> None:
    rows = cli_json(capsys, "ls", *map(str, roots))
    assert [(r["iteration"], r["complete"], r["copies_min"], r["copies_max"]) for r in rows] == [
        (3, True, 2, 2), (5, True, 2, 2)]
    assert rows[1]["holders"]["0"] == [str(roots[0]), str(roots[1])] and rows[1]["bytes"] > 0

    shutil.rmtree(roots[1])
    roots[1].mkdir()  # the replacement node: an empty root
    rows = cli_json(capsys, "ls", *map(str, roots))
    assert [(r["iteration"], r["complete"], r["copies_min"]) for r in rows] == [
        (3, True, 1), (5, True, 1)]
    shutil.rmtree(roots[0] / "job" / "iter_0000000005" / "rank_00002_of_00004")
    code, out, _ = run_cli(capsys, "ls", *map(str, roots))
    assert code == 0
    line5 = next(line for line in out.splitlines() if line.split()[1:2] == ["5"])
    assert line5.split()[3] == "NO" and line5.split()[-2:] == ["2", "-"]  # no metrics


def test_inspect_shows_identity_and_tensor_table(capsys: pytest.CaptureFixture[str],
                                                 roots: list[Path]) -> None:
    shard = roots[0] / "job" / "iter_0000000005" / "rank_00001_of_00004"
    code, out, _ = run_cli(capsys, "inspect", str(shard))
    assert code == 0
    assert "iteration 5, owner rank 1 of 4, session 'job'" in out
    assert "model/layer0.weight" in out and "bfloat16" in out and '"hostname"' in out
    doc = cli_json(capsys, "inspect", str(shard))
    assert doc["iteration"] == 5 and doc["identity"]["job"]["nodes"] == 2


def test_verify_passes_then_names_the_corrupt_file(capsys: pytest.CaptureFixture[str],
                                                   roots: list[Path]) -> None:
    assert cli_json(capsys, "verify", *map(str, roots)) == {"verified": 16, "corrupt": [],
                                                               "retired": []}
    chunk = roots[1] / "job" / "iter_0000000005" / "rank_00003_of_00004" / "data" / "c" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[5] ^= 0xFF
    chunk.write_bytes(raw)
    code, out, err = run_cli(capsys, "verify", *map(str, roots))
    assert code == 1
    assert "16 shards verified, 1 corrupt" in out and str(chunk) in out
    assert "[####################] 16/16" in err  # the progress bar


def test_gc_dry_run_then_removal(capsys: pytest.CaptureFixture[str], roots: list[Path]) -> None:
    leftover = roots[0] / "job" / "iter_0000000005" / ".tmp-rank_00000_of_00004-w00000-dead"
    leftover.mkdir()
    # one node's root of two: iterations go only with --partial
    plan = cli_json(capsys, "gc", str(roots[0]), "--dry-run", "--partial")
    old = roots[0] / "job" / "iter_0000000003"
    expected = {str(leftover)} | {str(old / f"rank_{o:05d}_of_00004") for o in range(4)}
    assert plan["dry_run"] and set(plan["removed"]) == expected and leftover.exists()
    done = cli_json(capsys, "gc", str(roots[0]), "--partial")
    assert set(done["removed"]) == expected
    assert not leftover.exists() and not (roots[0] / "job" / "iter_0000000003").exists()
    assert (roots[0] / "job" / "iter_0000000005" / "rank_00000_of_00004").is_dir()


def test_gc_removes_other_world_sizes_when_asked(capsys: pytest.CaptureFixture[str],
                                                 root: Path) -> None:
    with LocalCheckpointManager(root) as mgr:
        mgr.save(make_state(0, 1), 1)
    for owner in (0, 1):  # the job at its new world size saved iteration 2
        _shard(root, 2, owner, 2, session="")
    assert cli_json(capsys, "gc", str(root), "--session", "", "--world-size", "2")["removed"] == [
        str(root / "_default" / "iter_0000000001" / "rank_00000_of_00001")]
    assert [(r["iteration"], r["world_size"]) for r in cli_json(capsys, "ls", str(root))] == [
        (2, 2)]


@pytest.mark.parametrize("world", ["4", "0", "-1"])
def test_gc_world_size_without_a_complete_iteration_of_it_removes_nothing(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, world: str) -> None:
    """A typo in --world-size must not take the session's only checkpoints with it (a job of
    another world size can still load them, resharded)."""
    root = tmp_path / "node0"
    for it in (100, 200):
        for owner in (0, 1):
            _shard(root, it, owner, 2)
    code, _, err = run_cli(capsys, "gc", str(root), "--session", "job", "--world-size", world)
    assert code == 2 and "--world-size" in err and "nothing removed" in err, err
    assert [r["iteration"] for r in cli_json(capsys, "ls", str(root))] == [100, 200]


def test_gc_world_size_keeps_what_is_newer_than_that_world_size_has(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    root = tmp_path / "node0"
    _shard(root, 1, 0, 1)
    _shard(root, 3, 0, 1)  # newer than anything of world size 2: maybe what a job goes back to
    for owner in (0, 1):
        _shard(root, 2, owner, 2)
    assert cli_json(capsys, "gc", str(root), "--session", "job", "--world-size", "2")[
        "removed"] == [str(root / "job" / "iter_0000000001" / "rank_00000_of_00001")]
    assert [(r["iteration"], r["world_size"]) for r in cli_json(capsys, "ls", str(root))] == [
        (2, 2), (3, 1)]


def test_doctor_reports_storage_gpus_versions_and_warns_on_small_roots(
        capsys: pytest.CaptureFixture[str], root: Path) -> None:
    report = cli_json(capsys, "doctor", "--root", str(root), "--expected-bytes", str(1 << 60))
    assert report["root"]["free_bytes"] > 0 and report["root"]["fs"]
    assert report["nvml"] in ("ok", "no NVIDIA driver")
    assert report["versions"]["torch"] and report["versions"]["zarr"]
    assert any("--shm-size" in w for w in report["warnings"])
    code, out, _ = run_cli(capsys, "doctor", "--root", str(root))
    assert code == 0 and "GPUs" in out and "versions" in out


@pytest.mark.parametrize("argv", [
    ["ls", "/nonexistent/root"], ["verify", "/nonexistent"], ["inspect", "/nonexistent"],
    ["gc", "/nonexistent"], ["doctor", "--root", "/nonexistent"], ["ls", "{empty}"],
    ["inspect", "{empty}"]])
def test_bad_paths_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                           argv: list[str]) -> None:
    argv = [a.replace("{empty}", str(tmp_path)) for a in argv]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"localckpt {argv[0]}: error:")
    assert "Traceback" not in err


def test_console_script_runs_as_a_program(root: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "localckpt.ops.cli", "ls", str(root / "none")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "not a directory" in proc.stderr
    assert "Traceback" not in proc.stderr
    exe = Path(sys.executable).parent / "localckpt"
    if exe.exists():  # installed by pip install -e (the README's set-up)
        out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "verify" in out.stdout


# ------------------------------------------------------------------ airtight core


def _shard(root: Path, it: int, owner: int, world: int, session: str = "job",
           save: tuple[str, float] | None = None, nodes: int | None = None) -> Path:
    """A committed shard of (it, owner, world) under ``root``, as a job would leave it;
    ``save``: the (save id, rank 0's clock) it names; ``nodes``: the job's node count."""
    import torch

    from localckpt.storage.manifest import ShardManifest
    from localckpt.storage.space import chunking
    from localckpt.storage.store import ShardStore

    store = ShardStore(root, session, writer_rank=owner, chunk_nbytes=4096)
    size, count = chunking(1000, 4096)
    manifest = ShardManifest(session, it, owner, world, (), {"dict": []}, "plain", 1000, size,
                             count, (), metadata={} if save is None else {
                                 "save_id": save[0], "saved_unix": save[1]},
                             identity={} if nodes is None else {"job": {"nodes": nodes}})
    try:
        return store.write(manifest, torch.zeros(size * count, dtype=torch.uint8))[0].path
    finally:
        store.close()


def _present(*roots: Path) -> list[tuple[int, int]]:
    from localckpt.storage.layout import list_shards

    return sorted((s.iteration, s.owner_rank) for r in roots for s in list_shards(r, "job"))


def test_gc_never_removes_the_only_complete_iteration(capsys: pytest.CaptureFixture[str],
                                                      tmp_path: Path) -> None:
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    # a 2-rank job without replication; rank 1's save of iteration 2 failed
    for it in (1, 2):
        _shard(node0, it, 0, 2)
    _shard(node1, 1, 1, 2)
    # one root alone shows no complete iteration: nothing may go
    assert cli_json(capsys, "gc", str(node0))["removed"] == []
    # both roots: 1 is the only complete one; 2 is newer and may be completed elsewhere
    assert cli_json(capsys, "gc", str(node0), str(node1))["removed"] == []
    assert _present(node0, node1) == [(1, 0), (1, 1), (2, 0)]
    _shard(node1, 2, 1, 2)
    _shard(node0, 3, 0, 2)
    done = cli_json(capsys, "gc", str(node0), str(node1))
    assert sorted(done["removed"]) == sorted(
        str(r / "job" / "iter_0000000001" / f"rank_{o:05d}_of_00002")
        for r, o in ((node0, 0), (node1, 1)))
    assert _present(node0, node1) == [(2, 0), (2, 1), (3, 0)]


def test_gc_hides_a_shard_before_freeing_it(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "node0"
    for it in (1, 2):
        _shard(root, it, 0, 1)

    def dies_midway(path: Any, ignore_errors: bool = False, **kwargs: Any) -> None:
        for f in sorted(Path(path).rglob("*"), reverse=True)[:1]:
            f.unlink()  # one file freed, then the process is gone
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        main(["gc", str(root)])
    monkeypatch.undo()
    capsys.readouterr()
    # whatever is still listed is whole: a half-deleted shard is never visible
    assert cli_json(capsys, "verify", str(root))["corrupt"] == []


def test_ls_verify_and_gc_work_on_a_root_with_lost_and_found(capsys: pytest.CaptureFixture[str],
                                                             tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    (root / "lost+found").mkdir(parents=True)
    _shard(root, 1, 0, 1)
    assert [r["iteration"] for r in cli_json(capsys, "ls", str(root))] == [1]
    assert cli_json(capsys, "verify", str(root))["verified"] == 1
    assert cli_json(capsys, "gc", str(root))["removed"] == []


def test_gc_refuses_a_session_a_live_job_holds(capsys: pytest.CaptureFixture[str],
                                              root: Path) -> None:
    with LocalCheckpointManager(root, "job") as mgr:
        mgr.save(make_state(0, 1), 1)
        mgr.save(make_state(0, 2), 2)
        code, _, err = run_cli(capsys, "gc", str(root))
        assert code == 2 and "in use" in err and "job" in err, err
        assert cli_json(capsys, "gc", str(root), "--dry-run")["dry_run"]  # looking is fine
    assert cli_json(capsys, "gc", str(root))["removed"] == []
    assert _present(root) == [(2, 0)]
    # before its first save, a live job's session holds nothing yet: still in use, not "no
    # checkpoints" (the chaos scenario of gc during training met it at 860a6e8)
    with LocalCheckpointManager(root, "fresh"):
        code, _, err = run_cli(capsys, "gc", str(root), "--session", "fresh")
        assert code == 2 and "in use" in err, err


def test_gc_world_size_is_scoped_to_one_session(capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path) -> None:
    """Two jobs share a root: removing one job's old world size must not touch the other's."""
    root = tmp_path / "node0"
    _shard(root, 1, 0, 2, session="old")
    _shard(root, 2, 0, 1, session="old")
    _shard(root, 5, 0, 1, session="other")
    code, _, err = run_cli(capsys, "gc", str(root), "--world-size", "1")
    assert code == 2 and "--session" in err
    assert cli_json(capsys, "gc", str(root), "--session", "old", "--world-size", "1")[
        "removed"] == [str(root / "old" / "iter_0000000001" / "rank_00000_of_00002")]
    assert [(r["session"], r["iteration"]) for r in cli_json(capsys, "ls", str(root))] == [
        ("old", 2), ("other", 5)]


@pytest.mark.parametrize("argv", [["--keep-last", "0"], ["--keep-last", "-1"]])
def test_gc_keep_last_below_one_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                           argv: list[str]) -> None:
    root = tmp_path / "node0"
    for it in (1, 2):
        _shard(root, it, 0, 1)
    code, _, err = run_cli(capsys, "gc", str(root), *argv)
    assert code == 2 and "--keep-last" in err
    assert _present(root) == [(1, 0), (2, 0)]


def test_gc_given_one_root_twice_does_not_lock_itself_out(capsys: pytest.CaptureFixture[str],
                                                          tmp_path: Path) -> None:
    root = tmp_path / "node0"
    for it in (1, 2):
        _shard(root, it, 0, 1)
    done = cli_json(capsys, "gc", str(root), str(root) + "/")
    assert _present(root) == [(2, 0)] and len(done["removed"]) == 1


def test_deleting_the_lock_by_hand_does_not_let_gc_in(capsys: pytest.CaptureFixture[str],
                                                      root: Path) -> None:
    with LocalCheckpointManager(root, "job") as mgr:
        mgr.save(make_state(0, 1), 1)
        for stray in (root / "job").glob(".lock*"):  # an operator "cleaning a stale lock"
            stray.unlink()
        code, _, err = run_cli(capsys, "gc", str(root))
        assert code == 2 and "in use" in err


def test_verify_tells_a_damaged_version_from_another_format(capsys: pytest.CaptureFixture[str],
                                                           tmp_path: Path) -> None:
    root = tmp_path / "node0"
    meta = _shard(root, 1, 0, 1) / "zarr.json"
    text = meta.read_text()
    assert f'"format_version":{FORMAT_VERSION}' in text
    meta.write_text(text.replace(f'"format_version":{FORMAT_VERSION}', '"format_version":7'))
    code, out, _ = run_cli(capsys, "verify", str(root))
    assert code == 1 and "CORRUPT" in out and "checksum mismatch" in out


def test_verify_reports_an_unreadable_shard_and_goes_on(capsys: pytest.CaptureFixture[str],
                                                       tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    root = tmp_path / "node0"
    first = _shard(root, 1, 0, 1)
    for it in (2, 3):
        _shard(root, it, 0, 1)
    real_open = os.open

    def no_permission(path: Any, flags: int, *args: Any) -> int:
        if str(path).startswith(str(first / "data")):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_permission)
    code, out, _ = run_cli(capsys, "verify", str(root))
    assert code == 1 and "3 shards verified" in out
    assert f"UNREADABLE {first}" in out and out.count("UNREADABLE") == 1


def test_ls_verify_and_gc_count_rebuildable_iterations_of_erasure_coding(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """3+1 on 4 nodes, iterations 5 and 7 kept: with node 1 lost, both are still complete (its
    shards rebuild from parity), so gc --keep-last 1 removes 5 and keeps 7; parity blocks are
    verified like shards."""
    import erasure_scenarios

    base = tmp_path / "roots"
    results = run_ranks(erasure_scenarios.save, 4, tmp_path, str(base), 3, 1, 1, [5, 7], 2)
    assert all(r.ok for r in results), [r.message for r in results]
    roots = [base / f"node{n}" for n in range(4)]
    assert cli_json(capsys, "verify", *map(str, roots)) == {"verified": 12, "corrupt": [],
                                                           "retired": []}
    shutil.rmtree(roots[1])
    roots[1].mkdir()
    rows = cli_json(capsys, "ls", *map(str, roots))
    assert [(r["iteration"], r["complete"], r["missing_owners"]) for r in rows] == [
        (5, True, [1]), (7, True, [1])]
    done = cli_json(capsys, "gc", *map(str, roots), "--keep-last", "1")
    assert {Path(p).parent.name for p in done["removed"]} == {"iter_0000000005"}
    assert sorted(p.name for p in (roots[3] / "job" / "iter_0000000007").iterdir()) == [
        "parity_00000_00_of_00004", "rank_00003_of_00004"]


def test_a_parity_block_of_another_save_makes_no_iteration_complete_for_gc(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import erasure_scenarios

    for name in ("roots", "other"):
        results = run_ranks(erasure_scenarios.save, 4, tmp_path, str(tmp_path / name), 3, 1, 1,
                            [7])
        assert all(r.ok for r in results), [r.message for r in results]
    roots = [tmp_path / "roots" / f"node{n}" for n in range(4)]
    block = "job/iter_0000000007/parity_00000_00_of_00004"
    shutil.rmtree(roots[3] / block)
    shutil.copytree(tmp_path / "other" / "node3" / block, roots[3] / block)
    shutil.rmtree(roots[1])
    roots[1].mkdir()
    rows = cli_json(capsys, "ls", *map(str, roots))
    assert [(r["iteration"], r["complete"]) for r in rows] == [(7, False)]


def test_a_forged_deeply_nested_manifest_is_one_line_not_a_traceback(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    root = tmp_path / "node0"
    _shard(root, 1, 0, 1)
    forged = _shard(root, 2, 0, 1)
    (forged / "zarr.json").write_text("[" * 200_000 + "]" * 200_000)
    code, _, err = run_cli(capsys, "inspect", str(forged))
    assert code == 2 and len(err.strip().splitlines()) == 1 and str(forged) in err
    code, out, _ = run_cli(capsys, "ls", str(root))  # the listing goes on without its metrics
    assert code == 0 and [line.split()[1] for line in out.splitlines()[1:]] == ["1", "2"]
    code, out, _ = run_cli(capsys, "gc", "--dry-run", "--keep-last", "1", str(root))
    assert code == 0


def test_shard_names_in_a_bucket_are_read_as_strictly_as_on_disk() -> None:
    from localckpt.ops.cli_object import _worlds

    names = ["rank_0_001_of_00002", "rank_00001XXXX00002", "rank_0000x_of_00002",
             "rank_\u0660\u0660\u0660\u0660\u0661_of_00002", "rank_00003_of_00002",
             "rank_00001_of_00002", "COMMITTED-00002.json"]
    assert _worlds(names) == {2: [1]}


def test_verify_and_ls_beside_a_live_job_do_not_call_a_retired_shard_corrupt(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A live job's retention renames shards away while verify reads them: that is not a
    damaged shard, and a file gone from under ls's size count is no error."""
    from localckpt.storage import store as store_module

    root = tmp_path / "node0"
    first = _shard(root, 1, 0, 1)
    _shard(root, 2, 0, 1)
    real = store_module.ShardStore.read

    def retired_while_read(self: Any, ref: Any, *args: Any, **kwargs: Any) -> Any:
        if ref.path == first:
            shutil.rmtree(first)  # retention got there first
        return real(self, ref, *args, **kwargs)

    monkeypatch.setattr(store_module.ShardStore, "read", retired_while_read)
    code, out, _ = run_cli(capsys, "verify", str(root))
    assert code == 0 and "0 corrupt" in out and f"RETIRED {first}" in out, out
    monkeypatch.undo()

    real_size = Path.stat
    gone = root / "job" / "iter_0000000002" / "rank_00000_of_00001" / "data" / "c" / "0"

    def vanished(self: Path, *args: Any, **kwargs: Any) -> Any:
        if self == gone:
            raise FileNotFoundError(2, "No such file or directory", str(self))
        return real_size(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", vanished)
    code, out, err = run_cli(capsys, "ls", str(root))
    assert code == 0, err


@pytest.mark.parametrize("damage", ["array-metadata", "stray-chunk"])
def test_verify_checks_what_a_plain_zarr_reader_needs_too(capsys: pytest.CaptureFixture[str],
                                                         tmp_path: Path, damage: str) -> None:
    root = tmp_path / "node0"
    shard = _shard(root, 1, 0, 1)
    if damage == "array-metadata":
        (shard / "data" / "zarr.json").write_text("garbage")
    else:
        (shard / "data" / "c" / "77").mkdir()
    code, out, _ = run_cli(capsys, "verify", str(root))
    assert code == 1 and f"CORRUPT {shard}" in out, out


def test_doctor_finds_the_file_system_by_whole_path_components() -> None:
    from localckpt.ops.cli_doctor import fs_type_in

    mounts = ("/dev/sda1 / ext4 rw 0 0\nudev /dev devtmpfs rw 0 0\n"
              "tmpfs /dev/shm tmpfs rw 0 0\n/dev/sdb1 /mnt/my\\040disk xfs rw 0 0\n"
              "overlay /mnt/my\\040disk overlay rw 0 0\n")
    assert fs_type_in(Path("/devel/ckpt"), mounts) == "ext4"
    assert fs_type_in(Path("/dev/shm/x"), mounts) == "tmpfs"
    assert fs_type_in(Path("/dev"), mounts) == "devtmpfs"
    assert fs_type_in(Path("/mnt/my disk/ckpt"), mounts) == "overlay"  # mounted over xfs


def test_gc_collects_the_other_sessions_and_reports_them_when_one_is_in_use(
        capsys: pytest.CaptureFixture[str], root: Path) -> None:
    _shard(root, 1, 0, 1, session="c")
    _shard(root, 2, 0, 1, session="c")
    with LocalCheckpointManager(root, "a") as mgr:
        mgr.save(make_state(0, 1), 1)
        code, out, err = run_cli(capsys, "gc", str(root))
    assert code == 2 and "in use" in err and str(root / "a") in err, err
    assert f"removed {root / 'c' / 'iter_0000000001' / 'rank_00000_of_00001'}" in out, out
    from localckpt.storage.layout import list_shards
    assert [(s.iteration, s.owner_rank) for s in list_shards(root, "c")] == [(2, 0)]


def test_gc_of_a_directory_that_is_no_checkpoint_root_removes_nothing(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`localckpt gc /srv` for `/srv/ckpt`: every subdirectory was taken for a session, and its
    `.recycle` (a Samba recycle bin), `.trash-*` and `.quarantine-*` entries were deleted, exit
    0. Now only names localckpt makes are leftovers, and a root with no checkpoint is refused
    as `ls` refuses it."""
    share = tmp_path / "projects"
    (share / ".recycle" / "alice").mkdir(parents=True)
    (share / ".recycle" / "alice" / "thesis.tex").write_text("recoverable")
    (share / ".quarantine-av").mkdir()
    (share / ".trash-old").mkdir()
    (tmp_path / "ckpt").mkdir()
    assert main(["gc", str(tmp_path)]) == 2
    assert "no localckpt checkpoints" in capsys.readouterr().err
    assert sorted(p.name for p in share.iterdir()) == [".quarantine-av", ".recycle", ".trash-old"]
    # beside a real session, such names are left alone too
    _shard(tmp_path, 1, 0, 1, session="projects")
    assert cli_json(capsys, "gc", str(tmp_path))["removed"] == []
    assert (share / ".recycle" / "alice" / "thesis.tex").exists()
    assert sorted(p.name for p in share.iterdir()) == [
        ".quarantine-av", ".recycle", ".trash-old", "iter_0000000001"]


def test_gc_of_a_session_not_there_is_a_usage_error(capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path) -> None:
    """A mistyped --session removed nothing and exited 0, as if there were nothing to collect."""
    _shard(tmp_path, 1, 0, 1)
    assert main(["gc", str(tmp_path), "--session", "jbo", "--world-size", "7"]) == 2
    assert "--session 'jbo': no such session" in capsys.readouterr().err


def test_gc_does_not_count_an_iteration_whose_copies_are_of_two_saves(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Iteration 2 saved twice, crashes leaving rank 0's shard of one save and rank 1's of the
    other: the job cannot load it and falls back to 1. gc took 2 for complete and deleted 1,
    so the job had nothing left to load."""
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    for node, owner in ((node0, 0), (node1, 1)):
        _shard(node, 1, owner, 2, save=("a" * 32, 100.0))
    _shard(node0, 2, 0, 2, save=("b" * 32, 200.0))
    _shard(node1, 2, 1, 2, save=("c" * 32, 300.0))
    assert cli_json(capsys, "gc", str(node0), str(node1))["removed"] == []
    assert _present(node0, node1) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    # once a save of 3 covers every rank, 1 goes (2 is older than the newest complete one)
    for node, owner in ((node0, 0), (node1, 1)):
        _shard(node, 3, owner, 2, save=("d" * 32, 400.0))
    done = cli_json(capsys, "gc", str(node0), str(node1))
    assert _present(node0, node1) == [(3, 0), (3, 1)], done


def test_gc_of_some_nodes_roots_keeps_every_iteration(capsys: pytest.CaptureFixture[str],
                                                      tmp_path: Path) -> None:
    """3 nodes, node_spread F=2, iterations 1 and 2; a rollback to 1 wrote its fence on node 0
    only before a crash, so the job's checkpoint is 1. gc given node 1 and node 2 did not see
    the fence, kept 2 and deleted 1 on both: the job had nothing left to load. With fewer
    roots than the job has nodes, gc removes leftovers only (unless --partial)."""
    from localckpt.storage.rollback_fence import write_fence

    nodes = [tmp_path / f"node{i}" for i in range(3)]
    for it in (1, 2):
        for i, node in enumerate(nodes):
            for owner in (i, (i - 1) % 3):
                _shard(node, it, owner, 3, nodes=3)
    write_fence(nodes[0] / "job", ((1, 3, None),), "w00000")
    leftover = nodes[1] / "job" / "iter_0000000002" / ".tmp-rank_00001_of_00003-w00001-dead"
    leftover.mkdir()
    code, out, err = run_cli(capsys, "gc", str(nodes[1]), str(nodes[2]), "--json")
    assert code == 0 and json.loads(out)["removed"] == [str(leftover)], (out, err)
    assert "roots of 2 of the job's 3 nodes" in err
    assert _present(nodes[1], nodes[2]) == [(1, 0), (1, 1), (1, 1), (1, 2), (2, 0), (2, 1),
                                            (2, 1), (2, 2)]
    # the newest copy on one of the roots given unreadable: the count comes from another
    (nodes[2] / "job" / "iter_0000000002" / "rank_00002_of_00003" / "zarr.json").write_text("{")
    code, out, err = run_cli(capsys, "gc", str(nodes[1]), str(nodes[2]), "--json")
    assert code == 0 and "roots of 2 of the job's 3 nodes" in err, (out, err)
    assert (1, 1) in _present(nodes[1], nodes[2])
    # every node's root: the fence is seen, 2 is hidden, 1 is kept
    assert cli_json(capsys, "gc", *map(str, nodes))["removed"] == []
    assert {it for it, _ in _present(*nodes)} == {1, 2}


def test_gc_after_a_job_shrank_counts_the_nodes_it_runs_on_now(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A job of 4 nodes resumed on 2 (world size 4 -> 2): gc of both roots kept everything
    forever, the old world size's manifests saying 4 nodes."""
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    for it in (1, 2):
        for owner in range(4):
            _shard(node0 if owner < 2 else node1, it, owner, 4, nodes=4)
    for it in (3, 4):
        for node, owner in ((node0, 0), (node1, 1)):
            _shard(node, it, owner, 2, nodes=2)
    done = cli_json(capsys, "gc", str(node0), str(node1), "--session", "job",
                    "--world-size", "2")
    assert {Path(p).parent.name for p in done["removed"]} == {
        "iter_0000000001", "iter_0000000002", "iter_0000000003"}, done


def test_gc_removes_a_pool_and_a_fence_temporary_a_crash_left(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A session holding only a pool of recycled files (reserve() filled it, then the job died
    before its first commit) was skipped as no session; a fence's temporary file (a plain
    file) was reported removed and stayed."""
    pool = tmp_path / "job" / ".recycle"
    pool.mkdir(parents=True)
    for k in range(3):
        (pool / f"{k:020d}-{k:012x}").write_bytes(bytes(4096))
    assert cli_json(capsys, "gc", str(tmp_path))["removed"] == [str(pool)]
    assert not pool.exists()
    pool.mkdir()
    (pool / f"{7:020d}-{7:012x}").write_bytes(bytes(4096))
    (pool / ".nfs0000000001").write_text("a stray")  # the files go, the stray stays
    assert cli_json(capsys, "gc", str(tmp_path))["removed"] == [
        str(pool / f"{7:020d}-{7:012x}")]
    assert [p.name for p in pool.iterdir()] == [".nfs0000000001"]
    _shard(tmp_path, 1, 0, 1)
    fence_tmp = tmp_path / "job" / f".trash-fence-w00000-{'0' * 32}"
    fence_tmp.write_text("{")
    assert cli_json(capsys, "gc", str(tmp_path))["removed"] == [str(fence_tmp)]
    assert not fence_tmp.exists()


def test_ls_hides_what_a_fence_on_any_root_hides(capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    """A rollback to 1 wrote its fence on node 0 only before a crash: the job hides 2 on every
    root, but ls hid it on node 0 alone and showed 2 complete on node 1's copies."""
    from localckpt.storage.rollback_fence import write_fence

    nodes = [tmp_path / f"node{i}" for i in range(2)]
    for it in (1, 2):
        for node in nodes:
            for owner in (0, 1):
                _shard(node, it, owner, 2)
    write_fence(nodes[0] / "job", ((1, 2, None),), "w00000")
    rows = cli_json(capsys, "ls", *map(str, nodes))
    assert [(r["iteration"], r["complete"]) for r in rows] == [(1, True)], rows


@pytest.mark.parametrize("order", ["A first", "B first"])
def test_ls_and_gc_take_an_iteration_s_metrics_from_the_save_a_load_takes(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, order: str) -> None:
    """Iteration 30 saved twice: node A (away during a rollback to 20) keeps its first save of
    30 (a loss spike, 9.9); node B rolled back and saved 30 again (0.1), then 40. A load takes
    B's 30 (the newest save covering every rank), but ls showed, and gc --keep-best kept by,
    the metrics of whichever copy the roots' order met first: gc removed the best checkpoint
    on both roots (from the attacker review of the CLI)."""
    a, b = tmp_path / "nodeA", tmp_path / "nodeB"

    def state(it: int) -> dict[str, Any]:
        return {"w": torch.full((1000,), float(it))}

    with LocalCheckpointManager(a, "job", keep_last=10) as m:
        for it, loss in ((10, 0.5), (20, 0.4), (30, 9.9)):
            m.save(state(it), it, metrics={"loss": loss})
    shutil.copytree(a, b)  # node B held the same copies (replicas)
    with LocalCheckpointManager(b, "job", keep_last=10) as m:  # node A away
        m.load(iteration=20, discard_newer=True)
        m.save(state(30), 30, metrics={"loss": 0.1})
        m.save(state(40), 40, metrics={"loss": 0.3})
    roots = [str(a), str(b)] if order == "A first" else [str(b), str(a)]
    capsys.readouterr()
    assert main(["ls", *roots, "--json"]) == 0
    rows = {r["iteration"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[30]["metrics"] == {"loss": 0.1}, rows[30]
    assert main(["gc", *roots, "--keep-last", "1", "--keep-best", "1", "--metric", "loss",
                 "--dry-run", "--json"]) == 0
    removed = json.loads(capsys.readouterr().out)["removed"]
    assert not any("iter_0000000030" in p or "iter_0000000040" in p for p in removed), removed
    assert any("iter_0000000020" in p for p in removed), removed


def test_verify_reports_a_shard_marked_as_another_save_too(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A copy restored by hand over a copy of another save of its iteration (cp -a into the
    directory) keeps both saves' markers: every load then sees two saves of the iteration and
    gives it up, while verify said ok (from the attacker review of the CLI)."""
    root = tmp_path / "node0"
    shard = _shard(root, 1, 0, 1, save=("00aa11", 1.0))
    _shard(root, 2, 0, 1)  # written before markers (no save id): nothing to compare
    (marked,) = list((shard / "data").glob("save-*"))
    code, out, _ = run_cli(capsys, "verify", str(root))
    assert code == 0 and "0 corrupt" in out, out
    (shard / "data" / "save-0123abcd").touch()
    code, out, _ = run_cli(capsys, "verify", str(root))
    assert code == 1 and f"CORRUPT {shard}" in out and "save-0123abcd" in out, out
    assert out.count("CORRUPT") == 1 and marked.name in out


def test_an_iteration_no_save_covers_in_view_keeps_its_newest_save_s_metadata(
        tmp_path: Path) -> None:
    """With some nodes' roots only (gc --partial), no save may cover the view while one covers
    the job: the iteration lost its metrics and save time, and --keep-interval or
    --drop-without-metric removed it (from the review of loaded_saves)."""
    from localckpt.ops.cli_common import loaded_saves
    from localckpt.storage.layout import list_shards

    root = tmp_path / "node0"
    _shard(root, 30, 0, 2, save=("bb", 2.0))  # the newer save's copy of rank 0's shard
    _shard(root, 30, 1, 2, save=("aa", 1.0))  # a leftover of the first save
    (meta, covered), = loaded_saves(list_shards(root, "job"), 2).values()
    assert not covered and meta is not None and meta["save_id"] == "bb", meta


def test_gc_reports_what_it_removed_before_a_later_session_failed(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """gc removed session a's old iteration, then failed on session b's damaged fence: it
    printed the error alone (empty --json output), so what it had deleted went unreported
    (from an attacker review). Now every session's removals are reported, the failure after
    them, exit 2; sessions after the failing one are still collected."""
    root = tmp_path / "node0"
    for session in ("a", "c"):
        _shard(root, 1, 0, 1, session=session)
        _shard(root, 2, 0, 1, session=session)
    _shard(root, 1, 0, 1, session="b")
    (root / "b" / "rollback-fence.json").write_text("{")  # damaged
    gone = [root / s / "iter_0000000001" / "rank_00000_of_00001" for s in ("a", "c")]
    for dry in (["--dry-run"], []):
        code, out, err = run_cli(capsys, "gc", str(root), "--json", *dry)
        assert code == 2 and "rollback-fence.json" in err and "'b'" in err, (code, err)
        assert sorted(json.loads(out)["removed"]) == sorted(map(str, gone)), out
        assert all(p.exists() == bool(dry) for p in gone)


def test_a_malformed_record_of_finished_rollbacks_fails_the_cli_as_it_fails_the_job(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """With no fence on any root, ls, gc and verify never read the root's record of finished
    rollbacks: a malformed one passed them (verify: 0 corrupt) while every find_latest, load
    and save of the job raised naming it (from an attacker review). They fail alike now, as
    for a damaged fence: exit 2, naming the file."""
    root = tmp_path / "node0"
    with LocalCheckpointManager(root, "job") as mgr:
        mgr.save(make_state(0, 1), 1)
    record = root / "job" / "rollbacks-done.json"
    record.write_text("{")
    with LocalCheckpointManager(root, "job") as mgr, pytest.raises(Exception, match="rollbacks"):
        mgr.find_latest()
    for argv in (["ls"], ["gc", "--dry-run"], ["verify"]):
        code, out, err = run_cli(capsys, *argv, str(root))
        assert code == 2 and str(record) in err, (argv, code, out, err)


def test_a_stale_fence_does_not_hide_the_durable_tier_s_iterations_after_a_finished_rollback(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """2 ranks, a node each, durable tier D. A rollback to 10: node 0 finished it; node 1 died
    with its fence (and the discarded 20). The job went on, saved 30 and 40 and committed
    them to D; node 1 came back. The job hides nothing of D (a root finished the rollback),
    but D has no record of its own, so ls showed 30 and 40 incomplete and gc --keep-last 1
    removed nothing (from an attacker review). D counts the rollbacks any root finished."""
    from localckpt.storage.durable import commit_path
    from localckpt.storage.rollback_fence import record_done, write_fence
    n0, n1, d = tmp_path / "node0", tmp_path / "node1", tmp_path / "durable"
    for it in (10, 30, 40):
        _shard(n0, it, 0, 2)
        for owner in (0, 1):
            _shard(d, it, owner, 2)
        commit_path(d, "job", it, 2).write_text("{}")
    _shard(n1, 10, 1, 2)
    _shard(n1, 20, 1, 2)
    rollback = "0190000000aadeadbeef"
    write_fence(n1 / "job", ((10, 2, rollback),), "w00001")
    record_done(n0 / "job", [(rollback, 10, 2)], "w00000")
    rows = {r["iteration"]: r for r in cli_json(capsys, "ls", str(n0), str(n1), str(d))}
    assert sorted(rows) == [10, 30, 40] and all(r["complete"] for r in rows.values()), rows
    assert str(d) in rows[30]["holders"]["1"], rows[30]
    removed = cli_json(capsys, "gc", str(n0), str(n1), str(d), "--keep-last", "1",
                       "--dry-run")["removed"]
    assert sorted(Path(p).parent.name for p in removed) == ["iter_0000000010"] * 4 + [
        "iter_0000000030"] * 3, removed
    # without node 0's record, the rollback is unfinished: D's 30 and 40 stay hidden
    (n0 / "job" / "rollbacks-done.json").unlink()
    rows = {r["iteration"]: r for r in cli_json(capsys, "ls", str(n0), str(n1), str(d))}
    assert sorted(rows) == [10], rows


def test_an_iteration_with_a_stray_save_marker_is_not_counted_complete(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A copy marked as another save too (restored with cp -a over another save's copy): a
    load drops the stray marker and loads it, or, where the marker cannot be removed (a
    read-only directory), gives the iteration up and falls back. ls and gc judged by
    manifests alone and counted it complete: gc --keep-last 1 removed the iteration the load
    falls back to (from an attacker review). Until a load removes the marker, it counts as
    not complete."""
    root = tmp_path / "node0"
    for it in (1, 2):
        shard = _shard(root, it, 0, 1, save=(f"00aa1{it}", float(it)))
    (shard / "data" / "save-0123abcd").touch()
    rows = cli_json(capsys, "ls", str(root))
    assert [(r["iteration"], r["complete"]) for r in rows] == [(1, True), (2, False)], rows
    assert cli_json(capsys, "gc", str(root), "--keep-last", "1")["removed"] == []
    (shard / "data" / "save-0123abcd").unlink()  # what the load does
    assert cli_json(capsys, "gc", str(root), "--keep-last", "1")["removed"] == [
        str(root / "job" / "iter_0000000001" / "rank_00000_of_00001")]


def test_a_node_root_holding_a_progress_directory_is_not_taken_for_a_durable_tier(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A rollback to 10 finished on node 0; node 1, back with its fence, still holds the
    discarded 20 (both shards): the job hides it. A ``.persisting`` directory in node 1's
    session (a copied or reused directory) made the CLI take node 1 for a durable tier, count
    the rollback finished there, and so 20 complete: gc --keep-last 1 removed 10 on both
    nodes, the job's only loadable iteration (from an attacker review). A root with a fence
    or a record of its own is a node's."""
    from localckpt.storage.rollback_fence import record_done, write_fence
    n0, n1 = tmp_path / "node0", tmp_path / "node1"
    for owner in (0, 1):
        _shard(n0, 10, owner, 2, nodes=2)
        _shard(n1, 10, owner, 2, nodes=2)
        _shard(n1, 20, owner, 2, nodes=2)
    rollback = "0190000000aadeadbeef"
    write_fence(n1 / "job", ((10, 2, rollback),), "w00001")
    record_done(n0 / "job", [(rollback, 10, 2)], "w00000")
    (n1 / "job" / ".persisting").mkdir()
    rows = cli_json(capsys, "ls", str(n0), str(n1))
    assert [(r["iteration"], r["complete"]) for r in rows] == [(10, True)], rows
    assert cli_json(capsys, "gc", str(n0), str(n1), "--keep-last", "1")["removed"] == []


def test_gc_reports_a_leftover_it_could_not_remove_as_an_error_and_lists_the_same_order_dry(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A leftover whose deletion failed was reported removed, exit 0 (from an attacker
    review); it is an error now, and not in the list. And a dry run lists what the real run
    removes in the same order (2 world sizes over 2 roots)."""
    n0, n1 = tmp_path / "node0", tmp_path / "node1"
    for it in (1, 2, 3):
        for world in (2, 3):
            _shard(n0, it, 0, world)
            _shard(n1, it, 1, world)
        _shard(n1, it, 2, 3)
    argv = ["gc", str(n0), str(n1), "--keep-last", "1", "--partial"]
    plan = cli_json(capsys, *argv, "--dry-run")["removed"]
    assert cli_json(capsys, *argv)["removed"] == plan and len(plan) == 10
    trash = n0 / "job" / ".trash-iter_0000000003-rank_00000_of_00002-w00000-deadbeef0000"
    (trash / "data").mkdir(parents=True)
    import localckpt.storage.layout as layout
    monkeypatch.setattr(layout.shutil, "rmtree", lambda *a, **k: None)
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 2 and str(trash) in err and json.loads(out)["removed"] == [], (out, err)
    assert trash.exists()
