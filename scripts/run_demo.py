"""The node-loss demo: a 2-node torchrun job (one agent per simulated node, one rank each) trains
and checkpoints asynchronously with replication; node 1 dies mid-run (its agent and ranks are
SIGKILLed while staging iteration 29) and its root is wiped; a replacement node with an empty
root joins; the job resumes from the newest complete checkpoint, fetching the lost shard from the
surviving node, and finishes with weights bit-identical to an uninterrupted run.

A second act loses the whole job: with a durable tier (a directory standing in for a shared file
system), both nodes die while staging iteration 29 and come back with empty roots; the job
resumes from the newest iteration persisted there and finishes bit-identical too.

Usage: python scripts/run_demo.py [--json F] [--workdir D]; exit status 1 when anything differs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from chaos_job import NODES, SAVE_EVERY, STEPS, Job

from localckpt.storage.layout import list_shards

KILL_AT = 29  # node 1 dies while staging the checkpoint of this step


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workdir", default=None, help="default: a fresh directory in /dev/shm")
    p.add_argument("--json", default=None, help="also write the report here")
    p.add_argument("--timeout", type=float, default=6.0, help="localckpt collective timeout")
    a = p.parse_args()
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    base = Path(a.workdir or tempfile.mkdtemp(prefix="localckpt-demo-", dir=shm))
    print(f"localckpt demo: {NODES} nodes x 1 rank (torchrun agents on 127.0.0.1), {STEPS} steps,"
          f" async checkpoint every {SAVE_EVERY} replicated to the other node")
    try:
        t = time.monotonic()
        ref_dir = base / "reference"
        ref_dir.mkdir(parents=True)
        if err := Job(ref_dir, STEPS, a.timeout).run(300, wipe_lost=False):
            print(f"  reference run failed: {err}")
            return 1
        ref = json.loads((ref_dir / "out" / "rank0.json").read_text())["digest"]
        print(f"  uninterrupted reference run           {time.monotonic() - t:5.1f}s")

        t = time.monotonic()
        work = base / "faulty"
        work.mkdir()
        job = Job(work, STEPS, a.timeout, f"staging:kill_node:rank=1:iteration={KILL_AT}")
        if err := job.run(300, wipe_lost=True):
            print(f"  the job did not recover: {err}")
            return 1
        print(f"  run with node loss + replacement      {time.monotonic() - t:5.1f}s")
        print(f"  node {job.replaced[0]} killed at step {KILL_AT} (agent + ranks, SIGKILL), "
              "its root wiped, an empty replacement node joined")
        ranks = [json.loads((work / "out" / f"rank{r}.json").read_text()) for r in range(NODES)]
        expected = KILL_AT - SAVE_EVERY
        ok = True
        for r in ranks:
            same = r["digest"] == ref
            ok &= same and r["resumed_from"] == expected
            source = (f"fetched {r['fetched_bytes'] / 1024:.0f} KiB from the other node"
                      if r["fetched_bytes"] else "read from its own disk")
            print(f"  rank {r['rank']} on node {r['node']}: resumed from iteration "
                  f"{r['resumed_from']} (expected {expected}) in "
                  f"{r['restore_seconds'] * 1000:.0f} ms, {source}; final weights "
                  f"{'bit-identical' if same else 'DIFFER'}")
        last = STEPS - 1
        for n in range(NODES):
            held = sorted(s.owner_rank for s in list_shards(work / f"node{n}", "demo")
                          if s.iteration == last)
            ok &= held == list(range(NODES))
            print(f"  node {n} holds the shards of ranks {held} for iteration {last}"
                  f"{' (redundancy restored)' if n == job.replaced[0] else ''}")
        lost = whole_job_lost(base, a.timeout, ref)
        ok &= lost["ok"]
        print("RESULT:", "ok" if ok else "FAILED")
        if a.json:
            Path(a.json).write_text(json.dumps({"ok": ok, "ranks": ranks, "reference": ref,
                                                "expected_resume": expected,
                                                "replaced": job.replaced, "job_lost": lost},
                                               indent=1))
        return 0 if ok else 1
    finally:
        if a.workdir is None:
            shutil.rmtree(base, ignore_errors=True)


def whole_job_lost(base: Path, timeout: float, ref: str) -> dict[str, object]:
    """Act 2: every node lost at step 29, replaced by empty ones, restored from the durable
    tier."""
    t = time.monotonic()
    work = base / "job-lost"
    work.mkdir()
    shared = work / "shared"
    job = Job(work, STEPS, timeout, f"staging:kill_node:rank=0:iteration={KILL_AT};"
              f"staging:kill_node:rank=1:iteration={KILL_AT}",
              args=("--durable", str(shared), "--step-seconds", "0.05"))
    if err := job.run(300, wipe_lost=True):
        print(f"  the job did not recover from losing every node: {err}")
        return {"ok": False, "error": err}
    print(f"  run losing the whole job + restart     {time.monotonic() - t:5.1f}s")
    print(f"  nodes {sorted(job.replaced)} killed at step {KILL_AT}, every root wiped, empty "
          f"replacements joined; the durable tier is {shared}")
    ranks = [json.loads((work / "out" / f"rank{r}.json").read_text()) for r in range(NODES)]
    expected = KILL_AT - SAVE_EVERY
    ok = sorted(job.replaced) == list(range(NODES))
    for r in ranks:
        same = r["digest"] == ref
        ok &= same and r["resumed_from"] == expected
        print(f"  rank {r['rank']} on node {r['node']}: resumed from iteration "
              f"{r['resumed_from']} (expected {expected}) from the durable tier in "
              f"{r['restore_seconds'] * 1000:.0f} ms; final weights "
              f"{'bit-identical' if same else 'DIFFER'}")
    return {"ok": ok, "replaced": sorted(job.replaced),
            "resumed": [r["resumed_from"] for r in ranks],
            "identical": [r["digest"] == ref for r in ranks]}


if __name__ == "__main__":
    sys.exit(main())
