"""``localckpt gc``: remove leftovers, quarantined copies and the iterations retention would
remove, judged across the roots given with the library's own functions."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from ..control.coverage import complete_from_listings
from ..control.retention import KeepPolicy
from ..errors import CheckpointingError, ConfigurationError, SessionInUseError
from ..storage.durable import commit_path
from ..storage.layout import (
    ShardRef,
    find_leftovers,
    find_quarantined,
    holds_checkpoints,
    list_sessions,
    remove_paths,
    session_dir,
)
from ..storage.session_lock import SessionLock
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
from .cli_parity import rebuildable_iterations


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
    url = object_root(args.roots)
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
        sessions_under(root)  # a root that is not a directory is a usage error
        if all(not os.path.samefile(root, r) for r in roots):  # one root named twice: once
            roots.append(root)
    removed: list[Path] = []
    # only directories holding what localckpt writes, or a live job's (refused below): a root
    # given by mistake (a parent of the real one) must not have its subdirectories collected
    sessions = sorted({s for root in roots for s in list_sessions(root)
                       if holds_checkpoints(session_dir(root, s))
                       or _held_by_a_job(session_dir(root, s))})
    if not sessions:
        raise UsageError(f"no localckpt checkpoints under {', '.join(map(str, roots))}")
    if args.session is not None:
        session_dir(roots[0], args.session)  # an invalid id is a usage error
        if args.session not in sessions:  # a typo must not pass for "nothing to collect"
            raise UsageError(f"--session {args.session!r}: no such session under "
                             f"{', '.join(map(str, roots))} (sessions: "
                             f"{', '.join(repr(s) for s in sessions)})")
        sessions = [args.session]
    failed: list[str] = []  # the other sessions are still collected, and all reported
    for session in sessions:
        with contextlib.ExitStack() as locks:
            try:
                if not args.dry_run:
                    for root in roots:
                        if session_dir(root, session).is_dir():
                            locks.enter_context(SessionLock(session_dir(root, session),
                                                            exclusive=True))
            except SessionInUseError as exc:
                failed.append(str(exc))
                continue
            try:
                _collect(roots, session, policy, args.world_size, args.dry_run, removed,
                         args.partial)
            except (UsageError, CheckpointingError, OSError) as exc:
                failed.append(f"error: session {session!r}: {exc}")
    _report_gc(args, [str(p) for p in removed])
    for message in failed:
        print(f"localckpt gc: {message}", file=sys.stderr)
    return 2 if failed else 0


def _report_gc(args: argparse.Namespace, removed: list[str]) -> None:
    if args.json:
        print(json.dumps({"dry_run": args.dry_run, "removed": removed}))
    else:
        verb = "would remove" if args.dry_run else "removed"
        for p in removed:
            print(f"{verb} {p}")
        print(f"{len(removed)} entries {verb}")


def _collect(roots: list[Path], session: str, policy: KeepPolicy, world_size: int | None,
             dry_run: bool, removed: list[Path], partial: bool = False) -> None:
    """Adds to ``removed`` what gc removes in ``session`` of ``roots`` (removing it unless
    ``dry_run``), each entry as it goes: an error part way leaves the list true. A
    rollback's fence on one root hides the newer shards on every root (as the job does): they
    are neither counted nor removed (the job's next save finishes that rollback). With fewer
    node roots than the job has nodes, a fence elsewhere cannot be seen: only leftovers go,
    unless ``partial``."""
    shards = unfenced_shards(roots, session)
    worlds = sorted({s.world_size for refs in shards.values() for s in refs})
    # what a load takes of each iteration (one save of an iteration saved twice): its
    # metadata is what keep policies judge it by
    saves_of = {world: loaded_saves((s for refs in shards.values() for s in refs), world)
                for world in worlds}
    complete_of = {world: _complete(roots, session, shards, world, saves_of[world])
                   for world in worlds}
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
            meta = {it: m for it, (m, _) in saves_of[world].items()}
            keep = policy.keep(complete, unsure=seen - set(complete),
                               metrics={it: m["metrics"] for it, m in meta.items()
                                        if m.get("metrics") is not None},
                               times={it: m["saved_unix"] for it, m in meta.items()
                                      if isinstance(m.get("saved_unix"), (int, float))})
            doomed += [(root, s) for root, refs in shards.items() for s in refs
                       if s.world_size == world and s.iteration not in keep]
    short = None if partial or not doomed else _nodes_unseen(roots, session, shards)
    if short is not None:
        print(f"localckpt gc: session {session!r}: the roots of {short[0]} of the job's "
              f"{short[1]} nodes are given; a rollback begun on another node (its fence) cannot "
              "be seen from here, so no iteration is removed: give every node's root, or "
              "--partial to remove what this view's retention would", file=sys.stderr)
        doomed = []
    leftovers = [p for root in roots for p in (find_leftovers(session_dir(root, session))
                                               + find_quarantined(session_dir(root, session)))]
    # the order of the deletions, a dry run's too: each root's leftovers, then its shards
    doomed = [(root, ref) for root in roots for r, ref in doomed if r == root]
    if dry_run:
        removed += leftovers + [ref.path for _, ref in doomed]
        return
    stuck: list[Path] = []
    for root in roots:  # directories and files (a fence's temporary) alike
        mine = [p for p in leftovers if p.is_relative_to(session_dir(root, session))]
        remove_paths(session_dir(root, session), mine)
        for p in mine:  # remove_paths goes on past what it cannot delete
            (stuck if os.path.lexists(p) else removed).append(p)
    for root in roots:
        store = ShardStore(root, session, writer_rank=0, io_threads=1)
        try:
            for r, ref in doomed:
                if r == root:
                    # a durable tier's iteration stops being complete before any shard goes
                    commit_path(root, session, ref.iteration, ref.world_size).unlink(
                        missing_ok=True)
                    store.delete(ref)  # renamed out of sight first, then freed
                    removed.append(ref.path)
        finally:
            store.close()
    if stuck:
        raise OSError(f"{len(stuck)} leftovers could not be removed (permissions? a read-only "
                      f"file system?): {', '.join(map(str, stuck[:4]))}")


def _complete(roots: list[Path], session: str, shards: dict[Path, list[ShardRef]],
              world: int, saves: dict[int, tuple[Any, bool]]) -> list[int]:
    """The iterations of ``world`` complete across ``roots`` (held or rebuildable from parity
    blocks; with a durable tier, committed there too), newest first; ``saves``: loaded_saves."""
    listings = [frozenset((s.iteration, s.owner_rank, s.world_size) for s in refs)
                for refs in shards.values()]
    complete = sorted(set(complete_from_listings(listings, world)) | rebuildable_iterations(
        (s for refs in shards.values() for s in refs), world, read_manifest), reverse=True)
    # an iteration saved twice whose copies no one save covers: the job falls back past it
    complete = [it for it in complete if saves.get(it, (None, True))[1]]
    seen_its = {s.iteration for refs in shards.values() for s in refs if s.world_size == world}
    committed = committed_as_job(roots, session, seen_its, world)
    if committed is not None:  # a durable tier: complete only once committed as a job
        complete = [it for it in complete if it in committed]
    return complete


def _nodes_unseen(roots: list[Path], session: str,
                  shards: dict[Path, list[ShardRef]]) -> tuple[int, int] | None:
    """(node roots given, the job's node count) when those are fewer; None when they are not,
    or it cannot be told. The count is the newest iteration's, as any readable copy's manifest
    records it (the job as it runs now, after a resize). A durable tier's root holds every
    rank's shards and its own fence: one view of the whole job."""
    refs = sorted((ref for held in shards.values() for ref in held if ref.owner_rank >= 0),
                  key=lambda ref: ref.iteration, reverse=True)
    worlds = {ref.world_size for ref in refs}
    if any(committed_as_job(roots, session, {r.iteration for r in refs if r.world_size == w},
                            w) is not None for w in worlds):
        return None
    given = len(roots)  # an empty one counts: a wiped node's root holds no fence either
    for ref in refs:  # newest first, until a copy says
        with contextlib.suppress(UsageError, CheckpointingError):
            job = read_manifest(ref.path).identity.get("job")
            if isinstance(job, dict) and type(job.get("nodes")) is int:
                return (given, job["nodes"]) if job["nodes"] > given else None
    return None


def _held_by_a_job(path: Path) -> bool:
    """Whether a live manager holds the session directory ``path`` (it may hold nothing yet)."""
    try:
        SessionLock(path, exclusive=True).release()
    except SessionInUseError:
        return True
    except OSError:  # not a directory we may open: no job's
        return False
    return False
