"""torchrun agents forked from a server that imported torchrun once.

``python -m torch.distributed.run ARGV`` imports torch before it does anything (3-4 s of CPU
here). A job that launches many agents (the chaos harness, the demo, the example tests) forks
each from a multiprocessing forkserver that preloaded ``torch.distributed.run`` instead; the
agent is torchrun's own ``main(ARGV)``, and it starts its ranks as torchrun starts them (new
processes running the script). Used by scripts/chaos_job.py and tests/dist_harness.py.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

_server: Any = None
_server_lock = threading.Lock()


def agent_context() -> Any:
    """This process's forkserver context, ``torch.distributed.run`` among its preloads (a
    caller that set its own preloads adds it to them before the server starts)."""
    global _server
    with _server_lock:
        if _server is None:
            _server = multiprocessing.get_context("forkserver")
            _server.set_forkserver_preload(["torch.distributed.run"])
        return _server


def agent_main(argv: list[str], env: dict[str, str], log: str) -> None:
    """A torchrun agent, as ``python -m torch.distributed.run ARGV`` runs it, its output
    appended to ``log``; exits with torchrun's exit status. It stays in its caller's process
    group (a CI job's kill of the group reaches it, and torchrun then stops its ranks)."""
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    code = 1
    try:
        from torch.distributed.run import main

        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (its children, theirs...), from /proc."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{parent}/task"):
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
                out += kids
                todo += kids
    return out


class Agent:
    """A forked torchrun agent, read like a Popen: ``pid``, ``poll()`` (None while it runs,
    else its exit status, negative for a signal), ``kill()``, ``wait(timeout)`` (kills it and
    raises TimeoutError past ``timeout``), ``output()``. Daemonic: a caller that exits (a
    failed test, a pytest worker at its end) terminates it, and torchrun then stops its ranks,
    rather than waiting for it."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None,
                 context: Any = None) -> None:
        self.log = log
        ctx = context if context is not None else agent_context()
        self._proc = ctx.Process(target=agent_main, daemon=True,
                                 args=(list(argv), dict(env or os.environ), str(log)))
        self._proc.start()
        self.pid: int = self._proc.pid

    def poll(self) -> int | None:
        return self._proc.exitcode  # type: ignore[no-any-return]

    def kill(self) -> None:
        """SIGKILL to the agent and every process below it (torchrun starts each rank in a
        session of its own: a kill of the agent's process group would leave them running)."""
        for pid in [self.pid, *descendants(self.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            self.kill()
            self._proc.join()
            raise TimeoutError(f"torchrun did not finish within {timeout} s; its output ends:\n"
                               f"{self.output()[-3000:]}")
        return self._proc.exitcode  # type: ignore[no-any-return]

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""
