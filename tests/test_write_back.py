"""A restore after node loss returns once each rank has its own shard; the shards the replaced
node must hold again are written back in the background (localckpt.load.write_back), retried
when they fail, and never at the cost of the load or of a half-written shard."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import write_back_scenarios as wb
from dist_harness import run_ranks

from replication import Topology, Transfer, make_strategy, retrieval_plan, wanted_shards


def _saved_then_wiped(tmp_path: Path, root: Path, iterations: list[int], world: int = 2,
                      factor: int = 2) -> None:
    results = run_ranks(wb.save, world, tmp_path, str(root), iterations, factor)
    assert all(r.ok for r in results), [r.message for r in results]
    shutil.rmtree(root / f"node{world - 1}")


def test_no_load_waits_for_the_write_back(tmp_path: Path, root: Path) -> None:
    _saved_then_wiped(tmp_path, root, [3])
    gate = tmp_path / "gate"
    gate.mkdir()
    results = run_ranks(wb.load_with_write_back_held, 2, tmp_path, str(root), str(gate))
    for r in results:
        assert r.ok, r.message
        assert r.value["iteration"] == 3 and r.value["digest"] == r.value["expected"]
    node0, node1 = (r.value for r in results)
    assert node1["before"] == []  # rank 1 had its state before anything was written back
    assert node1["after"] == [[3, 0], [3, 1]] == node0["after"]  # redundancy is back


def test_a_write_back_that_fails_once_is_tried_again(tmp_path: Path, root: Path) -> None:
    _saved_then_wiped(tmp_path, root, [3])
    results = run_ranks(wb.load_then_save, 2, tmp_path, str(root), 4, 1)
    for r in results:
        assert r.ok, r.message
        assert r.value["first_ok"] and r.value["iteration"] == 3
        assert r.value["after_load"] == [[3, 0], [3, 1]]
    assert results[1].value["fired"] == 1


def test_a_write_back_that_always_fails_costs_neither_the_load_nor_the_next_save(
        tmp_path: Path, root: Path) -> None:
    _saved_then_wiped(tmp_path, root, [3])
    results = run_ranks(wb.load_then_save, 2, tmp_path, str(root), 4, 99)
    for r in results:
        assert r.ok, r.message
        assert r.value["first_ok"] and r.value["iteration"] == 3
        assert r.value["second"] == 4 and r.value["second_ok"]
    node0, node1 = (r.value for r in results)
    assert node1["fired"] == 2 * 3  # both shards it receives, in each of the 3 attempts
    assert node1["after_load"] == [] and node1["leftovers"] == []  # nothing half-written
    assert node0["after_load"] == [[3, 0], [3, 1]]
    # the next save brought redundancy back for the new iteration (keep_last=1)
    assert node1["after_save"] == [[4, 0], [4, 1]] == node0["after_save"]


def test_a_corrupt_copy_met_by_the_write_back_is_quarantined_and_another_holder_serves(
        tmp_path: Path, root: Path) -> None:
    # 4 nodes of one rank, F=3; node 3 is replaced. The write-back (not the load) reads node
    # 0's replica of rank 2's shard to give node 3 its copy again: that replica is damaged.
    _saved_then_wiped(tmp_path, root, [3], world=4, factor=3)
    topology = Topology.uniform(4, 1)
    placement = make_strategy("node_spread", replication_factor=3).place(topology)
    present = [frozenset((3, o) for o in range(4) if r == o or r in placement.holders[o])
               for r in range(3)] + [frozenset()]
    holders = {(3, o): [r for r in range(3) if (3, o) in present[r]] for o in range(4)}
    plan = retrieval_plan(wanted_shards(placement, topology, 3, present), holders)
    assert Transfer(0, 3, 3, 2) in plan.exchange.transfers and holders[(3, 2)] == [0, 2]
    chunk = root / "node0" / "job" / "iter_0000000003" / "rank_00002_of_00004" / "data" / "c" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[100] ^= 0x01
    chunk.write_bytes(raw)
    results = run_ranks(wb.load_and_wait, 4, tmp_path, str(root), 3)
    for r in results:
        assert r.ok, r.message
        assert r.value["ok"] and r.value["iteration"] == 3
    assert [3, 2] in results[3].value["held"]  # from the other holder, rank 2
    assert [3, 2] not in results[0].value["held"]  # the damaged copy was moved aside
    assert list((root / "node0" / "job").glob(".quarantine-*"))


def test_a_data_group_lost_in_the_write_back_fails_the_next_call_at_once(
        tmp_path: Path, root: Path) -> None:
    _saved_then_wiped(tmp_path, root, [3])
    for r in run_ranks(wb.write_back_group_lost, 2, tmp_path, str(root)):
        assert r.ok, r.message
        assert r.value["ok"]  # the load itself went well
        _, bases, msg = r.value["error"]
        assert "CollectiveError" in bases and "write-back of iteration 3" in msg, msg


# ------------------------------------------------------------------ one rank, a fake context

class _Group:
    def __init__(self) -> None:
        self.broken: BaseException | None = None

    def exchange(self, step: str, local: Any, wait: float | None = None) -> list[Any]:
        return [local()]  # a world of one answers for everyone

    def mark_broken(self, exc: BaseException) -> None:
        self.broken = exc


class _Store:
    def __init__(self, fail_quarantine: bool = False) -> None:
        self.quarantined: list[Any] = []
        self.fail_quarantine = fail_quarantine

    def ref(self, it: int, owner: int, world: int) -> tuple[int, int, int]:
        return (it, owner, world)

    def quarantine(self, ref: Any) -> str:
        if self.fail_quarantine:
            raise PermissionError(13, "Permission denied")
        self.quarantined.append(ref)
        return f"/q/{ref}"


def _ctx(store: _Store | None = None) -> Any:
    import types
    return types.SimpleNamespace(rank=0, world_size=2, timeout=1.0, store=store or _Store(),
                                 ring=None, data_group=_Group(), group=_Group(),
                                 topology=types.SimpleNamespace(same_node=lambda a, b: a == b))


def test_a_shard_whose_only_copy_was_quarantined_is_reported_not_restored(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import localckpt.load.write_back as wbm
    from localckpt.errors import CorruptShardError
    from replication import schedule

    calls: list[Any] = []

    def corrupt_at_rank_0(plan: Any, group: Any, source: Any, sink: Any) -> list[Any]:
        calls.append(plan.transfers)
        return [(t, CorruptShardError("bad chunk")) for t in plan.transfers if t.src == 0]

    monkeypatch.setattr(wbm, "run_transfers", corrupt_at_rank_0)
    ctx = _ctx()
    w = wbm.WriteBack(ctx, schedule([Transfer(0, 1, 3, 1)]), {(3, 1): [0]}, 3, 1.0)
    w.wait()
    assert ctx.store.quarantined == [(3, 1, 2)]
    assert w.failed == [Transfer(0, 1, 3, 1)] and len(calls) == 1  # no holder left to try
    assert "not restored" in caplog.text


def test_a_base_exception_on_the_write_back_thread_is_not_taken_for_success(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import localckpt.load.write_back as wbm
    from localckpt.errors import CollectiveError
    from replication import schedule

    def interrupted(plan: Any, group: Any, source: Any, sink: Any) -> list[Any]:
        raise SystemExit("injected")

    monkeypatch.setattr(wbm, "run_transfers", interrupted)
    ctx = _ctx()
    w = wbm.WriteBack(ctx, schedule([Transfer(0, 1, 3, 1)]), {(3, 1): [0]}, 3, 1.0)
    with pytest.raises(CollectiveError, match="write-back of iteration 3"):
        w.wait()
    assert ctx.group.broken is not None


def test_a_quarantine_that_fails_on_one_rank_still_agrees_with_the_others(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import localckpt.load.write_back as wbm
    from localckpt.errors import CorruptShardError
    from replication import schedule

    agreed: list[str] = []
    monkeypatch.setattr(wbm, "run_transfers", lambda plan, group, source, sink: [
        (t, CorruptShardError("bad chunk")) for t in plan.transfers if t.src == 0])
    ctx = _ctx(_Store(fail_quarantine=True))
    real = ctx.data_group.exchange
    ctx.data_group.exchange = lambda step, local, wait=None: (agreed.append(step),
                                                              real(step, local, wait))[1]
    w = wbm.WriteBack(ctx, schedule([Transfer(0, 1, 3, 1)]), {(3, 1): [0, 2]}, 3, 1.0)
    w.wait()  # the local failure is logged; the retry from rank 2 is agreed as usual
    assert w.error is None and w.failed == [] and len(agreed) == 2


def test_a_rollback_discards_nothing_when_a_rank_s_write_back_failed(tmp_path: Path,
                                                                     root: Path) -> None:
    results = run_ranks(wb.save, 2, tmp_path, str(root), [3, 5], 2, 2)
    assert all(r.ok for r in results), [r.message for r in results]
    results = run_ranks(wb.rollback_with_a_write_back_failed_on_rank_1, 2, tmp_path, str(root))
    assert all(r.ok for r in results), [r.message for r in results]
    assert all(r.value["error"] is not None for r in results), [r.value for r in results]
    assert all([5, 0] in r.value["held"] for r in results), [r.value for r in results]


def test_a_write_back_stopped_by_close_commits_nothing_after_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """close() after a write-back overran its bound: the thread may still be receiving. Once
    stopped, what it receives is dropped, never committed (the session lock is about to go)."""
    import threading

    import localckpt.load.write_back as wbm
    from replication import schedule

    gate, events = threading.Event(), []

    class Receiver:
        def __init__(self, *args: Any) -> None:
            events.append("made")

        def finish(self) -> None:
            events.append("committed")

        def abort(self) -> None:
            events.append("dropped")

    def slow_transfer(plan: Any, group: Any, source: Any, sink: Any) -> list[Any]:
        gate.wait(30)
        receiver = sink(plan.transfers[0], b"", 0)
        receiver.finish()
        return []

    monkeypatch.setattr(wbm, "StoreReceiver", Receiver)
    monkeypatch.setattr(wbm, "run_transfers", slow_transfer)
    w = wbm.WriteBack(_ctx(), schedule([Transfer(0, 1, 3, 1)]), {(3, 1): [0]}, 3, 0.01)
    assert not w.stop(0.1)  # still running: the caller keeps what the thread relies on
    gate.set()
    assert w.stop(10)
    assert events == ["made", "dropped"], events


def test_a_write_back_no_load_step_counted_waits_for_every_piece_sent(tmp_path: Path,
                                                                     root: Path) -> None:
    """The write-back after a resharding load at the same world size took every shard for
    one piece on the wire: a rank with nothing to send in the last round could time out while
    its peers still sent a large shard, breaking both groups. The ranks now count the pieces
    first."""
    from localckpt.storage.shard_stream import STREAM_PIECE_NBYTES

    results = run_ranks(wb.counted_write_back, 2, tmp_path, str(root), "save")
    assert all(r.ok for r in results), [r.message for r in results]
    shutil.rmtree(root / "node1")
    results = run_ranks(wb.counted_write_back, 2, tmp_path, str(root), "write back")
    assert all(r.ok for r in results), [r.message for r in results]
    pieces = -(-(40 << 20) // STREAM_PIECE_NBYTES)
    assert pieces >= 3
    for r in results:
        assert r.value["seconds"] >= 2 * (1 + 2 * pieces), r.value  # timeout 2 per piece
    assert sorted(w for r in results for w in map(tuple, r.value["written"])) == [(1, 0), (1, 1)]


def test_a_manifest_read_failing_for_the_process_s_reasons_is_one_failed_transfer_not_a_lost_group(
        tmp_path: Path, root: Path) -> None:
    """EMFILE reading a shard's manifest to count its pieces: the count's exchange raised on
    every rank and the write-back broke both groups (the next verb failed on every rank).
    Such a shard is counted as the largest one counted, and the transfers go on."""
    results = run_ranks(wb.counted_write_back, 2, tmp_path, str(root), "save")
    assert all(r.ok for r in results), [r.message for r in results]
    shutil.rmtree(root / "node1")
    results = run_ranks(wb.counted_write_back, 2, tmp_path, str(root), "busy")
    assert all(r.ok for r in results), [r.message for r in results]
    assert sorted(w for r in results for w in map(tuple, r.value["written"])) == [(1, 0), (1, 1)]
    pieces = -(-(40 << 20) // (16 << 20))
    for r in results:  # the unreadable manifest's shard counted as large as the other
        assert r.value["seconds"] >= 2 * (1 + 2 * pieces), r.value


def _save_ids(root: Path, iteration: int, owner: int) -> dict[str, str]:
    """The save id of each node's committed copy of the shard of ``owner`` at ``iteration``."""
    from localckpt.storage.store import ShardStore

    out = {}
    for node in sorted(p.name for p in root.iterdir()):
        store = ShardStore(root / node, "job", writer_rank=0)
        try:
            for ref in store.committed():
                if (ref.iteration, ref.owner_rank) == (iteration, owner):
                    out[node] = store.read_manifest(ref).metadata["save_id"]
        finally:
            store.close()
    return out


def test_the_write_back_never_sends_a_copy_of_another_save_of_the_iteration(
        tmp_path: Path, root: Path) -> None:
    """A copy of an older save of the same iteration number (restored by hand onto a node the
    placement gives no copy of that shard) was the write-back's source: the replaced node got
    the old save's replica and the loaded save was left on one node (from the attacker review
    of the byte-moving paths). The write-back sets such a copy aside, as a load does, and sends
    the loaded save's."""
    shard = "iter_0000000003/rank_00001_of_00003"
    older = tmp_path / "older"
    for base in (older, root):  # iteration 3 saved twice: the older save, then the one loaded
        results = run_ranks(wb.save, 3, tmp_path, str(base), [3])
        assert all(r.ok for r in results), [r.message for r in results]
    # node_spread over 3 nodes: owner 1's replica is on node 2, none on node 0
    shutil.copytree(older / "node1" / "job" / shard, root / "node0" / "job" / shard)
    loaded = _save_ids(root, 3, 1)["node1"]
    assert _save_ids(root, 3, 1)["node0"] != loaded
    shutil.rmtree(root / "node2")
    results = run_ranks(wb.load_and_wait, 3, tmp_path, str(root), 2)
    assert all(r.ok for r in results), [r.message for r in results]
    assert _save_ids(root, 3, 1) == {"node1": loaded, "node2": loaded}
