"""Benchmarks: localckpt's phases against this machine's raw limits and against torch.save and
torch.distributed.checkpoint (DCP), in one run.

    python scripts/bench.py                       # full grid -> docs/benchmarks.{json,md,png}
    python scripts/bench.py --quick --out /tmp/b  # tiny sizes, what the CI smoke test runs
    python scripts/bench.py --sizes 64 256 --worlds 2 --factors 2 --cases uniform

For every configuration (ranks per job, MiB per rank, replication factor, state dict case) a
fresh world of gloo ranks is spawned (2 simulated nodes on loopback, one tmpfs root per node) and
measures, with all ranks working at once:

- raw limits: memcpy into a preallocated buffer, crc32c, tmpfs write (fresh file + fsync, and in
  place), tmpfs read (warm buffer and fresh allocation), gloo send/recv one direction, and the
  replication schedule done with bare send/recv;
- localckpt: the stall of ``save(is_async=True)``, the local write, replication, finalize and
  call-to-finalized of that save, ``find_latest``, ``load`` from local disk, and (replication
  factor 2) ``find_latest`` + ``load`` after node 1's root was wiped;
- baselines: ``torch.save`` / ``torch.load`` to tmpfs, ``torch.save`` plus sending the file to a
  peer by hand, DCP ``save`` / ``async_save`` / ``load`` to tmpfs.

The ``fsdp2`` case (4 ranks, a (2, 2) mesh) saves and loads the state of an FSDP2 x tensor
parallel transformer with localckpt and with DCP (scripts/bench_fsdp2.py).

Every figure is the median of ``--repeats`` runs and is also given as a ratio to its raw limit
from the same configuration. Configurations whose memory (RAM + tmpfs) would not fit this
machine are listed as skipped with the reason. The planning figures at 1k-16k ranks are
``scripts/bench_planning.py``'s (pure functions, no processes).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import bench_fsdp2
import bench_rank
import bench_report
import benchlib
import torch

from localckpt.storage import checksum
from localckpt.storage.io_sizing import usable_cores

MiB, GiB = 1 << 20, 1 << 30
PROCESS_OVERHEAD = 400 * MiB  # python + torch + gloo per rank, measured RSS before any state


def footprint(world: int, nbytes: int, factor: int, case: str) -> tuple[int, int]:
    """(RAM incl. tmpfs, tmpfs) a configuration peaks at: per rank the state, the staging arena,
    two iterations of F shards on tmpfs while a save overlaps the retained one, the replica
    receive buffer; a separate raw payload unless the case's tensors are views of it."""
    per_rank = nbytes * (2 + 2 * factor + (factor - 1)) + (0 if case == "uniform" else nbytes)
    return world * (per_rank + PROCESS_OVERHEAD), world * nbytes * 2 * factor


def available() -> tuple[int, int]:
    """(MemAvailable, free bytes on the scratch tmpfs)."""
    meminfo = Path("/proc/meminfo").read_text().split("\n")
    mem = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable"))
    return mem, shutil.disk_usage(benchlib.SHM or "/tmp").free


def configurations(a: Any) -> list[dict[str, Any]]:
    configs = [{"case": "uniform", "world": w, "nbytes": s * MiB, "factor": f}
               for w in a.worlds for s in a.sizes for f in a.factors]
    for case in a.cases:
        if case == "fsdp2":  # a 2-D mesh: (dp=2, tp=2); the same bytes as DCP: no replicas
            configs.append({"case": case, "world": 4, "nbytes": 0, "factor": 1})
        elif case != "uniform":
            configs.append({"case": case, "world": 2, "nbytes": 0, "factor": 2})
    if "uniform" not in a.cases:
        configs = [c for c in configs if c["case"] != "uniform"]
    return configs


def summarize(samples: dict[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in samples.items()}


def run_config(config: dict[str, Any], case_args: dict[str, Any], repeats: int,
               start_method: str = "spawn") -> dict[str, Any]:
    t = time.perf_counter()
    measure = bench_fsdp2.measure if config["case"] == "fsdp2" else bench_rank.measure
    r = benchlib.spawn_ranks(measure, config["world"],
                             ({**config, "repeats": repeats, "case_args": case_args},),
                             "localckpt-bench-", start_method)
    return {**config, "nbytes": r["nbytes"], "tensors": r["tensors"],
            "median_s": summarize(r["samples"]), "samples_s": r["samples"],
            "wall_s": time.perf_counter() - t}


def main() -> int:
    p = benchlib.parser(__doc__, size_mib=0, repeats=3)
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 512, 1024, 2048],
                   help="MiB per rank of the uniform case")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="ranks (even)")
    p.add_argument("--factors", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    p.add_argument("--cases", nargs="+", default=["uniform", "small", "transformer", "fsdp2"],
                   choices=["uniform", "small", "transformer", "fsdp2"])
    p.add_argument("--small-count", type=int, default=10_000)
    p.add_argument("--small-kib", type=int, default=4)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32_000)
    p.add_argument("--io-threads", type=int, default=None,
                   help="LocalCheckpointManager io_threads (default: the manager's default, "
                        "each rank's share of the usable cores, 2 to 8)")
    p.add_argument("--recycle-files", action="store_true",
                   help="LocalCheckpointManager(recycle_files=True)")
    p.add_argument("--steps", nargs="+", default=["raw", "localckpt", "baselines"],
                   choices=["raw", "localckpt", "baselines"], help="what to measure")
    p.add_argument("--erasure-mib", type=int, default=64,
                   help="MiB per rank of the erasure section's saves and restarts against "
                        "node_spread (scripts/bench_erasure.py; 0: the section is not run)")
    p.add_argument("--only-erasure", action="store_true",
                   help="run the erasure section alone and render the report with the rows "
                        "of <out>/benchmarks.json")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--report-from", metavar="JSON",
                   help="only render the markdown and plot of an earlier run's JSON")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows of <out>/benchmarks.json this run does not measure (each "
                        "row records the command and date that measured it)")
    a = p.parse_args()
    if a.report_from:
        result = json.loads(Path(a.report_from).read_text())
        result["rows"] = [bench_report.derive(r) for r in result["rows"]]
        write_report(result, Path(a.out), result.get("command", "python scripts/bench.py"),
                     a.no_plot)
        return 0
    if (a.erasure_mib and not a.quick) or a.only_erasure:  # first: write_report embeds it
        import bench_erasure  # its smoke test is bench_erasure.py's own

        mib = max(a.erasure_mib, 1)
        bench_erasure.report(bench_erasure.measure(mib, a.repeats, mib), Path(a.out),
                             "python scripts/bench.py " + " ".join(sys.argv[1:]))
    if a.only_erasure:
        result = json.loads((Path(a.out) / "benchmarks.json").read_text())
        write_report(result, Path(a.out), result.get("command", "python scripts/bench.py"),
                     a.no_plot)
        return 0
    if a.quick:
        a.sizes, a.repeats, a.small_count = [2], 2, 200
        a.d_model, a.layers, a.vocab = 64, 2, 1000
    if any(w < 2 or w % 2 for w in a.worlds):
        p.error(f"--worlds: expected even rank counts >= 2 (two simulated nodes), got {a.worlds}")
    case_args = {"small_count": a.small_count, "small_kib": a.small_kib, "d_model": a.d_model,
                 "layers": a.layers, "vocab": a.vocab}
    rows, skipped = [], []
    configs = configurations(a)
    if a.quick:  # one replicated 4-rank configuration is enough to exercise every path
        configs = [c for c in configs if not (c["case"] == "uniform" and c["world"] == 4
                                              and c["factor"] == 1)]
    started = time.perf_counter()
    for config in configs:
        mem, shm = available()
        estimate = 1 * GiB
        if config["case"] == "fsdp2":  # fp32 weights + AdamW's two states, over the ranks
            d, v = case_args["d_model"], case_args["vocab"]
            estimate = 12 * (2 * v * d + 12 * case_args["layers"] * d * d) // config["world"]
        need_mem, need_shm = footprint(config["world"], config["nbytes"] or estimate,
                                       config["factor"], config["case"])
        label = bench_report.label(config)
        if need_mem > 0.85 * mem or need_shm > 0.9 * shm:
            reason = (f"needs ~{need_mem / GiB:.1f} GiB of memory ({need_shm / GiB:.1f} GiB of "
                      f"it tmpfs); this machine has {mem / GiB:.1f} GiB available, "
                      f"{shm / GiB:.1f} GiB free on tmpfs")
            skipped.append({**config, "reason": reason})
            print(f"skip {label}: {reason}", file=sys.stderr, flush=True)
            continue
        print(f"run  {label} ...", file=sys.stderr, flush=True)
        config.update(io_threads=a.io_threads, steps=a.steps, recycle_files=a.recycle_files)
        try:
            # --quick (the smoke test): ranks forked from a server that imported torch once
            rows.append(run_config(config, case_args, a.repeats,
                                   "forkserver" if a.quick else "spawn"))
        except Exception as exc:  # e.g. a rank killed by the OOM killer: report, go on
            skipped.append({**config, "reason": f"failed: {type(exc).__name__}: {exc}"})
            print(f"     failed: {exc}", file=sys.stderr, flush=True)
            continue
        print(f"     done in {rows[-1]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    result = {
        "machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "python": sys.version.split()[0], "root_fs": benchlib.SHM, "repeats": a.repeats,
        "memory_gib": round(available()[0] / GiB, 1), "case_args": case_args,
        "io_threads": a.io_threads or f"default ({usable_cores()[0]} usable cores)",
        "recycle_files": a.recycle_files, "crc32c": checksum.IMPLEMENTATION,
        "date": time.strftime("%Y-%m-%d"), "wall_s": time.perf_counter() - started,
        "rows": [bench_report.derive(r) for r in rows], "skipped": skipped,
    }
    result["command"] = "python scripts/bench.py " + " ".join(sys.argv[1:])
    for row in result["rows"]:
        row.update(command=result["command"], date=result["date"])
    if a.merge and (Path(a.out) / "benchmarks.json").exists():
        result = merged(json.loads((Path(a.out) / "benchmarks.json").read_text()), result)
    write_report(result, Path(a.out), result["command"].strip(), a.no_plot)
    return 0


def merged(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``old`` with the rows (and skips) of ``new``'s configurations replaced by ``new``'s."""
    def key(row: dict[str, Any]) -> tuple[Any, ...]:
        return row["case"], row["world"], row["factor"], row["nbytes"] if row["case"] == \
            "uniform" else 0

    ran = {key(r) for r in new["rows"] + new["skipped"]}
    return {**old, "rows": [r for r in old["rows"] if key(r) not in ran] + new["rows"],
            "skipped": [s for s in old["skipped"] if key(s) not in ran] + new["skipped"]}


def write_report(result: dict[str, Any], out: Path, cmd: str, no_plot: bool) -> None:
    """benchmarks.json, benchmarks.md and (with matplotlib) benchmarks.png under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    plot = None if no_plot else bench_report.plot(result, out / "benchmarks.png")
    text = bench_report.markdown(result, cmd, plot)
    cuda = out / "benchmarks-cuda.json"  # written by bench_cuda.py on a GPU machine
    if cuda.exists():
        import bench_cuda

        section = json.loads(cuda.read_text())
        text += "\n" + bench_cuda.markdown(section, section["command"])
    preemption = out / "benchmarks-preemption.md"  # written by bench_preemption.py
    if preemption.exists():
        text += "\n" + preemption.read_text().replace("# Preemption", "## Preemption", 1)
    durable = out / "benchmarks-durable.md"  # written by bench_durable.py
    if durable.exists():
        text += "\n" + durable.read_text().replace("# The durable tier", "## The durable tier", 1)
    erasure = out / "benchmarks-erasure.md"  # written by bench_erasure.py
    if erasure.exists():
        text += "\n" + erasure.read_text().replace("# Erasure", "## Erasure", 1)
    (out / "benchmarks.json").write_text(json.dumps(result, indent=1))
    (out / "benchmarks.md").write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
