"""An iteration number saved twice, its copies from both saves on disk (a run resumed from an
older iteration saved it again, and not every copy of the first save was replaced: a crash
mid-save, a copy restored by hand, a node that held a replica then). A state dict is never
built from two saves: when the newest save of that number has a copy of every rank's shard, it
is loaded and the copies of older saves are set aside; otherwise (the newest save is not whole,
whatever older save may be: it may have been discarded on purpose by a rollback) the iteration
cannot be loaded, and the manager leaves it out of what it lists until a save of that number is
finalized. Erasure-coded iterations are not resolved this way (their parity blocks belong to a
save too): they cannot be loaded, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..control.context import Context
from ..storage.layout import ShardRef, drop_other_markers, saves_marked

logger = logging.getLogger(__name__)


def newest_save(copies: Sequence[Sequence[Sequence[Any]]]) -> tuple[str | None, set[int]]:
    """The newest save each rank's ``[owner, save id, saved_unix]`` copies name (by rank 0's
    clock at the save, then by id) and the owners it has copies of (pure); (None, empty) when no
    copy names its save (written before save ids)."""
    owners: dict[str, set[int]] = {}
    when: dict[str, float] = {}
    for listed in copies:
        for owner, save, saved in listed:
            if save is not None:
                owners.setdefault(str(save), set()).add(int(owner))
                if isinstance(saved, (int, float)):
                    when[str(save)] = max(when.get(str(save), float("-inf")), float(saved))
    if not owners:
        return None, set()
    newest = max(owners, key=lambda s: (when.get(s, float("-inf")), s))
    return newest, owners[newest]


def covering_save(copies: Sequence[Sequence[Sequence[Any]]], world_size: int
                  ) -> tuple[str | None, str]:
    """The save to load, from each rank's ``[owner, save id, saved_unix]`` of the copies its
    node holds (pure): the newest save (:func:`newest_save`), when it has a copy of every
    owner's shard: (save id, ""); else (None, why). Copies written before save ids (None)
    count for no save."""
    newest, owners = newest_save(copies)
    if newest is None:
        return None, "no copy names its save"
    if owners >= set(range(world_size)):
        return newest, ""
    return None, (f"its newest save ({newest}) has copies of {len(owners)} of "
                  f"{world_size} ranks' shards")


def resolve_mixed(ctx: Context, iteration: int, world_size: int | None = None) -> str | None:
    """Collective. Every rank reports the save of each copy of ``iteration`` (saved by a job
    of ``world_size`` ranks, default this job's: a resharding load may name another) its node
    holds; when the newest save covers every old rank, every rank sets its node's copies of
    other saves aside (quarantine), removes other saves' markers from copies of that save (a
    copy restored by hand over another's) and None is returned (plan again). Else why the
    iteration cannot be loaded."""
    where = f"load of iteration {iteration}"
    world = ctx.world_size if world_size is None else world_size
    if ctx.erasure is not None and world == ctx.world_size:
        return "erasure-coded iterations saved twice are not resolved"
    held: list[tuple[ShardRef, Any]] = []
    unread: list[ShardRef] = []

    def mine() -> list[list[Any]]:  # inside the exchange: a rank's failure is every rank's
        for ref in ctx.store.committed():
            if ref.iteration == iteration and ref.world_size == world and ref.owner_rank >= 0:
                try:
                    held.append((ref, ctx.store.read_manifest(ref).metadata))
                except Exception as exc:  # left out: a copy that cannot be read is no vote
                    unread.append(ref)
                    logger.warning("rank %d: %s: %s left out: %s", ctx.rank, where, ref.path,
                                   exc)
        return [[ref.owner_rank, meta.get("save_id"), meta.get("saved_unix")]
                for ref, meta in held]

    reports = ctx.group.exchange(f"{where}: the saves of every copy", mine)
    chosen, why = covering_save(reports, world)
    if chosen is None:
        return why

    def set_aside() -> None:
        # A copy that cannot be read goes too when its marker names another save: left, it
        # would show two saves to every later load of the iteration.
        marked = [(ref, {"save_id": saves[0]}) for ref in unread
                  if (saves := saves_marked(ref.path)) and chosen not in saves]
        for ref, meta in held + marked:
            save = meta.get("save_id")
            if save == chosen:
                # the chosen save's copy, restored by hand over another save's: that save's
                # marker, left, would show two saves to every load of the iteration
                try:
                    if dropped := drop_other_markers(ref.path, chosen):
                        logger.warning("rank %d: %s: %s is a copy of save %s also marked as "
                                       "%s (restored over another copy?); those markers "
                                       "removed", ctx.rank, where, ref.path, chosen, dropped)
                except OSError as exc:
                    logger.warning("rank %d: %s: %s: a stray save marker cannot be removed: "
                                   "%s", ctx.rank, where, ref.path, exc)
            elif save is not None:
                moved = ctx.store.quarantine(ref)
                if moved is not None:
                    logger.warning("rank %d: %s: %s is a copy of an older save of that number "
                                   "(%s) than the one every rank's shard has a copy of (%s); "
                                   "set aside to %s", ctx.rank, where, ref.path, save, chosen,
                                   moved)

    # agreed: no rank lists again before every stale copy is out of sight
    ctx.group.exchange(f"{where}: copies of other saves set aside", set_aside)
    return None
