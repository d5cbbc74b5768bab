"""Rollback (issue 24, item 5): iterations() lists what the job can load, load(iteration=N)
loads that one through the same path as the newest, and never silently another."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import mixed_scenarios as mixed
import pytest
import rollback_scenarios as sc
import torch
from dist_harness import run_ranks
from scenarios import digest, make_state

from localckpt import (
    ConfigurationError,
    CorruptShardError,
    InvalidIterationError,
    LocalCheckpointManager,
    NoCheckpointError,
)


def test_iterations_and_load_of_an_older_iteration(root: Path) -> None:
    with LocalCheckpointManager(root, keep_last=3) as mgr:
        assert mgr.iterations() == []
        for it in (1, 2, 3, 4):
            mgr.save(make_state(0, it), it)
        assert mgr.iterations() == [2, 3, 4]
        state, ckpt_id = mgr.load(iteration=2)
        assert ckpt_id[0] == 2 and digest(state) == digest(make_state(0, 2))
        with pytest.raises(NoCheckpointError, match=r"iteration 1 .*not complete.*\[2, 3, 4\]"):
            mgr.load(iteration=1)
        for bad in (-1, 2.0, "3", True):
            with pytest.raises(InvalidIterationError, match="iteration"):
                mgr.load(iteration=bad)  # type: ignore[arg-type]
        state, ckpt_id = mgr.load()  # the newest, as before
        assert ckpt_id[0] == 4


def test_a_corrupt_rollback_target_is_an_error_not_an_older_iteration(root: Path) -> None:
    with LocalCheckpointManager(root, keep_last=3) as mgr:
        for it in (1, 2, 3):
            mgr.save(make_state(0, it), it)
    chunk = next(root.glob("*/iter_0000000002/rank_*/data/c/0"))
    raw = bytearray(chunk.read_bytes())
    raw[3] ^= 0xFF
    chunk.write_bytes(raw)
    with LocalCheckpointManager(root, keep_last=3) as mgr:
        with pytest.raises(CorruptShardError, match=r"iteration 2 can no longer be loaded.*"
                                                    r"quarantined"):
            mgr.load(iteration=2)
        assert mgr.iterations() == [1, 3]
        assert mgr.load(iteration=1)[1][0] == 1


def test_rollback_after_a_node_loss(tmp_path: Path) -> None:
    base = str(tmp_path / "roots")
    assert all(r.ok for r in run_ranks(sc.save, 2, tmp_path, base))
    shutil.rmtree(tmp_path / "roots" / "node1")  # its replacement starts empty
    results = run_ranks(sc.rollback, 2, tmp_path, base)
    assert all(r.ok for r in results), [r.message for r in results]
    for r in results:
        assert r.value == {"iterations": [10, 20, 30], "loaded": 20, "identical": True}
    # the write-back gave the replaced node its copies of iteration 20 again
    assert sorted(p.name for p in (tmp_path / "roots" / "node1" / "job" /
                                   "iter_0000000020").iterdir()) == [
        "rank_00000_of_00002", "rank_00001_of_00002"]


def test_rollback_with_discard_newer_lets_saves_go_on_from_there(root: Path) -> None:
    with LocalCheckpointManager(root, keep_last=4) as mgr:
        for it in (1, 2, 3, 4):
            mgr.save(make_state(0, it), it)
        with pytest.raises(ConfigurationError, match="discard_newer"):
            mgr.load(discard_newer=True)
        state, ckpt_id = mgr.load(iteration=2, discard_newer=True)
        assert ckpt_id[0] == 2 and digest(state) == digest(make_state(0, 2))
        assert mgr.iterations() == [1, 2]
        mgr.save(make_state(0, 33), 3)  # the new 3, not the discarded one
        assert mgr.iterations() == [1, 2, 3]
    with LocalCheckpointManager(root) as mgr:
        assert digest(mgr.load()[0]) == digest(make_state(0, 33))


def test_a_rollback_a_node_dies_in_never_brings_the_discarded_iteration_back(
        tmp_path: Path) -> None:
    """Each rank deleted its root's newer shards after one agreed step: node 1 dying before
    its deletions kept a complete 30 there, and the restarted job loaded the state the
    rollback had discarded."""
    base = str(tmp_path / "roots")
    assert all(r.ok for r in run_ranks(sc.save, 2, tmp_path, base))
    results = run_ranks(sc.rollback_dies_deleting, 2, tmp_path, base, "die")
    assert results[1].error == "Exited", results[1]
    for r in run_ranks(sc.load_newest, 2, tmp_path, base):
        assert r.ok and r.value == {"loaded": 20, "error": None, "is": 20}, r.value


@pytest.mark.parametrize("how", ["lost answer", "died after fence", "died before fence"])
def test_a_rollback_interrupted_at_its_fence_is_finished_never_undone(tmp_path: Path,
                                                                      how: str) -> None:
    """One rank's rollback stops at the fence step while the other goes on and deletes its
    newer shards. Each root's fence hid only that root's shards, and a rank that saw the step
    fail removed its own: the other node's complete 30 came back. Now any root's fence hides
    newer shards on every root, and the next save finishes the rollback everywhere."""
    base = str(tmp_path / "roots")
    assert all(r.ok for r in run_ranks(sc.save, 2, tmp_path, base))
    results = run_ranks(sc.rollback_interrupted, 2, tmp_path, base, how)
    assert results[0].ok and results[0].value.get("loaded") in (20, None), results[0]
    for r in run_ranks(sc.restart_and_save, 2, tmp_path, base, 21):
        assert r.ok, r.message
        assert r.value == {"loaded": 20, "is": 20, "then": [10, 20, 21]}, r.value
    for node in ("node0", "node1"):  # the discarded iteration is gone, and so is the fence
        assert not (tmp_path / "roots" / node / "job" / "iter_0000000030").exists()
        assert not (tmp_path / "roots" / node / "job" / "rollback-fence.json").exists()


def test_a_failed_rollback_leaves_an_earlier_unfinished_one_as_it_was(tmp_path: Path) -> None:
    """A rollback to 20 interrupted (node 0's fence only), then a rollback to 10 whose fence
    step fails alike on every rank: its cancel removed the whole fence file, the earlier
    rollback's included, and 30 came back."""
    base = str(tmp_path / "roots")
    assert all(r.ok for r in run_ranks(sc.save, 2, tmp_path, base))
    run_ranks(sc.rollback_interrupted, 2, tmp_path, base, "died before fence")
    for r in run_ranks(sc.rollback_fails_alike, 2, tmp_path, base):
        assert r.ok and r.value == "RankOSError", (r.value, r.message)
    for r in run_ranks(sc.restart_and_save, 2, tmp_path, base, 21):
        assert r.ok, r.message
        assert r.value == {"loaded": 20, "is": 20, "then": [10, 20, 21]}, r.value


def test_a_rollback_that_failed_after_its_fence_was_written_is_cancelled(tmp_path: Path) -> None:
    """Rank 1's fence was in place when its write failed (the directory's fsync): every rank
    was told the rollback failed, but rank 1 never cancelled a fence it had not seen written,
    so 20 and 30 vanished from find_latest and the next save deleted them (from an attacker
    review)."""
    base = str(tmp_path / "roots")
    assert all(r.ok for r in run_ranks(sc.save, 2, tmp_path, base))
    for r in run_ranks(sc.rollback_fenced_then_fails, 2, tmp_path, base):
        assert r.ok and r.value == "RankOSError", (r.value, r.message)
    for r in run_ranks(sc.restart_and_save, 2, tmp_path, base, 31):
        assert r.ok, r.message
        assert r.value == {"loaded": 30, "is": 30, "then": [20, 30, 31]}, r.value  # keep_last=3


def test_gc_honours_a_fence_any_root_holds(tmp_path: Path) -> None:
    """gc between runs after an interrupted rollback: node 1 (no fence) made 30 look complete,
    so gc kept 30 and deleted 10 and 20 everywhere; the job then had nothing to load."""
    from localckpt.ops.cli import main

    base = tmp_path / "roots"
    assert all(r.ok for r in run_ranks(sc.save, 2, tmp_path, str(base)))
    run_ranks(sc.rollback_interrupted, 2, tmp_path, str(base), "died before fence")
    assert main(["gc", "--keep-last", "1", str(base / "node0"), str(base / "node1")]) == 0
    for r in run_ranks(sc.restart_and_save, 2, tmp_path, str(base), 21):
        assert r.ok, r.message
        assert r.value == {"loaded": 20, "is": 20, "then": [20, 21]}, r.value


def test_a_rollback_whose_deletion_fails_on_one_node_still_goes_on_from_there(
        tmp_path: Path) -> None:
    """A deletion that failed was logged and left 30 listed on that node: the rollback
    returned, and the next save of 21 was refused as older than the newest."""
    base = str(tmp_path / "roots")
    assert all(r.ok for r in run_ranks(sc.save, 2, tmp_path, base))
    results = run_ranks(sc.rollback_dies_deleting, 2, tmp_path, base, "fail")
    for r in results:
        assert r.ok, r.message
        assert r.value["loaded"] == 20 and r.value["listed"] == [10, 20], r.value
    # the save of 21 tries the deletion again first: it fails again, so it is refused alike
    for r in results:
        error = r.value["save_error"]
        assert "rollback to iteration 20" in error and "node1" in error, r.value


@pytest.mark.parametrize("args", [
    ({"iteration": 20}, {"iteration": -1}),
    ({"iteration": 20, "discard_newer": True}, {"iteration": 20, "discard_newer": "yes"}),
    ({"iteration": 20}, {"iteration": 10}),
    ({"iteration": 20, "discard_newer": True}, {"iteration": 20}),
    ({}, {"iteration": 20}),
    ({"iteration": 20}, {"iteration": -1}, "pending"),
], ids=["bad-iteration", "bad-discard", "other-iteration", "other-discard", "one-rollback",
        "async-save-pending"])
def test_load_arguments_bad_or_unlike_on_one_rank_are_one_error_on_every_rank(
        tmp_path: Path, root: Path, args: tuple[Any, ...]) -> None:
    """A bad argument on one rank, or ranks asking for different things, raise the same error
    on every rank at once (before: the others waited out the timeout, or the group broke on
    steps out of order) and nothing is loaded or discarded; the job can load right after.
    With an async save pending, it is finalized first, on every rank (before: the arguments
    rode on its finalize on some ranks only, and the next call found the group out of step)."""
    for r in run_ranks(sc.save, 2, tmp_path, str(root)):
        assert r.ok, r.message
    pending = args[-1] == "pending"
    args = args[:2]
    results = run_ranks(sc.load_with, 2, tmp_path, str(root), list(args), pending,
                        deadline=60)
    errors = {r.value["error"] for r in results if r.ok}
    assert all(r.ok for r in results) and len(errors) == 1, [r.value for r in results]
    (error,) = errors
    bad = "yes" in str(args) or "-1" in str(args)
    assert error == ("InvalidIterationError" if "-1" in str(args) else "ConfigurationError")
    for r in results:
        assert ("rank 1" in r.value["message"]) if bad else ("iteration" in r.value["message"])
        assert r.value["then"] == (40 if pending else 30)  # the group goes on
    for node in ("node0", "node1"):
        assert sorted(p.name for p in (root / node / "job").glob("iter_*")) == [
            "iter_0000000010", "iter_0000000020", "iter_0000000030",
            *(["iter_0000000040"] if pending else [])]


def _saved_twice(tmp_path: Path, root: Path) -> Path:
    """Iterations 10, 20, 30 saved; a copy of rank 1's first shard of 30 kept aside (the
    backup, returned); then a rollback to 20 and 30 saved again, with other states."""
    for r in run_ranks(sc.save, 2, tmp_path, str(root)):
        assert r.ok, r.message
    backup = tmp_path / "first-save-30"
    shutil.copytree(root / "node1" / "job" / "iter_0000000030" / "rank_00001_of_00002", backup)
    for r in run_ranks(sc.resave, 2, tmp_path, str(root), 1000):
        assert r.ok, r.message
    return backup


@pytest.mark.parametrize("exact", [None, 30])
def test_an_iteration_saved_twice_loads_the_save_whose_copies_cover_every_rank(
        tmp_path: Path, root: Path, exact: int | None) -> None:
    """Iteration 30 saved twice (a later run rolled back to 20 and saved 30 again); one rank's
    shard of the first save put back on its own node (a copy restored by hand from a backup).
    Node 0 still holds both shards of the second save: every rank loads that save, never a
    mix of the two, and the stale copy is set aside."""
    backup = _saved_twice(tmp_path, root)
    first = root / "node1" / "job" / "iter_0000000030" / "rank_00001_of_00002"
    shutil.rmtree(first)
    shutil.copytree(backup, first)
    for r in run_ranks(sc.load_newest, 2, tmp_path, str(root), exact):
        assert r.ok, r.message
        assert r.value == {"loaded": 30, "error": None, "is": 1030}, r.value
    assert len(list((root / "node1" / "job").glob(".quarantine-*"))) == 1


def test_a_copy_restored_over_another_save_s_copy_loads_and_loses_the_stray_marker(
        tmp_path: Path, root: Path) -> None:
    """Rank 1's copy of the second save of 30 restored by hand with ``cp -a`` into a directory
    that held the first save's copy: the manifest and data are the second save's, but the
    first save's marker stays beside its own. Every copy's manifest names the second save,
    which covers every rank: the load takes it (before: every load saw two saves, gave 30 up
    and fell back to 20, while gc counted 30 complete and could remove 20) and drops the
    stray marker, so later loads and verify see one save."""
    backup = _saved_twice(tmp_path, root)
    first = root / "node1" / "job" / "iter_0000000030" / "rank_00001_of_00002"
    second = tmp_path / "second-save-30"
    shutil.copytree(first, second)
    shutil.rmtree(first)
    shutil.copytree(backup, first)
    shutil.copytree(second, first, dirs_exist_ok=True)  # cp -a second/. first/
    stray = {p.name for p in (backup / "data").glob("save-*")}
    own = {p.name for p in (second / "data").glob("save-*")}
    assert len(stray) == len(own) == 1 and stray != own
    assert {p.name for p in (first / "data").glob("save-*")} == stray | own
    for _ in range(2):
        for r in run_ranks(sc.load_newest, 2, tmp_path, str(root), None):
            assert r.ok, r.message
            assert r.value == {"loaded": 30, "error": None, "is": 1030}, r.value
        assert {p.name for p in (first / "data").glob("save-*")} == own
    assert not list((root / "node1" / "job").glob(".quarantine-*"))


def test_an_iteration_saved_twice_with_no_save_covering_every_rank_is_never_loaded(
        tmp_path: Path, root: Path) -> None:
    """The same without replicas: no save of 30 has a copy of every rank's shard. Every rank
    falls back to 20 instead of loading a mix, and the run can save 30 again (before, 30 still
    counted as the latest: save(30) was refused, and retention would have kept it over 20)."""
    for r in run_ranks(sc.save, 2, tmp_path, str(root), None):
        assert r.ok, r.message
    backup = tmp_path / "first-save-30"
    shutil.copytree(root / "node1" / "job" / "iter_0000000030" / "rank_00001_of_00002", backup)
    for r in run_ranks(sc.resave, 2, tmp_path, str(root), 1000, None):
        assert r.ok, r.message
    first = root / "node1" / "job" / "iter_0000000030" / "rank_00001_of_00002"
    shutil.rmtree(first)
    shutil.copytree(backup, first)
    for r in run_ranks(sc.load_newest, 2, tmp_path, str(root), 30, None):
        assert r.ok, r.message
        assert "different saves" in r.value["error"], r.value
    for r in run_ranks(sc.fall_back_then_save_again, 2, tmp_path, str(root)):
        assert r.ok, r.message
        assert r.value == {"loaded": 20, "latest": 20, "iterations": [10, 20],
                           "after": [30], "is": 2030}, r.value


@pytest.mark.parametrize("keep_every", [None, 2])
def test_a_resharding_job_keeps_its_lineage_as_its_keep_policy_says(
        tmp_path: Path, root: Path, keep_every: int | None) -> None:
    """keep_last=3 over the job's lineage: after a restart at another world size, the first save
    leaves the two newest of the old world size, not only itself (and the multiples of
    keep_every); once newer ones are kept, the old world size's shards go."""
    for r in run_ranks(sc.lineage_saves, 2, tmp_path, str(root), [1, 2, 3, 4], False,
                       keep_every):
        assert r.ok, r.message
    (first,) = run_ranks(sc.lineage_saves, 1, tmp_path, str(root), [5], True, keep_every)
    assert first.ok, first.message
    assert first.value == [*([(2, 2)] if keep_every else []), (3, 2), (4, 2), (5, 1)]
    (later,) = run_ranks(sc.lineage_saves, 1, tmp_path, str(root), [6, 7, 8], True,
                         keep_every)
    assert later.ok, later.message
    # 6, 7, 8 kept; of the old world size only the multiples of keep_every (2, 4) stay
    assert later.value == [*([(2, 2), (4, 2), (6, 1)] if keep_every else [(6, 1)]), (7, 1),
                           (8, 1)]


def test_a_resharding_load_never_builds_a_state_from_two_saves(tmp_path: Path,
                                                               root: Path) -> None:
    """Node 0 holds iteration 30's shards of two saves: a job of another world size never
    builds its state from both."""
    backup = _saved_twice(tmp_path, root)
    replica = root / "node0" / "job" / "iter_0000000030" / "rank_00001_of_00002"
    shutil.rmtree(replica)  # node 0's copy of rank 1's shard: the first save's, from a backup
    shutil.copytree(backup, replica)
    (r,) = run_ranks(sc.reshard_load, 1, tmp_path, str(root))
    assert r.ok, r.message
    # it falls back to 20, as a load at the saving world size does (before: every attempt
    # raised "different saves" and the job could not start); 30 stays on disk, left out
    assert r.value == {"loaded": 20, "error": None}, r.value
    assert replica.is_dir()


def test_a_rollback_while_an_async_save_is_in_flight_keeps_its_target(root: Path) -> None:
    """load(iteration=10) finalizes the async save of 30 first; its retention (keep_last=2)
    deleted 10, the very iteration asked for, and the rollback raised NoCheckpointError."""
    with LocalCheckpointManager(root, "s", keep_last=2, timeout=30) as mgr:
        for it in (10, 20):
            mgr.save({"w": torch.full((8,), float(it))}, it)
        mgr.save({"w": torch.full((8,), 30.0)}, 30, is_async=True)
        state, (it, _, _) = mgr.load(iteration=10, discard_newer=True)
        assert it == 10 and torch.equal(state["w"], torch.full((8,), 10.0))
        assert mgr.iterations() == [10]
        mgr.save({"w": torch.full((8,), 11.0)}, 11)
        assert mgr.iterations() == [10, 11]


def _resaved_with_stale_own_copies(tmp_path: Path, base: Path, strategy: str | None,
                                   saved_twice: list[int]) -> None:
    """10, 20 and ``saved_twice`` saved; a rollback to 20 saves ``saved_twice`` again (values
    + 1000); then rank 1's own copy of each is put back from the first save (by hand)."""
    for r in run_ranks(mixed.save, 2, tmp_path, str(base), strategy, [10, 20, *saved_twice],
                       0):
        assert r.ok, r.message
    own = lambda it: base / "node1" / "job" / f"iter_{it:010d}" / "rank_00001_of_00002"  # noqa: E731
    for it in saved_twice:
        shutil.copytree(own(it), tmp_path / f"first-{it}")
    for r in run_ranks(mixed.save, 2, tmp_path, str(base), strategy, saved_twice, 1000, 20):
        assert r.ok, r.message
    for it in saved_twice:
        shutil.rmtree(own(it))
        shutil.copytree(tmp_path / f"first-{it}", own(it))


@pytest.mark.parametrize("exact", [None, 30])
def test_a_resharding_load_of_an_iteration_saved_twice_loads_the_covering_save(
        tmp_path: Path, exact: int | None) -> None:
    """Node 0 holds both shards of 30's second save, node 1 its own shard of the first: the
    resharding load (into another layout) gave 30 up for good and fell back to 20 (then a
    save of 30 wrote over the second save), and load(iteration=30) failed; the plain load
    sets the stale copy aside and loads the second save, and so must it."""
    base = tmp_path / "roots"
    _resaved_with_stale_own_copies(tmp_path, base, "node_spread", [30])
    for r in run_ranks(mixed.load_other_layout, 2, tmp_path, str(base), "node_spread", exact):
        assert r.ok, r.message
        assert r.value == {"loaded": 30, "value": 1030.0, "w": 1030.0}, r.value
    assert len(list((base / "node1" / "job").glob(".quarantine-*"))) == 1


def test_iterations_saved_twice_that_cannot_load_do_not_use_up_the_resharding_attempts(
        tmp_path: Path) -> None:
    """Without replicas no save of 30-60 covers every rank: each is left out in turn. Each
    fallback counted as a failed attempt, and the fourth gave up: the job could not start
    although 20 loads."""
    base = tmp_path / "roots"
    _resaved_with_stale_own_copies(tmp_path, base, None, [30, 40, 50, 60])
    for r in run_ranks(mixed.load_other_layout, 2, tmp_path, str(base), None):
        assert r.ok, r.message
        assert r.value == {"loaded": 20, "value": 20.0, "w": 20.0}, r.value


def test_the_save_loaded_is_the_newest_and_only_when_it_covers_every_rank() -> None:
    from localckpt.load.mixed import covering_save

    # node 0 holds both shards of save B (newer); node 1 a stale copy of A
    assert covering_save([[[0, "B", 2.0], [1, "B", 2.0]], [[0, "B", 2.0], [1, "A", 1.0]]],
                         2) == ("B", "")
    chosen, why = covering_save([[[0, "B", 2.0]], [[1, "A", 1.0]]], 2)
    assert chosen is None and "newest save (B) has copies of 1 of 2" in why
    # both whole: the newer one
    assert covering_save([[[0, "A", 1.0], [1, "A", 1.0]], [[0, "B", 2.0], [1, "B", 2.0]]],
                         2) == ("B", "")
    # an older save whole, the newer not (a node back with a save a rollback discarded): none
    chosen, why = covering_save([[[0, "A", 1.0], [1, "A", 1.0]], [[0, "B", 2.0]]], 2)
    assert chosen is None and "(B)" in why
    assert covering_save([[[0, None, 3.0], [1, "A", 1.0]], [[0, "A", 1.0]]], 2) == ("A", "")


def test_copies_of_two_saves_are_seen_though_every_rank_read_one() -> None:
    """Pure: every rank's own shard (or the copy it was served) comes from save A, but a
    node holds copies of save B: the iteration is mixed (resolved by the saves' manifests),
    where only the ranks' own saves were compared before."""
    from localckpt.load.rounds import note_mixed

    mixed: dict[int, str] = {}
    agree = [{"save": "A", "copies": {"A": [[0, 2]]}}, {"save": "A", "copies": {}},
             {"save": None, "copies": {"B": [[0, 1], [2, 4]]}}, {"save": "A"}]
    assert note_mixed(mixed, 20, agree)
    assert mixed[20] == ("its copies come from different saves: save A has copies of ranks "
                         "[0, 1, 3]; save B has copies of ranks [0, 2, 3]")
    assert not note_mixed(mixed, 30, [{"save": "A", "copies": {"A": [[0, 4]]}},
                                      {"save": None, "copies": {}}])
    assert 30 not in mixed
    # the older save written before markers, read by every rank as its own; the newer marked
    assert note_mixed(mixed, 40, [{"save": "A", "copies": {"B": [[0, 2]]}},
                                  {"save": "A", "copies": {}}])
    assert "save A has copies of ranks [0, 1]" in mixed[40]


def test_an_only_iteration_of_two_saves_is_never_reported_as_nothing_saved(
        tmp_path: Path, root: Path) -> None:
    """Iteration 30 is the only one, and its shards come from two saves: every load in the
    process raises CorruptShardError naming it (before: the first did, and a retry said
    NoCheckpointError, which a job may take for "start afresh")."""
    for r in run_ranks(sc.save_these, 2, tmp_path, str(root), [30], 0):
        assert r.ok, r.message
    backup = tmp_path / "first"
    shutil.copytree(root / "node1" / "job" / "iter_0000000030" / "rank_00001_of_00002", backup)
    for node in (0, 1):
        shutil.rmtree(root / f"node{node}" / "job" / "iter_0000000030")
    for r in run_ranks(sc.save_these, 2, tmp_path, str(root), [30], 1000):
        assert r.ok, r.message
    shard = root / "node1" / "job" / "iter_0000000030" / "rank_00001_of_00002"
    shutil.rmtree(shard)
    shutil.copytree(backup, shard)
    for r in run_ranks(sc.load_twice, 2, tmp_path, str(root)):
        assert r.ok, r.message
        assert r.value[:2] == ["CorruptShardError", "CorruptShardError"], r.value


def test_a_failed_rollback_leaves_nothing_fenced_on_a_root_ranks_share(tmp_path: Path) -> None:
    """Each rank put back the fence it had read before writing its own; on a root two ranks
    share, the later one had read the earlier one's, and put this very rollback's fence back:
    find_latest answered 20, and the next save deleted 30 (from the attacker review of
    retention and rollback)."""
    base = str(tmp_path / "roots")
    assert all(r.ok for r in run_ranks(sc.save_on_a_shared_root, 2, tmp_path, base))
    for r in run_ranks(sc.rollback_fails_on_a_shared_root, 2, tmp_path, base):
        assert r.ok and r.value == "RankOSError", (r.value, r.message)
    for r in run_ranks(sc.listed_on_a_shared_root, 2, tmp_path, base):
        assert r.ok, r.message
        assert r.value == {"latest": 30, "iterations": [10, 20, 30]}, r.value


def test_a_node_back_with_the_fence_of_a_finished_rollback_hides_nothing_saved_after(
        tmp_path: Path) -> None:
    """Node 1 died in a rollback to 20 once its fence was written; the job went on with a new
    node 2 in its place (the load finished the rollback there, 30 deleted) and saved 40 and
    50. Node 1 came back with its fence: the fence hid 40 and 50 on every root, the job
    loaded 20 without a word, and its next save deleted 40 and 50 on node 0. A root that
    finished a rollback now records it, and that rollback's fence hides nothing of it
    (attacker review)."""
    base = str(tmp_path / "roots")
    assert all(r.ok for r in run_ranks(sc.save, 2, tmp_path, base))
    run_ranks(sc.rollback_interrupted, 2, tmp_path, base, "died after fence")
    for r in run_ranks(sc.on_nodes, 2, tmp_path, base, ["node0", "node2"], [40, 50]):
        assert r.ok, r.message
        assert r.value == {"loaded": 20, "identical": True, "then": [20, 40, 50]}, r.value
    shutil.rmtree(Path(base) / "node2")  # node 1 is back in its place
    for r in run_ranks(sc.on_nodes, 2, tmp_path, base, ["node0", "node1"], [60]):
        assert r.ok, r.message
        assert r.value == {"loaded": 50, "identical": True, "then": [40, 50, 60]}, r.value


def test_a_node_that_joined_after_a_rollback_keeps_what_it_was_given_from_a_stale_fence(
        tmp_path: Path) -> None:
    """As above, but node 0 is lost too: node 3 joined after the rollback was finished and
    got 50 from node 0 (a load's write-back). It never finished the rollback itself, so node
    1's fence would hide its 50, and the next save delete it. A node records the rollbacks
    another root of the job finished before anything is written to it."""
    base = str(tmp_path / "roots")
    assert all(r.ok for r in run_ranks(sc.save, 2, tmp_path, base))
    run_ranks(sc.rollback_interrupted, 2, tmp_path, base, "died after fence")
    assert all(r.ok for r in run_ranks(sc.on_nodes, 2, tmp_path, base, ["node0", "node2"],
                                       [40, 50]))
    shutil.rmtree(Path(base) / "node2")
    for r in run_ranks(sc.on_nodes, 2, tmp_path, base, ["node0", "node3"], []):
        assert r.ok, r.message
        assert r.value["loaded"] == 50, r.value
    shutil.rmtree(Path(base) / "node0")  # node 1 is back beside node 3
    for r in run_ranks(sc.on_nodes, 2, tmp_path, base, ["node3", "node1"], [60]):
        assert r.ok, r.message
        assert r.value == {"loaded": 50, "identical": True, "then": [20, 50, 60]}, r.value


def test_an_iteration_saved_again_on_other_nodes_loads_the_newer_save(tmp_path: Path) -> None:
    """Iteration 20 saved by a job without replicas on nodes 0-2, then again (states + 1000)
    by a job on nodes 1, 3 and 0 (node 2 away, ranks placed otherwise: 20 was incomplete
    there), whose copies all landed on nodes 0, 1 and 3. Back on nodes 0-2, each rank's own
    copy was the first save's (node 0 and node 1 kept theirs beside the new copies), so the
    ranks agreed on the older save: it loaded without a word, and the write-back set the
    newer save's copies aside. A save now removes the copies of its iteration on its nodes
    that it does not replace: the first save's copies are then on node 2 only, a load sees
    two saves, and the newer one, whose copies cover every rank, is loaded (attacker
    review)."""
    base = str(tmp_path / "roots")
    first = ["node0", "node1", "node2"]
    for r in run_ranks(sc.on_nodes_first_save, 3, tmp_path, base, first):
        assert r.ok, r.message
    for r in run_ranks(sc.on_nodes, 3, tmp_path, base, ["node1", "node3", "node0"], [20],
                       "node_spread", 1000):
        assert r.ok, r.message
        assert r.value["loaded"] == 10, r.value
    shutil.rmtree(Path(base) / "node3")
    for r in run_ranks(sc.on_nodes, 3, tmp_path, base, first, []):
        assert r.ok, r.message
        assert r.value["loaded"] == 20 and r.value.get("is") == 1020, r.value


def test_an_older_save_served_by_peers_is_not_loaded_over_a_newer_one(tmp_path: Path) -> None:
    """Iteration 20 saved on nodes Y and Z (every shard on both), then again (states + 1000,
    no replicas) on nodes X1 and X2, which Y and Z were away from. Ranks 0 and 1 back on Y, 2
    on X1 and 3 on X2: ranks 2 and 3 hold no copy of their own shard, and the plan had them
    receive it from Y (the fewest bytes to serve), so every rank got the older save, agreed
    on it, and loaded it, though the newer one has a copy of every rank's shard on X1 and
    X2. The ranks now compare the saves of every copy of the iteration their nodes hold
    (each shard records its save in its directory) (attacker review)."""
    base = str(tmp_path / "roots")
    for nodes, saves, strategy, offset, load in (
            (["Y", "Y", "X1", "X1"], [10], "node_spread", 0, False),
            (["Y", "Y", "Z", "Z"], [20], "node_spread", 0, True),
            (["X1", "X1", "X2", "X1"], [20], None, 1000, True)):
        assert all(r.ok for r in run_ranks(sc.on_nodes, 4, tmp_path, base, nodes, saves,
                                           strategy, offset, load))
    for r in run_ranks(sc.on_nodes, 4, tmp_path, base, ["Y", "Y", "X1", "X2"], [], None):
        assert r.ok, r.message
        assert r.value["loaded"] == 20 and r.value.get("is") == 1020, r.value


def test_a_damaged_copy_of_an_older_save_does_not_block_the_newer_one(tmp_path: Path) -> None:
    """Iteration 20 saved on nodes P and Q (every shard on both), then again (states + 1000)
    on nodes S and T while P and Q were away; one of P's copies of the first save is damaged
    (a chunk file cut short). Loading on S, S, P, T: the resolution kept the newer save and
    set aside P's readable copies of the older one, but left the damaged one (no manifest, no
    vote), whose marker showed two saves again: the iteration was given up, though the newer
    save is whole. A copy that cannot be read is set aside too when its marker names another
    save (review of the save markers)."""
    base = str(tmp_path / "roots")
    for nodes, offset in ((["P", "P", "Q", "Q"], 0), (["S", "S", "T", "T"], 1000)):
        assert all(r.ok for r in run_ranks(sc.on_nodes, 4, tmp_path, base, nodes, [20],
                                           "node_spread", offset, False))
    chunk = Path(base) / "P" / "job" / "iter_0000000020" / "rank_00000_of_00004" / "data" / "c"
    first = chunk / "0"
    first.write_bytes(first.read_bytes()[:-1])
    for r in run_ranks(sc.on_nodes, 4, tmp_path, base, ["S", "S", "P", "T"], [], None):
        assert r.ok, r.message
        assert r.value["loaded"] == 20 and r.value.get("is") == 1020, r.value


def test_copies_of_an_erasure_coded_iteration_are_not_compared(tmp_path: Path) -> None:
    """An erasure-coded iteration saved twice is never resolved (its parity belongs to a
    save): a node's leftover copies of the older save, which no rank reads, made a whole newer
    save unloadable. Copies are compared only without erasure coding (review of the save
    markers)."""
    import types

    import torch

    from localckpt.load.rounds import copies_held
    from localckpt.storage.manifest import ShardManifest
    from localckpt.storage.space import chunking
    from localckpt.storage.store import ShardStore
    from replication import Topology

    store = ShardStore(tmp_path / "root", "job", writer_rank=0)
    try:
        chunk_nbytes, count = chunking(100, store.chunk_nbytes)
        store.write(ShardManifest("job", 20, 1, 2, (), {"dict": []}, "plain", 100,
                                  chunk_nbytes, count, (), metadata={"save_id": "ab12"}),
                    torch.zeros(chunk_nbytes * count, dtype=torch.uint8))
        ctx = types.SimpleNamespace(rank=0, world_size=2, store=store, erasure=None,
                                    topology=Topology(("a", "a")))
        assert copies_held(ctx, 20, [0, 1]) == {"ab12": [[1, 2]]}  # type: ignore[arg-type]
        ctx.erasure = object()
        assert copies_held(ctx, 20, [0, 1]) == {}  # type: ignore[arg-type]
    finally:
        store.close()


def test_a_resharding_load_does_not_take_an_older_save_served_by_peers(tmp_path: Path) -> None:
    """Iteration 20 saved by 2 ranks on nodes Y and Z, then again (states + 1000) on X1 and
    X2 while Y and Z were away. A 4-rank resharding job on Y, Y, Y, X1: the servers chosen by
    load were on Y, every manifest read said the older save, and it loaded, though X1 holds
    the newer save whole. The resharding load compares the saves of every copy too (review of
    the save markers)."""
    base = str(tmp_path / "roots")
    for nodes, offset in ((["Y", "Z"], 0), (["X1", "X2"], 1000)):
        assert all(r.ok for r in run_ranks(sc.reshard_on_nodes, 2, tmp_path, base, nodes,
                                           offset, False))
    for r in run_ranks(sc.reshard_on_nodes, 4, tmp_path, base, ["Y", "Y", "Y", "X1"], 0, True):
        assert r.ok, r.message
        assert r.value == {"loaded": 20, "is": 1020}, r.value
