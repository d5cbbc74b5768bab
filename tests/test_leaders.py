"""The node-leader all-gather (localckpt/control/leaders.py): its encodings as pure functions,
and on real gloo ranks: payloads of every size across uneven and interleaved nodes, a failing
local step, and a peer that dies or stays away (every other rank raises, long before the
timeout when a peer died)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import leader_scenarios as sc
import pytest
from dist_harness import run_ranks

from localckpt.control.leaders import FRAME, decode_job, encode_job, encode_node


def test_a_job_message_gives_every_rank_its_payload_and_a_node_shares_equal_ones() -> None:
    node_a = encode_node([0, 2], [b"same", b"same"])
    node_b = encode_node([1, 3, 4], [b"", b"x" * 5000, b"y"])
    out = decode_job(encode_job([node_a, node_b]), 5)
    assert out == [b"same", b"", b"same", b"x" * 5000, b"y"]
    assert out[0] is out[2]  # carried and decoded once
    assert len(node_a) < len(encode_node([0, 2], [b"same", b"diff"])) + 4


@pytest.mark.parametrize("job, world, match", [
    (encode_job([encode_node([0], [b"a"])]), 2, "missing"),
    (encode_job([encode_node([0, 1], [b"a", b"b"]), encode_node([1], [b"c"])]), 2, "twice"),
    (encode_job([encode_node([0], [b"abc"])])[:-2], 1, "malformed"),
    (b"\xff\xff\xff\xff", 1, "malformed"),
    (encode_job([encode_node([5], [b"a"])]), 2, "malformed"),
])
def test_a_malformed_job_message_is_a_runtime_error(job: bytes, world: int, match: str) -> None:
    with pytest.raises(RuntimeError, match=match):
        decode_job(job, world)


SIZES = [[0, 1, FRAME - 8, FRAME - 7, 3 * FRAME],  # around the frame's inline capacity
         [5, 5, 5, 5, 5],
         [70_000, 0, 0, 2, FRAME]]


@pytest.mark.parametrize("node_of", [[0, 0, 1, 1, 1], [0, 1, 0, 1, 2], [0, 1, 2, 3, 4],
                                     [0, 0, 0, 0, 0]],
                         ids=["uneven", "interleaved", "one-per-node", "one-node"])
def test_every_rank_gets_every_payload_in_rank_order(tmp_path: Path, node_of: list[int]) -> None:
    results = run_ranks(sc.gather_sizes, 5, tmp_path, node_of, SIZES)
    for r in results:
        assert r.ok, r.message
        assert r.value == [True] * len(SIZES)


def test_a_failing_local_step_is_the_same_error_everywhere_and_the_group_goes_on(
        tmp_path: Path) -> None:
    results = run_ranks(sc.exchange_with_a_failing_rank, 4, tmp_path, [0, 0, 1, 1])
    for r in results:
        assert r.ok, r.message
        assert r.value["error"][1] == results[0].value["error"][1]
        assert "rank two failed" in r.value["error"][1]
        assert [d["rank"] for d in r.value["after"]] == [0, 1, 2, 3]


@pytest.mark.parametrize("victim", [1, 3, 2], ids=["member", "member-elsewhere", "leader"])
def test_every_rank_raises_at_once_when_a_peer_dies(tmp_path: Path, victim: int) -> None:
    results = run_ranks(sc.peer_vanishes, 5, tmp_path, [0, 0, 1, 1, 1], victim, 20.0, False, 6.0)
    assert results[victim].error == "Exited"
    for r in results:
        if r.rank == victim:
            continue
        assert r.ok, r.message
        assert r.value["error"] is not None and "CollectiveError" in r.value["error"], r.value
        # noticed by the ranks next to it and told to the others, not waited for
        assert r.value["seconds"] < 4, r.value


def test_a_peer_that_stays_away_times_out_every_rank_once(tmp_path: Path) -> None:
    results = run_ranks(sc.peer_vanishes, 4, tmp_path, [0, 0, 1, 1], 3, 2.0, True, 0.0)
    for r in results:
        assert r.ok, r.message
        assert r.value["error"] is not None and "CollectiveError" in r.value["error"], r.value
        assert r.value["seconds"] < 2.0 * 2.5, r.value  # bounded by the timeout, not a hang


def test_a_leader_failing_with_another_exception_tells_its_peers_and_breaks_its_group(
        tmp_path: Path) -> None:
    results = run_ranks(sc.leader_fails_with_memory_error, 4, tmp_path, [0, 0, 1, 1], 6.0)
    assert results[0].ok, results[0].message
    assert "MemoryError" in results[0].value["error"]  # raised as it is
    assert results[0].value["after"] == "CollectiveError"  # and the group is unusable
    for r in results[1:]:
        assert r.ok, r.message
        assert "CollectiveError" in r.value["error"], r.value
        assert r.value["seconds"] < 4, r.value  # told, not left to wait out the bound


class FakeWork:
    def __init__(self, completed: bool) -> None:
        self.completed, self.timeouts = completed, []  # type: ignore[var-annotated]

    def is_completed(self) -> bool:
        return self.completed

    def wait(self, timeout: Any = None) -> bool:
        self.timeouts.append(timeout)
        return True


def test_a_wait_never_asks_gloo_for_a_zero_timeout_and_a_completed_work_is_never_late() -> None:
    import time
    from datetime import timedelta

    from localckpt.control.leaders import _wait

    soon = FakeWork(completed=False)
    _wait(soon, time.monotonic() + 0.0001)  # type: ignore[arg-type]
    assert soon.timeouts[0] >= timedelta(milliseconds=1)  # 0 would mean gloo's whole timeout
    done = FakeWork(completed=True)
    _wait(done, time.monotonic() - 1)  # type: ignore[arg-type]  # past the deadline: no error
    assert done.timeouts == [None]
    with pytest.raises(RuntimeError, match="timed out"):
        _wait(FakeWork(completed=False), time.monotonic() - 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("what", ["interrupt", "nan"])
@pytest.mark.parametrize("victim", [1, 2])  # a member, a node leader
def test_an_interrupted_or_unencodable_local_step_fails_the_step_on_every_rank(
        tmp_path: Path, what: str, victim: int) -> None:
    """Ctrl-C in one rank's local step (or a result JSON refuses) is that step's failure on every
    rank at once: the others neither wait out the timeout nor pair their next step with the
    victim's (the interrupt is raised on the victim after the exchange)."""
    results = run_ranks(sc.local_step_interrupted_or_unencodable, 4, tmp_path,
                        [0, 0, 1, 1], victim, what)
    assert all(r.ok for r in results), [r.message for r in results]
    for r in results:
        expected = "RankValueError" if what == "nan" else \
            "KeyboardInterrupt" if r.rank == victim else "RankInterruptedError"
        assert r.value["one"] == expected, (r.rank, r.value)
        assert r.value["seconds"] < 4, (r.rank, r.value)
        assert r.value["two"] == [{"rank": k} for k in range(4)], (r.rank, r.value)


def test_an_exchange_s_wait_may_be_learned_by_its_local_step(tmp_path: Path) -> None:
    """A rollback waits for the write-back in an exchange whose wait is the write-back's bound,
    which grows once its thread counted the pieces: read before the local step, it was the
    bound of one piece a shard, and a rank with nothing to send timed out while a peer still
    sent a large shard. A callable wait is read after the local step."""
    results = run_ranks(sc.wait_known_after_the_local_step, 2, tmp_path)
    assert [r.value for r in results] == ["ok", "ok"], [r.message for r in results]
