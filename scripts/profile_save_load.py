"""Where the time of one async save's stall and of one load goes: cProfile of each, on the
Adam workload of scripts/bench_cases.py (a share of its bytes in small tensors), in a world of
one with ``keep_last=1`` as in scripts/bench_cuda.py.

Prints the median stall and load of ``--repeats`` runs, then the functions that took the most
time of the last profiled stall and load (own time, then cumulated). With ``--phases`` it
profiles nothing and prints instead the wall-clock time of each phase of the stall and of the
load on the calling thread (medians; cProfile's overhead per call distorts a path of many small
calls). Used on a lent GPU by scripts/device_check.sh; runs on the CPU too (``--device cpu``).

Usage: python scripts/profile_save_load.py [--device cuda] [--size-mib 1024] [--share 0.15]
                                           [--case adam|small] [--phases] [--into]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import importlib
import io
import pstats
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_cases
import benchlib
import torch
from bench_cuda import to_device

from localckpt import LocalCheckpointManager
from localckpt.save.async_calls import AsyncCallsQueue

# (module, class or None, attribute, phase): each timed where the loading or saving thread calls it
PHASES = [
    ("localckpt.save.prepare", None, "as_tensor_aware", "stall: walk the state dict"),
    ("localckpt.save.prepare", None, "dedupe", "stall: dedupe"),
    ("localckpt.save.prepare", None, "plan_layout", "stall: plan the layout"),
    ("localckpt.save.staging", "StagingArena", "stage_begin", "stall: queue the copies"),
    ("localckpt.save.prepare", None, "_describe", "stall: manifest (copies running)"),
    ("localckpt.load.loader", "LoadPath", "find_latest", "load: find_latest"),
    ("localckpt.storage.store", "ShardStore", "read_manifest", "load: read the manifest"),
    ("localckpt.storage.store", None, "read_shard_tensors",
     "load: allocate, read + copy to the device"),
    ("localckpt.storage.device_reader", "DeviceScatter", "finish", "load: wait for the copies"),
    ("localckpt.load.restore", None, "rebuild_state_dict", "load: rebuild the state dict"),
]


class PhaseClock:
    """Wall-clock seconds per phase on the main thread, for the call being measured."""

    def __init__(self) -> None:
        self.now: dict[str, float] = {}
        self.runs: dict[str, list[float]] = {}
        self._main = threading.get_ident()

    def wrap(self, fn: Callable[..., object], phase: str) -> Callable[..., object]:
        @functools.wraps(fn)
        def timed(*args: object, **kwargs: object) -> object:
            if threading.get_ident() != self._main:
                return fn(*args, **kwargs)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[phase] = self.now.get(phase, 0.0) + time.perf_counter() - t
        return timed

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        undo = []
        for module, cls, attr, phase in PHASES:
            owner = importlib.import_module(module)
            owner = getattr(owner, cls) if cls else owner
            fn = getattr(owner, attr)
            setattr(owner, attr, self.wrap(fn, phase))
            undo.append((owner, attr, fn))
        try:
            yield
        finally:
            for owner, attr, fn in undo:
                setattr(owner, attr, fn)

    def record(self, total_phase: str, seconds: float) -> None:
        self.now[total_phase] = seconds
        for phase, s in self.now.items():
            self.runs.setdefault(phase, []).append(s)
        self.now = {}

    def report(self) -> str:
        order = [p for *_, p in PHASES] + ["stall (whole call)", "load (whole call)"]
        lines = ["phase | median ms | runs", "---|---:|---:"]
        for phase in sorted(self.runs, key=lambda p: (p.split(":")[0], order.index(p))):
            runs = self.runs[phase]
            lines.append(f"{phase} | {statistics.median(runs) * 1e3:.1f} | {len(runs)}")
        return "\n".join(lines)


def top(profile: cProfile.Profile, lines: int) -> str:
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(lines)
    stats.sort_stats("cumulative").print_stats(lines)
    return out.getvalue()


def op_costs(device: torch.device, n: int = 2000) -> str:
    """Microseconds per call of the torch operations a load or a stall makes per tensor on
    ``device`` (the floor of a path that makes them once per tensor)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t = torch.randn(1024, device=device)
    flat = torch.zeros(n * 64, dtype=torch.uint8, device=device)
    dst = [torch.empty(64, dtype=torch.uint8, device=device) for _ in range(n)]
    ops: dict[str, Callable[[], object]] = {
        "torch.empty(shape, dtype, device)": lambda: [
            torch.empty((1024,), dtype=torch.float32, device=device) for _ in range(n)],
        "t.view(torch.uint8)": lambda: [t.view(torch.uint8) for _ in range(n)],
        "t.reshape(-1)": lambda: [t.reshape(-1) for _ in range(n)],
        "split_with_sizes, per piece": lambda: torch.split_with_sizes(flat, [64] * n),
        "_foreach_copy_, per pair": lambda: torch._foreach_copy_(
            dst, list(torch.split_with_sizes(flat, [64] * n))),
        "t.device": lambda: [t.device for _ in range(n)],
        "t.nbytes + t.dtype + t.shape": lambda: [(t.nbytes, t.dtype, t.shape) for _ in range(n)],
    }
    lines = ["operation | us per tensor", "---|---:"]
    for name, op in ops.items():
        op()
        sync()
        start = time.perf_counter()
        op()
        sync()
        lines.append(f"{name} | {(time.perf_counter() - start) / n * 1e6:.2f}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--share", type=float, default=0.15, help="bytes in small tensors")
    p.add_argument("--case", choices=["adam", "small"], default="adam",
                   help="adam: --size-mib with --share of it small; small: 10,000 x 4 KiB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lines", type=int, default=25)
    p.add_argument("--phases", action="store_true",
                   help="wall-clock time per phase instead of cProfile")
    p.add_argument("--into", action="store_true",
                   help="load into preallocated tensors (load(into=...)), as a restart that "
                        "built its model first")
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing profiled (use --device cpu)")
        return 0
    device = torch.device(a.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    case = (bench_cases.adam(a.size_mib << 20, a.share, seed=0) if a.case == "adam"
            else bench_cases.small(10_000, 4096, seed=0))
    state = to_device(case.state, device)
    template = bench_cases.zeros_like(state) if a.into else None
    root = benchlib.scratch("localckpt-profile-")
    stalls, loads = [], []
    stall_profile, load_profile = cProfile.Profile(), cProfile.Profile()
    clock = PhaseClock()
    try:
        with LocalCheckpointManager(root / "ckpt", "prof", keep_last=1, timeout=600) as mgr:
            queue = AsyncCallsQueue(timeout=600)
            for it in range(2):  # warm, and an older iteration for retention to delete
                mgr.save(state, it)
            with clock.installed() if a.phases else contextlib.nullcontext():
                for it in range(2, 2 + a.repeats):
                    last = it == 1 + a.repeats
                    sync()
                    t = time.perf_counter()
                    if last and not a.phases:
                        stall_profile.enable()
                    req = mgr.save(state, it, is_async=True)
                    stall_profile.disable()
                    stalls.append(time.perf_counter() - t)
                    clock.record("stall (whole call)", stalls[-1])
                    queue.schedule_async_request(req)  # type: ignore[arg-type]
                    queue.maybe_finalize_async_calls(blocking=True)
                    clock.now = {}  # the save's thread is not timed; its finalize is not either
                    with LocalCheckpointManager(root / "ckpt", "prof", timeout=600) as fresh:
                        sync()
                        t = time.perf_counter()
                        if last and not a.phases:
                            load_profile.enable()
                        loaded, _ = fresh.load(into=template)
                        sync()
                        load_profile.disable()
                        loads.append(time.perf_counter() - t)
                        clock.record("load (whole call)", loads[-1])
                    del loaded
            queue.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{case.name}: {case.nbytes / 2**20:,.0f} MiB on {device}, stall "
          f"{statistics.median(stalls) * 1e3:.1f} ms, load {statistics.median(loads) * 1e3:.1f} "
          f"ms (medians of {a.repeats}; the profiled runs are slower)")
    if a.phases:
        print("\n=== wall-clock time per phase (main thread; medians)\n" + clock.report())
        print(f"\n=== torch operations on {device}\n" + op_costs(device))
        return 0
    print("\n=== the stall of save(is_async=True)\n" + top(stall_profile, a.lines))
    print("\n=== a fresh manager's load()\n" + top(load_profile, a.lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
