"""bench.py's report: derived ratios, the markdown tables and the plot (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MiB = 1 << 20

RAW = ("memcpy", "crc32c", "tmpfs_write_fresh", "tmpfs_write_in_place", "tmpfs_read",
       "tmpfs_read_fresh", "gloo_one_direction")

# (ratio, how it is formed, bound, "<=" or ">=", what it says)
TARGETS = (
    ("stall_to_memcpy", "stall / memcpy", 1.0, "<=",
     "async save stall vs a single-thread memcpy (time)"),
    ("write_to_raw_write", "raw write / local write", 0.85, ">=",
     "local write vs raw tmpfs write (throughput)"),
    ("write_to_raw_overwrite", "raw overwrite / local write", 0.85, ">=",
     "local write vs raw tmpfs overwrite of an existing file (throughput; met only with "
     "recycle_files=True, see benchmarks-recycle/)"),
    ("replicate_to_raw_gloo", "raw send/recv / replication", 0.8, ">=",
     "replication vs raw gloo, same schedule (throughput)"),
    ("node_loss_to_raw", "restore / max(own read, replica read + transfer)", 1.3, "<=",
     "load after node loss vs the overlapped raw restore (time)"),
    ("first_save_to_steady", "first save of a fresh job / steady save", 1.5, "<=",
     "first save (after reserve) vs a steady save, both synchronous (time)"),
    ("load_into_to_raw_read", "load(into=...) / raw read into preallocated memory", 1.2, "<=",
     "local load into the caller's tensors vs raw read into preallocated memory (time)"),
    ("async_to_torch_save_and_replicate", "async save to finalized / (torch.save + send by hand)",
     0.5, "<=", "async save through finalize vs torch.save + replication by hand (time)"),
)


READING = """
### Reading the results

The machine has 2 cores, and every rank of a configuration shares them: figures for 4 ranks
are those of 4 processes on 2 cores, noisier and lower per rank than for 2.

- **The stall** of an async save is this rank's staging copy alone: the save's agreement with
  the other ranks runs on the save's own thread. It is compared with a single-thread memcpy of
  the same bytes. With 2 ranks on 2 cores each rank has one core, so the copy cannot beat that
  memcpy. With 4 processes on 2 cores, one rank's staging also competes with the other ranks'
  save threads, which start writing as soon as they have agreed.
- **Replication** is measured against the same transfers over bare gloo send/recv into memory.
  A replica is only of use once on the holder's disk, so the phase also checksums every chunk
  and writes it to tmpfs. localckpt pipelines that (piece i is written while piece i+1 arrives),
  but on loopback gloo's sending and receiving threads keep both cores busy, leaving none for
  the write. The phase therefore runs near the sequential bound (the second ratio), not the
  overlapped one. On a cluster the transfer is the NIC's DMA and the cores are free to write.
- **Save through finalize** (≤ 0.5× `torch.save` + sending the file by hand): the raw floor
  above leaves no room under 0.5 for the checksums, the fsyncs and the atomic commit, none of
  which `torch.save` does. Closing the gap needs the write and the transfer overlapped, which
  needs idle cores or a NIC doing the transfer.
- **Load after node loss** is bounded by the overlapped raw restore: each surviving rank reads
  its own shard into fresh memory while the holders read the lost ranks' shards and send them,
  received into fresh memory. `load` does that (checksumming every chunk on both ends) and
  returns; the shards node 1 must hold again are then sent once more and written in the
  background (`write-back`, against raw read + transfer + write of the whole plan), waited for
  by the next save.
- **Fresh memory** is advised for transparent huge pages (`madvise`), in localckpt's loads
  and in the raw operations alike (from 2026-11-28; earlier rows read into 4 KiB pages): a read
  into fresh memory with 4 KiB pages spends more time in page faults than in the read (256 MiB
  here: 0.9 GB/s against 2.2 with huge pages). Rows of different dates compare by their ratios.
- **`load(into=...)`** reads into the caller's tensors (a restart that built its model first),
  against a raw read into preallocated memory on one thread. It also checks every chunk's CRC-32C,
  a 1 MiB window at a time while the window is in the cache. On one core (every rank here has
  about one) that costs read + checksum. A 1 MiB window in the cache is checked at 85 GB/s by
  crc32c-rs, 64 by awscrt, 32 by the crc32c package (one core here); two processes loading
  256 MiB each at once took 1.15-1.17x a raw read with crc32c-rs, 1.23-1.24x with awscrt,
  1.45x with the crc32c package (interleaved in the same two processes). Run to run, this
  machine's raw reads vary by more than that difference (the bench's steps at 64 and 256 MiB,
  run twice with each implementation: the same within their spread). Small shards pay fixed
  costs (the manifest, the plan) that no checksum removes. Against `load` into fresh tensors it
  saves the page faults of a second copy.
- **Many small tensors** cost Python work per tensor, not bandwidth (10,000 x 4 KiB on one
  rank, `python scripts/profile_save_load.py --device cpu --case small --phases`): about 0.9 µs
  to walk the state dict, 1 µs to lay it out (small host tensors of one dtype packed in runs,
  each tensor checked to lie inside its storage), 0.8 µs to stage it (one `torch.cat` into the
  arena per run), 0.5 µs to describe it in the manifest (and, on the save's thread, 0.8 µs to
  encode it); a load parses about 1.2 µs of manifest per tensor (its CRC-32C checked over the
  bytes as written; from 1,024 tensors on the table is written in columns, format 6, which
  halved that: [benchmarks-manifest.md](benchmarks-manifest.md)), allocates one tensor each
  (1.4 µs), and copies tensors up to 16 KiB out of a read window rather than reading into each.
"""


def label(c: dict[str, Any]) -> str:
    what = f"{c['nbytes'] // MiB} MiB" if c["case"] == "uniform" else c["case"]
    return f"{what} × {c['world']} ranks, F={c['factor']}"


def derive(row: dict[str, Any]) -> dict[str, Any]:
    """Adds GB/s per rank of every timed figure and the ratios to raw limits."""
    m, n = row["median_s"], row["nbytes"]
    gbps = {k: n / s / 1e9 for k, s in m.items() if s > 0}

    def ratio(a: str, b: str) -> float | None:
        return m[a] / m[b] if a in m and b in m and m[b] > 0 else None

    ratios = {
        "stall_to_memcpy": ratio("stall", "memcpy"),
        "write_to_raw_write": ratio("tmpfs_write_fresh", "write"),
        "write_to_raw_overwrite": ratio("tmpfs_write_in_place", "write"),
        "replicate_to_raw_gloo": ratio("gloo_save_schedule", "replicate"),
        "replicate_to_raw_gloo_and_write": ratio("gloo_save_schedule_and_write", "replicate"),
        "node_loss_to_raw": ratio("load_after_node_loss", "raw_overlapped_restore"),
        "node_loss_to_raw_sequential": ratio("load_after_node_loss", "raw_read_and_transfer"),
        "write_back_to_raw": ratio("write_back_after_load", "raw_read_transfer_and_write_back"),
        "async_to_torch_save_and_replicate": ratio("async_save_to_finalized",
                                                   "torch_save_and_replicate"),
        "async_to_torch_save": ratio("async_save_to_finalized", "torch_save"),
        # With F=2 each rank receives one replica, which must reach tmpfs: even overlapped
        # perfectly with the transfer, replication takes max(transfer, fresh write).
        "replicate_overlap_bound": (
            m["gloo_save_schedule"] / max(m["gloo_save_schedule"], m["tmpfs_write_fresh"])
            if "gloo_save_schedule" in m and "tmpfs_write_fresh" in m
            and row.get("factor") == 2 else None),
        # The least a replicated save can take here, against the same baseline.
        "raw_floor_to_torch_save_and_replicate": (
            (m["memcpy"] + m["tmpfs_write_fresh"] + m["gloo_save_schedule"])
            / m["torch_save_and_replicate"]
            if all(k in m for k in ("memcpy", "tmpfs_write_fresh", "gloo_save_schedule",
                                    "torch_save_and_replicate")) else None),
        "load_local_to_raw_read_fresh": ratio("tmpfs_read_fresh", "load_local"),
        "load_into_to_raw_read": ratio("load_local_into", "tmpfs_read"),
        "first_save_to_steady": ratio("first_save", "steady_save"),
        "torch_save_to_raw_write": ratio("tmpfs_write_fresh", "torch_save"),
        "torch_load_to_raw_read_fresh": ratio("tmpfs_read_fresh", "torch_load"),
        "dcp_save_to_raw_write": ratio("tmpfs_write_fresh", "dcp_save"),
        "dcp_load_to_raw_read_fresh": ratio("tmpfs_read_fresh", "dcp_load"),
        "dcp_save_over_localckpt_save": ratio("dcp_save", "async_save_to_finalized"),
        "dcp_async_stall_over_stall": ratio("dcp_async_stall", "stall"),
        "dcp_load_over_load_local": ratio("dcp_load", "load_local"),
        "torch_load_over_load_local": ratio("torch_load", "load_local"),
        # the fsdp2 case: time ratios to DCP doing the same, and to the raw limits
        "fsdp2_save_to_dcp": ratio("localckpt_save", "dcp_save"),
        "fsdp2_load_to_dcp": ratio("localckpt_load_into", "dcp_load"),
        "fsdp2_save_to_raw_write": ratio("localckpt_save", "tmpfs_write_fresh"),
        "fsdp2_load_to_raw_read": ratio("localckpt_load_into", "tmpfs_read"),
        "dcp_fsdp2_save_to_raw_write": ratio("dcp_save", "tmpfs_write_fresh"),
        "dcp_fsdp2_load_to_raw_read": ratio("dcp_load", "tmpfs_read"),
        "fsdp2_reshard_to_dcp": ratio("localckpt_load_resharded", "dcp_load_resharded"),
    }
    return {**row, "label": label(row), "GBps_per_rank": gbps,
            "ratios": {k: v for k, v in ratios.items() if v is not None}}


def _met(value: float, bound: float, op: str) -> bool:
    return value <= bound if op == "<=" else value >= bound


def _f(value: float | None, fmt: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{fmt}}{suffix}"


def _ms(row: dict[str, Any], key: str) -> str:
    s = row["median_s"].get(key)
    return "–" if s is None else f"{s * 1000:,.0f}"


def _remeasured(r: dict[str, Any]) -> str:
    """The rows a later run measured again (``--merge``): by which command, on which date."""
    later: dict[tuple[str, str], list[str]] = {}
    for row in r["rows"]:
        if row.get("date", r["date"]) != r["date"] or row.get("command", "") not in ("",
                                                                               r["command"]):
            later.setdefault((row.get("command", ""), row["date"]), []).append(
                row.get("label", row["case"]))
    return "".join(f"\nRows measured again by `{cmd}` on {date}: {'; '.join(labels)}."
                   for (cmd, date), labels in sorted(later.items(), key=lambda kv: kv[0][1]))


def markdown(r: dict[str, Any], cmd: str, plot: Path | None) -> str:
    rows = [row for row in r["rows"] if row["case"] != "fsdp2"]
    fsdp2 = [row for row in r["rows"] if row["case"] == "fsdp2"]
    out = [f"""# Benchmarks

Measured by `{cmd}` on {r['date']}: {r['machine']}, {r['cpus']} cores, {r['memory_gib']} GiB
available, torch {r['torch']}, CRC-32C by {r.get('crc32c', 'crc32c')}, scratch on `{r['root_fs']}`;
{r['wall_s'] / 60:.0f} minutes.{_remeasured(r)}
Each configuration is a fresh job of gloo ranks on 2 simulated nodes (loopback, one tmpfs root
per node). Every figure is the median of {r['repeats']} runs of an operation done by **all ranks at
once** (time of the slowest rank), and is compared with the raw limit measured the same way, in
the same job. GB/s are per rank (10⁹ bytes). F is the replication factor (`node_spread`).
Planning at 1k-16k ranks: [benchmarks-planning.md](benchmarks-planning.md); the control plane
with 8-64 real processes: [benchmarks-control.md](benchmarks-control.md); saves with
`recycle_files=True`: [benchmarks-recycle/benchmarks.md](benchmarks-recycle/benchmarks.md); from a
preemption signal to a finalized checkpoint: [benchmarks-preemption.md](benchmarks-preemption.md);
the durable tier: [benchmarks-durable.md](benchmarks-durable.md); erasure codes and their memory:
[benchmarks-erasure.md](benchmarks-erasure.md); manifests of many tensors:
[benchmarks-manifest.md](benchmarks-manifest.md).
"""]
    if plot is not None:
        out.append(f"![throughput per rank against size]({plot.name})\n")
    out.append("## Targets\n\nRanges over the configurations of large tensors (`uniform` "
               "and `transformer`); the 10,000-small-tensors case is its own column, since its "
               "cost is per tensor, not per byte, and no raw limit of bytes bounds it.\n\n"
               "| target | ratio | bound | range | met in | `small` |\n"
               "|---|---|---:|---:|---:|---:|")
    for key, formed, bound, op, what in TARGETS:
        values = [row["ratios"][key] for row in rows
                  if key in row["ratios"] and row["case"] != "small"]
        small = [row["ratios"][key] for row in rows
                 if key in row["ratios"] and row["case"] == "small"]
        if not values:
            continue
        met = sum(_met(v, bound, op) for v in values)
        out.append(f"| {what} | {formed} | {op} {bound} | {min(values):.2f} – {max(values):.2f} "
                   f"| {met} of {len(values)} | {_f(small[0] if small else None)} |")
    floor = [row["ratios"]["raw_floor_to_torch_save_and_replicate"] for row in rows
             if "raw_floor_to_torch_save_and_replicate" in row["ratios"]
             and row["case"] != "small"]
    bound = [row["ratios"]["replicate_overlap_bound"] for row in rows
             if "replicate_overlap_bound" in row["ratios"] and row["case"] != "small"]
    if bound:
        out.append(f"\nA received replica must also be written to tmpfs. With that write fully "
                   f"overlapped with the transfer, replication could reach "
                   f"{min(bound):.2f} – {max(bound):.2f}× raw send/recv here (raw transfer ÷ "
                   "the longer of raw transfer and raw fresh write); done one after the other, "
                   "it is the second replication ratio in the phases table.")
    if floor:
        out.append(f"\nThe raw floor of a replicated save (memcpy + fresh tmpfs write + raw "
                   f"transfer) is already {min(floor):.2f} – {max(floor):.2f}× "
                   "`torch.save` + send by hand in these configurations.")
    out.append(READING)
    out.append("\n## Raw limits (GB/s per rank, all ranks at once)\n\n"
               "| configuration | memcpy | crc32c | tmpfs write, fresh file + fsync | tmpfs write "
               "in place | tmpfs read | tmpfs read, fresh memory | gloo one direction |\n"
               "|---|" + "---:|" * len(RAW))
    for row in rows:
        g = row["GBps_per_rank"]
        out.append(f"| {row['label']} | " + " | ".join(_f(g.get(k)) for k in RAW) + " |")
    out.append("\n## localckpt's phases\n\nTimes in ms; in brackets the ratio to the raw limit "
               "(time ratio for the stall and the restore, throughput ratio otherwise). "
               "Replication and restore have a second ratio: to the raw operation plus the "
               "write of the received bytes into tmpfs that the phase must also do (a replica "
               "is only of use on the holder's disk; a restore brings redundancy back).\n\n"
               "| configuration | first save ms, after `reserve` (÷ steady save) | "
               "stall (÷ memcpy) | local write GB/s (× raw write) | replication "
               "(× raw send/recv; × send/recv + write) | finalize | async save to finalized | "
               "`find_latest` | `load` local GB/s (× raw fresh read) | `load(into=...)` local "
               "ms (÷ raw read into preallocated memory) | `load` after node loss "
               "(÷ overlapped raw; ÷ sequential raw) | background write-back (÷ raw read, "
               "transfer and write) |"
               "\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        q, g = row["ratios"], row["GBps_per_rank"]
        repl = "–" if "replicate_to_raw_gloo" not in q else \
            f"{_ms(row, 'replicate')} ({q['replicate_to_raw_gloo']:.2f}; " \
            f"{q['replicate_to_raw_gloo_and_write']:.2f})"
        lost = "–" if "node_loss_to_raw" not in q else \
            f"{_ms(row, 'load_after_node_loss')} ({q['node_loss_to_raw']:.2f}; " \
            f"{_f(q.get('node_loss_to_raw_sequential'))})"
        back = "–" if "write_back_to_raw" not in q else \
            f"{_ms(row, 'write_back_after_load')} ({q['write_back_to_raw']:.2f})"
        out.append(f"| {row['label']} | {_ms(row, 'first_save')} "
                   f"({_f(q.get('first_save_to_steady'))}) | "
                   f"{_ms(row, 'stall')} ({_f(q.get('stall_to_memcpy'))}) | "
                   f"{_f(g.get('write'))} ({_f(q.get('write_to_raw_write'))}) | {repl} | "
                   f"{_ms(row, 'finalize')} | {_ms(row, 'async_save_to_finalized')} | "
                   f"{_ms(row, 'find_latest')} | {_f(g.get('load_local'))} "
                   f"({_f(q.get('load_local_to_raw_read_fresh'))}) | "
                   f"{_ms(row, 'load_local_into')} ({_f(q.get('load_into_to_raw_read'))}) | "
                   f"{lost} | {back} |")
    out.append("\n## Against torch.save and torch.distributed.checkpoint (tmpfs)\n\n"
               "Times in ms. torch.save / DCP neither fsync nor checksum; DCP writes one "
               "directory that every rank must see (a shared file system on a real cluster).\n\n"
               "| configuration | torch.save GB/s | torch.load GB/s | torch.save + send by hand "
               "| localckpt async save to finalized ÷ that | DCP save | DCP async_save stall / "
               "total | DCP load | DCP save ÷ localckpt save | DCP load ÷ localckpt load |\n"
               "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        q, g = row["ratios"], row["GBps_per_rank"]
        by_hand = _ms(row, "torch_save_and_replicate")
        vs = _f(q.get("async_to_torch_save_and_replicate", q.get("async_to_torch_save")))
        if "async_to_torch_save_and_replicate" not in q:
            vs += " (÷ torch.save)"
        out.append(f"| {row['label']} | {_f(g.get('torch_save'))} | {_f(g.get('torch_load'))} | "
                   f"{by_hand} | {vs} | {_ms(row, 'dcp_save')} | "
                   f"{_ms(row, 'dcp_async_stall')} / {_ms(row, 'dcp_async_save')} | "
                   f"{_ms(row, 'dcp_load')} | {_f(q.get('dcp_save_over_localckpt_save'))} | "
                   f"{_f(q.get('dcp_load_over_load_local'))} |")
    cases = [row for row in rows if row["case"] != "uniform"]
    if cases:
        out.append("\n## State dicts other than a few large tensors\n")
        for row in cases:
            out.append(f"- **{row['label']}**: {row['tensors']:,} tensors, "
                       f"{row['nbytes'] / MiB:,.1f} MiB per rank.")
        ca = r["case_args"]
        out.append(f"\n`small` is {ca['small_count']:,} fp32 tensors × {ca['small_kib']} KiB. "
                   f"`transformer` is a {ca['layers']}-layer decoder (d_model {ca['d_model']}, "
                   f"vocabulary {ca['vocab']:,}) after one `torch.optim.Adam` step: bf16 weights, "
                   "fp32 master weights, `exp_avg`, `exp_avg_sq`, `step`, the CPU RNG state and a "
                   "data-loader position. Their figures are in the tables above.")
    if fsdp2:
        out.append(fsdp2_section(fsdp2, r["case_args"]))
    if r["skipped"]:
        out.append("\n## Not run on this machine\n")
        out.extend(f"- {label(s)}: {s['reason']}." for s in r["skipped"])
    return "\n".join(out) + "\n"


def fsdp2_section(rows: list[dict[str, Any]], ca: dict[str, Any]) -> str:
    """The fsdp2 case: localckpt against DCP on the same FSDP2 x TP state (bench_fsdp2.py)."""
    out = ["\n## FSDP2 x tensor parallel state: localckpt against DCP\n",
           f"scripts/fsdp2_example.py's transformer ({ca['layers']} layers, d_model "
           f"{ca['d_model']}, vocabulary {ca['vocab']:,}) on a (dp=2, tp=2) mesh of 4 ranks, "
           "FSDP2 over dp, tensor parallel over tp, with AdamW's state, through the example's "
           "`AppState` (`get_state_dict` / `set_state_dict`) for both. Save: `save({'app': app})`"
           " synchronous, no replicas (localckpt) against `dcp.save` (both on tmpfs when they "
           "return; localckpt also checksums, fsyncs and commits atomically). Load: a freshly "
           "built job's objects, `find_latest` + `load(into=...)` against `dcp.load`. "
           "Resharded: the same checkpoint loaded by the same 4 ranks onto a (dp=4, tp=1) mesh "
           "(localckpt with `reshard=True`: its normal load stops at the first manifest, then "
           "the resharding load moves the intersecting boxes; DCP reshards by itself). Times in "
           "ms; ratios are times (below 1: localckpt is faster).\n",
           "| configuration | bytes per rank (tensors) | localckpt save (÷ DCP; ÷ raw write) | "
           "DCP save (÷ raw write) | localckpt load (÷ DCP; ÷ raw read) | DCP load (÷ raw "
           "read) | localckpt load onto a (4, 1) mesh, resharded (÷ DCP) | DCP load onto it | "
           "measured by |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        q = row["ratios"]
        out.append(
            f"| {row['label']} | {row['nbytes'] / MiB:,.1f} MiB ({row['tensors']}) | "
            f"{_ms(row, 'localckpt_save')} ({_f(q.get('fsdp2_save_to_dcp'))}; "
            f"{_f(q.get('fsdp2_save_to_raw_write'))}) | {_ms(row, 'dcp_save')} "
            f"({_f(q.get('dcp_fsdp2_save_to_raw_write'))}) | "
            f"{_ms(row, 'localckpt_load_into')} ({_f(q.get('fsdp2_load_to_dcp'))}; "
            f"{_f(q.get('fsdp2_load_to_raw_read'))}) | {_ms(row, 'dcp_load')} "
            f"({_f(q.get('dcp_fsdp2_load_to_raw_read'))}) | "
            f"{_ms(row, 'localckpt_load_resharded')} ({_f(q.get('fsdp2_reshard_to_dcp'))}) | "
            f"{_ms(row, 'dcp_load_resharded')} | "
            f"`{row.get('command', '')}` {row.get('date', '')} |")
    return "\n".join(out)


PANELS = (  # title, localckpt figure, raw figure, baselines, replication factor of the rows
    ("staging stall (async save)", "stall", "memcpy", ("dcp_async_stall",), 1),
    ("local write", "write", "tmpfs_write_fresh", ("torch_save", "dcp_save"), 1),
    ("replication", "replicate", "gloo_save_schedule", (), 2),
    ("load, local", "load_local", "tmpfs_read_fresh", ("torch_load", "dcp_load"), 1),
    ("load after node loss", "load_after_node_loss", "raw_overlapped_restore", (), 2),
    ("save to finalized, F=2", "async_save_to_finalized", None, ("torch_save_and_replicate",), 2),
)


def plot(r: dict[str, Any], path: Path) -> Path | None:
    """Throughput per rank against size, one panel per phase, raw limit dashed; None without
    matplotlib (``pip install -e '.[plot]'``)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[plot]')")
        return None
    rows = [row for row in r["rows"] if row["case"] == "uniform"]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5), sharex=True)
    colours = {2: "tab:blue", 4: "tab:orange"}
    styles = {"torch_save": ":", "dcp_save": "-.", "torch_load": ":", "dcp_load": "-.",
              "dcp_async_stall": "-.", "torch_save_and_replicate": ":"}
    for ax, (title, phase, raw, baselines, factor) in zip(axes.flat, PANELS, strict=True):
        for world, colour in colours.items():
            mine = sorted((row for row in rows if row["world"] == world
                           and row["factor"] == factor), key=lambda row: row["nbytes"])
            if not mine:
                continue
            x = [row["nbytes"] / MiB for row in mine]
            for key, style, name in ((phase, "-", "localckpt"), (raw, "--", "raw limit"),
                                     *((b, styles[b], b) for b in baselines)):
                if key is None:
                    continue
                y = [row["GBps_per_rank"].get(key) for row in mine]
                if all(v is not None for v in y):
                    ax.plot(x, y, style, color=colour, marker="o", markersize=3,
                            label=f"{name}, {world} ranks")
        ax.set_title(title)
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("MiB per rank")
    for ax in axes[:, 0]:
        ax.set_ylabel("GB/s per rank")
    fig.suptitle(f"localckpt vs raw limits, torch.save and DCP ({r['cpus']} cores, tmpfs, "
                 f"medians of {r['repeats']})")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
