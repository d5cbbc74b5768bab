"""Erasure-coded redundancy: encode and rebuild rates against memcpy, and the tmpfs bytes per
node each layout costs, against full replicas (``node_spread`` F=2 and F=3).

One process, one thread, ``--mib`` MiB per shard, medians of ``--repeats``; memcpy is a numpy
copy of the same bytes into memory already touched, in the same run. Encode: the m parity blocks
of a stripe of k shards (3+1: XOR; 4+2: Reed-Solomon, zfec). Rebuild: the lost shards of a
stripe from k surviving blocks (3+1: one lost; 4+2: two lost, the worst case). Rates are bytes
of the stripe's data (k shards) per second. The bytes per node come from the layouts themselves
(``replication.erasure.stripe_layout``, ``node_spread``'s placement) for 8 nodes of 4 ranks.

Results: docs/benchmarks-erasure.{md,json} (``--out``); scripts/bench.py embeds the section.

    python scripts/bench_erasure.py --mib 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from replication import Topology, make_strategy  # noqa: E402
from replication.codes import decode, encode  # noqa: E402
from replication.erasure import describe_layout, stripe_layout  # noqa: E402
from replication.parity import ParityAccumulator  # noqa: E402


def _median(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def rates(mib: int, repeats: int) -> list[dict[str, Any]]:
    nbytes = mib << 20
    rng = np.random.default_rng(0)
    rows = []
    for k, m in ((3, 1), (4, 2)):
        shards = [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(k)]
        copy_to = np.empty(nbytes, dtype=np.uint8)
        copy_to[:] = 1  # touched: the copy measures bandwidth, not page faults

        def memcpy(shards: list[np.ndarray] = shards, out: np.ndarray = copy_to) -> None:
            for shard in shards:
                out[:] = shard

        parity = encode(shards, m)
        blocks = {i: s for i, s in enumerate(shards)} | {k + j: p for j, p in enumerate(parity)}
        survivors = {i: b for i, b in blocks.items() if i >= m}  # the first m shards lost
        sizes = [nbytes] * k
        rebuilt = decode(survivors, sizes, m)
        assert all(np.array_equal(rebuilt[i], shards[i]) for i in range(m))
        acc = ParityAccumulator(k, m, 0, nbytes)
        acc.block[:] = 1  # touched: the fold-in measures the arithmetic, not page faults

        def fold_in(acc: ParityAccumulator = acc, shards: list[np.ndarray] = shards) -> None:
            for i, shard in enumerate(shards):  # as a parity holder receives them, 1 MiB each
                for lo in range(0, len(shard), 1 << 20):
                    acc.add(i, lo, shard[lo: lo + (1 << 20)])

        t_fold = _median(fold_in, repeats)
        t_copy = _median(memcpy, repeats)
        t_encode = _median(lambda shards=shards, m=m: encode(shards, m), repeats)
        t_decode = _median(lambda s=survivors, z=sizes, m=m: decode(s, z, m), repeats)
        data = k * nbytes
        rows.append({"layout": f"{k}+{m}", "code": "XOR" if m == 1 else "Reed-Solomon (zfec)",
                     "memcpy_gbs": data / t_copy / 1e9, "encode_gbs": data / t_encode / 1e9,
                     "rebuild_gbs": data / t_decode / 1e9, "lost": m,
                     "fold_in_gbs": data / t_fold / 1e9, "fold_in_to_memcpy": t_fold / t_copy,
                     "encode_to_memcpy": t_encode / t_copy, "rebuild_to_memcpy": t_decode / t_copy})
    return rows


def bytes_per_node(nodes: int, per_node: int) -> list[dict[str, Any]]:
    """Shards a node keeps, in units of one shard, for each layout (max over nodes)."""
    topo = Topology.uniform(nodes, per_node)
    rows = []
    for factor in (2, 3):
        placement = make_strategy("node_spread", replication_factor=factor).place(topo)
        kept = [0] * nodes
        for owner, holders in enumerate(placement.holders):
            kept[topo.node_of[owner]] += 1
            for h in holders:
                kept[topo.node_of[h]] += 1
        rows.append({"layout": f"node_spread F={factor}", "survives": f"{factor - 1} node",
                     "shards_per_node": max(kept)})
    for k, m in ((3, 1), (4, 2)):
        info = describe_layout(stripe_layout(topo, k, m), topo)
        kept = [a + b for a, b in zip(info["shards_per_node"], info["parity_per_node"],
                                      strict=True)]
        rows.append({"layout": f"erasure {k}+{m}", "survives": f"{m} node",
                     "shards_per_node": max(kept)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(REPO / "docs"))
    args = parser.parse_args()
    result = {"mib": args.mib, "repeats": args.repeats, "cores": os.cpu_count(),
              "rates": rates(args.mib, args.repeats), "memory": bytes_per_node(8, 4),
              "date": time.strftime("%Y-%m-%d")}
    text = (
        "# Erasure-coded redundancy: codes and memory\n\n"
        f"`python scripts/bench_erasure.py --mib {args.mib} --repeats {args.repeats}` on "
        f"{result['date']}, this machine ({os.cpu_count()} cores), one thread, {args.mib} MiB "
        "per shard, medians. Rates are bytes of the stripe's k shards per second; memcpy "
        "copies the same bytes in the same run.\n\n"
        "| layout | code | encode GB/s | ÷ memcpy time | parity folded in piecewise GB/s "
        "| ÷ memcpy time | rebuild GB/s (lost shards) | ÷ memcpy time | memcpy GB/s |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|\n"
        + "".join(f"| {r['layout']} | {r['code']} | {r['encode_gbs']:.2f} "
                  f"| {r['encode_to_memcpy']:.2f}x | {r['fold_in_gbs']:.2f} "
                  f"| {r['fold_in_to_memcpy']:.2f}x | {r['rebuild_gbs']:.2f} ({r['lost']}) "
                  f"| {r['rebuild_to_memcpy']:.2f}x | {r['memcpy_gbs']:.2f} |\n"
                  for r in result["rates"])
        + "\nEncode: all m parity blocks from the k shards at once (XOR; zfec). Folded in "
        "piecewise: one parity block built as a holder receives the members' bytes, 1 MiB at a "
        "time, in any order (`replication.parity.ParityAccumulator`: XOR, or one table lookup "
        "per byte for a Reed-Solomon weight), what a save's parity holder will run.\n"
        + "\nShards a node keeps (its own ranks' and the copies or parity blocks placed on it), "
        "the most of any node, 8 nodes of 4 ranks, every shard the same size:\n\n"
        "| layout | survives | shards per node | tmpfs against no redundancy |\n"
        "|---|---|---:|---:|\n"
        + "".join(f"| {r['layout']} | any {r['survives']} loss"
                  f"{'es' if not r['survives'].startswith('1') else ''} "
                  f"| {r['shards_per_node']} | {r['shards_per_node'] / 4:.2f}x |\n"
                  for r in result["memory"])
        + "\nThe erasure layouts are computed and their codes measured; the save path does not "
        "use them yet (issue \"Erasure-coded redundancy\"), so there are no save or rebuild "
        "times through localckpt here.\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "benchmarks-erasure.md").write_text(text)
    (out / "benchmarks-erasure.json").write_text(json.dumps(result, indent=1))
    print(text)


if __name__ == "__main__":
    main()
