"""Running the chaos harness's training job: K simulated nodes, each one torchrun agent with its
own local root, on 127.0.0.1, sharing a rendezvous hosted by the driver (so that no node's death
takes the rendezvous with it). Used by scripts/chaos.py and scripts/run_demo.py.

An agent is torchrun's own ``main`` forked from a server that imported it once
(scripts/forked_torchrun.py: 3-4 s of CPU less per agent, a third of a chaos scenario's on 2
cores); its ranks are started by it as torchrun starts them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time
from pathlib import Path
from typing import Any

from forked_torchrun import Agent

HERE = Path(__file__).resolve().parent
STEPS, SAVE_EVERY, NODES = 40, 10, 2
SAVED = [s for s in range(STEPS) if (s + 1) % SAVE_EVERY == 0]  # 9, 19, 29, 39


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Job:
    """One training job: K torchrun agents sharing a rendezvous hosted by this driver."""

    def __init__(self, work: Path, steps: int, timeout: float, faults: str = "",
                 args: tuple[str, ...] = ()) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        self.work, self.steps, self.timeout, self.faults = work, steps, timeout, faults
        self.args = args  # more train_demo.py arguments
        self.agents: dict[int, Agent] = {}
        self.replaced: list[int] = []
        self.relaunches = 0
        self._store: Any = None
        self._new_rendezvous = lambda: dist.TCPStore(
            "127.0.0.1", self.port, is_master=True, multi_tenant=True, wait_for_workers=False,
            timeout=timedelta(seconds=60))

    def start_all(self, with_faults: bool) -> None:
        """A fresh rendezvous (hosted here, not in a node that a scenario kills) and an agent
        per node."""
        for attempt in range(5):  # another scenario may take the free port before we bind it
            self.port = free_port()
            try:
                self._store = self._new_rendezvous()
                break
            except RuntimeError:  # DistNetworkError: EADDRINUSE
                if attempt == 4:
                    raise
        for node in range(NODES):
            self.start_agent(node, with_faults)

    def stop_all(self) -> None:
        for a in self.agents.values():
            if a.poll() is None:
                a.kill()
                a.wait()

    def start_agent(self, node: int, with_faults: bool) -> None:
        env = dict(os.environ, LOCALCKPT_DEMO_NODE=str(node), OMP_NUM_THREADS="1",
                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONPATH=str(HERE.parent))
        env.pop("LOCALCKPT_FAULTS", None)
        if with_faults and self.faults:
            env["LOCALCKPT_FAULTS"] = self.faults
            env["LOCALCKPT_FAULTS_ONCE_DIR"] = str(self.work)  # each fault fires once per job
        argv = [f"--nnodes={NODES}", "--nproc-per-node=1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{self.port}", "--rdzv-id=chaos",
                # A dead node is noticed after 2 missed 1 s heartbeats (default: 3 x 5 s).
                "--rdzv-conf=is_host=false,join_timeout=30,keep_alive_interval=1,"
                "keep_alive_max_attempt=2", "--max-restarts=4",
                "--monitor-interval=0.2", str(HERE / "train_demo.py"),
                "--root", str(self.work / "node{node}"), "--out", str(self.work / "out"),
                "--steps", str(self.steps), "--save-every", str(SAVE_EVERY),
                "--timeout", str(self.timeout), *self.args]
        self.agents[node] = Agent(argv, self.work / f"agent{node}-{len(self.replaced)}.log", env)

    def run(self, deadline: float, wipe_lost: bool) -> str | None:
        """Run to the end, replacing nodes whose agent was killed, and relaunching the whole
        job (as a cluster scheduler would) when torchrun gives up. None, or what went wrong."""
        self.start_all(with_faults=True)
        end = time.monotonic() + deadline
        try:
            while True:
                codes = {n: a.poll() for n, a in self.agents.items()}
                if all(c == 0 for c in codes.values()):
                    return None
                for node, code in codes.items():
                    if code == -signal.SIGKILL and len(self.replaced) < 3:
                        self.replaced.append(node)  # the node died: bring up a replacement
                        if wipe_lost:
                            shutil.rmtree(self.work / f"node{node}", ignore_errors=True)
                        self.start_agent(node, with_faults=False)
                    elif code not in (None, 0):
                        if self.relaunches == 2:
                            return (f"agent of node {node} failed with exit status {code} "
                                    f"after {self.relaunches} relaunches of the job")
                        self.relaunches += 1  # e.g. the other node had already finished
                        self.stop_all()
                        # A launch that failed before any rank started (a rendezvous timeout on
                        # a loaded machine) is retried as it was: the faults never had a chance.
                        started = any(e["event"] == "start" for e in events(self.work / "out"))
                        self.start_all(with_faults=not started)
                        break
                if time.monotonic() > end:
                    return f"hang: not finished within {deadline:.0f}s"
                time.sleep(0.1)
        finally:
            self.stop_all()
            self._store = None


def events(out: Path) -> list[dict[str, Any]]:
    evs = []
    for f in sorted(out.glob("events-rank*.jsonl")):
        evs += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return sorted(evs, key=lambda e: e["t"])
