"""Chaos harness: a real multi-node torchrun job, faults injected at every phase, recovery checked
bit for bit.

Each simulated node is one torchrun agent with its own local root (scripts/chaos_job.py). A
scenario arms faults inside localckpt (``LOCALCKPT_FAULTS``, see localckpt/ops/faults.py): a kill
(rank or whole node) and a raise at every fault point, ENOSPC, a rank slower than the timeout;
breaks a call order (one rank in ``find_latest`` while the others save; the manager closed before
the queue holding the last save); damages a root at rest (a flipped byte, a truncated chunk, a
forged manifest, crash leftovers, with and without replication); or runs an operator command
(``localckpt gc`` between runs, and while the job runs). It runs scripts/train_demo.py to the end
through torchrun's restarts, replacing a node whose agent was killed (on a wiped root when the
scenario says so). Then it checks the invariants (scripts/chaos_checks.py):

- the job finishes, and its final weights are bit-identical to a fault-free run;
- it resumed at the newest iteration finalized on every rank before the fault, or a newer
  complete one (exactly the expected one after a first run that ended at rest);
- a failure every rank can agree on (a raise) never restarts the job: every rank sees each save
  end the same way, and exactly the broken saves fail;
- nothing hangs: every scenario ends within its deadline;
- no leftovers (``.tmp-*``, ``.trash-*``, ``.quarantine-*``, recycled chunk files) remain after
  the last save;
- every node again holds every shard the placement puts on it (losing F-1 nodes is recovered).

Usage:
    python scripts/chaos.py                 # the CI set: every fault point and kind at least once
    python scripts/chaos.py --set points    # a kill and a raise at every fault point
    python scripts/chaos.py --full          # and variants whose point and kind another tries
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
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from chaos_checks import (  # noqa: E402
    BUCKET,
    Outcome,
    check,
    damage_at_rest,
    gc_while_running,
    substitute,
)
from chaos_job import NODES, SAVE_EVERY, SAVED, STEPS, Job  # noqa: E402

from localckpt.ops.faults import POINTS  # noqa: E402


class ReferenceFailed(Exception):
    """The fault-free run every scenario is compared with did not finish."""


@dataclass
class Scenario:
    name: str
    point: str  # the fault point exercised, or "at_rest" for damage between two runs
    kind: str  # kill_rank, kill_node, wipe_node, raise, reorder, flip_byte, truncate, ...
    faults: str = ""  # LOCALCKPT_FAULTS
    damage: str = ""  # after a first run that ends with iteration 29 at rest (see damage_at_rest)
    pre_args: tuple[str, ...] = ()  # train_demo arguments of a first run (to the end if no damage)
    args: tuple[str, ...] = ()  # train_demo arguments of every run
    wipe: bool = False  # a node killed by the fault comes back with an empty root
    expect_restart: bool = True
    expect_failed: tuple[int, ...] | None = None  # saves that must fail alike (no restart)
    expect_resume: int | None = None  # after a first run: default its last save
    during: str = ""  # "gc": an operator runs localckpt gc while the job trains
    # "ci": the short form CI runs (every point and every kind at least once); "points": a
    # kill and a raise at every fault point; "full": variants whose point and kind another
    # scenario already tries. Each set holds the ones before it.
    tier: str = "points"


SETS = ("ci", "points", "full")


def scenario_set(name: str = "ci") -> list[Scenario]:
    """The scenarios of a set (``SETS``), each holding the ones before it:

    - ``ci``: the short form CI runs: every fault point and every fault kind at least once;
    - ``points``: a kill and a raise at every fault point, and every other kind at least once
      (run it after a change to the save or load path);
    - ``full``: also the variants whose point and kind another scenario already tries.
    """
    if name not in SETS:
        raise ValueError(f"chaos set: expected one of {SETS}, got {name!r}")
    k = "kill_rank"
    kills = [
        Scenario("kill rank during staging", "staging", k, "staging:kill:rank=1:iteration=19"),
        Scenario("kill rank during local write", "local_write", k,
                 "local_write:kill:rank=0:iteration=19"),
        Scenario("crash before commit leaves leftovers", "before_commit", "leftovers",
                 "before_commit:kill:rank=1:iteration=29", tier="ci"),
        Scenario("kill sender during replica send", "replica_send", k,
                 "replica_send:kill:rank=0:iteration=19"),
        Scenario("kill receiver during replica receive", "replica_receive", k,
                 "replica_receive:kill:rank=1:iteration=29", tier="full"),
        Scenario("kill rank after commit before finalize", "after_commit", k,
                 "after_commit:kill:rank=1:iteration=19"),
        Scenario("kill rank during finalize cleanup", "finalize", k,
                 "finalize:kill:rank=0:iteration=29"),
        Scenario("kill rank in find_latest after a restart", "find_latest", k,
                 "staging:kill:rank=1:iteration=29;find_latest:kill:rank=1:attempt=1", tier="ci"),
        Scenario("kill rank during load retrieval", "load_retrieval", k,
                 "staging:kill:rank=1:iteration=29;load_retrieval:kill:rank=1:attempt=1"),
        Scenario("kill node during staging", "staging", "kill_node",
                 "staging:kill_node:rank=1:iteration=19", tier="full"),
        Scenario("kill node during replica send", "replica_send", "kill_node",
                 "replica_send:kill_node:rank=1:iteration=29", tier="ci"),
        Scenario("wipe node lost during local write", "local_write", "wipe_node",
                 "local_write:kill_node:rank=1:iteration=29", wipe=True, tier="full"),
        Scenario("wipe node lost during replica receive", "replica_receive", "wipe_node",
                 "replica_receive:kill_node:rank=0:iteration=19", wipe=True, tier="ci"),
        Scenario("wipe node lost after commit", "after_commit", "wipe_node",
                 "after_commit:kill_node:rank=0:iteration=29", wipe=True, tier="full"),
        Scenario("wipe node lost during finalize", "finalize", "wipe_node",
                 "finalize:kill_node:rank=1:iteration=19", wipe=True),
        # rank 1's node is replaced empty; the survivor dies sending the shards back after the
        # restore. No rank named: the replacement runs unarmed, and either node may hold rank 0
        # after the restart, so the survivor (the only sender) is the one armed process.
        Scenario("kill sender during the write-back after node loss", "load_write_back",
                 "wipe_node", "local_write:kill_node:rank=1:iteration=29;"
                 "load_write_back:kill:attempt=*", wipe=True, tier="ci"),
    ]
    # A raise on one rank must fail that save on every rank alike, and training goes on. One in
    # retention (finalize) fails nothing: the save had already been agreed complete.
    # Three to a job, one save each (a raise restarts nothing, so one job tries several): the
    # saves of 9, 19 and 29 fail in turn, and 39 must still be complete everywhere.
    raises = [Scenario(f"raise on one rank at {', '.join(p for p, _, _ in group)}", group[0][0],
                       "raise", ";".join(f"{p}:raise:rank={r}:iteration={it}"
                                         for p, r, it in group), expect_restart=False,
                       expect_failed=tuple(it for p, _, it in group if p != "finalize"),
                       tier="ci")
              for group in ((("staging", 1, 9), ("local_write", 0, 19), ("before_commit", 1, 29)),
                            (("replica_send", 0, 9), ("replica_receive", 1, 19),
                             ("after_commit", 0, 29), ("finalize", 1, 39)))]
    raises += [  # at start-up every rank raises alike; the job restarts again and resumes
        Scenario("raise in find_latest after a restart", "find_latest", "raise",
                 "staging:kill:rank=1:iteration=29;find_latest:raise:rank=1:attempt=1"),
        Scenario("raise in load retrieval after a restart", "load_retrieval", "raise",
                 "staging:kill:rank=1:iteration=29;load_retrieval:raise:rank=1:attempt=1",
                 tier="ci"),
        # fails one transfer of the write-back, which is tried again; the load never sees it
        Scenario("raise in the write-back after node loss", "load_write_back", "raise",
                 "local_write:kill_node:rank=1:iteration=29;"
                 "load_write_back:raise:attempt=*",  # the survivor (see the kill above)
                 wipe=True),
    ]
    # Saves that write over retired chunk files (recycle_files=True): a kill and a raise
    # mid-write, and a crash between the writes and the commit.
    recycled = ("--recycle-files",)
    kills += [
        Scenario("kill rank writing over recycled files", "local_write", k,
                 "local_write:kill:rank=0:iteration=29", args=recycled, tier="full"),
        Scenario("crash before commit over recycled files", "before_commit", "leftovers",
                 "before_commit:kill:rank=1:iteration=29", args=recycled, tier="ci"),
    ]
    raises += [Scenario("raise on one rank writing over recycled files", "local_write", "raise",
                        "local_write:raise:rank=1:iteration=29", expect_restart=False,
                        expect_failed=(29,), args=recycled)]
    # The durable tier ({work}/shared): the whole job lost (both nodes killed, roots wiped) and
    # restarted on empty nodes from it; a kill or a raise while persisting or committing.
    durable = ("--durable", "{work}/shared", "--step-seconds", "0.05")
    erasure = ("--repl", "erasure")
    kills += [
        Scenario("whole job lost, restarted on empty nodes from the durable tier", "staging",
                 "job_lost", "staging:kill_node:rank=0:iteration=29;"
                 "staging:kill_node:rank=1:iteration=29", wipe=True, args=durable),
        # both kills in one job: the tier must end committed and clean of either's leftovers
        Scenario("kill rank while persisting, then rank 0 before the durable commit",
                 "persist_write", k, "persist_write:kill:rank=1:iteration=19:attempt=*;"
                 "persist_commit:kill:rank=0:iteration=29:attempt=*", args=durable, tier="ci"),
        Scenario("kill rank while persisting to the durable tier", "persist_write", k,
                 "persist_write:kill:rank=1:iteration=19", args=durable),
        Scenario("kill rank 0 before the durable commit", "persist_commit", k,
                 "persist_commit:kill:rank=0:iteration=19", args=durable),
        # a first run ends at 29 (persisted), then every node root is lost at rest
        Scenario("kill rank fetching from the durable tier after the job was lost",
                 "durable_fetch", "job_lost", "durable_fetch:kill:rank=1", damage="job_lost",
                 args=durable, tier="ci"),
        Scenario("job lost and the newest durable copy corrupt: the older one loads",
                 "at_rest", "job_lost", damage="job_lost:flip_durable", args=durable,
                 expect_resume=SAVED[1]),
    ]
    # The durable tier in a bucket of a local S3-protocol server (scripts/s3_local.py).
    bucket = ("--durable", "{bucket}", "--step-seconds", "0.05")
    kills += [
        Scenario("whole job lost, restarted on empty nodes from a bucket", "staging",
                 "job_lost", "staging:kill_node:rank=0:iteration=29;"
                 "staging:kill_node:rank=1:iteration=29", wipe=True, args=bucket, tier="full"),
        Scenario("kill rank while persisting to a bucket", "persist_write", k,
                 "persist_write:kill:rank=1:iteration=19", args=bucket, tier="full"),
        Scenario("job lost and the newest copy in the bucket corrupt: the older one loads",
                 "at_rest", "job_lost", damage="job_lost:flip_bucket", args=bucket,
                 expect_resume=SAVED[1], tier="full"),
    ]
    raises += [
        # both durable raises in one job (each is logged, no save fails)
        Scenario("raise while persisting, then before the durable commit", "persist_write",
                 "raise", "persist_write:raise:rank=1:iteration=19;"
                 "persist_commit:raise:rank=0:iteration=29", expect_restart=False,
                 expect_failed=(), args=durable, tier="ci"),
        Scenario("raise while persisting on one rank", "persist_write", "raise",
                 "persist_write:raise:rank=1:iteration=19", expect_restart=False,
                 expect_failed=(), args=durable),
        # rank 1 cannot copy the newest persisted iteration: every rank gives it up, the older
        # one is restored
        Scenario("raise fetching from the durable tier after the job was lost", "durable_fetch",
                 "raise", "durable_fetch:raise:rank=1", damage="job_lost", args=durable,
                 expect_resume=SAVED[1]),
        Scenario("raise before the durable commit", "persist_commit", "raise",
                 "persist_commit:raise:rank=0:iteration=19", expect_restart=False,
                 expect_failed=(), args=durable),
    ]
    every = kills + raises + [
        Scenario("one rank in find_latest while the other saves", "staging", "reorder",
                 args=("--desync-at-step", "29", "--desync-rank", "1"), tier="ci"),
        Scenario("manager closed before the queue with a save pending", "finalize", "reorder",
                 pre_args=("--close-order", "manager-first"), expect_resume=SAVED[-1]),
        Scenario("flip a byte in a primary shard", "at_rest", "flip_byte", damage="flip:primary",
                 tier="ci"),
        Scenario("flip a byte in a replica", "at_rest", "flip_byte", damage="flip:replica",
                 tier="full"),
        Scenario("truncate a primary shard", "at_rest", "truncate", damage="truncate:primary",
                 tier="ci"),
        Scenario("truncate a replica", "at_rest", "truncate", damage="truncate:replica",
                 tier="full"),
        Scenario("forged manifest in a primary shard", "at_rest", "forge_manifest",
                 damage="forge:primary", tier="ci"),
        Scenario("corrupt primary without replication falls back", "at_rest", "no_replica",
                 damage="flip:primary", args=("--repl", "none", "--keep-last", "2"),
                 expect_resume=SAVED[1], tier="ci"),
        Scenario("ENOSPC on local write, then a kill", "local_write", "enospc",
                 "local_write:enospc:rank=1:iteration=19;staging:kill:rank=0:iteration=29",
                 tier="ci"),
        Scenario("ENOSPC on replica receive, then a kill", "replica_receive", "enospc",
                 "replica_receive:enospc:rank=0:iteration=29;staging:kill:rank=1:iteration=39",
                 tier="full"),
        Scenario("rank slower than the timeout in local write", "local_write", "slow_rank",
                 "local_write:sleep:rank=1:iteration=19:seconds=600", tier="ci"),
        Scenario("crash leftovers at rest are cleaned", "at_rest", "leftovers",
                 damage="leftovers"),
        Scenario("wipe node lost during the parity fold (erasure)", "replica_receive",
                 "wipe_node", "replica_receive:kill_node:rank=0:iteration=19", wipe=True,
                 args=erasure, tier="ci"),
        Scenario("kill rank sending its shard to its parity holder (erasure)", "replica_send",
                 k, "replica_send:kill:rank=1:iteration=29", args=erasure),
        Scenario("flip a byte in a primary shard (erasure: rebuilt from parity)", "at_rest",
                 "flip_byte", damage="flip:primary", args=erasure),
        Scenario("localckpt gc between runs keeps the newest complete", "at_rest", "operator",
                 damage="gc", pre_args=("--keep-last", "3")),
        Scenario("localckpt gc while the job runs is refused", "finalize", "operator",
                 args=("--step-seconds", "0.5"), during="gc", expect_restart=False,
                 expect_failed=(), tier="ci"),
    ]
    return [s for s in every if SETS.index(s.tier) <= SETS.index(name)]


def random_scenarios(n: int, seed: int) -> list[Scenario]:
    rng = random.Random(seed)
    points = ["staging", "local_write", "before_commit", "replica_send", "replica_receive",
              "after_commit", "finalize"]
    out = []
    for i in range(n):
        point, it, rank = rng.choice(points), rng.choice(SAVED[1:]), rng.randrange(NODES)
        kind = rng.choice(["kill_rank", "kill_node", "wipe_node", "enospc", "raise", "at_rest"])
        if kind == "at_rest":
            how = rng.choice(["flip", "truncate", "forge"])
            dmg = f"{how}:{rng.choice(['primary', 'replica'])}"
            out.append(Scenario(f"soak {i}: {dmg} at rest", "at_rest", dmg.split(":")[0],
                                damage=dmg))
            continue
        action = {"kill_rank": "kill", "enospc": "enospc", "raise": "raise"}.get(kind, "kill_node")
        spec = f"{point}:{action}:rank={rank}:iteration={it}"
        if kind == "enospc":
            spec += f";staging:kill:rank={1 - rank}:iteration={SAVED[-1]}"
        out.append(Scenario(f"soak {i}: {kind} at {point} it {it} rank {rank}", point, kind,
                            spec, wipe=kind == "wipe_node", expect_restart=kind != "raise"))
    return out


def first_run_of(sc: Scenario) -> tuple[tuple[str, ...], int] | None:
    """The first run a scenario starts from (its arguments, its steps: to iteration 29 before
    damage at rest, or to the end), or None."""
    if not (sc.damage or sc.pre_args):
        return None
    return sc.args + sc.pre_args, SAVED[2] + 1 if sc.damage else STEPS


def shareable(first: tuple[tuple[str, ...], int]) -> bool:
    """A fault-free first run whose state at rest any scenario may copy: none of its arguments
    names the scenario's own directory or bucket prefix."""
    return not any("{" in a for a in first[0])


def run_first(first: tuple[tuple[str, ...], int], work: Path, timeout: float,
              deadline: float) -> str | None:
    """Run a fault-free first run into ``work``; what went wrong, or None."""
    work.mkdir(parents=True, exist_ok=True)
    args = tuple(substitute(a, work) for a in first[0])
    return Job(work, first[1], timeout, args=args).run(deadline, wipe_lost=False)


def run_scenario(sc: Scenario, base: Path, reference: Future[str], timeout: float,
                 deadline: float, shared: dict[Any, tuple[Path, Future[str | None]]]) -> Outcome:
    """Run one scenario (after its first run: shared and copied, or its own) and judge it."""
    work = base / f"scn-{abs(hash(sc.name)) % 10**8}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.monotonic()
    pre = None
    error = None
    args = tuple(substitute(a, work) for a in sc.args)
    first = first_run_of(sc)
    if first is not None:
        if first in shared:  # the same fault-free state at rest: a copy of it
            ready, done = shared[first]
            error = done.result()
            if error is None:
                shutil.copytree(ready, work, symlinks=True, dirs_exist_ok=True)
        else:
            error = run_first(first, work, timeout, deadline)
        pre = sc.expect_resume if sc.expect_resume is not None else first[1] - 1
        if error is None and sc.damage:
            error = damage_at_rest(work, sc.damage)
    job = Job(work, STEPS, timeout, sc.faults, args=args)
    during: list[str | None] = []
    watcher = None
    if sc.during == "gc":
        watcher = threading.Thread(target=lambda: during.append(gc_while_running(work, 60)))
        watcher.start()
    if error is None:
        error = job.run(deadline, wipe_lost=sc.wipe)
    if watcher is not None:
        watcher.join()
        error = error or (during[0] if during else "the operator never ran gc")
    outcome = check(sc, work, reference.result(), pre, error, started)
    outcome.relaunches = job.relaunches
    return outcome


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--soak", type=int, default=0, help="run N random scenarios instead")
    p.add_argument("--set", default="ci", choices=SETS, dest="set_name",
                   help="ci: every fault point and kind at least once (what CI runs); points: "
                        "a kill and a raise at every fault point; full: and every variant "
                        "(see scenario_set)")
    p.add_argument("--full", action="store_true", help="the same as --set full")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="", help="scenarios whose name contains this text")
    p.add_argument("--jobs", type=int, default=1, help="scenarios run at once")
    p.add_argument("--timeout", type=float, default=6.0, help="localckpt collective timeout")
    # hang detection; the rank slower than the timeout takes 120-140 s with --jobs 3 on 2 cores
    p.add_argument("--deadline", type=float, default=300.0, help="seconds a scenario may take")
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=str(HERE.parent / "docs" / "chaos.json"))
    a = p.parse_args()
    scenarios = random_scenarios(a.soak, a.seed) if a.soak else scenario_set(
        "full" if a.full else a.set_name)
    scenarios = [s for s in scenarios if a.only in s.name]
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    base = Path(a.workdir or tempfile.mkdtemp(prefix="localckpt-chaos-", dir=shm))
    t0 = time.monotonic()
    server = None
    if any("{bucket}" in a for sc in scenarios for a in sc.args):
        from s3_local import S3Server

        server = S3Server((BUCKET,))
        os.environ.update(server.env)  # every job's ranks reach it
    print(f"chaos: {len(scenarios)} scenarios, {NODES} nodes x 1 rank, {STEPS} steps, "
          f"async save every {SAVE_EVERY} with node_spread F=2, timeout {a.timeout:g}s")
    try:
        ref_work = base / "reference"

        def reference_run() -> str:
            error = run_first(((), STEPS), ref_work, a.timeout, a.deadline)
            if error:
                raise ReferenceFailed(f"the fault-free reference run failed: {error}")
            return str(json.loads((ref_work / "out" / "rank0.json").read_text())["digest"])

        # The pool takes work in order: the reference and the shared first runs start before
        # any scenario that waits for them, and the longest scenarios before the short ones.
        with ThreadPoolExecutor(a.jobs) as pool:
            reference = pool.submit(reference_run)
            firsts = [f for f in map(first_run_of, scenarios) if f is not None]
            shared = {}
            for i, first in enumerate(dict.fromkeys(f for f in firsts if shareable(f))):
                if firsts.count(first) > 1:
                    ready = base / f"first-{i}"
                    shared[first] = (ready, pool.submit(run_first, first, ready, a.timeout,
                                                        a.deadline))
            ordered = sorted(scenarios, key=lambda s: (s.kind != "slow_rank",
                                                       first_run_of(s) is None))
            futures = {s.name: pool.submit(run_scenario, s, base, reference, a.timeout,
                                           a.deadline, shared) for s in ordered}
            try:
                outcomes = [futures[s.name].result() for s in scenarios]
            except ReferenceFailed as exc:  # every scenario needs it: nothing to judge
                print(exc)
                return 1
    finally:
        if server is not None:
            server.stop()
        if a.workdir is None:
            shutil.rmtree(base, ignore_errors=True)
    print(f"\n{'scenario':<46} {'fault':<10} {'expected':>8} {'resumed':>7} {'bit-id':>6} "
          f"{'recover s':>9} {'total s':>7}  violations")
    for o in outcomes:
        print(f"{o.scenario[:46]:<46} {o.kind[:10]:<10} {o.expected:>8} {o.resumed:>7} "
              f"{'yes' if o.bit_identical else 'NO':>6} {o.recovery_s:>9.2f} {o.seconds:>7.1f}  "
              f"{'; '.join(o.violations) or '-'}")
    bad = [o for o in outcomes if o.violations]
    fired = {f for o in outcomes for f in o.fired}
    node_loss = sorted(o.recovery_s for o in outcomes if o.kind in ("kill_node", "wipe_node"))
    median = node_loss[len(node_loss) // 2] if node_loss else None
    raised = sorted(p for p in POINTS if f"{p}:raise" in fired)
    killed = sorted(p for p in POINTS if {f"{p}:kill", f"{p}:kill_node"} & fired)
    print(f"\n{len(outcomes)} scenarios, {len(bad)} with violations; kinds "
          f"{len({o.kind for o in outcomes})}; fault points killed at {len(killed)}/{len(POINTS)}"
          f", raised at {len(raised)}/{len(POINTS)}; median recovery after node loss {median} s; "
          f"{time.monotonic() - t0:.0f}s in all")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({
        "scenarios": [asdict(o) for o in outcomes], "violations": len(bad),
        "median_node_loss_recovery_s": median, "soak": a.soak, "seed": a.seed,
        "set": None if a.soak else ("full" if a.full else a.set_name),
        "seconds": round(time.monotonic() - t0)}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
