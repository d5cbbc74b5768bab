"""The manifest of a shard of many tensors: parse (what find_latest, load and a received replica
pay) and encode (each save's commit and replication), in rows (format 1-5: an object per tensor)
and in columns (format 6), for 1,000, 10,000 and 30,000 tensors of the shape a small-tensor
state dict has (``model/layer<i>.weight``, 1-D float32, packed back to back).

The raw floor of a parse is ``json.loads`` of the same bytes (no checks, no entries built); of
an encode, ``json.dumps`` of the same body. Medians of ``--repeats``, the collector paused as
localckpt pauses it; writes docs/benchmarks-manifest.{json,md}.

Usage: python scripts/bench_manifest.py [--repeats 15] [--out docs]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchlib

from localckpt.storage.manifest import GROUP_PREFIX, GROUP_SUFFIX, ShardManifest, TensorEntry
from localckpt.storage.shard_reader import parse_manifest_file


def manifest(count: int, version: int) -> ShardManifest:
    entries = tuple(TensorEntry(f"model/layer{i}.weight", "float32", (1024,), 4096 * i, 4096,
                                "cpu") for i in range(count))
    hollow = {"dict": [["model", {"dict": [[f"layer{i}.weight", {"T": i}]
                                           for i in range(count)]}]]}
    nbytes = 4096 * count
    return ShardManifest("s", 1, 0, 1, entries, hollow, "plain", nbytes, nbytes, 1, (0,),
                         created_unix=1.0, format_version=version)


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    gc.disable()
    try:
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    finally:
        gc.enable()
    return statistics.median(times) * 1e3


def measure(count: int, version: int, repeats: int) -> dict[str, Any]:
    m = manifest(count, version)
    file = GROUP_PREFIX + m.encoded + GROUP_SUFFIX
    body = m._body()
    parse = median_ms(lambda: parse_manifest_file(file, "bench"), repeats)
    encode = median_ms(lambda: dataclasses.replace(m).encoded, repeats)
    raw_parse = median_ms(lambda: json.loads(m.encoded), repeats)
    raw_encode = median_ms(lambda: json.dumps(body, sort_keys=True, separators=(",", ":")),
                           repeats)
    return {"tensors": count, "format": version, "bytes": len(m.encoded),
            "parse_ms": parse, "encode_ms": encode, "json_loads_ms": raw_parse,
            "json_dumps_ms": raw_encode, "parse_to_json_loads": parse / raw_parse,
            "encode_to_json_dumps": encode / raw_encode}


def report(result: dict[str, Any], cmd: str) -> str:
    rows = result["rows"]
    lines = ["# Manifests of many tensors", "",
             f"Measured by `{cmd}` on {result['date']} ({result['python']}); medians.", "",
             "Parse: what `find_latest`, `load` and a received replica pay per shard (checksum, "
             "JSON, every entry checked and built); encode: what each save's commit and "
             "replication pay. Floors: `json.loads` / `json.dumps` of the same bytes and body. "
             "Format 4 writes an object per tensor; format 6 (1,024 tensors or more) a column "
             "per field.", "",
             "| tensors | format | manifest bytes | parse ms (÷ json.loads) | encode ms "
             "(÷ json.dumps) |", "|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['tensors']:,} | {r['format']} | {r['bytes']:,} | "
                     f"{r['parse_ms']:.2f} ({r['parse_to_json_loads']:.2f}) | "
                     f"{r['encode_ms']:.2f} ({r['encode_to_json_dumps']:.2f}) |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--counts", type=int, nargs="+", default=[1_000, 10_000, 30_000])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs"))
    a = p.parse_args()
    rows = [measure(n, v, a.repeats) for n in a.counts for v in (4, 6)]
    result = {"rows": rows, "date": time.strftime("%Y-%m-%d"),
              "python": f"Python {sys.version.split()[0]}"}
    benchlib.write_report(a.out, "benchmarks-manifest", result, report,
                          f"bench_manifest.py --repeats {a.repeats}", False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
