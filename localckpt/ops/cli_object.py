"""``localckpt ls / verify / gc`` on a durable tier in object storage (``s3://bucket/prefix``).

A bucket holds what a durable directory holds (see :mod:`localckpt.storage.durable`): an
iteration is complete once its commit record exists. Settings come from the ``AWS_*``
environment (``AWS_ENDPOINT_URL`` for an S3-compatible server), as for a job.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from typing import Any

from ..control.retention import KeepPolicy
from ..errors import CheckpointingError, UnsupportedFormatError
from ..storage.durable import DurableStore, commit_name
from ..storage.layout import parse_shard_name


def _stores(url: str, session: str | None) -> list[DurableStore]:
    probe = DurableStore(url, "", 0, timeout=30)
    try:
        sessions = probe.backend.sessions()  # type: ignore[attr-defined]
    finally:
        probe.close()
    if session is not None:
        sessions = [s for s in sessions if s == session]
    return [DurableStore(url, s, 0, timeout=30) for s in sessions]


def _worlds(names: list[str]) -> dict[int, list[int]]:
    """World size -> owners with a shard among ``names`` (an iteration's entries)."""
    out: dict[int, list[int]] = {}
    for name in names:
        if shard := parse_shard_name(name):  # else no shard of a job: not listed, as locally
            out.setdefault(shard[1], []).append(shard[0])
    return {w: sorted(o) for w, o in out.items()}


def rows(url: str) -> list[dict[str, Any]]:
    """One row per (session, iteration, world size) in the bucket."""
    out = []
    for tier in _stores(url, None):
        try:
            backend: Any = tier.backend
            for it in backend.iterations():
                names, sizes = backend.names(it), backend.sizes(it)
                for world, owners in sorted(_worlds(names).items()):
                    committed = commit_name(world) in names
                    metrics = None
                    with contextlib.suppress(OSError, CheckpointingError):
                        metrics = tier.read_with_digest(it, owners[0], world)[1].metadata.get(
                            "metrics")
                    out.append({
                        "session": tier.session_id, "iteration": it, "world_size": world,
                        "complete": committed and len(owners) == world,
                        "durable_committed": [url] if committed else [],
                        "missing_owners": sorted(set(range(world)) - set(owners)),
                        "copies_min": 1 if len(owners) == world else 0, "copies_max": 1,
                        "bytes": sum(v for k, v in sizes.items()
                                     if (shard := parse_shard_name(k)) and shard[1] == world),
                        "holders": {str(o): [url] for o in owners}, "metrics": metrics})
        finally:
            tier.close()
    return out


def verify(url: str) -> tuple[int, list[dict[str, Any]]]:
    """Every shard in the bucket read and checked: chunk CRCs against the manifest and, for a
    committed iteration, the manifest against its commit record (and every committed shard
    present). Returns (shards verified, problems)."""
    checked, bad = 0, []
    for tier in _stores(url, None):
        try:
            backend: Any = tier.backend
            for it in backend.iterations():
                names = backend.names(it)
                for world, owners in sorted(_worlds(names).items()):
                    committed = commit_name(world) in names
                    expected = set(range(world)) if committed else set(owners)
                    for owner in sorted(expected | set(owners)):
                        checked += 1
                        where = f"{url}/{tier.session_id or '_default'}/iter_{it:010d}/" \
                                f"rank_{owner:05d}_of_{world:05d}"
                        try:
                            if committed:
                                tier.read_shard(it, owner, world)
                            else:
                                tier.read_data(tier.read_with_digest(it, owner, world)[1])
                        except UnsupportedFormatError as exc:
                            bad.append({"shard": where, "error": str(exc), "unsupported": True})
                        except (CheckpointingError, OSError) as exc:
                            bad.append({"shard": where, "error": str(exc)})
        finally:
            tier.close()
    return checked, bad


def collect(url: str, policy: KeepPolicy, session: str | None, dry_run: bool) -> list[str]:
    """What gc removes from the bucket: per session and world size, the committed iterations
    ``policy`` does not keep (commit record first; one whose manifest cannot be read is kept,
    its metrics unknown), and the uncommitted iterations older than
    the newest committed one (each rank persists in order: nothing completes them). Newer
    uncommitted ones may be a persist in progress and stay."""
    removed: list[str] = []
    for tier in _stores(url, session):
        try:
            backend: Any = tier.backend
            iterations = backend.iterations()
            worlds = {w for it in iterations for w in _worlds(backend.names(it))}
            newest_committed = -1
            for world in sorted(worlds):
                complete = tier.complete(world)
                newest_committed = max([newest_committed, *complete])
                meta, unread = {}, set()
                for it in complete:
                    try:
                        meta[it] = tier.committed_manifest(it, 0, world).metadata
                    except (OSError, CheckpointingError):  # kept: its metrics are unknown
                        unread.add(it)
                keep = unread | policy.keep(complete, metrics={
                    it: m["metrics"] for it, m in meta.items() if m.get("metrics") is not None},
                    times={it: m["saved_unix"] for it, m in meta.items()
                           if isinstance(m.get("saved_unix"), (int, float))})
                for it in complete:
                    if it not in keep:
                        removed.append(f"{url}/{tier.session_id or '_default'}/iter_{it:010d} "
                                       f"(world size {world})")
                        if not dry_run:
                            tier.delete(it, world)
            for it in tier.uncommitted():
                if it < newest_committed:
                    removed.append(f"{url}/{tier.session_id or '_default'}/iter_{it:010d} "
                                   "(uncommitted)")
                    if not dry_run:
                        tier.remove_uncommitted(it)
        finally:
            tier.close()
    return removed


def cmd_verify_bucket(url: str, args: argparse.Namespace) -> int:
    checked, bad = verify(url)
    if args.json:
        print(json.dumps({"verified": checked, "corrupt": bad}, indent=1))
    else:
        print(f"{checked} shards verified, {len(bad)} corrupt or unreadable")
        for b in bad:
            print(f"{'UNSUPPORTED' if b.get('unsupported') else 'CORRUPT'} {b['shard']}: "
                  f"{b['error']}")
    return 1 if bad else 0
