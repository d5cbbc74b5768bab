"""The durable tier: persist throughput and a whole-job restart from it, against raw operations
on the same bytes and against DCP, in one run.

Two ranks (spawned processes, gloo, one simulated node each, node_spread F=2), each with
``--mib`` MiB of CPU tensors in 8 tensors. The durable tier is a directory on ``--durable-dir``
(default: a directory on the disk file system under /tmp, this machine's stand-in for a shared
file system; node roots are on /dev/shm). Measured, all ranks at once, medians of
``--repeats`` (the slowest rank each time):

- raw copy: each rank copies the chunk files of its committed local shard to the durable
  directory (read, write, fsync each file): the floor of a persist;
- persist: ``persist(it)`` on every rank until rank 0 committed the iteration;
- whole-job restart on empty nodes: both node roots removed, fresh managers, ``find_latest`` +
  ``load`` from the durable tier; against the raw read of the persisted files into memory and
  against ``torch.distributed.checkpoint.load`` of the same state saved by ``dcp.save`` into
  the same file system.

Results: docs/benchmarks-durable.{md,json} (``--out``); scripts/bench.py embeds the section.

    python scripts/bench_durable.py --mib 256
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _copy_raw(src: Path, dst: Path) -> None:
    """Every file under ``src`` to ``dst``: read, written, fsynced."""
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        target = dst / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        data = path.read_bytes()
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view, done = memoryview(data), 0
            while done < len(view):
                done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)


def _read_raw(src: Path) -> int:
    return sum(len(p.read_bytes()) for p in src.rglob("*") if p.is_file())


def _rank(rank: int, world: int, store_path: str, base: str, durable: str, mib: int,
          repeats: int, out: Any) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from localckpt import DurableTier, LocalCheckpointManager

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    gen = torch.Generator().manual_seed(rank)
    state = {f"layer{i}.weight": torch.randn(mib << 15, generator=gen) for i in range(8)}
    root = Path(base) / f"node{rank}"
    tier = DurableTier(durable, persist_every=None, keep=repeats + 1)
    times: dict[str, list[float]] = {"raw_copy": [], "persist": [], "raw_read": [],
                                     "restore": [], "dcp_load": []}

    def timed(name: str, fn: Any) -> None:
        dist.barrier()
        t = time.perf_counter()
        fn()
        value = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        times[name].append(float(value))

    mgr = LocalCheckpointManager(root, "bench", "node_spread", node_id=f"node{rank}",
                                 timeout=300, durable=tier, keep_last=repeats + 1)
    for it in range(1, repeats + 1):
        mgr.save(state, it)
        shard = mgr._ctx.store.path_of(it, rank, world)
        raw_dst = Path(durable) / "raw" / f"{it}-{rank}"
        timed("raw_copy", lambda s=shard, d=raw_dst: _copy_raw(s, d))
        timed("raw_read", lambda d=raw_dst: _read_raw(d))

        def persist(it: int = it) -> None:
            mgr.persist(it)
            assert mgr.wait_for_persist(300)
        timed("persist", persist)
    persister = mgr._save.persister
    failures = list(persister.failures) if persister else []
    mgr.close()
    dcp_dir = Path(durable) / "dcp"
    dcp.save(state, checkpoint_id=str(dcp_dir))
    for _ in range(repeats):
        if rank == 0:
            shutil.rmtree(Path(base), ignore_errors=True)  # every node lost
        dist.barrier()

        fresh = LocalCheckpointManager(root, "bench", "node_spread", node_id=f"node{rank}",
                                       timeout=300, durable=tier)
        loaded: dict[str, Any] = {}

        def restore(fresh: Any = fresh, loaded: dict[str, Any] = loaded) -> None:
            fresh.find_latest()
            loaded.update(fresh.load()[0])
        timed("restore", restore)
        fresh.close()
        assert all(torch.equal(loaded[k], v) for k, v in state.items())
        target = {k: torch.empty_like(v) for k, v in state.items()}
        timed("dcp_load", lambda t=target: dcp.load(t, checkpoint_id=str(dcp_dir)))
    out.put({"rank": rank, "times": times, "failures": failures,
             "nbytes": sum(v.numel() * v.element_size() for v in state.values())})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--durable-dir", default=None,
                        help="where the durable tier goes (default: under /tmp)")
    parser.add_argument("--out", default=str(REPO / "docs"))
    args = parser.parse_args()
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    base = Path(tempfile.mkdtemp(prefix="bench-durable-roots-", dir=shm))
    durable = Path(tempfile.mkdtemp(prefix="bench-durable-", dir=args.durable_dir))
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, str(durable / "store"), str(base / "roots"),
                                             str(durable / "tier"), args.mib, args.repeats,
                                             results))
             for r in range(2)]
    try:
        for p in procs:
            p.start()
        got = sorted((results.get(timeout=1200) for _ in procs), key=lambda d: d["rank"])
        for p in procs:
            p.join(60)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(durable, ignore_errors=True)
    times = got[0]["times"]  # already the max over ranks
    med = {k: statistics.median(v) for k, v in times.items()}
    nbytes = got[0]["nbytes"]
    gbs = {k: nbytes / v / 1e9 for k, v in med.items()}
    result = {"mib": args.mib, "repeats": args.repeats, "cores": os.cpu_count(),
              "durable_fs": _fs(durable.parent), "median_s": med, "samples_s": times,
              "failures": [f for g in got for f in g["failures"]],
              "ratios": {"persist_to_raw_copy": med["persist"] / med["raw_copy"],
                         "restore_to_raw_read": med["restore"] / med["raw_read"],
                         "restore_to_dcp_load": med["restore"] / med["dcp_load"]},
              "date": time.strftime("%Y-%m-%d")}
    text = (
        "# The durable tier: persist and a whole-job restart\n\n"
        f"`python scripts/bench_durable.py --mib {args.mib} --repeats {args.repeats}` on "
        f"{result['date']}, this machine ({os.cpu_count()} cores): 2 ranks, one simulated node "
        f"each (node roots on /dev/shm), node_spread F=2, {args.mib} MiB of CPU tensors per "
        f"rank. The durable tier is a directory on {result['durable_fs']}, standing in for a "
        "shared file system. Medians of the slowest rank; GB/s per rank.\n\n"
        "| operation | seconds | GB/s | ratio |\n|---|---:|---:|---:|\n"
        f"| raw copy of a rank's shard files to the durable directory (read, write, fsync) "
        f"| {med['raw_copy']:.3f} | {gbs['raw_copy']:.2f} | |\n"
        f"| `persist` until rank 0 committed the iteration | {med['persist']:.3f} "
        f"| {gbs['persist']:.2f} | {result['ratios']['persist_to_raw_copy']:.2f}x raw copy |\n"
        f"| raw read of the persisted files into memory | {med['raw_read']:.3f} "
        f"| {gbs['raw_read']:.2f} | |\n"
        f"| whole job on empty nodes: `find_latest` + `load` from the durable tier (a "
        f"fresh manager, built before the clock starts) "
        f"| {med['restore']:.3f} | {gbs['restore']:.2f} "
        f"| {result['ratios']['restore_to_raw_read']:.2f}x raw read |\n"
        f"| DCP `load` of the same state from the same file system | {med['dcp_load']:.3f} "
        f"| {gbs['dcp_load']:.2f} | restore ÷ DCP: "
        f"{result['ratios']['restore_to_dcp_load']:.2f} |\n\n"
        "A persist reads the shard from the node root and verifies it, writes it with every "
        "chunk's CRC-32C checked, fsyncs and renames it; rank 0 then commits the iteration. "
        "A restore copies each rank's shard into its empty node root (read and verified, "
        "written, committed: the node holds it again), then loads it from there; DCP reads "
        "into the caller's tensors and keeps no local copy. The files were just written, "
        "so every read here (the raw one, the restore's, DCP's) comes from the page "
        "cache: the raw read is a memory-speed floor, not what a shared file system "
        "delivers; the restore against DCP is the comparison that carries over.\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "benchmarks-durable.md").write_text(text)
    (out / "benchmarks-durable.json").write_text(json.dumps(result, indent=1))
    print(text)


def _fs(path: Path) -> str:
    best = ("", "a local file system")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if str(path).startswith(mnt) and len(mnt) > len(best[0]):
                    best = (mnt, f"{fstype} ({dev} on {mnt})")
    except OSError:
        pass
    return best[1]


if __name__ == "__main__":
    main()
