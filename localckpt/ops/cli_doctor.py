"""``localckpt doctor``: the node's storage, GPUs and library versions."""

from __future__ import annotations

import argparse
import json
import os
import re
from importlib import metadata
from pathlib import Path
from typing import Any

from . import health


def _fs_type(path: Path) -> str:
    try:
        return fs_type_in(path.resolve(), Path("/proc/mounts").read_text())
    except OSError:
        return "unknown"


def fs_type_in(path: Path, mounts: str) -> str:
    """The type of the file system ``path`` (absolute, resolved) is on, from the text of
    /proc/mounts (pure): the longest mount point that is ``path`` or a directory above it (the
    last one mounted there), its
    octal escapes (a space is written \\040) decoded."""
    best, kind = -1, "unknown"
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = Path(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), parts[1]))
        if (point == path or point in path.parents) and len(point.parts) >= best:
            best, kind = len(point.parts), parts[2]
    return kind


def cmd_doctor(args: argparse.Namespace) -> int:
    root = Path(args.root)
    if not root.is_dir():
        raise NotADirectoryError(f"{root}: not a directory")  # exit status 2, as bad input
    report: dict[str, Any] = {}
    for name, path in (("root", root), ("dev_shm", Path("/dev/shm"))):
        if path.is_dir():
            st = os.statvfs(path)
            report[name] = {"path": str(path), "fs": _fs_type(path),
                            "free_bytes": st.f_bavail * st.f_frsize,
                            "total_bytes": st.f_blocks * st.f_frsize}
    warnings = []
    if args.expected_bytes and report["root"]["free_bytes"] < args.expected_bytes:
        warnings.append(f"root has {report['root']['free_bytes'] / 2**30:.2f} GiB free, a "
                        f"checkpoint needs {args.expected_bytes / 2**30:.2f} GiB: enlarge it "
                        "(Docker: --shm-size) or choose another root")
    status, gpus = health.gpu_inventory()
    report["nvml"] = status
    report["gpus"] = health.as_json(gpus)
    warnings += [f"GPU {g.index} ({g.uuid}) unhealthy: uncorrected ECC "
                 f"{g.ecc_uncorrected_volatile}, retired pages {g.retired_pages}"
                 for g in gpus if not g.healthy]
    versions: dict[str, str | None] = {}
    for dist in ("localckpt", "torch", "zarr", "numcodecs", "crc32c", "nvidia-ml-py"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    report["versions"] = versions
    report["warnings"] = warnings
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    for name in ("root", "dev_shm"):
        if name in report:
            r = report[name]
            print(f"{name:<8} {r['path']} ({r['fs']}): {r['free_bytes'] / 2**30:.2f} GiB free of "
                  f"{r['total_bytes'] / 2**30:.2f} GiB")
    print(f"GPUs     {status}" + "".join(
        f"\n  {g['index']}: {g['name']} {g['uuid']} {g['memory_total_bytes'] / 2**30:.0f} GiB "
        f"{'healthy' if g['healthy'] else 'UNHEALTHY'}"
        f"{' throttled: ' + ', '.join(g['throttle_reasons']) if g['throttle_reasons'] else ''}"
        for g in report["gpus"]))
    print("versions " + ", ".join(f"{k} {v or 'missing'}" for k, v in versions.items()))
    for w in warnings:
        print(f"WARNING  {w}")
    return 0
