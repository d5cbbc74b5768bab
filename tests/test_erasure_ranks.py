"""Erasure-coded redundancy on real gloo ranks with simulated nodes: the save folds parity on
the holders, and after losing any m nodes of a stripe the job restarts bit-identical, its lost
shards rebuilt and its lost parity folded again."""

from __future__ import annotations

import shutil
from pathlib import Path

import erasure_scenarios as es
import pytest
from dist_harness import run_ranks

from localckpt.storage.layout import list_shards
from replication import parity_slot


def saved(tmp_path: Path, root: Path, k: int, m: int, nodes: int, per: int | list[int],
          iterations: list[int], keep_last: int = 1, is_async: bool = False,
          recycle_files: bool = False) -> None:
    world = nodes * per if isinstance(per, int) else sum(per)
    results = run_ranks(es.save, world, tmp_path, str(root), k, m, per, iterations,
                        keep_last, is_async, recycle_files)
    assert all(r.ok for r in results), [r.message for r in results]


def loaded(tmp_path: Path, root: Path, k: int, m: int, nodes: int,
           per: int | list[int], slow_local_fold: float = 0.0) -> list[dict]:
    world = nodes * per if isinstance(per, int) else sum(per)
    results = run_ranks(es.load, world, tmp_path, str(root), k, m, per, slow_local_fold)
    assert all(r.ok for r in results), [r.message for r in results]
    return [r.value for r in results]


def block_dir(root: Path, node: int, iteration: int, owner: int, world: int) -> Path:
    (ref,) = [r for r in list_shards(root / f"node{node}", "job")
              if r.iteration == iteration and r.owner_rank == owner]
    assert ref.world_size == world
    return ref.path


@pytest.mark.parametrize("k,m,nodes,per", [(3, 1, 4, 2), (4, 2, 6, 1)])
def test_every_loss_of_m_nodes_is_rebuilt_bit_identical_with_data_and_parity_back(
        tmp_path: Path, root: Path, k: int, m: int, nodes: int, per: int) -> None:
    world = nodes * per
    results = run_ranks(es.every_loss, world, tmp_path, str(root), k, m, per, 7, deadline=300)
    assert all(r.ok for r in results), [r.message for r in results if not r.ok]
    want = es.expected_holdings(world, per, k, m)
    assert any(slot < 0 for node in want for slot in node)
    combos = [row["lost"] for row in results[0].value]
    assert len(combos) == {(4, 1): 4, (6, 2): 15}[(nodes, m)]
    for c, lost in enumerate(combos):
        rows = [r.value[c] for r in results]
        assert all(row["latest"] == 7 and row["ok"] for row in rows), (lost, rows)
        # only the lost nodes' ranks rebuilt anything: the others read their own shard
        assert [row["rebuilt"] > 0 for row in rows] == [r // per in lost for r in range(world)]
        assert rows[0]["held"] == want, lost  # every lost shard and parity block is back


def test_a_parity_write_that_fails_fails_the_save_on_every_rank(tmp_path: Path,
                                                                 root: Path) -> None:
    results = run_ranks(es.parity_write_fails, 4, tmp_path, str(root), 3, 1, 1, 3)
    for r in results:
        assert r.ok, r.message
        name, message = r.value["error"]
        assert name == "RankOSError" and "rank 3" in message and "injected" in message
        assert r.value["held"] == [[], [], [], []]  # iteration 2 removed on every node
        assert r.value["latest"] == 1 and r.value["ok"]


def test_a_corrupt_surviving_block_is_treated_as_lost(tmp_path: Path, root: Path) -> None:
    """4+2 on 6 nodes: node 0 lost and member 2's shard corrupt (on node 2): two blocks of the
    stripe gone, the newest iteration still rebuilds; with node 1 lost too it cannot, and
    every rank falls back to the older iteration."""
    saved(tmp_path, root, 4, 2, 6, 1, [5, 7], keep_last=2)
    pristine = tmp_path / "pristine"
    shutil.copytree(root, pristine)
    for lost in ([0], [0, 1]):
        shutil.rmtree(root)
        shutil.copytree(pristine, root)
        for node in lost:
            shutil.rmtree(root / f"node{node}")
        chunk = block_dir(root, 2, 7, 2, 6) / "data" / "c" / "0"
        raw = bytearray(chunk.read_bytes())
        raw[100] ^= 0x01
        chunk.write_bytes(raw)
        values = loaded(tmp_path, root, 4, 2, 6, 1)
        assert all(v["ok"] for v in values), (lost, values)
        assert [v["latest"] for v in values] == [7 if lost == [0] else 5] * 6
        quarantined = list((root / "node2" / "job").glob(".quarantine-*"))
        assert len(quarantined) == 1  # the corrupt copy was set aside, not trusted
        if lost == [0]:  # rank 2's shard rebuilt too: node 2 holds a good copy again
            assert (block_dir(root, 2, 7, 2, 6) / "data" / "c" / "0").read_bytes() != raw


def test_a_corrupt_parity_block_with_a_lost_node_falls_back_for_m_1(tmp_path: Path,
                                                                    root: Path) -> None:
    saved(tmp_path, root, 3, 1, 4, 1, [5, 7], keep_last=2)
    shutil.rmtree(root / "node0")
    chunk = block_dir(root, 3, 7, parity_slot(0, 0), 4) / "data" / "c" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[7] ^= 0x80
    chunk.write_bytes(raw)
    values = loaded(tmp_path, root, 3, 1, 4, 1)
    assert [v["latest"] for v in values] == [5] * 4 and all(v["ok"] for v in values)


def test_async_saves_fold_parity_and_survive_a_node_loss(tmp_path: Path, root: Path) -> None:
    saved(tmp_path, root, 3, 1, 4, 1, [1, 2, 3], is_async=True)
    assert es.holdings(str(root), 4, 3) == es.expected_holdings(4, 1, 3, 1)
    assert es.holdings(str(root), 4, 2) == [[]] * 4  # keep_last=1: parity retired too
    shutil.rmtree(root / "node1")
    values = loaded(tmp_path, root, 3, 1, 4, 1)
    assert [v["latest"] for v in values] == [3] * 4 and all(v["ok"] for v in values)
    assert [v["rebuilt"] > 0 for v in values] == [False, True, False, False]


def test_more_lost_nodes_than_parity_restore_from_the_durable_tier(tmp_path: Path,
                                                                  root: Path) -> None:
    """4+2 on 6 nodes, 3 nodes lost (nodes 2-4: stripe 0 lost three blocks): the local tiers
    cannot rebuild it, the durable tier restores the newest iteration, and the parity blocks
    the surviving nodes still hold are of that save, so they are kept and the lost ones folded
    again."""
    durable = str(tmp_path / "shared")
    results = run_ranks(es.durable_save, 6, tmp_path, str(root), durable, 4, 2, 1, [5, 7])
    assert all(r.ok for r in results), [r.message for r in results]
    for node in (2, 3, 4):
        shutil.rmtree(root / f"node{node}")
    results = run_ranks(es.durable_load, 6, tmp_path, str(root), durable, 4, 2, 1)
    assert all(r.ok for r in results), [r.message for r in results if not r.ok]
    assert [(r.value["latest"], r.value["ok"]) for r in results] == [(7, True)] * 6
    assert results[0].value["held"] == es.expected_holdings(6, 1, 4, 2)


def test_ranks_moved_onto_the_node_holding_their_stripes_parity(tmp_path: Path,
                                                                root: Path) -> None:
    """3+1 on 4 nodes: node 0 lost, and the restart puts rank 0 on node 3's machine (stripe
    0's parity is there) and rank 3 on an empty one. Rank 0 rebuilds from its own node's
    parity block; the repair folds stripe 1's parity on node 0 from rank 3's shard there.
    That fold reads a whole shard from rank 0's disk, longer than the timeout here: the peers
    no longer wait for it in their transfers (the data group broke, and the repair with it)."""
    saved(tmp_path, root, 3, 1, 4, 1, [5, 7], keep_last=2)
    shutil.rmtree(root / "node0")
    (root / "node3").rename(root / "node0")
    values = loaded(tmp_path, root, 3, 1, 4, 1, slow_local_fold=5.0)
    assert [(v["latest"], v["ok"], v["written_back"]) for v in values] == [(7, True, "ok")] * 4
    assert values[0]["rebuilt"] > 0
    held = es.holdings(str(root), 4, 7)
    want = es.expected_holdings(4, 1, 3, 1)
    assert all(set(w) <= set(h) for w, h in zip(want, held, strict=True)), (held, want)


def test_a_stale_copy_of_a_parity_block_is_set_aside_and_a_good_one_used(tmp_path: Path,
                                                                         root: Path) -> None:
    """Stripe 0's parity on node 3 is another save's (iteration 7 saved again elsewhere), a
    good copy of it on node 2: the rebuild of node 0's shard refuses the stale one (quarantined)
    and uses the good one, instead of falling back to iteration 5."""
    other = tmp_path / "other"
    saved(tmp_path, other, 3, 1, 4, 1, [7])
    saved(tmp_path, root, 3, 1, 4, 1, [5, 7], keep_last=2)
    good = block_dir(root, 3, 7, parity_slot(0, 0), 4)
    shutil.copytree(good, root / "node2" / "job" / "iter_0000000007" / good.name)
    shutil.rmtree(good)
    shutil.copytree(block_dir(other, 3, 7, parity_slot(0, 0), 4), good)
    shutil.rmtree(root / "node0")
    values = loaded(tmp_path, root, 3, 1, 4, 1)
    assert [(v["latest"], v["ok"]) for v in values] == [(7, True)] * 4
    assert len(list((root / "node3" / "job").glob(".quarantine-*"))) == 1
    assert es.holdings(str(root), 4, 7)[3] == [parity_slot(0, 0), 3]  # folded again there


def test_corrupt_sources_in_several_iterations_fall_back_to_an_intact_one(tmp_path: Path,
                                                                          root: Path) -> None:
    """Node 0 lost and rank 1's shard corrupt in iterations 4, 3 and 2: none of them can be
    rebuilt, and iteration 1 loads (the corrupt copies are not damage in transit)."""
    saved(tmp_path, root, 3, 1, 4, 1, [1, 2, 3, 4], keep_last=4)
    shutil.rmtree(root / "node0")
    for it in (2, 3, 4):
        chunk = block_dir(root, 1, it, 1, 4) / "data" / "c" / "0"
        raw = bytearray(chunk.read_bytes())
        raw[3] ^= 0x08
        chunk.write_bytes(raw)
    values = loaded(tmp_path, root, 3, 1, 4, 1)
    assert [(v["latest"], v["ok"]) for v in values] == [(1, True)] * 4


def _stale_parity_then_node0_lost(tmp_path: Path, root: Path, k: int, m: int,
                                  node: int) -> Path:
    """k+m on 4 nodes, iterations 5 and 7; stripe 0's parity block 0 (on ``node``) replaced by
    another save's of 7; node 0 lost. The stale block's directory."""
    other = tmp_path / "other"
    saved(tmp_path, other, k, m, 4, 1, [7])
    saved(tmp_path, root, k, m, 4, 1, [5, 7], keep_last=2)
    block = block_dir(root, node, 7, parity_slot(0, 0), 4)
    shutil.rmtree(block)
    shutil.copytree(block_dir(other, node, 7, parity_slot(0, 0), 4), block)
    shutil.rmtree(root / "node0")
    return block


def test_the_last_copy_of_a_parity_block_is_never_set_aside_as_stale(tmp_path: Path,
                                                                     root: Path) -> None:
    """Stripe 0's only parity block is another save's: iteration 7 cannot be rebuilt (every
    rank falls back to 5), but the block stays where it is: whether it or the members are the
    stale ones, deleting the last copy could only lose data."""
    block = _stale_parity_then_node0_lost(tmp_path, root, 3, 1, 3)
    values = loaded(tmp_path, root, 3, 1, 4, 1)
    assert [(v["latest"], v["ok"]) for v in values] == [(5, True)] * 4
    assert not list((root / "node3" / "job").glob(".quarantine-*")) and block.is_dir()


def test_a_stale_last_copy_of_one_parity_block_leaves_the_others_to_rebuild_from(
        tmp_path: Path, root: Path) -> None:
    """2+2: stripe 0's parity block 0 (node 2's only copy) is another save's, block 1 (node 3)
    is good. Node 0 lost: its shard is rebuilt from member 1 and block 1, and iteration 7 loads
    (before: the stale block made 7 unusable, every rank fell back to 5, and `localckpt gc`,
    which counts 7 complete, could then delete 5)."""
    _stale_parity_then_node0_lost(tmp_path, root, 2, 2, 2)
    values = loaded(tmp_path, root, 2, 2, 4, 1)
    assert [(v["latest"], v["ok"]) for v in values] == [(7, True)] * 4
    assert values[0]["rebuilt"] > 0
    # Once rebuilt without it, it is set aside and the write-back folds it again: two more
    # nodes lost (m = 2) still leave 7 loadable (before: the stale block stayed, and 7 could
    # not be loaded)
    assert len(list((root / "node2" / "job").glob(".quarantine-*"))) == 1
    assert es.holdings(str(root), 4, 7) == es.expected_holdings(4, 1, 2, 2)
    shutil.rmtree(root / "node1")
    shutil.rmtree(root / "node3")
    values = loaded(tmp_path, root, 2, 2, 4, 1)
    assert [(v["latest"], v["ok"]) for v in values] == [(7, True)] * 4


def test_unequal_nodes_and_recycled_files_survive_any_single_node_loss(tmp_path: Path,
                                                                       root: Path) -> None:
    """3+1 on nodes of 2, 1, 1, 2 and 1 ranks (short stripes, parity spread unevenly),
    saving over recycled chunk files: every single node loss restores bit-identical, with
    data and parity back."""
    per = [2, 1, 1, 2, 1]
    saved(tmp_path, root, 3, 1, 5, per, [1, 2, 3], recycle_files=True)
    want = es.expected_holdings(7, per, 3, 1)
    assert es.holdings(str(root), 5, 3) == want
    pristine = tmp_path / "pristine"
    shutil.copytree(root, pristine)
    for lost in range(5):
        shutil.rmtree(root)
        shutil.copytree(pristine, root)
        shutil.rmtree(root / f"node{lost}")
        values = loaded(tmp_path, root, 3, 1, 5, per)
        assert [(v["latest"], v["ok"]) for v in values] == [(3, True)] * 7, lost
        assert es.holdings(str(root), 5, 3) == want, lost


def test_a_rank_that_cannot_allocate_what_it_folds_fails_alike_and_the_group_goes_on(
        tmp_path: Path, root: Path) -> None:
    """2+1 on 3 nodes. The parity holder cannot allocate its block at the save of 10: that
    save fails on every rank at once, and the next one succeeds (before: the senders waited
    out the timeout, and the group was broken for every later save). After node 0 is lost,
    its rank cannot allocate the shard it rebuilds: the load fails alike on every rank at
    once, naming it (before: a timeout on every rank)."""
    results = run_ranks(es.no_memory_for_parity, 3, tmp_path, str(root), 2, 1, 1, "save")
    assert all(r.ok for r in results), [r.message for r in results]
    for r in results:
        assert r.value[0] == "ok" and r.value[2] == "ok", r.value
        assert "cannot allocate the parity block" in r.value[1], r.value
        assert r.elapsed < 9, (r.elapsed, r.value)
    shutil.rmtree(root / "node0")
    results = run_ranks(es.no_memory_for_parity, 3, tmp_path, str(root), 2, 1, 1, "rebuild")
    assert all(r.ok for r in results), [r.message for r in results]
    for r in results:
        assert "cannot allocate the rebuilt shard" in r.value[0], r.value
        assert r.elapsed < 9, (r.elapsed, r.value)


def test_a_fold_that_dies_leaves_no_parity_block_of_the_earlier_save_of_its_iteration(
        tmp_path: Path, root: Path) -> None:
    """2+1 on 3 nodes. Iteration 10 saved, then left incomplete (its stripe-0 members' shards
    gone); a later run saves 10 again and the parity holder dies in the fold. Its block of
    the first save must not stay as if it were the second's: before, it counted towards
    completeness, no write-back folded it again, and after node 0 was lost, 10 could not be
    rebuilt (every rank fell back to 5). Now the holder removes it before folding: the next
    load's write-back folds it again, and 10 survives the loss of node 0."""
    saved(tmp_path, root, 2, 1, 3, 1, [5, 10], keep_last=2)
    for node in (0, 1):
        shutil.rmtree(block_dir(root, node, 10, node, 3))
    results = run_ranks(es.save_again_dying_in_the_fold, 3, tmp_path, str(root), 2, 1, 1)
    assert results[2].error == "Exited", results[2]
    for r in run_ranks(es.load_and_write_back, 3, tmp_path, str(root), 2, 1, 1):
        assert r.ok and r.value == {"latest": 10, "is": 1010}, (r.value, r.message)
    shutil.rmtree(root / "node0")
    for r in run_ranks(es.load_and_write_back, 3, tmp_path, str(root), 2, 1, 1):
        assert r.ok and r.value == {"latest": 10, "is": 1010}, (r.value, r.message)


def test_damage_past_the_lost_shards_length_does_not_stop_its_rebuild(tmp_path: Path,
                                                                      root: Path) -> None:
    """3+1 on 4 nodes, node 0 (rank 0: the smallest shard of stripe 0) lost, and the last chunk
    of stripe 0's parity block damaged: bytes the rebuild of rank 0's shard never needs. The
    rebuild streamed every source whole, so the damaged chunk failed the transfer, the block
    was quarantined and iteration 7 given up for 5 (then deleted by the next save's cleanup,
    though rebuildable)."""
    saved(tmp_path, root, 3, 1, 4, 1, [5, 7], keep_last=2)
    lost = block_dir(root, 0, 7, 0, 4)
    parity = block_dir(root, 3, 7, parity_slot(0, 0), 4)
    chunks = sorted((parity / "data" / "c").iterdir(), key=lambda p: int(p.name))
    assert len(chunks) > len(list((lost / "data" / "c").iterdir()))  # a tail past rank 0's
    data = bytearray(chunks[-1].read_bytes())
    data[5] ^= 0xFF
    chunks[-1].write_bytes(bytes(data))
    shutil.rmtree(root / "node0")
    values = loaded(tmp_path, root, 3, 1, 4, 1)
    assert [(v["latest"], v["ok"]) for v in values] == [(7, True)] * 4
    assert values[0]["rebuilt"] > 0
