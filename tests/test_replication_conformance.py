"""One conformance suite run against every registered replicating strategy, on real gloo ranks
with simulated nodes (each node its own root and node id)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import scenarios
from dist_harness import run_ranks

from localckpt.storage.layout import list_shards
from replication import ErasureCodingStrategy, Topology, make_strategy

STRATEGIES = ["clique", "lazy_clique", "node_spread", "erasure"]
LAYOUTS = [(2, 2), (4, 2)]  # (nodes, ranks per node): 4 ranks on 2 nodes, 8 ranks on 4 nodes


def kwargs_for(name: str, ranks_per_node: int, nodes: int) -> dict[str, Any]:
    if name in ("clique", "lazy_clique"):
        return {"replication_jump": ranks_per_node, "replication_factor": 2}
    if name == "erasure":  # one parity block per stripe of the other nodes' ranks: 1+1, 3+1
        return {"k": nodes - 1, "m": 1}
    return {"replication_factor": 2}


def expected_on_nodes(name: str, nodes: int, per_node: int) -> list[set[int]]:
    """Owners whose shard each node must hold: its own ranks' and the replicas placed on it
    (with erasure coding, the slots of the parity blocks placed on it)."""
    topo = Topology.uniform(nodes, per_node)
    strategy = make_strategy(name, **kwargs_for(name, per_node, nodes))
    placement = strategy.place(topo)
    want: list[set[int]] = [set() for _ in range(nodes)]
    for owner, holders in enumerate(placement.holders):
        want[topo.node_of[owner]].add(owner)
        for h in holders:
            want[topo.node_of[h]].add(owner)
    if isinstance(strategy, ErasureCodingStrategy):
        layout = strategy.stripes(topo)
        for s, j, slot in layout.slots():
            want[topo.node_of[layout.stripes[s].parity[j]]].add(slot)
    return want


def held(root: Path, node: int, iteration: int) -> set[int]:
    return {s.owner_rank for s in list_shards(root / f"node{node}", "job")
            if s.iteration == iteration}


def load_all(tmp_path: Path, root: Path, name: str, nodes: int, per: int) -> list[Any]:
    results = run_ranks(scenarios.replicated_load, nodes * per, tmp_path, str(root), name,
                        kwargs_for(name, per, nodes), per)
    for r in results:
        assert r.ok, r.message
    return [r.value for r in results]


@pytest.mark.parametrize("nodes,per", LAYOUTS)
@pytest.mark.parametrize("name", STRATEGIES)
def test_node_loss_recovery_restores_redundancy_and_survives_a_second_loss(
        tmp_path: Path, root: Path, name: str, nodes: int, per: int) -> None:
    world = nodes * per
    results = run_ranks(scenarios.replicated_save, world, tmp_path, str(root), name,
                        kwargs_for(name, per, nodes), per, [3, 5])
    assert all(r.ok for r in results), [r.message for r in results]
    want = expected_on_nodes(name, nodes, per)
    assert [held(root, n, 5) for n in range(nodes)] == want
    assert all(held(root, n, 3) == set() for n in range(nodes))  # keep_last=1

    for lost in (1, 0):  # lose node 1, recover; then lose node 0, recover again
        shutil.rmtree(root / f"node{lost}")
        values = load_all(tmp_path, root, name, nodes, per)
        for v in values:
            assert v["latest"] == 5 and v["digest"] == v["expected"]
        assert [held(root, n, 5) for n in range(nodes)] == want  # redundancy restored
        # Only the replaced node's ranks received anything (reported by the metrics hook).
        assert [v["fetched"] > 0 for v in values] == [r // per == lost for r in range(world)]


@pytest.mark.parametrize("nodes,per", LAYOUTS)
@pytest.mark.parametrize("name", STRATEGIES)
def test_corrupt_primary_is_replaced_from_a_verified_replica(tmp_path: Path, root: Path,
                                                              name: str, nodes: int,
                                                              per: int) -> None:
    world = nodes * per
    assert all(r.ok for r in run_ranks(scenarios.replicated_save, world, tmp_path, str(root),
                                       name, kwargs_for(name, per, nodes), per, [4]))
    chunk = root / "node0" / "job" / "iter_0000000004" / f"rank_00001_of_{world:05d}" / "data" \
        / "c" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[10] ^= 0x40
    chunk.write_bytes(raw)
    for v in load_all(tmp_path, root, name, nodes, per):
        assert v["latest"] == 4 and v["digest"] == v["expected"]
    assert chunk.read_bytes() != bytes(raw)  # the corrupt primary was rewritten from a replica
    for v in load_all(tmp_path, root, name, nodes, per):  # and now loads locally
        assert v["digest"] == v["expected"]


@pytest.mark.parametrize("nodes,per", [(2, 2)])
@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize("keep_last,expected", [(2, 6), (1, -1)])
def test_losing_every_copy_of_a_shard_falls_back_never_to_an_unloadable_iteration(
        tmp_path: Path, root: Path, name: str, nodes: int, per: int, keep_last: int,
        expected: int) -> None:
    world = nodes * per
    results = run_ranks(scenarios.replicated_save, world, tmp_path, str(root), name,
                        kwargs_for(name, per, nodes), per, [6, 9], keep_last)
    assert all(r.ok for r in results), [r.message for r in results]
    for shard in root.glob(f"node*/job/iter_0000000009/rank_00002_of_{world:05d}"):
        shutil.rmtree(shard)
    for block in root.glob(f"node*/job/iter_0000000009/parity_*_of_{world:05d}"):
        shutil.rmtree(block)  # erasure: what would rebuild it goes too
    for v in load_all(tmp_path, root, name, nodes, per):
        assert v["latest"] == expected
        if expected >= 0:
            assert v["digest"] == v["expected"]


def test_failed_replica_receive_fails_the_save_on_every_rank(tmp_path: Path, root: Path) -> None:
    results = run_ranks(scenarios.replica_receive_fails_on, 4, tmp_path, str(root), 3)
    for r in results:
        assert r.ok, r.message
        name, bases, msg = r.value["error"]
        assert name == "RankOSError" and "OSError" in bases, (name, msg)
        assert "rank 3" in msg and "injected" in msg
        assert r.value["iters"] == ["iter_0000000001"]  # iteration 2 removed on every node
        assert r.value["latest"] == 1 and r.value["digest"] == r.value["expected"]


def test_recycled_chunk_files_are_shared_by_a_node_and_survive_a_node_loss(
        tmp_path: Path, root: Path) -> None:
    results = run_ranks(scenarios.recycled_saves, 4, tmp_path, str(root), 4)
    for r in results:
        assert r.ok, r.message
        assert r.value["ok"] == [True] * 4
    assert sum(r.value["reused"] for r in results) > 0  # shards and replicas written over
    shutil.rmtree(root / "node1")  # node 1 lost: its shards come back from node 0's replicas
    for value in load_all(tmp_path, root, "node_spread", 2, 2):
        assert value["latest"] == 4 and value["digest"] == value["expected"]
