"""Async save figures: the training stall and the time to a finalized checkpoint, against a
memcpy and the synchronous path measured in the same run.

    python scripts/bench_async.py                    # 2 ranks x 256 MiB, 2 simulated nodes, F=2
    python scripts/bench_async.py --quick --out /tmp/b

- stall: time inside ``save(..., is_async=True)`` (validation collective + staging copy), vs a
  memcpy of the same bytes into a preallocated buffer;
- save to finalized: from the call to ``save(is_async=True)`` until
  ``maybe_finalize_async_calls(blocking=True)`` returned, vs a synchronous ``save`` (both with
  replication factor 2 across the 2 nodes).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from localckpt import LocalCheckpointManager
from localckpt.async_calls import AsyncCallsQueue

MiB = 1 << 20


def _rank(rank: int, world: int, store_path: str, base: str, nbytes: int, repeats: int,
          out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    queue = AsyncCallsQueue(timeout=300)
    mgr = LocalCheckpointManager(Path(base) / f"node{rank}", "bench", "node_spread",
                                 timeout=300, node_id=f"node{rank}")
    state = {f"layer{i}": torch.randn(nbytes // 4 // 8) for i in range(8)}
    flat = torch.cat([t.view(-1) for t in state.values()])
    dst = torch.empty_like(flat)
    dst.copy_(flat)
    memcpy = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(flat)
        memcpy.append(time.perf_counter() - t)
    it = iter(range(10**6))
    mgr.save(state, next(it))  # warm: arena allocated, files exist
    stall, to_final, sync = [], [], []
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        req = mgr.save(state, next(it), is_async=True)
        stall.append(time.perf_counter() - t)
        queue.schedule_async_request(req)  # type: ignore[arg-type]
        queue.maybe_finalize_async_calls(blocking=True)
        to_final.append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        mgr.save(state, next(it))
        sync.append(time.perf_counter() - t)
    queue.close()
    mgr.close()
    local = torch.tensor([statistics.median(x) for x in (memcpy, stall, to_final, sync)])
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    if rank == 0:
        m, s, f, y = (float(v) for v in local)
        Path(out).write_text(json.dumps({
            "world": world, "nbytes_per_rank": nbytes, "repeats": repeats,
            "memcpy_s": m, "stall_s": s, "stall_ratio_to_memcpy": s / m,
            "save_to_finalized_s": f, "sync_save_s": y, "async_to_sync_ratio": f / y}))
    dist.destroy_process_group()


def markdown(r: dict[str, Any], cmd: str) -> str:
    return f"""# Async save benchmark

Measured by `{cmd}`: {r['world']} ranks on {r['world']} simulated nodes, {r['nbytes_per_rank'] // MiB} MiB
per rank (8 tensors), node_spread replication factor 2, medians of {r['repeats']} runs (max over
ranks), same run.

| figure | time | ratio | target |
|---|---:|---:|---:|
| training stall: inside `save(is_async=True)` | {r['stall_s'] * 1000:.0f} ms | **{r['stall_ratio_to_memcpy']:.2f}x** a memcpy of the same bytes ({r['memcpy_s'] * 1000:.0f} ms) | ≤ 1.25 |
| async save until finalized | {r['save_to_finalized_s'] * 1000:.0f} ms | {r['async_to_sync_ratio']:.2f}x the synchronous save ({r['sync_save_s'] * 1000:.0f} ms) | |

The stall is the validation collective (a few ms) plus copying every tensor into the reused
staging arena; writing, replication and finalize then run while training continues. When the
next save comes before the previous one finished, it waits (or, with `busy="skip"`, skips).
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs"))
    a = p.parse_args()
    if a.quick:
        a.size_mib, a.repeats = 4, 2
    work = Path(tempfile.mkdtemp(prefix="localckpt-bench-async-",
                                 dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        mp.start_processes(_rank, args=(a.world, str(work / "store"), str(work / "roots"),
                                        a.size_mib * MiB, a.repeats, str(work / "r.json")),
                           nprocs=a.world, start_method="spawn")
        r = json.loads((work / "r.json").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "python scripts/bench_async.py" + (" --quick" if a.quick else "")
    (out / "benchmarks-async.json").write_text(json.dumps(r, indent=1))
    (out / "benchmarks-async.md").write_text(markdown(r, cmd))
    print(markdown(r, cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
