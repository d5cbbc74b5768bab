"""Scale simulation: the pure planning functions for 1k, 4k and 16k simulated ranks.

No processes, no bytes moved: every rank's inventory is built in memory (8 ranks per node,
node_spread F=2, 10 retained iterations, so each rank lists its node's 16 shards per iteration),
then timed: every strategy's placement, the save exchange plan, ``choose_latest`` (the
find_latest decision, with the JSON decoding of the gathered inventories it implies), and the
retrieval plan after one node was lost. Peak memory of each step by tracemalloc. Medians of
``--repeats``; writes docs/benchmarks-planning.{json,md}.

Usage: python scripts/bench_planning.py [--quick] [--repeats 3] [--out docs]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchlib

from localckpt.control.coverage import Inventory, choose_latest, decode_inventories
from replication import (
    Topology,
    make_strategy,
    retrieval_plan,
    save_plan,
    wanted_shards,
)

PER_NODE, ITERATIONS, FACTOR = 8, 10, 2


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, float, Any]:
    """(median seconds, peak MiB of one traced run, result)."""
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return statistics.median(times), peak / 2**20, result


def inventories_json(topo: Topology, holders: tuple[tuple[int, ...], ...],
                     lost_node: int | None) -> list[dict[str, Any]]:
    """What each rank sends in find_latest: the committed shards on its node."""
    world = topo.world_size
    on_node: list[list[int]] = [[] for _ in range(topo.num_nodes)]
    for owner in range(world):
        on_node[topo.node_of[owner]].append(owner)
        for h in holders[owner]:
            if topo.node_of[h] != topo.node_of[owner]:
                on_node[topo.node_of[h]].append(owner)
    docs = []
    for r in range(world):
        node = topo.node_of[r]
        owners = [] if node == lost_node else sorted(set(on_node[node]))
        shards = frozenset((it, o, world) for it in range(ITERATIONS) for o in owners)
        docs.append(Inventory(r, "job", shards).to_json())
    return docs


def one_size(world: int, repeats: int) -> dict[str, Any]:
    topo = Topology.uniform(world // PER_NODE, PER_NODE)
    row: dict[str, Any] = {"world": world, "nodes": topo.num_nodes}
    placements = {}
    for name, kwargs in (("node_spread", {"replication_factor": FACTOR}),
                         ("clique", {"replication_jump": PER_NODE,
                                     "replication_factor": FACTOR}),
                         ("lazy_clique", {"replication_jump": PER_NODE,
                                          "replication_factor": FACTOR})):
        strategy = make_strategy(name, **kwargs)
        s, mib, placements[name] = timed(lambda st=strategy: st.place(topo), repeats)
        row[f"place_{name}"] = {"seconds": s, "peak_mib": mib}
    placement = placements["node_spread"]
    s, mib, plan = timed(lambda: save_plan(placement, topo, ITERATIONS - 1), repeats)
    row["save_plan"] = {"seconds": s, "peak_mib": mib, "transfers": len(plan.transfers)}

    docs = inventories_json(topo, placement.holders, None)
    row["inventory_json_bytes_per_rank"] = len(json.dumps(docs[0]))
    # through node leaders a node's equal documents travel once (localckpt/control/leaders.py)
    row["inventory_json_bytes_gathered"] = len({json.dumps(d) for d in docs}) * \
        row["inventory_json_bytes_per_rank"]

    def find_latest() -> int:
        return choose_latest(decode_inventories(docs), world)

    s, mib, latest = timed(find_latest, repeats)
    assert latest == ITERATIONS - 1
    row["find_latest"] = {"seconds": s, "peak_mib": mib}

    lost = inventories_json(topo, placement.holders, lost_node=0)
    invs = [Inventory.from_json(d, r) for r, d in enumerate(lost)]

    def retrieval() -> Any:
        it = ITERATIONS - 1
        present = [frozenset((i, o) for i, o, _ in inv.shards if i == it) for inv in invs]
        holders: dict[tuple[int, int], list[int]] = {}
        for r, shards in enumerate(present):
            for shard in shards:
                holders.setdefault(shard, []).append(r)
        return retrieval_plan(wanted_shards(placement, topo, it, present), holders)

    s, mib, rplan = timed(retrieval, repeats)
    assert not rplan.missing
    row["retrieval_after_node_loss"] = {"seconds": s, "peak_mib": mib,
                                        "remote": len(rplan.exchange.transfers)}
    return row


def markdown(result: dict[str, Any], cmd: str) -> str:
    lines = [
        "# Planning at scale (pure functions, no processes)", "",
        f"Measured by `{cmd}`: {PER_NODE} ranks per node, node_spread F={FACTOR}, "
        f"{ITERATIONS} retained iterations per rank inventory, medians of {result['repeats']} "
        "runs; memory is the tracemalloc peak of one run. Target: 16k ranks planned in ≤ 1 s.",
        "",
        "| ranks | nodes | placement node_spread / clique / lazy_clique | save plan | "
        "find_latest decision (decode + choose) | retrieval after node loss | inventory JSON "
        "per rank |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        def ms(k: str, row: dict[str, Any] = r) -> str:
            return f"{row[k]['seconds'] * 1e3:.1f} ms ({row[k]['peak_mib']:.1f} MiB)"
        lines.append(
            f"| {r['world']} | {r['nodes']} | {ms('place_node_spread')} / {ms('place_clique')}"
            f" / {ms('place_lazy_clique')} | {ms('save_plan')} | {ms('find_latest')} | "
            f"{ms('retrieval_after_node_loss')} | {r['inventory_json_bytes_per_rank']} B |")
    big = result["rows"][-1]
    total = sum(big[k]["seconds"] for k in ("place_node_spread", "save_plan", "find_latest",
                                            "retrieval_after_node_loss"))
    lines += ["", f"Largest size: placement + save plan + find_latest + retrieval = "
              f"{total:.2f} s for {big['world']} ranks. The inventories are "
              f"{big['inventory_json_bytes_per_rank'] * big['world'] / 2**20:.0f} MiB of JSON "
              "in all; through node leaders, where a node's ranks send the same document once, "
              f"{big.get('inventory_json_bytes_gathered', 0) / 2**20:.1f} MiB travel "
              "(gathering them is the collective's cost, measured with real processes up to 64 "
              "in [benchmarks-control.md](benchmarks-control.md)).", ""]
    return "\n".join(lines)


def main() -> None:
    p = benchlib.parser(__doc__, size_mib=0, repeats=3)
    a = p.parse_args()
    sizes = [64, 256] if a.quick else [1024, 4096, 16384]
    rows = [one_size(w, 1 if a.quick else a.repeats) for w in sizes]
    result = {"repeats": 1 if a.quick else a.repeats, "rows": rows}
    benchlib.write_report(a.out, "benchmarks-planning", result, markdown, "bench_planning.py",
                          a.quick)


if __name__ == "__main__":
    main()
