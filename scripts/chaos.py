"""Chaos harness: a real multi-node torchrun job, faults injected at every phase, recovery checked
bit for bit.

Each simulated node is one torchrun agent (``--nnodes K``, c10d rendezvous on 127.0.0.1, hosted
by this driver so that no node's death takes the rendezvous with it) with its own local root. A
scenario arms a fault inside localckpt (``LOCALCKPT_FAULTS``, see localckpt/faults.py) or damages
a root at rest, runs scripts/train_demo.py to the end through torchrun's in-place restarts, and
replaces a node whose agent was killed by a fresh agent (on a wiped root when the scenario says
so). Then it checks the invariants:

- the job finishes, and its final weights are bit-identical to a fault-free run;
- it resumed at the newest iteration finalized on every rank before the fault, or a newer
  complete one (exactly the last saved one for damage at rest);
- nothing hangs: every scenario ends within its deadline;
- no leftovers (``.tmp-*``, ``.trash-*``) remain after the last successful save;
- every node again holds every shard the placement puts on it (losing F-1 nodes is recovered).

Usage:
    python scripts/chaos.py                 # the CI set: every point and every kind, ~22 scenarios
    python scripts/chaos.py --soak 50 --seed 7   # 50 random scenarios
    python scripts/chaos.py --only kill_node     # scenarios whose name contains the text
Prints a table and writes JSON (--json, default docs/chaos.json); exit status 1 on a violation.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from localckpt.storage.store import list_shards  # noqa: E402

STEPS, SAVE_EVERY, NODES = 40, 10, 2
SAVED = [s for s in range(STEPS) if (s + 1) % SAVE_EVERY == 0]  # 9, 19, 29, 39


@dataclass
class Scenario:
    name: str
    point: str  # fault point, or "at_rest" for damage between runs
    kind: str  # kill_rank, kill_node, wipe_node, flip_byte, truncate, enospc, slow_rank, ...
    faults: str = ""  # LOCALCKPT_FAULTS
    damage: str = ""  # at rest: "flip:primary", "truncate:replica", "leftovers"
    wipe: bool = False  # a node killed by the fault comes back with an empty root
    expect_restart: bool = True


@dataclass
class Outcome:
    scenario: str
    point: str
    kind: str
    expected: int
    resumed: int
    bit_identical: bool
    recovery_s: float
    seconds: float
    violations: list[str] = field(default_factory=list)
    relaunches: int = 0  # whole-job relaunches after torchrun gave up


def ci_scenarios() -> list[Scenario]:
    """Every fault point and every fault kind at least once."""
    k = "kill_rank"
    return [
        Scenario("kill rank during staging", "staging", k, "staging:kill:rank=1:iteration=19"),
        Scenario("kill rank during local write", "local_write", k,
                 "local_write:kill:rank=0:iteration=19"),
        Scenario("crash before commit leaves leftovers", "before_commit", "leftovers",
                 "before_commit:kill:rank=1:iteration=29"),
        Scenario("kill sender during replica send", "replica_send", k,
                 "replica_send:kill:rank=0:iteration=19"),
        Scenario("kill receiver during replica receive", "replica_receive", k,
                 "replica_receive:kill:rank=1:iteration=29"),
        Scenario("kill rank after commit before finalize", "after_commit", k,
                 "after_commit:kill:rank=1:iteration=19"),
        Scenario("kill rank during finalize cleanup", "finalize", k,
                 "finalize:kill:rank=0:iteration=29"),
        Scenario("kill rank in find_latest after a restart", "find_latest", k,
                 "staging:kill:rank=1:iteration=29;find_latest:kill:rank=1:attempt=1"),
        Scenario("kill rank during load retrieval", "load_retrieval", k,
                 "staging:kill:rank=1:iteration=29;load_retrieval:kill:rank=1:attempt=1"),
        Scenario("kill node during staging", "staging", "kill_node",
                 "staging:kill_node:rank=1:iteration=19"),
        Scenario("kill node during replica send", "replica_send", "kill_node",
                 "replica_send:kill_node:rank=1:iteration=29"),
        Scenario("wipe node lost during local write", "local_write", "wipe_node",
                 "local_write:kill_node:rank=1:iteration=29", wipe=True),
        Scenario("wipe node lost during replica receive", "replica_receive", "wipe_node",
                 "replica_receive:kill_node:rank=0:iteration=19", wipe=True),
        Scenario("wipe node lost after commit", "after_commit", "wipe_node",
                 "after_commit:kill_node:rank=0:iteration=29", wipe=True),
        Scenario("wipe node lost during finalize", "finalize", "wipe_node",
                 "finalize:kill_node:rank=1:iteration=19", wipe=True),
        Scenario("flip a byte in a primary shard", "at_rest", "flip_byte", damage="flip:primary"),
        Scenario("flip a byte in a replica", "at_rest", "flip_byte", damage="flip:replica"),
        Scenario("truncate a primary shard", "at_rest", "truncate", damage="truncate:primary"),
        Scenario("truncate a replica", "at_rest", "truncate", damage="truncate:replica"),
        Scenario("ENOSPC on local write, then a kill", "local_write", "enospc",
                 "local_write:enospc:rank=1:iteration=19;staging:kill:rank=0:iteration=29"),
        Scenario("ENOSPC on replica receive, then a kill", "replica_receive", "enospc",
                 "replica_receive:enospc:rank=0:iteration=29;staging:kill:rank=1:iteration=39"),
        Scenario("rank slower than the timeout in local write", "local_write", "slow_rank",
                 "local_write:sleep:rank=1:iteration=19:seconds=600"),
        Scenario("crash leftovers at rest are cleaned", "at_rest", "leftovers",
                 damage="leftovers"),
    ]


def random_scenarios(n: int, seed: int) -> list[Scenario]:
    rng = random.Random(seed)
    points = ["staging", "local_write", "before_commit", "replica_send", "replica_receive",
              "after_commit", "finalize"]
    out = []
    for i in range(n):
        point, it, rank = rng.choice(points), rng.choice(SAVED[1:]), rng.randrange(NODES)
        kind = rng.choice(["kill_rank", "kill_node", "wipe_node", "enospc", "at_rest"])
        if kind == "at_rest":
            dmg = f"{rng.choice(['flip', 'truncate'])}:{rng.choice(['primary', 'replica'])}"
            out.append(Scenario(f"soak {i}: {dmg} at rest", "at_rest", dmg.split(":")[0],
                                damage=dmg))
            continue
        action = {"kill_rank": "kill", "enospc": "enospc"}.get(kind, "kill_node")
        spec = f"{point}:{action}:rank={rank}:iteration={it}"
        if kind == "enospc":
            spec += f";staging:kill:rank={1 - rank}:iteration={SAVED[-1]}"
        out.append(Scenario(f"soak {i}: {kind} at {point} it {it} rank {rank}", point, kind,
                            spec, wipe=kind == "wipe_node"))
    return out


# --------------------------------------------------------------------------- running a job

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Job:
    """One training job: K torchrun agents sharing a rendezvous hosted by this driver."""

    def __init__(self, work: Path, steps: int, timeout: float, faults: str = "") -> None:
        from datetime import timedelta

        import torch.distributed as dist

        self.work, self.steps, self.timeout, self.faults = work, steps, timeout, faults
        self.agents: dict[int, subprocess.Popen[bytes]] = {}
        self.replaced: list[int] = []
        self.relaunches = 0
        self._store: Any = None
        self._new_rendezvous = lambda: dist.TCPStore(
            "127.0.0.1", self.port, is_master=True, multi_tenant=True, wait_for_workers=False,
            timeout=timedelta(seconds=60))

    def start_all(self, with_faults: bool) -> None:
        """A fresh rendezvous (hosted here, not in a node that a scenario kills) and an agent
        per node."""
        self.port = free_port()
        self._store = self._new_rendezvous()
        for node in range(NODES):
            self.start_agent(node, with_faults)

    def stop_all(self) -> None:
        for a in self.agents.values():
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()

    def start_agent(self, node: int, with_faults: bool) -> None:
        env = dict(os.environ, LOCALCKPT_DEMO_NODE=str(node), OMP_NUM_THREADS="1",
                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONPATH=str(HERE.parent))
        env.pop("LOCALCKPT_FAULTS", None)
        if with_faults and self.faults:
            env["LOCALCKPT_FAULTS"] = self.faults
            env["LOCALCKPT_FAULTS_ONCE_DIR"] = str(self.work)  # each fault fires once per job
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}",
               "--nproc-per-node=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{self.port}", "--rdzv-id=chaos",
               # A dead node is noticed after 2 missed 1 s heartbeats (default: 3 x 5 s).
               "--rdzv-conf=is_host=false,join_timeout=30,keep_alive_interval=1,"
               "keep_alive_max_attempt=2", "--max-restarts=4",
               "--monitor-interval=0.2", str(HERE / "train_demo.py"),
               "--root", str(self.work / "node{node}"), "--out", str(self.work / "out"),
               "--steps", str(self.steps), "--save-every", str(SAVE_EVERY),
               "--timeout", str(self.timeout)]
        log = open(self.work / f"agent{node}-{len(self.replaced)}.log", "ab")  # noqa: SIM115
        self.agents[node] = subprocess.Popen(cmd, env=env, stdout=log, stderr=log,
                                             start_new_session=True)

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
                        self.start_all(with_faults=False)
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


def damage_at_rest(work: Path, what: str) -> None:
    """Damage the newest iteration on node 0: its own (primary) shard or a replica it holds."""
    if what == "leftovers":
        it_dir = work / "node0" / "demo" / f"iter_{SAVED[1]:010d}"
        (it_dir / ".tmp-rank_00000_of_00002-w00000-deadbeef0000" / "data").mkdir(parents=True)
        (it_dir / ".trash-rank_00000_of_00002-w00000-deadbeef0001").mkdir()
        return
    how, which = what.split(":")
    shards = list_shards(work / "node0", "demo")
    newest = max(s.iteration for s in shards)
    owner = 0 if which == "primary" else 1
    ref = next(s for s in shards if s.iteration == newest and s.owner_rank == owner)
    chunk = ref.path / "data" / "c" / "0"
    raw = bytearray(chunk.read_bytes())
    if how == "flip":
        raw[len(raw) // 2] ^= 0x10
    else:
        raw = raw[: len(raw) // 3]
    chunk.write_bytes(bytes(raw))


def check(sc: Scenario, work: Path, reference: str, pre_iteration: int | None,
          error: str | None, started: float) -> Outcome:
    out = work / "out"
    violations = [error] if error else []
    evs = events(out)
    first_pid: dict[int, int] = {}
    for e in evs:
        if e["event"] == "start":
            first_pid.setdefault(e["rank"], e["pid"])
    initial = [e for e in evs if first_pid.get(e["rank"]) == e["pid"]]
    finalized = [{e["iteration"] for e in initial if e["event"] == "finalized" and e["rank"] == r}
                 for r in range(NODES)]
    common = set.intersection(*finalized) if finalized else set()
    expected = max(common, default=-1) if pre_iteration is None else pre_iteration
    later = [e for e in evs if e["event"] == "resumed" and first_pid.get(e["rank"]) != e["pid"]]
    if pre_iteration is not None:  # damage at rest: the second run's start is the restart
        later = [e for e in evs if e["event"] == "resumed" and e["iteration"] >= 0]
    resumed = min((e["iteration"] for e in later), default=-1)
    recovery = 0.0
    if later:
        last_initial = max((e["t"] for e in initial), default=started)
        t_fault = last_initial if pre_iteration is None else min(e["t"] for e in later)
        recovery = max(e["t"] for e in later) - t_fault if pre_iteration is None else \
            max(e["seconds"] for e in later)
    if sc.expect_restart and not later:
        violations.append("the job never restarted")
    if later:
        if pre_iteration is not None and resumed != expected:
            violations.append(f"resumed at {resumed}, expected exactly {expected}")
        elif resumed < expected:
            violations.append(f"resumed at {resumed}, older than {expected} finalized before")
        if resumed not in (-1, *SAVED):
            violations.append(f"resumed at {resumed}, never saved")
    digests = []
    for r in range(NODES):
        try:
            digests.append(json.loads((out / f"rank{r}.json").read_text())["digest"])
        except (OSError, ValueError, KeyError):
            digests.append(None)
    identical = all(d == reference for d in digests)
    if not identical:
        violations.append("final weights differ from the fault-free run")
    leftovers = [str(p) for p in [*work.glob("node*/demo/iter_*/.*"),
                                  *work.glob("node*/demo/.trash-*")]]
    if leftovers and not error:
        violations.append(f"leftovers after the last save: {leftovers}")
    last = SAVED[-1]
    for n in range(NODES):
        held = {s.owner_rank for s in list_shards(work / f"node{n}", "demo")
                if s.iteration == last}
        if held != set(range(NODES)) and not error:
            violations.append(f"node {n} holds shards {sorted(held)} of iteration {last}, "
                              f"expected all {NODES} (redundancy not restored)")
    return Outcome(sc.name, sc.point, sc.kind, expected, resumed, identical, round(recovery, 2),
                   round(time.monotonic() - started, 1), violations)


def run_scenario(sc: Scenario, base: Path, reference: str, timeout: float,
                 deadline: float) -> Outcome:
    work = base / f"scn-{abs(hash(sc.name)) % 10**8}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.monotonic()
    pre = None
    error = None
    if sc.point == "at_rest":
        pre_steps = SAVED[2] + 1  # the first run ends after saving iteration 29
        error = Job(work, pre_steps, timeout).run(deadline, wipe_lost=False)
        pre = SAVED[2]
        if error is None:
            damage_at_rest(work, sc.damage)
    job = Job(work, STEPS, timeout, sc.faults)
    if error is None:
        error = job.run(deadline, wipe_lost=sc.wipe)
    outcome = check(sc, work, reference, pre, error, started)
    outcome.relaunches = job.relaunches
    return outcome


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--soak", type=int, default=0, help="run N random scenarios instead")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="", help="scenarios whose name contains this text")
    p.add_argument("--jobs", type=int, default=1, help="scenarios run at once")
    p.add_argument("--timeout", type=float, default=6.0, help="localckpt collective timeout")
    p.add_argument("--deadline", type=float, default=150.0, help="seconds a scenario may take")
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=str(HERE.parent / "docs" / "chaos.json"))
    a = p.parse_args()
    scenarios = random_scenarios(a.soak, a.seed) if a.soak else ci_scenarios()
    scenarios = [s for s in scenarios if a.only in s.name]
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    base = Path(a.workdir or tempfile.mkdtemp(prefix="localckpt-chaos-", dir=shm))
    t0 = time.monotonic()
    try:
        ref_work = base / "reference"
        ref_work.mkdir(parents=True, exist_ok=True)
        error = Job(ref_work, STEPS, a.timeout).run(a.deadline, wipe_lost=False)
        if error:
            print(f"the fault-free reference run failed: {error}")
            return 1
        reference = json.loads((ref_work / "out" / "rank0.json").read_text())["digest"]
        print(f"chaos: {len(scenarios)} scenarios, {NODES} nodes x 1 rank, {STEPS} steps, "
              f"async save every {SAVE_EVERY} with node_spread F=2, timeout {a.timeout:g}s")
        with ThreadPoolExecutor(a.jobs) as pool:
            outcomes = list(pool.map(lambda s: run_scenario(s, base, reference, a.timeout,
                                                            a.deadline), scenarios))
    finally:
        if a.workdir is None:
            shutil.rmtree(base, ignore_errors=True)
    print(f"\n{'scenario':<46} {'fault':<10} {'expected':>8} {'resumed':>7} {'bit-id':>6} "
          f"{'recover s':>9} {'total s':>7}  violations")
    for o in outcomes:
        print(f"{o.scenario[:46]:<46} {o.kind:<10} {o.expected:>8} {o.resumed:>7} "
              f"{'yes' if o.bit_identical else 'NO':>6} {o.recovery_s:>9.2f} {o.seconds:>7.1f}  "
              f"{'; '.join(o.violations) or '-'}")
    bad = [o for o in outcomes if o.violations]
    node_loss = sorted(o.recovery_s for o in outcomes if o.kind in ("kill_node", "wipe_node"))
    median = node_loss[len(node_loss) // 2] if node_loss else None
    print(f"\n{len(outcomes)} scenarios, {len(bad)} with violations; points "
          f"{len({o.point for o in outcomes})}, kinds {len({o.kind for o in outcomes})}; "
          f"median recovery after node loss {median} s; {time.monotonic() - t0:.0f}s in all")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({
        "scenarios": [asdict(o) for o in outcomes], "violations": len(bad),
        "median_node_loss_recovery_s": median, "soak": a.soak, "seed": a.seed}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
