"""Where the time of one async save's stall and of one load goes: cProfile of each, on the
Adam workload of scripts/bench_cases.py (a share of its bytes in small tensors), in a world of
one with ``keep_last=1`` as in scripts/bench_cuda.py.

Prints the median stall and load of ``--repeats`` runs, then the functions that took the most
time of the last profiled stall and load (own time, then cumulated). Used on a lent GPU by
scripts/device_check.sh; runs on the CPU too (``--device cpu``).

Usage: python scripts/profile_save_load.py [--device cuda] [--size-mib 1024] [--share 0.15]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_cases
import benchlib
import torch
from bench_cuda import to_device

from localckpt import LocalCheckpointManager
from localckpt.save.async_calls import AsyncCallsQueue


def top(profile: cProfile.Profile, lines: int) -> str:
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(lines)
    stats.sort_stats("cumulative").print_stats(lines)
    return out.getvalue()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--share", type=float, default=0.15, help="bytes in small tensors")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lines", type=int, default=25)
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing profiled (use --device cpu)")
        return 0
    device = torch.device(a.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    case = bench_cases.adam(a.size_mib << 20, a.share, seed=0)
    state = to_device(case.state, device)
    root = benchlib.scratch("localckpt-profile-")
    stalls, loads = [], []
    stall_profile, load_profile = cProfile.Profile(), cProfile.Profile()
    try:
        with LocalCheckpointManager(root / "ckpt", "prof", keep_last=1, timeout=600) as mgr:
            queue = AsyncCallsQueue(timeout=600)
            for it in range(2):  # warm, and an older iteration for retention to delete
                mgr.save(state, it)
            for it in range(2, 2 + a.repeats):
                last = it == 1 + a.repeats
                sync()
                t = time.perf_counter()
                if last:
                    stall_profile.enable()
                req = mgr.save(state, it, is_async=True)
                stall_profile.disable()
                stalls.append(time.perf_counter() - t)
                queue.schedule_async_request(req)  # type: ignore[arg-type]
                queue.maybe_finalize_async_calls(blocking=True)
                with LocalCheckpointManager(root / "ckpt", "prof", timeout=600) as fresh:
                    sync()
                    t = time.perf_counter()
                    if last:
                        load_profile.enable()
                    loaded, _ = fresh.load()
                    sync()
                    load_profile.disable()
                    loads.append(time.perf_counter() - t)
                del loaded
            queue.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{case.name}: {case.nbytes / 2**20:,.0f} MiB on {device}, stall "
          f"{statistics.median(stalls) * 1e3:.1f} ms, load {statistics.median(loads) * 1e3:.1f} "
          f"ms (medians of {a.repeats}; the profiled runs are slower)")
    print("\n=== the stall of save(is_async=True)\n" + top(stall_profile, a.lines))
    print("\n=== a fresh manager's load()\n" + top(load_profile, a.lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
