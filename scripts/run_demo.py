"""Drive the demo: an uninterrupted reference run, then a run that crashes and is restarted by
torchrun, then a bit-for-bit comparison. Prints a short report; exit status 1 on any mismatch.

Usage: python scripts/run_demo.py [--steps 40] [--save-every 10] [--crash-at-step 25] [--json F]
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(nproc: int, args: list[str], max_restarts: int, timeout: float) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           # c10d rendezvous: every restart gets a fresh rendezvous round (the static one reuses
           # the store, and a restarted gloo group then dials the dead attempt's addresses).
           "--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           "--rdzv-id=localckpt-demo",
           f"--max-restarts={max_restarts}", "--monitor-interval=0.5",
           str(HERE / "train_demo.py"), *args]
    return subprocess.run(cmd, timeout=timeout, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True).returncode


def read_results(out: Path, nproc: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--crash-at-step", type=int, default=25)
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--workdir", default=None, help="default: a fresh directory in /dev/shm")
    p.add_argument("--json", default=None, help="also write the report here")
    p.add_argument("--timeout", type=float, default=300)
    a = p.parse_args()
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    base = Path(a.workdir or tempfile.mkdtemp(prefix="localckpt-demo-", dir=shm))
    common = ["--steps", str(a.steps), "--save-every", str(a.save_every)]
    print(f"localckpt demo: {a.nproc} ranks on 127.0.0.1, {a.steps} steps, checkpoint every "
          f"{a.save_every}, rank {a.crash_rank} crashes at step {a.crash_at_step}")
    try:
        t = time.monotonic()
        rc = torchrun(a.nproc, [*common, "--root", str(base / "ref-root"), "--out",
                                str(base / "ref-out")], 0, a.timeout)
        if rc != 0:
            print(f"reference run failed with exit status {rc}")
            return 1
        ref = read_results(base / "ref-out", a.nproc)
        print(f"  reference run (no fault)      done in {time.monotonic() - t:.1f}s")
        t = time.monotonic()
        rc = torchrun(a.nproc, [*common, "--root", str(base / "root"), "--out", str(base / "out"),
                                "--crash-at-step", str(a.crash_at_step),
                                "--crash-rank", str(a.crash_rank)], 1, a.timeout)
        if rc != 0:
            print(f"faulty run did not recover: exit status {rc}")
            return 1
        got = read_results(base / "out", a.nproc)
        expected_resume = (a.crash_at_step // a.save_every) * a.save_every - 1
        print(f"  crash + torchrun restart      done in {time.monotonic() - t:.1f}s")
        ok = True
        for g, r in zip(got, ref, strict=True):
            same = g["digest"] == r["digest"]
            ok &= same and g["attempt"] == 1 and g["resumed_from"] == expected_resume
            print(f"  rank {g['rank']}: restart #{g['attempt']} resumed from iteration "
                  f"{g['resumed_from']} (expected {expected_resume}) in "
                  f"{g['restore_seconds'] * 1000:.0f} ms; final weights "
                  f"{'bit-identical' if same else 'DIFFER'} to the reference")
        print("RESULT:", "ok" if ok else "FAILED")
        if a.json:
            Path(a.json).write_text(json.dumps({"ok": ok, "ranks": got, "reference": ref,
                                                "expected_resume": expected_resume}, indent=1))
        return 0 if ok else 1
    finally:
        if a.workdir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
