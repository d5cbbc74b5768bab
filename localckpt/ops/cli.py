"""The ``localckpt`` command: look at, verify and clean node-local checkpoints; check a node.

    localckpt ls ROOT...            iterations, owners, copies, bytes; coverage across the roots
    localckpt inspect SHARD         manifest, tensor table, writer identity
    localckpt verify ROOT...        every committed shard's checksums (exit 1 on corruption)
    localckpt gc ROOT... [--dry-run] leftovers, quarantined copies, iterations retention would
                                    delete (--keep-last, --keep-every) across the roots
    localckpt doctor [--root R]     file system, free space, /dev/shm, GPUs, library versions

``--json`` gives machine-readable output. Bad input is one line on stderr and exit status 2;
corruption found by ``verify`` is exit status 1. Run ``ls`` and ``gc`` with the roots of every
node (or copies of them): completeness is judged across the roots given, with the library's own
function. ``gc`` refuses a session that a live job holds. A durable tier in object storage is
given as its one root, ``s3://bucket/prefix`` (settings from the ``AWS_*`` environment).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import stat
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..control.coverage import complete_from_listings
from ..control.retention import KeepPolicy
from ..errors import (
    CheckpointingError,
    ConfigurationError,
    CorruptShardError,
    SessionInUseError,
    UnsupportedFormatError,
)
from ..storage.durable import commit_path
from ..storage.durable_object import is_object_url
from ..storage.layout import (
    ShardRef,
    find_leftovers,
    find_quarantined,
    holds_checkpoints,
    iteration_dir,
    list_sessions,
    list_shards,
    session_dir,
)
from ..storage.manifest import ShardManifest
from ..storage.rollback_fence import hidden, merged, read_fence
from ..storage.session_lock import SessionLock
from ..storage.shard_reader import parse_manifest_file
from ..storage.shard_writer import array_metadata, chunk_files_off
from ..storage.store import ShardStore
from . import cli_object
from .cli_doctor import cmd_doctor
from .cli_parity import rebuildable_iterations


class UsageError(Exception):
    """Bad input: printed as one line, exit status 2."""


def _sessions(root: Path) -> list[str]:
    if not root.is_dir():
        raise UsageError(f"{root}: not a directory")
    return list_sessions(root)


def _all_shards(roots: Sequence[Path]) -> list[tuple[Path, str, ShardRef]]:
    found = [(root, session, ref) for root in roots for session in _sessions(root)
             for ref in list_shards(root, session)]
    if not found:
        raise UsageError(f"no localckpt checkpoints under {', '.join(map(str, roots))}")
    return found


def _size(path: Path) -> int:
    """Bytes of the files under ``path``; files a live job deletes meanwhile count nothing."""
    total = 0
    for f in path.rglob("*"):
        with contextlib.suppress(FileNotFoundError):
            st = f.stat(follow_symlinks=False)
            total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def _read_manifest(shard: Path) -> ShardManifest:
    """The shard's manifest, read and verified as a load reads it; raises UsageError for a
    missing or unreadable file, CorruptShardError for anything else wrong with it."""
    path = shard / "zarr.json"
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{shard}: not a localckpt shard (no readable zarr.json: {exc})") from exc
    return parse_manifest_file(data, str(path))


def _bucket(roots: Sequence[str]) -> str | None:
    """The ``s3://`` URL among ``roots`` (then the only root), else None."""
    urls = [r for r in roots if is_object_url(r)]
    if urls and len(roots) > 1:
        raise UsageError(f"an object-storage root is given alone: got {list(roots)}")
    return urls[0] if urls else None


def cmd_ls(args: argparse.Namespace) -> int:
    url = _bucket(args.roots)
    rows = cli_object.rows(url) if url else _dir_rows([Path(r) for r in args.roots])
    if url and not rows:
        raise UsageError(f"no localckpt checkpoints under {url}")
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'session':<12} {'iteration':>10} {'world':>5} {'complete':>8} {'copies':>7} "
          f"{'MiB':>10}  {'durable':>9}  {'missing owners':<15} metrics")
    for r in rows:
        print(f"{r['session'] or '(default)':<12} {r['iteration']:>10} {r['world_size']:>5} "
              f"{'yes' if r['complete'] else 'NO':>8} "
              f"{r['copies_min']}-{r['copies_max']:<5} {r['bytes'] / 2**20:>10.1f}  "
              f"{'committed' if r['durable_committed'] else '-':>9}  "
              f"{_ranges(r['missing_owners']) or '-':<15} "
              f"{' '.join(f'{k}={v:g}' for k, v in (r['metrics'] or {}).items()) or '-'}")
    return 0


def _dir_rows(roots: list[Path]) -> list[dict[str, Any]]:
    shards = _all_shards(roots)
    Key = tuple[str, int, int]
    groups: dict[Key, dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
    sizes: dict[tuple[str, int, int], int] = defaultdict(int)
    metrics: dict[Key, Any] = {}
    for root, session, ref in shards:
        key = (session, ref.iteration, ref.world_size)
        groups[key][ref.owner_rank].append(str(root))
        sizes[key] += _size(ref.path)
        if key not in metrics:  # rank 0's, in every shard of the iteration
            with contextlib.suppress(UsageError, CheckpointingError):
                metrics[key] = _read_manifest(ref.path).metadata.get("metrics")
    listings: dict[tuple[str, Path], set[tuple[int, int, int]]] = defaultdict(set)
    for root, session, ref in shards:
        listings[(session, root)].add((ref.iteration, ref.owner_rank, ref.world_size))
    complete = {(session, world): set(complete_from_listings(
                    [frozenset(s) for (sess, _), s in listings.items() if sess == session], world))
                | rebuildable_iterations((r for _, sess, r in shards if sess == session), world,
                                         _read_manifest)
                for session, world in {(k[0], k[2]) for k in groups}}
    for (session, world), its in complete.items():  # a durable tier: once committed as a job
        committed = _committed(roots, session, {k[1] for k in groups if k[0] == session}, world)
        if committed is not None:
            its &= committed
    rows: list[dict[str, Any]] = []
    for (session, it, world), owners in sorted(groups.items()):
        missing = sorted(set(range(world)) - set(owners))
        copies = [len(owners.get(o, [])) for o in range(world)]
        rows.append({"session": session, "iteration": it, "world_size": world,
                     "complete": it in complete[(session, world)], "missing_owners": missing,
                     "copies_min": min(copies), "copies_max": max(copies),
                     "bytes": sizes[(session, it, world)],
                     "holders": {str(o): roots_ for o, roots_ in sorted(owners.items())},
                     "metrics": metrics.get((session, it, world)),
                     # roots holding the iteration as a durable tier does: committed as a job
                     "durable_committed": [str(r) for r in roots
                                           if commit_path(r, session, it, world).is_file()]})
    return rows


def _committed(roots: Sequence[Path], session: str, iterations: set[int],
               world: int) -> set[int] | None:
    """Of ``iterations``, those some root commits as a job (a durable tier's commit file);
    None when no root has such a file for ``world`` (node roots)."""
    found = {it for it in iterations for r in roots
             if commit_path(r, session, it, world).is_file()}
    return found if found or any(
        any(iteration_dir(r, session, it).glob("COMMITTED-*")) for r in roots
        for it in iterations) else None


def _ranges(values: list[int]) -> str:
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ",".join(out)


def cmd_inspect(args: argparse.Namespace) -> int:
    shard = Path(args.shard)
    if not shard.is_dir():
        raise UsageError(f"{shard}: not a directory")
    m = _read_manifest(shard)
    if args.json:
        print(json.dumps(m.to_json_dict()["manifest"], indent=1))
        return 0
    print(f"shard          {shard}")
    print(f"checkpoint id  iteration {m.iteration}, owner rank {m.owner_rank} of {m.world_size}, "
          f"session {m.session_id!r}")
    print(f"format         version {m.format_version}, {m.chunk_count} chunks of "
          f"{m.chunk_nbytes} bytes, {m.data_nbytes} bytes of tensors")
    print(f"written by     {json.dumps(m.identity)}")
    if m.metadata.get("metrics") is not None:
        print(f"metrics        {json.dumps(m.metadata['metrics'])}")
    if m.metadata.get("custom") is not None:
        print(f"metadata       {json.dumps(m.metadata['custom'])}")
    print(f"\n{'tensor':<48} {'dtype':<10} {'shape':<20} {'bytes':>12}  device")
    for t in m.tensors:
        print(f"{t.key_path[:48]:<48} {t.dtype:<10} {list(t.shape)!s:<20} {t.nbytes:>12}  "
              f"{t.device}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    url = _bucket(args.roots)
    if url:
        return cli_object.cmd_verify_bucket(url, args)
    shards = _all_shards([Path(r) for r in args.roots])
    bad: list[dict[str, Any]] = []
    retired: list[str] = []
    for n, (root, session, ref) in enumerate(shards, 1):
        store = ShardStore(root, session, writer_rank=0)
        try:
            _check_as_zarr(ref.path, store.read(ref)[0])
            status = "ok"
        except UnsupportedFormatError as exc:  # intact, written by another localckpt version
            status = f"UNSUPPORTED: {exc}"
            bad.append({"shard": str(ref.path), "error": str(exc), "unsupported": True})
        except CheckpointingError as exc:
            if not ref.path.exists():  # a live job's retention took it while it was read
                status = "RETIRED (deleted while verified)"
                retired.append(str(ref.path))
            else:
                status = f"CORRUPT: {exc}"
                bad.append({"shard": str(ref.path), "error": str(exc)})
        except OSError as exc:  # this process's trouble (no permission...): the next one
            if not ref.path.exists():
                status = "RETIRED (deleted while verified)"
                retired.append(str(ref.path))
            else:
                status = f"UNREADABLE: {exc}"
                bad.append({"shard": str(ref.path), "error": str(exc), "unreadable": True})
        finally:
            store.close()
        if not args.json:
            bar = "#" * (20 * n // len(shards))
            print(f"[{bar:<20}] {n}/{len(shards)} {ref.path}: {status}", file=sys.stderr)
    if args.json:
        print(json.dumps({"verified": len(shards), "corrupt": bad, "retired": retired},
                         indent=1))
    else:
        print(f"{len(shards)} shards verified, {len(bad)} corrupt or unreadable"
              + (f", {len(retired)} deleted by a live job meanwhile" if retired else ""))
        for path in retired:
            print(f"RETIRED {path}")
        for b in bad:
            label = ("UNSUPPORTED" if b.get("unsupported") else
                     "UNREADABLE" if b.get("unreadable") else "CORRUPT")
            print(f"{label} {b['shard']}: {b['error']}")
    return 1 if bad else 0


def _check_as_zarr(shard: Path, manifest: ShardManifest) -> None:
    """What a plain zarr reader needs beyond what a load checks: the array's metadata as the
    manifest describes it, and nothing in the chunk directory but the chunks. Raises
    CorruptShardError."""
    where = shard / "data" / "zarr.json"
    try:
        doc = json.loads(where.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise CorruptShardError(f"{where}: unreadable array metadata ({exc})") from exc
    if doc != array_metadata(manifest.chunk_nbytes, manifest.chunk_count):
        raise CorruptShardError(f"{where}: the array metadata does not describe the shard's "
                                f"{manifest.chunk_count} chunks of {manifest.chunk_nbytes} bytes")
    extra = chunk_files_off(shard / "data" / "c", manifest.chunk_count)[1]
    if extra:
        raise CorruptShardError(f"{shard / 'data' / 'c'}: entries that are no chunk of the "
                                f"shard: {extra[:8]}")


def cmd_gc(args: argparse.Namespace) -> int:
    """Remove leftovers, quarantined copies, and iterations retention would remove: for each
    session and world size, what the library's KeepPolicy keeps of the iterations complete
    across the given roots (``--keep-last`` newest, each multiple of ``--keep-every``) is kept,
    and so is what it would keep were an incomplete one complete with roots not given (anything
    newer than the oldest of the last k, or a multiple of --keep-every; a save in progress);
    the rest goes. With no complete iteration in view nothing goes.
    Deletes in a session only while no live job holds it (its lock), each shard hidden by a
    rename before it is freed."""
    try:
        policy = KeepPolicy(args.keep_last, args.keep_every, args.keep_best, args.metric,
                            args.mode, not args.drop_without_metric,
                            interval=args.keep_interval)
    except ConfigurationError as exc:
        raise UsageError(str(exc).replace("keep_", "--keep-").replace("best_metric", "--metric")
                         .replace("best_mode", "--mode")) from None
    url = _bucket(args.roots)
    if url:
        if args.world_size is not None:
            raise UsageError("--world-size: not for an object-storage root")
        if args.session is not None:
            session_dir(Path("/"), args.session)  # an invalid id is a usage error
        _report_gc(args, cli_object.collect(url, policy, args.session, args.dry_run))
        return 0
    if args.world_size is not None and args.session is None:
        raise UsageError("--world-size removes every shard of other world sizes: name the "
                         "session it applies to with --session (another job's session may "
                         "share the root)")
    roots: list[Path] = []
    for root in map(Path, args.roots):
        _sessions(root)  # a root that is not a directory is a usage error
        if all(not os.path.samefile(root, r) for r in roots):  # one root named twice: once
            roots.append(root)
    removed: list[Path] = []
    # only directories holding what localckpt writes: a root given by mistake (a parent of
    # the real one) must not have its subdirectories collected as sessions
    sessions = sorted({s for root in roots for s in list_sessions(root)
                       if holds_checkpoints(session_dir(root, s))})
    if not sessions:
        raise UsageError(f"no localckpt checkpoints under {', '.join(map(str, roots))}")
    if args.session is not None:
        session_dir(roots[0], args.session)  # an invalid id is a usage error
        if args.session not in sessions:  # a typo must not pass for "nothing to collect"
            raise UsageError(f"--session {args.session!r}: no such session under "
                             f"{', '.join(map(str, roots))} (sessions: "
                             f"{', '.join(repr(s) for s in sessions)})")
        sessions = [args.session]
    in_use: list[str] = []
    for session in sessions:
        with contextlib.ExitStack() as locks:
            try:
                if not args.dry_run:
                    for root in roots:
                        if session_dir(root, session).is_dir():
                            locks.enter_context(SessionLock(session_dir(root, session),
                                                            exclusive=True))
            except SessionInUseError as exc:  # the other sessions are still collected
                in_use.append(str(exc))
                continue
            removed += _collect(roots, session, policy, args.world_size, args.dry_run)
    _report_gc(args, [str(p) for p in removed])
    for message in in_use:
        print(f"localckpt gc: {message}", file=sys.stderr)
    return 2 if in_use else 0


def _report_gc(args: argparse.Namespace, removed: list[str]) -> None:
    if args.json:
        print(json.dumps({"dry_run": args.dry_run, "removed": removed}))
    else:
        verb = "would remove" if args.dry_run else "removed"
        for p in removed:
            print(f"{verb} {p}")
        print(f"{len(removed)} entries {verb}")


def _collect(roots: list[Path], session: str, policy: KeepPolicy, world_size: int | None,
             dry_run: bool) -> list[Path]:
    """What gc removes in ``session`` of ``roots`` (and removes it unless ``dry_run``). A
    rollback's fence on one root hides the newer shards on every root (as the job does): they
    are neither counted nor removed (the job's next save finishes that rollback)."""
    fence = None
    for root in roots:
        if (held := read_fence(session_dir(root, session))) is not None:
            fence = merged(fence, held)
    shards = {root: [s for s in list_shards(root, session)
                     if not hidden(fence, s.iteration, s.world_size)] for root in roots}
    worlds = sorted({s.world_size for refs in shards.values() for s in refs})
    complete_of = {world: _complete(roots, session, shards, world) for world in worlds}
    doomed: list[tuple[Path, ShardRef]] = []
    if world_size is not None:
        newest = max(complete_of.get(world_size, []), default=None)
        if newest is None:  # a typo must not take the only checkpoints (loadable resharded)
            found = ", ".join(f"{w} (complete: {complete_of[w][:3] or 'none'})" for w in worlds)
            raise UsageError(f"--world-size {world_size}: session {session!r} has no complete "
                             f"iteration of that world size in view (world sizes: "
                             f"{found or 'none'}); nothing removed")
        # another world size's shards go once that world size has a newer complete iteration
        doomed += [(root, s) for root, refs in shards.items() for s in refs
                   if s.world_size != world_size and s.iteration < newest]
    for world in worlds:
        if world_size is not None and world != world_size:
            continue
        complete = complete_of[world]
        if complete:  # the same function as a save's retention, unsure of what it cannot see
            seen = {s.iteration for refs in shards.values() for s in refs if s.world_size == world}
            meta = _metadata(shards, world) if policy.needs_metadata else {}
            keep = policy.keep(complete, unsure=seen - set(complete),
                               metrics={it: m["metrics"] for it, m in meta.items()
                                        if m.get("metrics") is not None},
                               times={it: m["saved_unix"] for it, m in meta.items()
                                      if isinstance(m.get("saved_unix"), (int, float))})
            doomed += [(root, s) for root, refs in shards.items() for s in refs
                       if s.world_size == world and s.iteration not in keep]
    leftovers = [p for root in roots for p in (find_leftovers(session_dir(root, session))
                                               + find_quarantined(session_dir(root, session)))]
    if not dry_run:
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True)
        for root in roots:
            store = ShardStore(root, session, writer_rank=0, io_threads=1)
            try:
                for r, ref in doomed:
                    if r == root:
                        # a durable tier's iteration stops being complete before any shard goes
                        commit_path(root, session, ref.iteration, ref.world_size).unlink(
                            missing_ok=True)
                        store.delete(ref)  # renamed out of sight first, then freed
            finally:
                store.close()
    return leftovers + [ref.path for _, ref in doomed]


def _complete(roots: list[Path], session: str, shards: dict[Path, list[ShardRef]],
              world: int) -> list[int]:
    """The iterations of ``world`` complete across ``roots`` (held or rebuildable from parity
    blocks; with a durable tier, committed there too), newest first."""
    listings = [frozenset((s.iteration, s.owner_rank, s.world_size) for s in refs)
                for refs in shards.values()]
    complete = sorted(set(complete_from_listings(listings, world)) | rebuildable_iterations(
        (s for refs in shards.values() for s in refs), world, _read_manifest), reverse=True)
    seen_its = {s.iteration for refs in shards.values() for s in refs if s.world_size == world}
    committed = _committed(roots, session, seen_its, world)
    if committed is not None:  # a durable tier: complete only once committed as a job
        complete = [it for it in complete if it in committed]
    return complete


def _metadata(shards: dict[Path, list[ShardRef]], world: int) -> dict[int, Any]:
    """Iteration -> its manifest's metadata (metrics, save time; from the first readable shard
    of it: rank 0's, in every shard)."""
    out: dict[int, Any] = {}
    for refs in shards.values():
        for ref in refs:
            if ref.world_size == world and ref.iteration not in out:
                try:
                    out[ref.iteration] = _read_manifest(ref.path).metadata
                except (UsageError, CheckpointingError):
                    continue
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="localckpt", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", help="list checkpoints and their coverage across roots")
    ls.add_argument("roots", nargs="+")
    ins = sub.add_parser("inspect", help="show one shard's manifest and tensors")
    ins.add_argument("shard")
    ver = sub.add_parser("verify", help="check every shard's checksums")
    ver.add_argument("roots", nargs="+")
    gc = sub.add_parser("gc", help="remove leftovers and old iterations")
    gc.add_argument("roots", nargs="+", help="the roots of every node (or some of them)")
    gc.add_argument("--keep-last", type=int, default=1)
    gc.add_argument("--keep-every", type=int, default=None,
                    help="also keep each complete iteration that is a multiple of this")
    gc.add_argument("--keep-best", type=int, default=None,
                    help="also keep the N iterations with the best --metric")
    gc.add_argument("--metric", default=None, help="the metric --keep-best ranks by")
    gc.add_argument("--mode", default="min", choices=("min", "max"))
    gc.add_argument("--drop-without-metric", action="store_true",
                    help="with --keep-best, iterations saved without the metric may go")
    gc.add_argument("--keep-interval", type=float, default=None,
                    help="also keep one iteration per this many seconds (the first of each)")
    gc.add_argument("--session", default=None,
                    help="only this session ('' is the default session); required with "
                         "--world-size")
    gc.add_argument("--world-size", type=int, default=None,
                    help="also remove the session's shards of other world sizes that are older "
                         "than its newest iteration complete at this world size")
    gc.add_argument("--dry-run", action="store_true")
    doc = sub.add_parser("doctor", help="check the node: storage, GPUs, versions")
    doc.add_argument("--root", default="/dev/shm")
    doc.add_argument("--expected-bytes", type=int, default=0,
                     help="bytes a checkpoint needs on the root (with replicas)")
    for s in (ls, ins, ver, gc, doc):
        s.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"ls": cmd_ls, "inspect": cmd_inspect, "verify": cmd_verify, "gc": cmd_gc,
                "doctor": cmd_doctor}
    try:
        return handlers[args.command](args)
    except (UsageError, CheckpointingError, OSError) as exc:
        print(f"localckpt {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
