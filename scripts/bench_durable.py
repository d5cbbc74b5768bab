"""The durable tier: persist throughput and a whole-job restart from it, against raw operations
on the same bytes and against DCP, in one run.

Two ranks (spawned processes, gloo, one simulated node each, node_spread F=2), each with
``--mib`` MiB of CPU tensors in 8 tensors. Two durable tiers, one after the other
(``--tiers``): a directory on ``--durable-dir`` (default: a directory on the disk file system
under /tmp, this machine's stand-in for a shared file system; node roots are on /dev/shm), and a
bucket on an S3-protocol server (moto's, started by this script on 127.0.0.1 in a process of
its own). Measured, all ranks at once, medians of ``--repeats`` (the slowest rank each time):

- raw copy: each rank copies the chunk files of its committed local shard to the durable
  directory (read, write, fsync each file), or PUTs them to the bucket (obstore, as many
  requests in flight as the tier uses): the floor of a persist;
- persist: ``persist(it)`` on every rank until rank 0 committed the iteration;
- whole-job restart on empty nodes: both node roots removed, fresh managers, ``find_latest`` +
  ``load`` from the durable tier; against the raw read of the persisted files (GET of the
  objects) into memory and against ``torch.distributed.checkpoint.load`` of the same state
  saved by ``dcp.save`` into the directory.

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

from s3_local import S3Server

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


_S3_THREADS = 8  # requests in flight: what the object tier's pool runs


def _s3_store(url: str) -> Any:
    from obstore.store import S3Store

    return S3Store.from_url(url, client_options={"allow_http": True})


def _put_raw(src: Path, url: str) -> None:
    """Every file under ``src`` PUT to ``url`` (same relative keys), 8 in flight."""
    from concurrent.futures import ThreadPoolExecutor

    import obstore

    store = _s3_store(url)
    files = sorted(p for p in src.rglob("*") if p.is_file())
    with ThreadPoolExecutor(_S3_THREADS) as pool:
        list(pool.map(lambda p: obstore.put(store, str(p.relative_to(src)), p.read_bytes(),
                                            use_multipart=False), files))


def _get_raw(url: str) -> int:
    from concurrent.futures import ThreadPoolExecutor

    import obstore

    store = _s3_store(url)
    keys = [o["path"] for batch in obstore.list(store) for o in batch]
    with ThreadPoolExecutor(_S3_THREADS) as pool:
        return sum(pool.map(lambda k: len(obstore.get(store, k).bytes()), keys))


def _rank(rank: int, world: int, store_path: str, base: str, durable: str, dcp_dir: str,
          mib: int, repeats: int, out: Any, env: dict[str, str]) -> None:
    os.environ.update(env)
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
        if durable.startswith("s3://"):
            raw_url = f"{durable.rsplit('/', 1)[0]}/raw/{it}-{rank}"
            timed("raw_copy", lambda s=shard, u=raw_url: _put_raw(s, u))
            timed("raw_read", lambda u=raw_url: _get_raw(u))
        else:
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
    dcp.save(state, checkpoint_id=dcp_dir)
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
        timed("dcp_load", lambda t=target: dcp.load(t, checkpoint_id=dcp_dir))
    out.put({"rank": rank, "times": times, "failures": failures,
             "nbytes": sum(v.numel() * v.element_size() for v in state.values())})
    dist.destroy_process_group()


def _run_tier(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    base = Path(tempfile.mkdtemp(prefix="bench-durable-roots-", dir=shm))
    scratch = Path(tempfile.mkdtemp(prefix="bench-durable-", dir=args.durable_dir))
    server = S3Server(("bench",)) if kind == "s3" else None
    tier = "s3://bench/tier" if server else str(scratch / "tier")
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, str(scratch / "store"), str(base / "roots"),
                                             tier, str(scratch / "dcp"), args.mib,
                                             args.repeats, results,
                                             server.env if server else {}))
             for r in range(2)]
    try:
        for p in procs:
            p.start()
        got = sorted((results.get(timeout=1200) for _ in procs), key=lambda d: d["rank"])
        for p in procs:
            p.join(60)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    times = got[0]["times"]  # already the max over ranks
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"tier": kind, "where": "moto's S3 server on 127.0.0.1" if server
            else _fs(scratch.parent),
            "median_s": med, "samples_s": times, "nbytes": got[0]["nbytes"],
            "failures": [f for g in got for f in g["failures"]],
            "ratios": {"persist_to_raw_copy": med["persist"] / med["raw_copy"],
                       "restore_to_raw_read": med["restore"] / med["raw_read"],
                       "restore_to_dcp_load": med["restore"] / med["dcp_load"]}}


def _rows(r: dict[str, Any]) -> str:
    med, ratios, nbytes = r["median_s"], r["ratios"], r["nbytes"]
    gbs = {k: nbytes / v / 1e9 for k, v in med.items()}
    s3 = r["tier"] == "s3"
    copy = ("raw PUT of a rank's shard files, 8 in flight" if s3 else
            "raw copy of a rank's shard files to the durable directory (read, write, fsync)")
    read = ("raw GET of the persisted objects into memory, 8 in flight" if s3 else
            "raw read of the persisted files into memory")
    name = "bucket" if s3 else "directory"
    return (
        f"| {name} | {copy} | {med['raw_copy']:.3f} | {gbs['raw_copy']:.2f} | |\n"
        f"| {name} | `persist` until rank 0 committed the iteration | {med['persist']:.3f} "
        f"| {gbs['persist']:.2f} | {ratios['persist_to_raw_copy']:.2f}x raw copy |\n"
        f"| {name} | {read} | {med['raw_read']:.3f} | {gbs['raw_read']:.2f} | |\n"
        f"| {name} | whole job on empty nodes: `find_latest` + `load` from the durable tier "
        f"(a fresh manager, built before the clock starts) | {med['restore']:.3f} "
        f"| {gbs['restore']:.2f} | {ratios['restore_to_raw_read']:.2f}x raw read, "
        f"{ratios['restore_to_dcp_load']:.2f}x DCP |\n"
        f"| {name} | DCP `load` of the same state from the directory, in this tier's run "
        f"| {med['dcp_load']:.3f} "
        f"| {gbs['dcp_load']:.2f} | |\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiers", nargs="+", choices=("dir", "s3"), default=["dir", "s3"])
    parser.add_argument("--durable-dir", default=None,
                        help="where the durable directory goes (default: under /tmp)")
    parser.add_argument("--out", default=str(REPO / "docs"))
    args = parser.parse_args()
    runs = [_run_tier(kind, args) for kind in args.tiers]
    result = {"mib": args.mib, "repeats": args.repeats, "cores": os.cpu_count(),
              "tiers": runs, "date": time.strftime("%Y-%m-%d")}
    where = "; ".join(f"the {'bucket' if r['tier'] == 's3' else 'directory'} on {r['where']}"
                      for r in runs)
    text = (
        "# The durable tier: persist and a whole-job restart\n\n"
        f"`python scripts/bench_durable.py --mib {args.mib} --repeats {args.repeats}` on "
        f"{result['date']}, this machine ({os.cpu_count()} cores): 2 ranks, one simulated node "
        f"each (node roots on /dev/shm), node_spread F=2, {args.mib} MiB of CPU tensors per "
        f"rank. Durable tiers: {where}, standing in for a shared file system and for object "
        "storage. Medians of the slowest rank; GB/s per rank.\n\n"
        "| tier | operation | seconds | GB/s | ratio |\n|---|---|---:|---:|---:|\n"
        + "".join(_rows(r) for r in runs) + "\n"
        "A persist reads the shard from the node root and verifies it, writes it with every "
        "chunk's CRC-32C checked (to a directory: fsynced and renamed; to a bucket: one PUT "
        "per chunk, its body's SHA-256 signed and checked by the server, the manifest last); "
        "rank 0 then commits the iteration. A restore copies each rank's shard into its empty "
        "node root (read and verified, written, committed: the node holds it again), then "
        "loads it from there; DCP reads into the caller's tensors and keeps no local copy. "
        "The files were just written, so every read from the directory (the raw one, the "
        "restore's, DCP's) comes from the page cache: the raw read is a memory-speed floor, "
        "not what a shared file system delivers; the restore against DCP is the comparison "
        "that carries over. The S3 server is Python (moto) on the same 2 cores as the ranks: "
        "its figures say what the client side costs against a raw PUT / GET through the "
        "same server, not what a real object store delivers.\n")
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
