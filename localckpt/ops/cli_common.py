"""What the ``localckpt`` command's subcommands share: the usage error, reading a root's
sessions and a shard's manifest as a load does, and telling an object-storage root."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..errors import CheckpointingError
from ..load.mixed import newest_save
from ..storage.durable import PROGRESS_DIR, commit_path
from ..storage.durable_object import is_object_url
from ..storage.layout import (
    ShardRef,
    iteration_dir,
    list_sessions,
    list_shards,
    saves_marked,
    session_dir,
)
from ..storage.manifest import ShardManifest
from ..storage.rollback_fence import (
    DONE_NAME,
    FENCE_NAME,
    hidden,
    merged,
    read_done,
    read_fence,
    unfinished,
)
from ..storage.shard_reader import parse_manifest_file


class UsageError(Exception):
    """Bad input: printed as one line, exit status 2."""


def sessions_under(root: Path) -> list[str]:
    if not root.is_dir():
        raise UsageError(f"{root}: not a directory")
    return list_sessions(root)


def read_manifest(shard: Path) -> ShardManifest:
    """The shard's manifest, read and verified as a load reads it; raises UsageError for a
    missing or unreadable file, CorruptShardError for anything else wrong with it."""
    path = shard / "zarr.json"
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{shard}: not a localckpt shard (no readable zarr.json: {exc})") from exc
    return parse_manifest_file(data, str(path))


def loaded_saves(refs: Iterable[ShardRef], world: int
                 ) -> dict[int, tuple[dict[str, Any], bool]]:
    """Iteration of ``world`` -> (the manifest metadata of the save a load takes, whether one
    save covers every rank), as a load decides (:func:`newest_save`) from the copies of
    ``refs`` it can read. Copies of one save: the first readable one's metadata (rank 0's, in
    every shard), True, but False where a copy is marked as another save too (restored by
    hand over another save's copy: a load that cannot remove that marker gives the iteration
    up, so until one has, it is not counted). Copies of several (an iteration saved twice):
    the newest save's, and whether it has a copy of every rank's shard (with some nodes' roots
    only, a save that does not cover the view may still cover the job). A copy that cannot be
    read has no say; parity blocks count only where no copy of a rank's shard is readable."""
    copies: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    stray: set[int] = set()
    for ref in refs:
        if ref.world_size == world:
            with contextlib.suppress(UsageError, CheckpointingError):
                metadata = read_manifest(ref.path).metadata
                copies.setdefault(ref.iteration, []).append((ref.owner_rank, metadata))
                if ref.owner_rank >= 0 and set(saves_marked(ref.path)) - {
                        metadata.get("save_id")}:
                    stray.add(ref.iteration)
    out: dict[int, tuple[dict[str, Any], bool]] = {}
    for it, held in copies.items():
        held = [c for c in held if c[0] >= 0] or held
        saves = {m.get("save_id") for _, m in held} - {None}
        if len(saves) <= 1:
            out[it] = (held[0][1], it not in stray)
            continue
        save, owners = newest_save([[[o, m.get("save_id"), m.get("saved_unix")]
                                     for o, m in held]])
        out[it] = (next(m for _, m in held if str(m.get("save_id")) == save),
                   owners >= set(range(world)) and it not in stray)
    return out


def object_root(roots: Sequence[str]) -> str | None:
    """The ``s3://`` URL among ``roots`` (then the only root), else None."""
    urls = [r for r in roots if is_object_url(r)]
    if urls and len(roots) > 1:
        raise UsageError(f"an object-storage root is given alone: got {list(roots)}")
    return urls[0] if urls else None


def committed_as_job(roots: Sequence[Path], session: str, iterations: set[int],
               world: int) -> set[int] | None:
    """Of ``iterations``, those some root commits as a job (a durable tier's commit file);
    None when no root has such a file for ``world`` (node roots)."""
    found = {it for it in iterations for r in roots
             if commit_path(r, session, it, world).is_file()}
    return found if found or any(
        any(iteration_dir(r, session, it).glob("COMMITTED-*")) for r in roots
        for it in iterations) else None


def unfenced_shards(roots: Sequence[Path], session: str) -> dict[Path, list[ShardRef]]:
    """Each root's committed shards of ``session`` but those a rollback's fence on any of the
    roots hides (the job hides them on every root, but on one that finished that rollback, and
    on a durable tier once any root finished it). CorruptShardError naming the file when a
    fence or a record of finished rollbacks cannot be read (every job call fails then too)."""
    fence = None
    for root in roots:
        if (held := read_fence(session_dir(root, session))) is not None:
            fence = merged(fence, held)
    # read with or without a fence, as the job reads them: a malformed one fails every call
    done = {root: read_done(session_dir(root, session)) for root in roots}
    anywhere = frozenset().union(*done.values())
    out = {}
    for root in roots:  # a root that finished a rollback shows what it saved after it
        # a durable tier keeps no record: the job hides its iterations until any node's root
        # finished the rollback (coverage.job_unfinished)
        left = unfinished(fence, anywhere if _is_durable(root, session) else done[root]) \
            if fence else None
        out[root] = [s for s in list_shards(root, session, fenced=False)
                     if not hidden(left, s.iteration, s.world_size)]
    return out


def _is_durable(root: Path, session: str) -> bool:
    """Whether ``root`` is a durable tier's directory for ``session`` (a job's commit file of
    an iteration, or the ranks' progress records) and no node's: only a node's store writes
    a rollback's fence or record (a copied or reused directory may hold both kinds)."""
    path = session_dir(root, session)
    if (path / FENCE_NAME).exists() or (path / DONE_NAME).exists():
        return False
    return (path / PROGRESS_DIR).is_dir() or any(path.glob("iter_*/COMMITTED-*"))
