"""On the GPU: an async save's stall, the save through finalize and the load back onto the
device, each against the machine's floor on the same bytes, measured in the same run.

For each state dict (the Adam workload at each ``--sizes-mib``, with 1 % and with 15 % of its
bytes in small tensors; ``uniform`` at each ``--uniform-mib``), every tensor on the device:

- floors (scripts/bench_floors.py): D2H into pinned memory, H2D from pinned memory, tmpfs write
  of fresh fsynced 16 MiB chunk files and their read back into preallocated memory, each with 1
  and with N threads (N = the manager's default I/O threads here); a floor is the fastest;
- localckpt in a world of one with ``--keep-last`` (every save has an older iteration to
  delete): ``StagingArena.stage``, the stall of ``save(is_async=True)``, the time to finalized,
  and a fresh manager's ``load()`` with every tensor back on the device (checked bit for bit).

Ratios: ``stall_to_d2h_pinned``, ``finalized_to_floor`` (÷ D2H + write floor), ``load_to_floor``
(÷ read floor + H2D). Writes docs/benchmarks-cuda.{json,md} and renders docs/benchmarks.md
again, which embeds that section. Without a CUDA device it says so and exits 0 without writing
anything, unless ``--device cpu`` (every path on the CPU: a smoke run of the bench itself).

Usage: python scripts/bench_cuda.py [--quick] [--repeats 5] [--sizes-mib 1024 4096]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_cases
import bench_floors
import benchlib
import torch

from localckpt import LocalCheckpointManager
from localckpt.ops import health
from localckpt.save.async_calls import AsyncCallsQueue
from localckpt.save.staging import StagingArena, plan_layout
from localckpt.state_dict import as_tensor_aware
from localckpt.storage.io_sizing import default_io_threads, usable_cores
from localckpt.storage.views import byte_view


def to_device(obj: Any, device: torch.device) -> Any:
    """Every tensor of a nested dict / list / tuple on ``device``, except RNG states (CPU)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: v if k == "rng" else to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def raw_read_to_gpu_s(payload: torch.Tensor, root: Path, device: torch.device,
                      repeats: int) -> float:
    """Median seconds to read ``payload``'s bytes from a tmpfs file into fresh host memory on one
    thread and copy them to the device: how a naive restart loads (reported, not a floor)."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "raw.bin"
    payload.numpy().tofile(path)

    def read() -> None:
        buf = torch.empty(payload.numel(), dtype=torch.uint8)
        view, done = byte_view(buf), 0
        with open(path, "rb", buffering=0) as f:
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise OSError(f"{path}: short read")
                done += n
        buf.to(device)

    try:
        return bench_floors.median_s(read, repeats, sync=_sync(device))
    finally:
        path.unlink()


def _sync(device: torch.device) -> Callable[[], None] | None:
    return torch.cuda.synchronize if device.type == "cuda" else None


def arena_stage_s(tensors: list[torch.Tensor], device: torch.device, repeats: int) -> float:
    layout = plan_layout(tensors)
    arena = StagingArena()
    arena.stage(tensors, layout, layout.nbytes)  # warm: pinned allocation
    return bench_floors.median_s(lambda: arena.stage(tensors, layout, layout.nbytes), repeats,
                                 sync=_sync(device))


def floors(payload: torch.Tensor, root: Path, device: torch.device, threads: int,
           repeats: int) -> dict[str, float]:
    """The raw operations on ``payload``'s bytes, with 1 and ``threads`` writers / readers."""
    med = bench_floors.device_copies(payload, device, repeats)
    for n in sorted({1, threads}):
        med[f"tmpfs_write_{n}"] = bench_floors.tmpfs_write(payload, root, n, repeats)
        med[f"tmpfs_read_{n}"] = bench_floors.tmpfs_read(payload, root, n, repeats)
    bench_floors.remove_files(root)
    med["tmpfs_write"] = min(v for k, v in med.items() if k.startswith("tmpfs_write_"))
    med["tmpfs_read"] = min(v for k, v in med.items() if k.startswith("tmpfs_read_"))
    med["read_to_device_one_thread"] = raw_read_to_gpu_s(payload, root, device, repeats)
    return med


def measure_case(case: bench_cases.Case, repeats: int, root: Path, device: torch.device,
                 keep_last: int) -> dict[str, Any]:
    """Floors, staging, and a world of one's async saves (an older iteration to delete at
    every save: ``keep_last`` of them kept) and loads by a fresh manager onto ``device``."""
    threads = default_io_threads(1)
    med = floors(case.payload, root / "floors", device, threads, repeats)
    state = to_device(case.state, device)
    tensors = list(as_tensor_aware(state).tensors)  # what a save stages, in its order
    med["arena_stage"] = arena_stage_s(tensors, device, repeats)
    sync = _sync(device) or (lambda: None)

    stalls, finalized, loads = [], [], []
    with LocalCheckpointManager(root / "ckpt", "cuda", keep_last=keep_last,
                                timeout=600) as mgr:
        queue = AsyncCallsQueue(timeout=600)
        for it in range(keep_last + 1):  # warm, and as many iterations as are kept
            mgr.save(state, it)
        for it in range(keep_last + 1, keep_last + 1 + repeats):
            sync()
            t = time.perf_counter()
            req = mgr.save(state, it, is_async=True)
            stalls.append(time.perf_counter() - t)
            queue.schedule_async_request(req)  # type: ignore[arg-type]
            queue.maybe_finalize_async_calls(blocking=True)
            finalized.append(time.perf_counter() - t)
            with LocalCheckpointManager(root / "ckpt", "cuda", timeout=600) as fresh:
                sync()
                t = time.perf_counter()
                loaded, _ = fresh.load()
                sync()
                loads.append(time.perf_counter() - t)
            if it == keep_last + repeats and not _same(loaded, state):
                raise AssertionError(f"{case.name}: the load did not give back what was saved")
            del loaded
        queue.close()
    med |= {"save_stall": statistics.median(stalls),
            "async_save_to_finalized": statistics.median(finalized),
            "load_to_device": statistics.median(loads)}
    save_floor = med["d2h_pinned"] + med["tmpfs_write"]
    load_floor = med["tmpfs_read"] + med["h2d_pinned"]
    return {"case": case.name, "nbytes": case.nbytes, "tensors": len(tensors),
            "keep_last": keep_last, "io_threads": threads, "median_s": med,
            "floors_s": {"save": save_floor, "load": load_floor},
            "ratios": {"stage_to_d2h_pinned": med["arena_stage"] / med["d2h_pinned"],
                       "stall_to_d2h_pinned": med["save_stall"] / med["d2h_pinned"],
                       "finalized_to_floor": med["async_save_to_finalized"] / save_floor,
                       "load_to_floor": med["load_to_device"] / load_floor}}


def _same(a: Any, b: Any) -> bool:
    """Bit for bit, on the devices they were saved from."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.device == b.device and a.dtype == b.dtype
                and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def _ratio(row: dict[str, Any], key: str) -> str:
    return f"{row['ratios'][key]:.2f}" if key in row["ratios"] else "–"


def markdown(result: dict[str, Any], cmd: str) -> str:
    if "keep_last" not in result:
        return markdown_staging_only(result, cmd)
    gpu, rows = result["gpu"], result["rows"]
    threads = rows[0]["io_threads"] if rows else "-"
    lines = [
        "## CUDA: staging, save and load against the machine's floors",
        "",
        f"Measured by `{result.get('command', cmd)}` on {result['date']}: {gpu['name']} "
        f"({gpu['memory_gib']:.0f} GiB, driver {gpu['driver']}, NVML: {gpu['nvml']}), torch "
        f"{result['torch']}, {result['cpus']} usable CPUs, scratch on `{result['root']}`. "
        f"One rank, every tensor on the device, `keep_last={result['keep_last']}` (every save "
        f"has an older iteration to delete), default I/O threads ({threads}). "
        f"Medians of {result['repeats']} runs; GB/s are 10⁹ bytes per second. Floors, on the same "
        "bytes in the same run: **stall** ÷ D2H into pinned memory; **save to finalized** ÷ "
        "(D2H pinned + the fastest tmpfs write of fresh fsynced 16 MiB chunk files, 1 or N "
        "threads); **load** ÷ (the fastest tmpfs read of those files, 1 or N threads + H2D "
        "from pinned memory). Every load is a fresh manager's `load()` (find_latest included), "
        "every tensor back on the device, checked bit for bit.",
        "",
        "| state dict | size | tensors | D2H pinned GB/s | H2D pinned GB/s "
        "| tmpfs write GB/s, 1 / N threads | tmpfs read GB/s, 1 / N threads "
        "| arena stage ms (÷ D2H) | async save stall ms (÷ D2H) "
        "| async save to finalized ms (÷ floor) | `load` onto the device ms (÷ floor) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        m, n, k = r["median_s"], r["nbytes"], r["io_threads"]

        def gbs(key: str, m: dict[str, float] = m, n: int = n) -> str:
            return f"{n / m[key] / 1e9:.1f}" if key in m else "–"
        lines.append(
            f"| {r['case']} | {n / 2**20:,.0f} MiB | {r['tensors']:,} "
            f"| {gbs('d2h_pinned')} | {gbs('h2d_pinned')} "
            f"| {gbs('tmpfs_write_1')} / {gbs(f'tmpfs_write_{k}')} "
            f"| {gbs('tmpfs_read_1')} / {gbs(f'tmpfs_read_{k}')} "
            f"| {m['arena_stage'] * 1e3:,.1f} ({_ratio(r, 'stage_to_d2h_pinned')}) "
            f"| {m['save_stall'] * 1e3:,.1f} ({_ratio(r, 'stall_to_d2h_pinned')}) "
            f"| {m['async_save_to_finalized'] * 1e3:,.0f} ({_ratio(r, 'finalized_to_floor')}) "
            f"| {m['load_to_device'] * 1e3:,.0f} ({_ratio(r, 'load_to_floor')}) |")
    if rows:
        def span(key: str) -> str:
            values = [r["ratios"][key] for r in rows]
            return f"{min(values):.2f} – {max(values):.2f}"
        lines += [
            "",
            f"- **Stall** ÷ pinned D2H: {span('stall_to_d2h_pinned')} (target ≤ 1.1).",
            f"- **Async save to finalized** ÷ floor: {span('finalized_to_floor')} (target ≤ 1.2).",
            f"- **Load onto the device** ÷ floor: {span('load_to_floor')} (target ≤ 1.3).",
        ]
    return "\n".join(lines) + "\n"


def markdown_staging_only(result: dict[str, Any], cmd: str) -> str:
    """The report of a run before the floors were measured (docs/ may still hold one)."""
    gpu, rows = result["gpu"], result["rows"]
    lines = [
        "## CUDA staging",
        "",
        f"Measured by `{cmd}` on {result['date']}: {gpu['name']} ({gpu['memory_gib']:.0f} GiB, "
        f"driver {gpu['driver']}, NVML: {gpu['nvml']}), torch {result['torch']}, "
        f"{result['cpus']} CPUs, scratch on `{result['root']}`. One rank, every tensor on the "
        f"GPU. Medians of {result['repeats']} runs; GB/s are 10⁹ bytes per second; ratios are "
        "times over the raw D2H copy of the same bytes into pinned memory (the stall's target "
        "is ≤ 1.25).",
        "",
        "| state dict | size | tensors | raw D2H pinned GB/s | raw D2H pageable GB/s "
        "| host memcpy GB/s | arena stage ms (÷ raw pinned) | async save stall ms (÷ raw pinned) "
        "| async save to finalized ms | `load` onto the GPU GB/s (÷ raw read + H2D) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        m, n = r["median_s"], r["nbytes"]
        lines.append(
            f"| {r['case']} | {n / 2**20:,.0f} MiB | {r['tensors']:,} "
            f"| {n / m['d2h_pinned'] / 1e9:.1f} | {n / m['d2h_pageable'] / 1e9:.1f} "
            f"| {n / m['memcpy'] / 1e9:.1f} "
            f"| {m['arena_stage'] * 1e3:,.1f} ({r['ratios']['stage_to_d2h_pinned']:.2f}) "
            f"| {m['save_stall'] * 1e3:,.1f} ({r['ratios']['stall_to_d2h_pinned']:.2f}) "
            f"| {m['async_save_to_finalized'] * 1e3:,.0f} "
            f"| {n / m['load_to_gpu'] / 1e9:.2f} "
            f"({_ratio(r, 'load_to_raw_read_to_gpu')}) |")
    large = [r for r in rows if r["case"] != "small"]
    small = [r for r in rows if r["case"] == "small"]
    if not large:
        return "\n".join(lines) + "\n"

    def span(values: list[float]) -> str:
        return f"{min(values):.2f} – {max(values):.2f}"

    stage = span([r["ratios"]["stage_to_d2h_pinned"] for r in large])
    stall = span([r["ratios"]["stall_to_d2h_pinned"] for r in large])
    pinned = span([r["median_s"]["d2h_pageable"] / r["median_s"]["d2h_pinned"] for r in large])
    over = ", ".join(f"{r['case']} {r['nbytes'] / 2**20:,.0f} MiB "
                     f"({r['ratios']['stall_to_d2h_pinned']:.2f})"
                     for r in large if r["ratios"]["stall_to_d2h_pinned"] > 1.25) or "none"
    overhead = max(r["median_s"]["save_stall"] - r["median_s"]["arena_stage"] for r in large)
    lines += [
        "",
        f"- **Staging** (D2H on a side stream into the pinned arena) runs at {stage}× the raw "
        f"pinned copy. Pinned memory is why: D2H into pageable memory is {pinned}× slower.",
        f"- **The stall** of an async save adds to staging the validation exchange, the capacity "
        f"check and the manifest (up to {overhead * 1e3:.1f} ms here): {stall}× the raw copy. "
        "Above 1.25: "
        f"{over}; there that fixed part is large beside a short copy, or grows with the number "
        "of tensors.",
    ]
    if small:
        m = small[0]["median_s"]
        lines.append(
            f"- **Many small tensors**: {small[0]['tensors']:,} CUDA tensors are concatenated on "
            "the GPU per dtype and cross in one copy per run of at most 64 MiB: staging takes "
            f"{m['arena_stage'] * 1e3:.0f} ms (171 ms when copied one by one, measured on this "
            "GPU before the change). The rest of the stall, "
            f"{(m['save_stall'] - m['arena_stage']) * 1e3:.0f} ms, is Python work per tensor "
            "(flattening the state dict, the layout, the manifest) that the CPU path has too; "
            "`load` pays the same per tensor, plus a CUDA allocation each (every loaded tensor "
            "has a storage of its own).")
    if all("load_to_raw_read_to_gpu" in r["ratios"] for r in large):
        load = span([r["ratios"]["load_to_raw_read_to_gpu"] for r in large])
        lines.append(
            "- **`load` onto the GPU** reads and verifies the shard into fresh host memory, then "
            f"copies each tensor to the device: {load}× the time of a raw read into fresh memory "
            "on one thread + one host-to-device copy (`load` reads chunks on the manager's default "
            "I/O threads: the process's share of its cores, 2 to 8).")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="runs per figure (median)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    p.add_argument("--out", default=str(benchlib.DOCS), help="where the report goes")
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[1024, 4096],
                   help="sizes of the Adam workloads (each with 1 %% and 15 %% small tensors)")
    p.add_argument("--uniform-mib", type=int, nargs="*", default=[256],
                   help="sizes of the uniform case (8 large tensors)")
    p.add_argument("--keep-last", type=int, default=1)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: every path on the CPU (a smoke run of the bench itself)")
    p.add_argument("--root", default=None, help="checkpoint scratch (default: tmpfs)")
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing measured, nothing written")
        return 0
    device = torch.device(a.device)
    repeats = 2 if a.quick else a.repeats
    matrix = (1 << 20) if a.quick else (64 << 20)
    sizes = [8] if a.quick else a.sizes_mib
    cases = [bench_cases.adam(s << 20, share, seed=0, matrix_nbytes=matrix)
             for s in sizes for share in (0.01, 0.15)]
    cases += [bench_cases.build("uniform", s << 20, seed=0)
              for s in ([4] if a.quick else a.uniform_mib)]
    rows = []
    for case in cases:
        root = Path(a.root) if a.root else benchlib.scratch("localckpt-cuda-")
        root.mkdir(parents=True, exist_ok=True)
        print(f"run  {case.name}, {case.nbytes / 2**20:,.0f} MiB ...", flush=True)
        try:
            rows.append(measure_case(case, repeats, root, device, a.keep_last))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        m = rows[-1]["median_s"]  # in the log as it comes: a later case that fails keeps it
        print(f"     stall {m['save_stall'] * 1e3:.1f} ms, finalized "
              f"{m['async_save_to_finalized'] * 1e3:.0f} ms, load {m['load_to_device'] * 1e3:.0f} "
              f"ms; ratios " + ", ".join(f"{k} {v:.2f}" for k, v in rows[-1]["ratios"].items()),
              flush=True)
    result = {
        "command": " ".join(["python scripts/bench_cuda.py", *_args_but_out(sys.argv[1:])]),
        "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "cpus": usable_cores()[0], "machine": platform.machine(),
        "root": a.root or benchlib.SHM or "a temporary directory", "repeats": repeats,
        "keep_last": a.keep_last, "device": a.device, "gpu": gpu_identity(device),
        "rows": rows,
    }
    benchlib.write_report(a.out, "benchmarks-cuda", result, markdown, "bench_cuda.py", a.quick)
    main_json = Path(a.out) / "benchmarks.json"
    if main_json.exists():  # benchmarks.md embeds this section: render it again
        subprocess.run([sys.executable, str(Path(__file__).with_name("bench.py")),
                        "--report-from", str(main_json), "--out", a.out],
                       check=True, stdout=subprocess.DEVNULL)
    return 0


def _args_but_out(args: list[str]) -> list[str]:
    out = [a for a in args if not a.startswith("--out=")]
    while "--out" in out:
        i = out.index("--out")
        del out[i:i + 2]
    return out


def gpu_identity(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"name": "none (--device cpu)", "nvml": "not used", "driver": "none",
                "memory_gib": 0.0}
    status, gpus = health.gpu_inventory()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    driver = "unknown"
    if status == "ok":
        import pynvml

        raw = pynvml.nvmlSystemGetDriverVersion()
        driver = raw.decode() if isinstance(raw, bytes) else str(raw)
    return {"name": gpus[0].name if gpus else props.name, "nvml": status, "driver": driver,
            "memory_gib": props.total_memory / 2**30}


if __name__ == "__main__":
    sys.exit(main())
