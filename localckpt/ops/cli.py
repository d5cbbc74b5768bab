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
function; with fewer, ``gc`` removes only leftovers unless ``--partial``. ``gc`` refuses a
session that a live job holds. A durable tier in object storage is given as its one root,
``s3://bucket/prefix`` (settings from the ``AWS_*`` environment).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import stat
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..control.coverage import complete_from_listings
from ..errors import (
    CheckpointingError,
    CorruptShardError,
    UnsupportedFormatError,
)
from ..storage.durable import commit_path
from ..storage.layout import ShardRef, save_marker, saves_marked
from ..storage.manifest import ShardManifest
from ..storage.shard_writer import array_metadata, chunk_files_off
from ..storage.store import ShardStore
from . import cli_object
from .cli_common import (
    UsageError,
    committed_as_job,
    loaded_saves,
    object_root,
    read_manifest,
    sessions_under,
    unfenced_shards,
)
from .cli_doctor import cmd_doctor
from .cli_gc import cmd_gc
from .cli_parity import rebuildable_iterations


def _all_shards(roots: Sequence[Path]) -> list[tuple[Path, str, ShardRef]]:
    """Every committed shard under ``roots`` but those a rollback's fence on any of them hides
    (the job hides them on every root)."""
    sessions = sorted({s for root in roots for s in sessions_under(root)})
    found = [(root, session, ref) for session in sessions
             for root, refs in unfenced_shards(roots, session).items() for ref in refs]
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


def cmd_ls(args: argparse.Namespace) -> int:
    url = object_root(args.roots)
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
    for root, session, ref in shards:
        key = (session, ref.iteration, ref.world_size)
        groups[key][ref.owner_rank].append(str(root))
        sizes[key] += _size(ref.path)
    # of an iteration saved twice, what a load takes: its metrics, and no iteration is
    # complete whose copies no one save covers
    saves = {(session, world): loaded_saves((r for _, sess, r in shards if sess == session),
                                            world)
             for session, world in {(k[0], k[2]) for k in groups}}
    listings: dict[tuple[str, Path], set[tuple[int, int, int]]] = defaultdict(set)
    for root, session, ref in shards:
        listings[(session, root)].add((ref.iteration, ref.owner_rank, ref.world_size))
    complete = {(session, world): set(complete_from_listings(
                    [frozenset(s) for (sess, _), s in listings.items() if sess == session], world))
                | rebuildable_iterations((r for _, sess, r in shards if sess == session), world,
                                         read_manifest)
                for session, world in {(k[0], k[2]) for k in groups}}
    for (session, world), its in complete.items():
        its -= {it for it, (_, covered) in saves[(session, world)].items() if not covered}
        # a durable tier: complete once committed as a job
        committed = committed_as_job(roots, session,
                                     {k[1] for k in groups if k[0] == session}, world)
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
                     "metrics": saves[(session, world)].get(it, ({}, True))[0].get("metrics"),
                     # roots holding the iteration as a durable tier does: committed as a job
                     "durable_committed": [str(r) for r in roots
                                           if commit_path(r, session, it, world).is_file()]})
    return rows


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
    m = read_manifest(shard)
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
    url = object_root(args.roots)
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
    manifest describes it, and nothing in the chunk directory but the chunks; and what a load
    compares besides: no marker of a save other than the manifest's (a copy merged by hand
    with another save's shows two saves of the iteration to every load, which gives it up).
    Raises CorruptShardError."""
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
    own = save_marker(manifest.metadata.get("save_id"))
    marked = [f"save-{save}" for save in saves_marked(shard)]
    if own is not None and marked and marked != [own]:
        raise CorruptShardError(f"{shard / 'data'}: markers {marked[:8]}, its manifest is "
                                f"{own}: a copy merged with another save's (a load drops the "
                                "other markers when its manifest's save is the one loaded, "
                                "else gives the iteration up)")


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
    gc.add_argument("roots", nargs="+", help="the roots of every node (with some of them, "
                    "only leftovers go unless --partial)")
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
    gc.add_argument("--partial", action="store_true",
                    help="remove iterations even when the roots given are not every node's "
                         "(a rollback begun on another node is then not seen)")
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
