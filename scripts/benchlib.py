"""What the benchmark scripts share: arguments, a scratch directory on tmpfs, spawning ranks,
and writing the JSON + markdown report."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent.parent / "docs"
SHM = "/dev/shm" if Path("/dev/shm").is_dir() else None


def parser(description: str | None, size_mib: int, repeats: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=size_mib, help="bytes per rank / shard")
    p.add_argument("--repeats", type=int, default=repeats, help="runs per figure (median)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    p.add_argument("--out", default=str(DOCS), help="where the report goes")
    return p


def scratch(prefix: str) -> Path:
    """A fresh directory on tmpfs when there is one; the caller removes it."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=SHM))


def spawn_ranks(fn: Callable[..., None], nprocs: int, args: tuple[Any, ...],
                prefix: str, start_method: str = "spawn") -> dict[str, Any]:
    """Run ``fn(rank, store_path, roots_dir, result_path, *args)`` on ``nprocs`` new ranks
    (``start_method``: forkserver shares the imported modules' pages, for many ranks); returns
    the JSON rank 0 wrote to ``result_path``."""
    import torch.multiprocessing as mp

    if start_method == "forkserver":  # imported once by the server (its first use sets this)
        mp.get_context("forkserver").set_forkserver_preload(
            ["torch", "torch.distributed", "torch._dynamo", "localckpt", fn.__module__])
    work = scratch(prefix)
    try:
        result = work / "result.json"
        mp.start_processes(fn, args=(str(work / "store"), str(work / "roots"), str(result),
                                     *args), nprocs=nprocs, start_method=start_method)
        return dict(json.loads(result.read_text()))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write_report(out: str, name: str, result: dict[str, Any],
                 markdown: Callable[[dict[str, Any], str], str], script: str, quick: bool) -> None:
    """``<out>/<name>.json`` and ``<out>/<name>.md``; the markdown is printed too."""
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    cmd = f"python scripts/{script}" + (" --quick" if quick else "")
    text = markdown(result, cmd)
    (directory / f"{name}.json").write_text(json.dumps(result, indent=1))
    (directory / f"{name}.md").write_text(text)
    print(text)
