"""Resharding plan: which byte boxes of an old job's DTensor shards each rank of a job of another
world size (or mesh) needs, and from whom. Pure: every rank computes the same plan from the same
gathered input (old shards' layouts, new ranks' wants), no processes needed to test it.

A DTensor shard is a box of its global tensor: an offset and a shape per dim (as torch computes
them for Shard, _StridedShard and Replicate placements). A new rank's shard is assembled from the
intersections of its box with the old shards' boxes; a box that repeats (Replicate placements:
several old ranks hold the same one) is sent once to each destination, from the destination's
own copy when it serves one, else from the holder whose server sends the least so far. Only the
intersections move: no rank ever holds a whole tensor.

Plain (non-DTensor) state is per rank and cannot be split: new rank ``r`` takes that of old rank
``r % old_world`` (see :func:`plain_owner`), its whole non-DTensor part.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import ConfigurationError, IncompleteCheckpointError

Shape = tuple[int, ...]


@dataclass(frozen=True)
class OldShard:
    """One old owner's shard of one DTensor leaf: entry ``entry`` of its manifest."""

    owner: int
    entry: int
    global_shape: Shape
    dtype: str
    offset: Shape
    shape: Shape


@dataclass(frozen=True)
class Want:
    """The shard a new rank holds of a DTensor leaf, as its ``load(into=...)`` laid it out."""

    global_shape: Shape
    dtype: str
    offset: Shape
    shape: Shape


@dataclass(frozen=True)
class Piece:
    """Box ``src_start``/``size`` of old owner ``owner``'s local shard (entry ``entry``) goes
    to box ``dst_start``/``size`` of new rank ``dst``'s local shard of ``path``; ``src`` is the
    rank that reads the old shard and sends it."""

    src: int
    dst: int
    owner: int
    entry: int
    path: str
    src_start: Shape
    dst_start: Shape
    size: Shape


def choose_servers(holders: Mapping[int, Sequence[int]], old_world: int) -> dict[int, int]:
    """Old owner -> the new rank that reads its shard and sends from it: among the ranks
    holding it, the one serving the fewest so far (the old owner's own rank number first), so
    the reads spread over the job instead of landing on the lowest rank.
    IncompleteCheckpointError naming the owners no rank holds."""
    missing = [o for o in range(old_world) if not holders.get(o)]
    if missing:
        raise IncompleteCheckpointError(f"no rank of this job holds the shards of old owners "
                                        f"{missing[:8]}: the iteration is no longer complete")
    load: dict[int, int] = {}
    servers = {}
    for o in range(old_world):
        server = min(holders[o], key=lambda r: (load.get(r, 0), r != o, r))
        servers[o] = server
        load[server] = load.get(server, 0) + 1
    return servers


def plain_owner(rank: int, old_world: int) -> int:
    """The old rank whose non-DTensor state (RNG, data position, plain tensors) new ``rank``
    takes: the same rank when it existed, else ``rank % old_world``."""
    return rank % old_world


def _intersect(a_off: Shape, a_shape: Shape, b_off: Shape, b_shape: Shape
               ) -> tuple[Shape, Shape] | None:
    start = tuple(max(x, y) for x, y in zip(a_off, b_off, strict=True))
    end = tuple(min(x + m, y + n) for x, m, y, n in zip(a_off, a_shape, b_off, b_shape,
                                                         strict=True))
    size = tuple(e - s for s, e in zip(start, end, strict=True))
    if any(n <= 0 for n in size):
        return None
    return start, size


def plan_reshard(old: Mapping[str, Sequence[OldShard]], servers: Mapping[int, int],
                 wants: Sequence[Mapping[str, Want]]) -> list[Piece]:
    """The pieces every new rank needs, in a fixed order (by destination, then path, then old
    owner). ``old``: per leaf path, every old owner's shard; ``servers``: old owner -> the new
    rank that reads its shard; ``wants[r]``: new rank r's shards by path.

    ConfigurationError naming the leaves that cannot be assembled: a path the old job did not
    save as a DTensor, another global shape or dtype, or old boxes that do not cover a new one
    exactly once (a layout whose shards are not boxes)."""
    pieces: list[Piece] = []
    problems: list[str] = []
    served: dict[int, int] = {}  # elements each server sends so far
    for dst, mine in enumerate(wants):
        for path in sorted(mine):
            want = mine[path]
            shards = old.get(path)
            if not shards:
                problems.append(f"{path!r}: `into` has a DTensor there, the checkpoint has none")
                continue
            first = shards[0]
            if (first.global_shape, first.dtype) != (want.global_shape, want.dtype):
                problems.append(f"{path!r}: saved as {first.dtype} of global shape "
                                f"{list(first.global_shape)}, `into` has {want.dtype} of "
                                f"{list(want.global_shape)}")
                continue
            copies: dict[tuple[Shape, Shape], list[OldShard]] = {}
            for s in sorted(shards, key=lambda s: s.owner):
                copies.setdefault((s.offset, s.shape), []).append(s)
            covered = 0
            boxes: list[tuple[Shape, Shape]] = []
            for held in copies.values():
                hit = _intersect(held[0].offset, held[0].shape, want.offset, want.shape)
                if hit is None:
                    continue
                # a box several old ranks hold (Replicate): the destination's own copy when it
                # serves one (nothing crosses the wire), else the least busy server's
                s = min(held, key=lambda s: (servers[s.owner] != dst,
                                             served.get(servers[s.owner], 0), s.owner))
                start, size = hit
                boxes.append(hit)
                covered += math.prod(size)
                served[servers[s.owner]] = served.get(servers[s.owner], 0) + math.prod(size)
                pieces.append(Piece(
                    servers[s.owner], dst, s.owner, s.entry, path,
                    tuple(a - o for a, o in zip(start, s.offset, strict=True)),
                    tuple(a - o for a, o in zip(start, want.offset, strict=True)), size))
            overlap = any(_intersect(*a, *b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
            if covered != math.prod(want.shape) or overlap:
                problems.append(f"{path!r}: the old shards cover {covered} of the "
                                f"{math.prod(want.shape)} elements of rank {dst}'s new shard"
                                f"{' more than once' if overlap else ''}")
    if problems:
        shown = "; ".join(problems[:3])
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ConfigurationError(f"cannot reshard onto this job's layout: {shown}{more}")
    return pieces
