"""The control plane with many real processes on this machine: ``find_latest`` and a tiny save.

For every world size (8, 32, 64 by default) a fresh job of gloo ranks is started on this one
machine, ``--ranks-per-node`` ranks per simulated node (one tmpfs root per node, node_spread
F=2 replication), and every rank times, ``--repeats`` times after a barrier:

- ``find_latest`` (one inventory exchange and the pure decision);
- a tiny sync ``save`` (one 1 KiB tensor: staging, write, replication, finalize with retention):
  nearly all of its time is agreement, not bytes;
- the raw limit of one agreement: ``dist.all_gather`` of 8 bytes per rank on a gloo group, and a
  gloo ``barrier``, measured in the same job.

A figure is the slowest rank's time of one repetition (a collective ends when its last rank
does); the report gives the median and the spread (min-max) over the repetitions and writes
docs/benchmarks-control.{json,md}. All ranks share this machine's cores, so at 64 processes on
2 cores the figures include the OS scheduling 64 processes per hop; they are an upper bound on
what separate machines would see.

Usage: python scripts/bench_control.py [--worlds 8 32 64] [--ranks-per-node 4] [--repeats 20]
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchlib
import torch
import torch.distributed as dist

from localckpt import LocalCheckpointManager


def control_rank(rank: int, store_path: str, roots: str, out: str, config: dict[str, Any]
                 ) -> None:
    """One spawned rank: every figure of ``config`` (world, per_node, repeats)."""
    torch.set_num_threads(1)
    world, per_node, repeats = config["world"], config["per_node"], config["repeats"]
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    node = rank // per_node
    strategy = "node_spread" if world // per_node >= 2 else None
    samples: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[[], Any]) -> None:
        for _ in range(repeats):
            dist.barrier()
            started, cpu = time.perf_counter(), time.process_time()
            fn()
            samples.setdefault(name, []).append(time.perf_counter() - started)
            samples.setdefault(f"{name}_cpu", []).append(time.process_time() - cpu)

    started = time.perf_counter()
    records: list[Any] = []
    mgr = LocalCheckpointManager(Path(roots) / f"node{node}", "control", strategy, timeout=600,
                                 node_id=f"node{node}", metrics=records.append)
    samples["construct"] = [time.perf_counter() - started]
    raw = dist.new_group(backend="gloo", timeout=timedelta(seconds=600))
    word = torch.zeros(1, dtype=torch.int64)
    words = [torch.empty(1, dtype=torch.int64) for _ in range(world)]
    timed("raw_all_gather", lambda: dist.all_gather(words, word, group=raw))
    timed("raw_barrier", lambda: dist.barrier(group=raw))
    scratch = Path(roots) / f"raw{rank}"
    scratch.mkdir(parents=True)
    partner = (rank + per_node) % world, (rank - per_node) % world
    blob, inbox = torch.zeros(256, dtype=torch.float32), torch.empty(256, dtype=torch.float32)

    def raw_save() -> None:
        """A tiny save's bare operations: agree, write 1 KiB + fsync + rename, send it to the
        next node and receive the previous node's, agree."""
        dist.all_gather(words, word, group=raw)
        with open(scratch / "tmp", "wb") as f:
            f.write(blob.numpy().tobytes())
            os.fsync(f.fileno())
        os.replace(scratch / "tmp", scratch / "shard")
        works = [dist.isend(blob, partner[0], group=raw), dist.irecv(inbox, partner[1], group=raw)]
        for work in works:
            work.wait()
        dist.all_gather(words, word, group=raw)

    timed("raw_save", raw_save)
    state = {"w": torch.arange(256, dtype=torch.float32), "step": 0}
    iteration = iter(range(1, 10**6))
    mgr.save(state, 0)  # the first save touches fresh pages: not what is measured
    records.clear()
    timed("save", lambda: mgr.save(state, next(iteration)))
    for phase in ("write", "replicate", "finalize"):
        samples[f"save_{phase}"] = [r.seconds for r in records if r.phase == phase] \
            or [0.0] * repeats
    timed("find_latest", mgr.find_latest)
    mgr.close()
    # Every rank's samples to rank 0: per repetition, the slowest rank's time.
    names = sorted(samples)
    flat = torch.tensor([s for n in names for s in samples[n]], dtype=torch.float64)
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    if rank == 0:
        stacked = torch.stack(gathered)
        # the slowest rank's wall time; CPU seconds of all ranks together (every thread)
        worst, total = stacked.max(dim=0).values.tolist(), stacked.sum(dim=0).tolist()
        result, at = {}, 0
        for n in names:
            result[n] = (total if n.endswith("_cpu") else worst)[at: at + len(samples[n])]
            at += len(samples[n])
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def markdown(result: dict[str, Any], cmd: str) -> str:
    lines = [
        "# Control plane with many processes (one machine)", "",
        f"Measured by `{cmd}`: {result['per_node']} ranks per simulated node, node_spread F=2, "
        f"{result['repeats']} repetitions, each figure the slowest rank's time; median "
        "(min-max). Raw: one `all_gather` of 8 bytes per rank and one `barrier` on a gloo "
        f"group, same job. {result['machine']}. Targets (issue 19): find_latest <= 20 ms at "
        "8 ranks, <= 100 ms at 64.", "",
        "| ranks | nodes | find_latest | raw all_gather | find_latest / raw all_gather | "
        "tiny save | raw tiny save | tiny save / raw | raw barrier | manager construction |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    phases = ["| ranks | whole save | write | replicate | finalize | CPU of all ranks / cores |",
              "|---:|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        def ms(k: str, r: dict[str, Any] = row) -> str:
            s = r[k]
            return f"{s['median'] * 1e3:.1f} ms ({s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f})"
        def ratio(a: str, b: str, r: dict[str, Any] = row) -> str:
            return f"{r[a]['median'] / r[b]['median']:.2f}"
        lines.append(f"| {row['world']} | {row['world'] // result['per_node']} | "
                     f"{ms('find_latest')} | {ms('raw_all_gather')} | "
                     f"{ratio('find_latest', 'raw_all_gather')} | {ms('save')} | "
                     f"{ms('raw_save')} | {ratio('save', 'raw_save')} | {ms('raw_barrier')} | "
                     f"{row['construct']['median']:.2f} s |")
        cpu = row["save_cpu"]["median"] / result["cores"]
        phases.append(f"| {row['world']} | {ms('save')} | {ms('save_write')} | "
                      f"{ms('save_replicate')} | {ms('save_finalize')} | {cpu * 1e3:.1f} ms |")
    notes = [
        "", "Where a tiny save's time goes (the slowest rank per phase; the last column is the "
        "CPU time every rank's process used during the save, all threads, divided by this "
        "machine's cores: with every rank on these cores the save cannot end sooner).", ""]
    return "\n".join([*lines, *notes, *phases]) + "\n"


def main() -> None:
    p = benchlib.parser(__doc__, size_mib=0, repeats=20)
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--ranks-per-node", type=int, default=4)
    a = p.parse_args()
    worlds = [4] if a.quick else a.worlds
    repeats = 3 if a.quick else a.repeats
    per_node = 2 if a.quick else a.ranks_per_node
    rows = []
    for world in worlds:
        started = time.perf_counter()
        samples = benchlib.spawn_ranks(control_rank, world, (
            {"world": world, "per_node": per_node, "repeats": repeats},), "lcctl-",
            start_method="forkserver")
        rows.append({"world": world, **{k: summary(v) for k, v in samples.items()}})
        print(f"{world} ranks: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    result = {"per_node": per_node, "cores": os.cpu_count() or 1, "repeats": repeats, "rows": rows,
              "machine": f"{os.cpu_count()} cores, {platform.machine()}, torch "
                         f"{torch.__version__}"}
    benchlib.write_report(a.out, "benchmarks-control", result, markdown, "bench_control.py",
                          a.quick)


if __name__ == "__main__":
    main()
