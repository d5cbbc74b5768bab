"""What the chaos harness does to a job's roots and how it judges the outcome: damage at rest
(flipped or truncated chunks, a forged manifest, crash leftovers), operator commands (``localckpt
gc`` between runs, and while a job runs), and the invariants every scenario must keep.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos_job import HERE, NODES, SAVED, events

from localckpt.control.coverage import complete_from_listings
from localckpt.ops.faults import fired_marker
from localckpt.ops.faults import parse as parse_faults
from localckpt.storage.layout import list_shards
from replication import parity_slot

SESSION = "demo"


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
    fired: list[str] = field(default_factory=list)  # "point:action" of the faults that fired


BUCKET = "chaos"  # the local S3 server's bucket (scripts/s3_local.py), started by chaos.py


def substitute(arg: str, work: Path) -> str:
    """A scenario's argument with ``{work}`` (its directory) and ``{bucket}`` (its own prefix in
    the local S3 server's bucket) filled in."""
    return arg.replace("{work}", str(work)).replace("{bucket}", f"s3://{BUCKET}/{work.name}")


def _flip_in_bucket(work: Path, key: str) -> None:
    import obstore
    from obstore.store import S3Store

    store = S3Store.from_url(f"s3://{BUCKET}/{work.name}", client_options={"allow_http": True})
    raw = bytearray(obstore.get(store, key).bytes())
    raw[len(raw) // 2] ^= 0x10
    obstore.put(store, key, bytes(raw))


def fired_faults(work: Path) -> list[str]:
    """The faults that fired, from the once-per-job markers (fired-POINT-ACTION-...)."""
    return sorted({":".join(m.name.split("-")[1:3]) for m in work.glob("fired-*")})


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "localckpt.ops.cli", *argv],
                          capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(HERE.parent), "PATH": "/usr/bin:/bin"})


def damage_at_rest(work: Path, what: str) -> str | None:
    """Damage the newest iteration on node 0 (its own, "primary", shard or a replica it holds),
    leave crash leftovers, or run ``localckpt gc`` as an operator would. Returns a violation."""
    if what.startswith("job_lost"):  # every node root gone; maybe the newest durable damaged
        for n in range(NODES):
            shutil.rmtree(work / f"node{n}", ignore_errors=True)
        chunk_key = f"{SESSION}/iter_{SAVED[2]:010d}/rank_00001_of_00002/data/c/0"
        if what.endswith(":flip_durable"):
            chunk = work / "shared" / chunk_key
            raw = bytearray(chunk.read_bytes())
            raw[len(raw) // 2] ^= 0x10
            chunk.write_bytes(bytes(raw))
        elif what.endswith(":flip_bucket"):
            _flip_in_bucket(work, chunk_key)
        return None
    if what in ("leftovers", "gc"):
        it_dir = work / "node0" / SESSION / f"iter_{SAVED[1]:010d}"
        (it_dir / ".tmp-rank_00000_of_00002-w00000-deadbeef0000" / "data").mkdir(parents=True)
        (it_dir / ".trash-rank_00000_of_00002-w00000-deadbeef0001").mkdir()
        return operator_gc(work) if what == "gc" else None
    how, which = what.split(":")
    shards = list_shards(work / "node0", SESSION)
    newest = max(s.iteration for s in shards)
    # a replica is rank 1's shard on node 0; a parity block (erasure) the one node 0 keeps
    ref = next(s for s in shards if s.iteration == newest and (
        s.owner_rank < 0 if which == "parity" else s.owner_rank == (which != "primary")))
    if how == "forge":
        forge_manifest(ref.path)
        return None
    chunk = ref.path / "data" / "c" / "0"
    raw = bytearray(chunk.read_bytes())
    if how == "flip":
        raw[len(raw) // 2] ^= 0x10
    else:
        raw = raw[: len(raw) // 3]
    chunk.write_bytes(bytes(raw))
    return None


def forge_manifest(shard: Path) -> None:
    """Give the first tensor a shape that does not match its bytes, with a valid checksum: only
    the consistency checks can catch it."""
    from localckpt.storage.manifest import _crc_of

    meta = shard / "zarr.json"
    doc = json.loads(meta.read_text())
    body = doc["attributes"]["localckpt"]["manifest"]
    if "tensor_table" in body:  # format 6: the table in columns
        body["tensor_table"]["shape"][0] = [1 << 20, 1 << 20]
    else:
        body["tensors"][0]["shape"] = [1 << 20, 1 << 20]
    doc["attributes"]["localckpt"]["crc32c"] = _crc_of(body)
    meta.write_text(json.dumps(doc))


def operator_gc(work: Path) -> str | None:
    """``localckpt gc`` over both roots after a run that kept 3 iterations: it must keep the
    newest complete one, remove the older ones and the leftovers, and nothing else."""
    roots = [str(work / f"node{n}") for n in range(NODES)]
    proc = cli("gc", *roots, "--keep-last", "1", "--json")
    if proc.returncode != 0:
        return f"localckpt gc failed ({proc.returncode}): {proc.stderr.strip()}"
    removed = json.loads(proc.stdout)["removed"]
    left = {(s.iteration, s.owner_rank) for r in roots for s in list_shards(Path(r), SESSION)}
    if left != {(SAVED[2], o) for o in range(NODES)} or not removed:
        return f"localckpt gc left {sorted(left)} (removed {len(removed)} entries)"
    return None


def gc_while_running(work: Path, deadline: float) -> str | None:
    """Once the job trains, ``localckpt gc`` on a node's root must refuse: the session is in use
    (it exits 2 before looking at any shard)."""
    end = time.monotonic() + deadline
    while not any(e["event"] == "step" for e in events(work / "out")):
        if time.monotonic() > end:
            return "the job never started a step; gc was not tried"
        time.sleep(0.2)
    proc = cli("gc", str(work / "node0"), "--keep-last", "1")
    if proc.returncode != 2 or "in use" not in proc.stderr:
        return (f"localckpt gc on a live job exited {proc.returncode}: "
                f"{(proc.stderr or proc.stdout).strip()[:200]}")
    return None


def check(sc: Any, work: Path, reference: str, pre_iteration: int | None,
          error: str | None, started: float) -> Outcome:
    """Judge a finished scenario against the invariants (see scripts/chaos.py)."""
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
    if pre_iteration is not None:  # a first run ended at rest: the second run's start is it
        later = [e for e in evs if e["event"] == "resumed" and e["iteration"] >= 0]
    resumed = min((e["iteration"] for e in later), default=-1)
    recovery = 0.0
    if later:
        last_initial = max((e["t"] for e in initial), default=started)
        recovery = (max(e["t"] for e in later) - last_initial if pre_iteration is None
                    else max(e["seconds"] for e in later))
    if sc.expect_restart and not later:
        violations.append("the job never restarted")
    if not sc.expect_restart and pre_iteration is None and later:
        violations.append("the job restarted: a failure that every rank should have agreed on "
                          "left the ranks out of step")
    if later:
        if pre_iteration is not None and resumed != expected:
            violations.append(f"resumed at {resumed}, expected exactly {expected}")
        elif resumed < expected:
            violations.append(f"resumed at {resumed}, older than {expected} finalized before")
        if resumed not in (-1, *SAVED):
            violations.append(f"resumed at {resumed}, never saved")
    else:
        violations += _agreed_saves(sc, initial)
    if sc.pre_args and "manager-first" in " ".join(sc.pre_args):
        closes = [e for e in evs if e["event"] == "close_failed"]
        if len(closes) != NODES or not all("closed" in e["message"] for e in closes):
            violations.append(f"closing the queue after the manager did not raise the clear "
                              f"error on every rank: {closes}")
    digests = []
    for r in range(NODES):
        try:
            digests.append(json.loads((out / f"rank{r}.json").read_text())["digest"])
        except (OSError, ValueError, KeyError):
            digests.append(None)
    identical = all(d == reference for d in digests)
    if not identical:
        violations.append("final weights differ from the fault-free run")
    leftovers = [str(p) for p in [*work.glob(f"node*/{SESSION}/iter_*/.*"),
                                  *work.glob(f"node*/{SESSION}/.trash-*"),
                                  *work.glob(f"node*/{SESSION}/.quarantine-*"),
                                  *work.glob(f"node*/{SESSION}/.recycle/*")]]
    if leftovers and not error:
        violations.append(f"leftovers after the last save: {leftovers}")
    # the newest iteration complete on disk (the last save may have failed alike, on purpose)
    listings = [frozenset((s.iteration, s.owner_rank, s.world_size)
                          for s in list_shards(work / f"node{n}", SESSION)) for n in range(NODES)]
    last = next(iter(complete_from_listings(listings, NODES)), -1)
    failed_everywhere = all(any(e["event"] == "save_failed" and e["iteration"] == SAVED[-1]
                                and e["rank"] == r for e in evs) for r in range(NODES))
    if last != SAVED[-1] and not failed_everywhere and not error:
        violations.append(f"iteration {SAVED[-1]} is not complete on disk (newest: {last}) "
                          "although its save did not fail on every rank")
    replicated = "none" not in sc.args
    erasure = "erasure" in sc.args
    for n in range(NODES):
        held = {s.owner_rank for s in list_shards(work / f"node{n}", SESSION)
                if s.iteration == last}
        want = set(range(NODES)) if replicated and not erasure else {n}
        if erasure:  # its rank's shard and the parity block of the other rank's stripe (a
            # replaced node may run the other rank: torchrun numbers ranks by arrival)
            rank = n if n in held or 1 - n not in held else 1 - n
            want = {rank, parity_slot(1 - rank, 0)}
        if held != want and not error:
            violations.append(f"node {n} holds shards {sorted(held)} of iteration {last}, "
                              f"expected {sorted(want)}"
                              + (" (redundancy not restored)" if replicated else ""))
    if "--durable" in sc.args and not error:
        violations += _durable_violations(substitute(
            sc.args[sc.args.index("--durable") + 1], work))
    # Every fault the scenario armed fired (its once-per-job marker): a scenario whose fault
    # never fired would pass without having tried anything.
    silent = [f"{f.point}:{f.action}" for f in parse_faults(sc.faults)
              if not (work / fired_marker(f)).exists()]
    if silent and not error:
        violations.append(f"armed faults that never fired: {silent}")
    return Outcome(sc.name, sc.point, sc.kind, expected, resumed, identical, round(recovery, 2),
                   round(time.monotonic() - started, 1), violations,
                   fired=fired_faults(work))


def _durable_violations(shared: str) -> list[str]:
    """After the last save: the durable tier's newest complete iteration is the last saved, every
    shard of it verifies, and no uncommitted iteration older than it is left."""
    from localckpt.storage.durable import DurableStore

    tier = DurableStore(shared, SESSION, 0)
    try:
        complete = tier.complete(NODES)
        if not complete or complete[-1] != SAVED[-1]:
            return [f"the durable tier's complete iterations are {complete}, expected the last "
                    f"save {SAVED[-1]} among them, newest"]
        for owner in range(NODES):
            tier.read_shard(SAVED[-1], owner, NODES)  # raises if corrupt or not the committed one
        old = [it for it in tier.uncommitted() if it < complete[-1]]
        return [f"uncommitted durable iterations {old} left"] if old else []
    except Exception as exc:
        return [f"the durable tier does not verify: {type(exc).__name__}: {exc}"]
    finally:
        tier.close()


def _agreed_saves(sc: Any, initial: list[dict[str, Any]]) -> list[str]:
    """Without a restart every rank must have seen every save end the same way, and exactly
    the saves the scenario breaks must have failed."""
    outcome: dict[int, dict[int, str]] = {}
    for e in initial:
        if e["event"] in ("finalized", "save_failed"):
            outcome.setdefault(e["iteration"], {})[e["rank"]] = e["event"]
    violations = []
    for it in SAVED:
        seen = outcome.get(it, {})
        if len(set(seen.values())) > 1 or (seen and len(seen) != NODES):
            violations.append(f"ranks disagree on the save of iteration {it}: {seen}")
    if sc.expect_failed is not None:
        failed = sorted(it for it, seen in outcome.items() if "save_failed" in seen.values())
        if failed != sorted(sc.expect_failed):
            violations.append(f"saves of {failed} failed, expected exactly "
                              f"{list(sc.expect_failed)}")
    return violations
