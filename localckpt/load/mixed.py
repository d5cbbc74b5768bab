"""An iteration number saved twice, its copies from both saves on disk (a run resumed from an
older iteration saved it again, and not every copy of the first save was replaced: a crash
mid-save, a copy restored by hand, a node that held a replica then). A state dict is never
built from two saves: the save whose copies cover every rank is loaded and the other copies
are set aside; with no such save (or two) the iteration cannot be loaded, and the manager
leaves it out of what it lists until a save of that number replaces it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..control.context import Context
from ..errors import CorruptShardError

logger = logging.getLogger(__name__)


def covering_save(copies: Sequence[Sequence[Sequence[Any]]], world_size: int
                  ) -> tuple[str | None, str]:
    """The save whose copies hold every owner's shard, from each rank's ``[owner, save id]``
    of the copies its node holds (pure). (save id, "") when exactly one save covers every
    owner; else (None, why). Copies written before save ids (None) count for no save."""
    owners: dict[str, set[int]] = {}
    for listed in copies:
        for owner, save in listed:
            if save is not None:
                owners.setdefault(str(save), set()).add(int(owner))
    full = sorted(s for s, held in owners.items() if held >= set(range(world_size)))
    if len(full) == 1:
        return full[0], ""
    seen = "; ".join(f"save {s} has shards of {len(held)} of {world_size} ranks"
                     for s, held in sorted(owners.items()))
    if not full:
        return None, f"no save of it has a copy of every rank's shard ({seen})"
    return None, f"two saves of it are complete ({seen}): which one is meant is not known"


def resolve_mixed(ctx: Context, iteration: int) -> str | None:
    """Collective. Every rank reports the save of each copy of ``iteration`` its node holds;
    when one save covers every rank, every rank sets its node's copies of other saves aside
    (quarantine) and None is returned (plan again). Else why the iteration cannot be loaded."""
    where = f"load of iteration {iteration}"

    def mine() -> list[tuple[Any, str | None]]:
        out = []
        for ref in ctx.store.committed():
            if ref.iteration == iteration and ref.world_size == ctx.world_size \
                    and ref.owner_rank >= 0:
                try:
                    out.append((ref, ctx.store.read_manifest(ref).metadata.get("save_id")))
                except CorruptShardError:
                    continue  # a damaged copy is the normal path's to quarantine
        return out

    held = mine()
    reports = ctx.group.exchange(f"{where}: the saves of every copy",
                                 lambda: [[ref.owner_rank, save] for ref, save in held])
    chosen, why = covering_save(reports, ctx.world_size)
    if chosen is None:
        return why

    def set_aside() -> None:
        for ref, save in held:
            if save is not None and save != chosen:
                moved = ctx.store.quarantine(ref)
                if moved is not None:
                    logger.warning("rank %d: %s: %s is a copy of another save of that number "
                                   "(%s) than the one every rank's shard has a copy of (%s); "
                                   "set aside to %s", ctx.rank, where, ref.path, save, chosen,
                                   moved)

    # agreed: no rank lists again before every stale copy is out of sight
    ctx.group.exchange(f"{where}: copies of other saves set aside", set_aside)
    return None
