"""Erasure-coded redundancy: encode and rebuild rates against memcpy, the tmpfs bytes per node
each layout costs, and saves and restarts after node loss through localckpt, against full
replicas (``node_spread`` F=2 and F=3).

One process, one thread, ``--mib`` MiB per shard, medians of ``--repeats``; memcpy is a numpy
copy of the same bytes into memory already touched, in the same run. Encode: the m parity blocks
of a stripe of k shards (3+1: XOR; 4+2: Reed-Solomon, zfec). Rebuild: the lost shards of a
stripe from k surviving blocks (3+1: one lost; 4+2: two lost, the worst case). Rates are bytes
of the stripe's data (k shards) per second. The bytes per node come from the layouts themselves
(``replication.erasure.stripe_layout``, ``node_spread``'s placement) for 8 nodes of 4 ranks.

Saves and restarts (``--e2e-mib`` MiB of CPU tensors per rank, 0: skipped): real gloo ranks of
simulated nodes (4 nodes of 3 ranks for F=2 and 3+1, 6 of 2 for F=3 and 4+2), each layout saved
synchronously, then restarted after losing as many nodes as it survives; the restart is timed
to the end of ``load`` and to the end of the write-back (redundancy back), and the bytes the
fullest node root holds are measured on disk.

Results: docs/benchmarks-erasure.{md,json} (``--out``); ``scripts/bench.py`` runs it too
(``--erasure-mib``) and embeds the section.

    python scripts/bench_erasure.py --mib 64 --e2e-mib 64
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
SHM = "/dev/shm" if Path("/dev/shm").is_dir() else None

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


# (label, strategy, its arguments, nodes, ranks per node, nodes lost at the restore): full
# stripes on every node, as on a real job's many ranks per node
E2E = [("node_spread F=2", "node_spread", {"replication_factor": 2}, 4, 3, 1),
       ("erasure 3+1", "erasure", {"k": 3, "m": 1}, 4, 3, 1),
       ("node_spread F=3", "node_spread", {"replication_factor": 3}, 6, 2, 2),
       ("erasure 4+2", "erasure", {"k": 4, "m": 2}, 6, 2, 2)]


def _e2e_rank(rank: int, world: int, per: int, store_path: str, base: str, name: str,
              kwargs: dict[str, Any], mib: int, repeats: int, lost: int,
              out: mp.Queue) -> None:  # type: ignore[type-arg]
    """One rank of one layout: ``repeats`` synchronous saves (after a first, unmeasured one),
    then ``repeats`` restarts after losing the first ``lost`` nodes (roots wiped), each a fresh
    manager timed from ``find_latest`` to the end of ``load`` and of the write-back."""
    import torch
    import torch.distributed as dist

    from localckpt import LocalCheckpointManager
    from replication import make_strategy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    node, first = rank // per, rank % per == 0  # the node's first rank wipes and measures it
    root = Path(base) / f"node{node}"
    g = torch.Generator().manual_seed(rank)
    state = {f"w{i}": torch.randn((mib << 20) // 32, generator=g) for i in range(8)}

    def manager() -> LocalCheckpointManager:
        return LocalCheckpointManager(root, "bench", make_strategy(name, **kwargs), timeout=600,
                                      node_id=f"node{node}", io_threads=1)

    def timed(fn: Any) -> float:
        dist.barrier()
        t = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - t
        return max(x for x in _gather(elapsed))

    def _gather(x: float) -> list[float]:
        got: list[Any] = [None] * world
        dist.all_gather_object(got, x)
        return got

    saves, stalls, loads, healed = [], [], [], []
    with manager() as mgr:
        mgr.reserve(state)
        for it in range(repeats + 1):
            took = timed(lambda it=it: mgr.save(state, it + 1))
            if it:
                saves.append(took)
        for it in range(repeats):  # async: what training waits for (the parity is not in it)
            requests: list[Any] = []
            stalls.append(timed(lambda it=it, requests=requests: requests.append(
                mgr.save(state, repeats + 2 + it, is_async=True))))
            requests[0].async_fn(*requests[0].async_fn_args)
            for fn in requests[0].finalize_fns:
                fn()
    dist.barrier()
    held = sum(f.stat().st_size for f in (root / "bench").rglob("*") if f.is_file())
    for _ in range(repeats):
        dist.barrier()
        if node < lost and first:
            shutil.rmtree(root)
        dist.barrier()
        mgr = manager()
        loads.append(timed(lambda mgr=mgr: (mgr.find_latest(), mgr.load())))
        healed.append(loads[-1] + timed(mgr.wait_for_write_back))
        mgr.close()
    sizes = _gather(held)
    if rank == 0:
        out.put({"save_s": statistics.median(saves), "save_spread": [min(saves), max(saves)],
                 "stall_s": statistics.median(stalls),
                 "restore_s": statistics.median(loads), "restore_spread": [min(loads), max(loads)],
                 "redundant_again_s": statistics.median(healed),
                 "tmpfs_per_node_mib": max(sizes) / 2**20})
    dist.destroy_process_group()


def end_to_end(mib: int, repeats: int) -> list[dict[str, Any]]:
    """Save and restart times of each layout through localckpt, on real gloo ranks (one per
    simulated node, all on this machine), with the tmpfs each node holds."""
    ctx = mp.get_context("forkserver")  # torch imported once, not once per rank
    ctx.set_forkserver_preload(["torch", "torch.distributed", "localckpt"])
    rows = []
    for label, name, kwargs, nodes, per, lost in E2E:
        work = Path(tempfile.mkdtemp(prefix="bench-erasure-", dir=SHM))
        queue = ctx.Queue()
        try:
            procs = [ctx.Process(target=_e2e_rank, args=(
                r, nodes * per, per, str(work / "store"), str(work / "roots"), name, kwargs,
                mib, repeats, lost, queue)) for r in range(nodes * per)]
            for proc in procs:
                proc.start()
            result = queue.get(timeout=3600)
            for proc in procs:
                proc.join()
        finally:
            shutil.rmtree(work, ignore_errors=True)
        rows.append({"layout": label, "nodes": nodes, "ranks_per_node": per, "lost": lost,
                     **result})
        print(f"{label}: {result}", file=sys.stderr, flush=True)
    return rows


def measure(mib: int, repeats: int, e2e_mib: int) -> dict[str, Any]:
    return {"mib": mib, "repeats": repeats, "cores": os.cpu_count(),
            "rates": rates(mib, repeats), "memory": bytes_per_node(8, 4),
            "e2e_mib": e2e_mib, "e2e": end_to_end(e2e_mib, repeats) if e2e_mib else [],
            "date": time.strftime("%Y-%m-%d")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--e2e-mib", type=int, default=64,
                        help="MiB per rank of the save and restart runs (0: none)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(REPO / "docs"))
    args = parser.parse_args()
    report(measure(args.mib, args.repeats, args.e2e_mib), Path(args.out),
           f"python scripts/bench_erasure.py --mib {args.mib} --e2e-mib {args.e2e_mib} "
           f"--repeats {args.repeats}")


def report(result: dict[str, Any], out: Path, command: str) -> None:
    """docs/benchmarks-erasure.{md,json} under ``out``."""
    args = argparse.Namespace(mib=result["mib"], repeats=result["repeats"])
    text = (
        "# Erasure-coded redundancy: codes, memory, saves and restarts\n\n"
        f"`{command}` on "
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
        + e2e_markdown(result))
    out.mkdir(parents=True, exist_ok=True)
    (out / "benchmarks-erasure.md").write_text(text)
    (out / "benchmarks-erasure.json").write_text(json.dumps(result, indent=1))
    print(text)


def e2e_markdown(result: dict[str, Any]) -> str:
    rows = result.get("e2e") or []
    if not rows:
        return ""
    base = {r["layout"]: r for r in rows if r["layout"].startswith("node_spread")}
    ref = {"erasure 3+1": "node_spread F=2", "erasure 4+2": "node_spread F=3"}
    text = (f"\nThrough localckpt, on real gloo ranks of simulated nodes on this machine "
            f"(12 ranks each: 4 nodes of 3, 6 nodes of 2; one I/O thread per rank), "
            f"{result['e2e_mib']} MiB of CPU tensors per rank, medians of "
            f"{result['repeats']} (the slowest rank each time). Save: a synchronous `save` "
            "(write, replicas or parity, finalize); stall: the time `save(is_async=True)` "
            "blocks training (staging; the replicas or parity are on the save's thread). "
            "Restart: the first `lost` nodes' roots "
            "wiped, fresh managers, `find_latest` + `load` (their shards fetched from a "
            "replica, or rebuilt from their stripe); redundant again: until the write-back "
            "has put the lost shards and replicas or parity blocks back. tmpfs per node: the "
            "bytes the fullest node root holds after a save.\n\n"
            "| layout | nodes x ranks | lost | tmpfs per node MiB | save s | stall s | "
            "restart s | redundant again s | save ÷ replicas' | restart ÷ replicas' |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    for r in rows:
        other = base.get(ref.get(r["layout"], ""))
        ratios = (f"{r['save_s'] / other['save_s']:.2f}x | "
                  f"{r['restore_s'] / other['restore_s']:.2f}x") if other else "- | -"
        text += (f"| {r['layout']} | {r['nodes']} x {r['ranks_per_node']} | {r['lost']} | "
                 f"{r['tmpfs_per_node_mib']:.0f} | {r['save_s']:.3f} | {r['stall_s']:.3f} | "
                 f"{r['restore_s']:.3f} | "
                 f"{r['redundant_again_s']:.3f} | {ratios} |\n")
    return text


if __name__ == "__main__":
    main()
