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

import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import benchlib
import torch
import torch.distributed as dist

from localckpt import LocalCheckpointManager
from localckpt.async_calls import AsyncCallsQueue

MiB = 1 << 20


def _rank(rank: int, store_path: str, base: str, out: str, world: int, nbytes: int,
          repeats: int) -> None:
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
    p = benchlib.parser(__doc__, size_mib=256, repeats=5)
    p.add_argument("--world", type=int, default=2)
    a = p.parse_args()
    if a.quick:
        a.size_mib, a.repeats = 4, 2
    r = benchlib.spawn_ranks(_rank, a.world, (a.world, a.size_mib * MiB, a.repeats),
                             "localckpt-bench-async-")
    benchlib.write_report(a.out, "benchmarks-async", r, markdown, "bench_async.py", a.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
