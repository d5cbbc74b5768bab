"""What ``localckpt ls`` and ``gc`` learn from parity blocks (erasure coding): an iteration whose
missing shards the parity blocks on the given roots can rebuild is complete, as it is to a job
(``find_latest`` would load it), so ``gc`` keeps it as it keeps any complete iteration. The
stripes are read from the blocks' own manifests: the CLI knows no topology."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

from replication import parity_of_slot

from ..storage.layout import ShardRef
from ..storage.manifest import ShardManifest


def rebuildable_iterations(refs: Iterable[ShardRef], world: int,
                           read: Callable[[Path], ShardManifest]) -> set[int]:
    """Iterations of ``world`` some of whose shards are missing from ``refs`` (every root's,
    together) and rebuildable: every missing owner is a member of a stripe that holds as many
    blocks (its members' shards and readable parity blocks of the same save as a held shard)
    as it has members. ``read`` parses a manifest; a block it cannot read counts as lost."""
    owners: dict[int, set[int]] = defaultdict(set)
    some_shard: dict[int, Path] = {}
    blocks: dict[int, dict[tuple[int, int], list[Path]]] = defaultdict(lambda: defaultdict(list))
    for ref in refs:
        if ref.world_size != world:
            continue
        if ref.owner_rank >= 0:
            owners[ref.iteration].add(ref.owner_rank)
            some_shard.setdefault(ref.iteration, ref.path)
        else:
            blocks[ref.iteration][parity_of_slot(ref.owner_rank)].append(ref.path)
    out = set()
    for it, held in owners.items():
        missing = set(range(world)) - held
        if not missing or it not in blocks:
            continue
        try:  # a parity block of another save of this iteration number rebuilds nothing
            save = read(some_shard[it]).metadata.get("save_id")
        except Exception:
            continue
        stripes: dict[int, tuple[tuple[int, ...], int]] = {}  # stripe -> (members, blocks)
        for (stripe, _), paths in blocks[it].items():
            for path in paths:  # one readable copy of the block is enough
                try:
                    block = read(path)
                except Exception:
                    continue
                info = block.parity
                if info is not None and block.metadata.get("save_id") == save:
                    members = stripes.get(stripe, (info.members, 0))[0]
                    stripes[stripe] = (members, stripes.get(stripe, ((), 0))[1] + 1)
                    break
        covered = {r for members, _ in stripes.values() for r in members}
        if missing <= covered and all(
                sum(r in held for r in members) + n >= len(members)
                for members, n in stripes.values() if set(members) & missing):
            out.add(it)
    return out
