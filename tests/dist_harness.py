"""Run a function on N real gloo ranks (spawned processes, FileStore rendezvous in tmp_path).

Each rank's outcome comes back as RankResult: its return value, or the exception's class name,
base class names and message, so tests assert on behaviour without unpickling exceptions.
A run that exceeds ``deadline`` kills every rank and fails: a hang is a test failure, not a stall.
A rank that dies without reporting (a fault point's SIGKILL) comes back as error ``"Exited"``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from forked_torchrun import Agent


@dataclass
class RankResult:
    rank: int
    value: Any = None
    error: str | None = None          # exception class name
    error_bases: tuple[str, ...] = ()  # names in its MRO
    message: str = ""
    elapsed: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None

    def raised(self, name: str) -> bool:
        return self.error is not None and name in self.error_bases


def _entry(fn: Callable[..., Any], rank: int, world_size: int, store_path: str,
           out: Any, args: tuple[Any, ...], env: dict[str, str]) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    started = time.monotonic()
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=60))
        value = fn(rank, world_size, *args)
        out.put(RankResult(rank, value, elapsed=time.monotonic() - started))
    except BaseException as exc:  # report everything, including SystemExit from a scenario
        out.put(RankResult(rank, None, type(exc).__name__,
                           tuple(c.__name__ for c in type(exc).__mro__),
                           f"{exc}\n{traceback.format_exc()}", time.monotonic() - started))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


_CTX: Any = None


def _context() -> Any:
    """A forkserver that has imported torch once: each rank then starts in milliseconds instead
    of re-importing torch (seconds). The server is single-threaded, so forking it is safe."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "localckpt",
                                     "scenarios", "torch.distributed.run"])
    return _CTX


def start_torchrun(args: Sequence[str], log: Path, env: dict[str, str] | None = None) -> Agent:
    """``torchrun ARGS`` started: torchrun's own main forked from this process's forkserver
    (which imported torch once), not a new interpreter importing it again (3-4 s of CPU per
    launch); it starts its ranks as torchrun does. Its output goes to ``log``."""
    return Agent(list(args), log, {**os.environ, **(env or {})}, context=_context())


def torchrun(args: Sequence[str], log: Path, timeout: float = 300.0) -> str:
    """``torchrun ARGS`` run to the end (see :func:`start_torchrun`); its output. Fails the
    test, with the end of the output, unless it exits 0 within ``timeout``."""
    agent = start_torchrun(args, log)
    code = agent.wait(timeout)
    assert code == 0, f"torchrun exited with {code}; its output ends:\n{agent.output()[-6000:]}"
    return agent.output()


def run_ranks(fn: Callable[..., Any], world_size: int, tmp_path: Path, *args: Any,
              deadline: float = 120.0, env: dict[str, str] | None = None) -> list[RankResult]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; results by rank.

    ``fn`` must be importable (a module-level function of a module on sys.path).
    """
    ctx = _context()
    results: Any = ctx.Queue()
    store_path = str(tmp_path / f"filestore-{uuid.uuid4().hex}")
    procs = [ctx.Process(target=_entry, daemon=True,
                         args=(fn, r, world_size, store_path, results, args, env or {}))
             for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, RankResult] = {}
    end = time.monotonic() + deadline
    dead_since: dict[int, float] = {}
    try:
        while len(got) < world_size:
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"ranks {sorted(set(range(world_size)) - set(got))} did not finish within "
                    f"{deadline}s (hang); finished: {sorted(got)}")
            try:
                res = results.get(timeout=min(remaining, 0.5))
                got[res.rank] = res
            except queue.Empty:
                pass
            for r, p in enumerate(procs):  # died without a result (after a grace for the queue)
                if r not in got and p.exitcode is not None and \
                        time.monotonic() - dead_since.setdefault(r, time.monotonic()) > 2.0:
                    got[r] = RankResult(r, None, "Exited", ("Exited",), f"exit code {p.exitcode}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [got[r] for r in range(world_size)]


def run_python(code: str) -> Any:
    """Run ``code`` in a fresh Python process importing this checkout's localckpt (a crash there,
    such as a segfault, fails the test instead of the test run); its CompletedProcess."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(repo)})
