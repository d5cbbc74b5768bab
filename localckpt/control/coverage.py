"""Global decisions as pure functions over the inventories every rank gathered.

No I/O and no processes: these are unit-tested with thousands of simulated ranks. Every rank runs
them on the same gathered input and so reaches the same answer without further communication.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from replication import StripeLayout, parity_of_slot
from replication.erasure import rebuildable

from ..errors import ConfigurationError, InsufficientSpaceError, InvalidIterationError
from ..storage.layout import MAX_ITERATION
from ..storage.rollback_fence import Done, Fence, fence_of, hidden, merged, unfinished
from .retention import KeepPolicy

ShardKey = tuple[int, int, int]  # (iteration, owner rank, world size)


@dataclass(frozen=True)
class Inventory:
    """What one rank can read from its node-local root: committed shards of its session."""

    rank: int
    session_id: str
    shards: frozenset[ShardKey]
    # the fence of a rollback not finished on this rank's root (storage/rollback_fence.py);
    # it hides the shards it names on every rank's root, but those of a root that finished
    # the rollback: ``done``, the rollbacks this rank's root finished (id, N, W)
    fence: Fence | None = None
    done: frozenset[Done] = frozenset()

    def to_json(self) -> dict[str, Any]:
        """``{"session", "shards": [[iteration, world size, [[first owner, last owner + 1],
        ...]], ...]}``: owners as runs, so its size grows with the iterations held, not with
        the shards (a node holds its ranks' shards and their neighbours' replicas: a few runs).
        The rank is left out: the ranks of a node send the same bytes, which a node-leader
        exchange then carries once; it is the document's place in the gathered list."""
        by_key: dict[tuple[int, int], list[int]] = defaultdict(list)
        for it, owner, world in self.shards:
            by_key[(it, world)].append(owner)
        listing = [[it, world, owner_runs(owners)]
                   for (it, world), owners in sorted(by_key.items())]
        doc: dict[str, Any] = {"session": self.session_id, "shards": listing}
        if self.fence is not None:
            doc["fence"] = [list(e) for e in self.fence]
        if self.done:
            doc["done"] = [list(d) for d in sorted(self.done)]
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any], rank: int) -> Inventory:
        """The inventory ``rank`` sent as ``doc``. The documents come from localckpt on the
        peers (to_json), so entries are not converted one by one (that halves decoding at 16k
        ranks)."""
        shards = frozenset((it, o, w) for it, w, runs in doc["shards"] for a, b in runs
                           for o in range(a, b))
        return cls(rank, str(doc["session"]), shards, _fence_of(doc), _done_of(doc))


def owner_runs(owners: Iterable[int]) -> list[list[int]]:
    """``owners`` as sorted runs ``[first, last + 1]`` (:func:`owners_in` reads them)."""
    runs: list[list[int]] = []
    for owner in sorted(set(owners)):
        if runs and runs[-1][1] == owner:
            runs[-1][1] = owner + 1
        else:
            runs.append([owner, owner + 1])
    return runs


def owners_in(runs: Iterable[Sequence[int]]) -> Iterator[int]:
    """The owners of :func:`owner_runs`' runs."""
    return (owner for first, end in runs for owner in range(first, end))


def _fence_of(doc: dict[str, Any]) -> Fence | None:
    fence = doc.get("fence")
    return None if fence is None else fence_of(fence)


def _done_of(doc: dict[str, Any]) -> frozenset[Done]:
    return frozenset((str(i), int(n), None if w is None else int(w))
                     for i, n, w in doc.get("done") or ())


def decode_inventories(docs: Sequence[dict[str, Any]]) -> list[Inventory]:
    """:meth:`Inventory.from_json` of every gathered document, in rank order. Ranks of one node
    share a root and nearly always list the same shards: a listing equal to the previous
    distinct one shares its decoded set (comparing lists is far cheaper than building the set,
    and free when the exchange delivered one object for the node; at 16k ranks with 8 per node
    that is 8x less decoding and memory)."""
    out: list[Inventory] = []
    last_listing: Any = None
    shards: frozenset[ShardKey] = frozenset()
    for rank, doc in enumerate(docs):
        if doc["shards"] is not last_listing and doc["shards"] != last_listing:
            last_listing = doc["shards"]
            shards = Inventory.from_json(doc, rank).shards
        out.append(Inventory(rank, str(doc["session"]), shards, _fence_of(doc), _done_of(doc)))
    return apply_fence(out)


def job_fence(inventories: Sequence[Inventory]) -> Fence | None:
    """The fence of every rank's root together (see rollback_fence.merged), or None."""
    fence: Fence | None = None
    for inv in inventories:
        if inv.fence is not None:
            fence = merged(fence, inv.fence)
    return fence


def job_done(inventories: Sequence[Inventory]) -> frozenset[Done]:
    """The rollbacks some rank's root finished."""
    return frozenset().union(*(inv.done for inv in inventories))


def job_unfinished(inventories: Sequence[Inventory]) -> Fence | None:
    """What of the job's fence no root finished (what still hides the durable tier's newer
    iterations: a rollback finished on some root has discarded them), or None."""
    return unfinished(job_fence(inventories), job_done(inventories))


def apply_fence(inventories: list[Inventory]) -> list[Inventory]:
    """``inventories`` without the shards the fence of any rank's root hides: a rollback that
    reached one root (its fence written) is not undone by another root that never got it, or
    got past it. A root that finished a rollback shows what it holds above its iteration
    (saved after it: a node away during the rollback, back with its fence, hides none of
    it). Shared shard sets stay shared."""
    fence = job_fence(inventories)
    if fence is None:
        return inventories
    kept: dict[tuple[int, frozenset[Done]], frozenset[ShardKey]] = {}
    out = []
    for inv in inventories:
        key = (id(inv.shards), inv.done)
        shards = kept.get(key)
        if shards is None:
            left = unfinished(fence, inv.done)
            shards = kept[key] = frozenset(
                s for s in inv.shards if not hidden(left, s[0], s[2]))
        out.append(Inventory(inv.rank, inv.session_id, shards, inv.fence, inv.done))
    return out


def _distinct_listings(inventories: Sequence[Inventory]
                       ) -> list[tuple[frozenset[ShardKey], list[int]]]:
    """Each distinct shard set (by identity, see :func:`decode_inventories`) with its ranks."""
    by_id: dict[int, tuple[frozenset[ShardKey], list[int]]] = {}
    for inv in inventories:
        by_id.setdefault(id(inv.shards), (inv.shards, []))[1].append(inv.rank)
    return list(by_id.values())


def check_sessions(inventories: Sequence[Inventory]) -> None:
    """All ranks must use the same session id; ConfigurationError names the odd ones."""
    sessions = {inv.session_id for inv in inventories}
    if len(sessions) > 1:
        by = {inv.rank: inv.session_id for inv in inventories}
        raise ConfigurationError(f"every rank must use the same session_id, got {by}")


def complete_from_listings(listings: Iterable[frozenset[ShardKey]], world_size: int,
                           layout: StripeLayout | None = None) -> list[int]:
    """Iterations, newest first, for which the ``listings`` (shard sets of node roots, or of
    ranks) together hold the shard of every owner rank of a ``world_size`` job, or, with an
    erasure ``layout`` (of this world size), hold it or blocks enough of its stripe to rebuild
    it. Shards of other world sizes never count."""
    owners: dict[int, set[int]] = defaultdict(set)
    parity: dict[int, set[tuple[int, int]]] = defaultdict(set)
    for shards in listings:
        for it, owner, world in shards:
            if world == world_size and 0 <= owner < world_size:
                owners[it].add(owner)
            elif world == world_size and owner < 0 and layout is not None:
                parity[it].add(parity_of_slot(owner))
    return sorted((it for it, o in owners.items() if len(o) == world_size or (
        layout is not None and rebuildable(layout, o, parity[it]))), reverse=True)


def complete_iterations(inventories: Sequence[Inventory], world_size: int,
                        layout: StripeLayout | None = None) -> list[int]:
    """Iterations, newest first, that every rank of a ``world_size`` job can load: every owner's
    shard is held by some rank (a rank reads its own from its node's root or receives it from a
    holder; with no replication that holder is normally the owner's node, or wherever the owner
    ran before the ranks moved between nodes), or with an erasure ``layout`` can be rebuilt."""
    if len(inventories) != world_size:
        raise ValueError(f"expected {world_size} inventories, got {len(inventories)}")
    return complete_from_listings((s for s, _ in _distinct_listings(inventories)), world_size,
                                  layout)


def why_incomplete(inventories: Sequence[Inventory], world_size: int,
                   layout: StripeLayout | None = None) -> str:
    """For an error saying nothing is complete: what the newest iteration of this world size
    any rank holds a shard of lacks (and, with an erasure ``layout``, which stripes hold fewer
    blocks than they need); "" when no rank holds any. The same on every rank."""
    held: dict[int, set[int]] = defaultdict(set)
    for shards, _ in _distinct_listings(inventories):
        for it, owner, world in shards:
            if world == world_size:
                held[it].add(owner)
    if not held:
        return ""
    newest = max(held)
    missing = sorted(set(range(world_size)) - held[newest])
    shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
    why = (f"the newest iteration on disk, {newest}, has no copy of the shard"
           f"{'s of ranks' if len(missing) > 1 else ' of rank'} {shown}")
    for s, stripe in enumerate(layout.stripes if layout is not None else ()):
        blocks = len(set(stripe.members) & held[newest]) + sum(
            1 for slot in held[newest] if slot < 0 and parity_of_slot(slot)[0] == s)
        if blocks < len(stripe.members):
            why += (f"; stripe {s} (ranks {list(stripe.members)}) holds {blocks} of its blocks, "
                    f"{len(stripe.members)} needed to rebuild")
    return why


def choose_latest(inventories: Sequence[Inventory], world_size: int,
                  layout: StripeLayout | None = None) -> int:
    """The newest iteration every rank can load (see :func:`complete_iterations`), or -1 when
    there is none."""
    check_sessions(inventories)
    complete = complete_iterations(inventories, world_size, layout)
    return complete[0] if complete else -1


def holders_of(inventories: Sequence[Inventory], iteration: int, world_size: int
               ) -> dict[int, list[int]]:
    """Owner (or parity slot) -> the ranks whose root holds that shard of ``iteration``."""
    holders: dict[int, list[int]] = defaultdict(list)
    for shards, ranks in _distinct_listings(inventories):
        for it, owner, world in shards:
            if it == iteration and world == world_size:
                holders[owner] += ranks
    return {owner: sorted(ranks) for owner, ranks in holders.items()}


def choose_latest_any_world(inventories: Sequence[Inventory], world_size: int,
                            layout: StripeLayout | None = None) -> tuple[int, int]:
    """The newest iteration the job can load, saved by a job of any world size (loading one of
    another world size reshards it), and that world size; (-1, world_size) when there is none.
    An iteration complete at this world size wins a tie."""
    check_sessions(inventories)
    listings = [s for s, _ in _distinct_listings(inventories)]
    worlds = {w for shards in listings for _, _, w in shards if w >= 1}
    best = (-1, True, world_size)
    for w in worlds:
        complete = complete_from_listings(listings, w, layout if w == world_size else None)
        if complete:
            best = max(best, (complete[0], w == world_size, w))
    return best[0], best[2]


def other_world_shards(inventories: Sequence[Inventory], world_size: int) -> dict[int, list[int]]:
    """World size -> iterations of shards on disk written by jobs of another world size: they
    cannot be loaded by this job (find_latest reports them) and are never deleted by its
    retention (unless it reshards: see :func:`shards_to_delete`); ``localckpt gc
    --world-size`` removes them."""
    found: dict[int, set[int]] = defaultdict(set)
    for shards, _ in _distinct_listings(inventories):
        for it, _, world in shards:
            if world != world_size:
                found[world].add(it)
    return {w: sorted(its) for w, its in sorted(found.items())}


def validate_save(iterations: Sequence[Any], inventories: Sequence[Inventory],
                  world_size: int, any_world: bool = False,
                  layout: StripeLayout | None = None) -> int:
    """Check a save request gathered from every rank; return the iteration to save.

    Raises InvalidIterationError (not an int, negative, too wide for the directory name,
    different across ranks, not newer than the latest complete checkpoint of this world size,
    or with ``any_world`` of any world size: a job that reshards would otherwise load that one
    instead of this), or ConfigurationError (different session ids). Otherwise shards of other
    world sizes never block it.
    """
    check_sessions(inventories)
    distinct = sorted({repr(i) for i in iterations})
    if len(distinct) > 1:
        by = {r: it for r, it in enumerate(iterations)}
        raise InvalidIterationError(f"every rank must save the same iteration, got {by}")
    iteration = iterations[0]
    if type(iteration) is not int:  # a rank sends what it was given as its type and repr
        shown = f"{iteration['type']} {iteration['repr']}" if isinstance(iteration, dict) \
            else f"{type(iteration).__name__} {iteration!r}"
        raise InvalidIterationError(f"iteration: expected a non-negative int, got {shown}")
    if iteration < 0:
        raise InvalidIterationError(f"iteration: expected a non-negative int, got {iteration}")
    if iteration > MAX_ITERATION:
        raise InvalidIterationError(
            f"iteration: expected at most {MAX_ITERATION} (10 digits in the directory name), "
            f"got {iteration}; nothing was written")
    latest = choose_latest_any_world(inventories, world_size, layout)[0] if any_world \
        else choose_latest(inventories, world_size, layout)
    if iteration <= latest:
        raise InvalidIterationError(
            f"iteration: expected a value newer than the latest committed checkpoint {latest}, got "
            f"{iteration}; nothing was written and checkpoint {latest} is untouched"
        )
    return iteration


def retained_iterations(inventories: Sequence[Inventory], world_size: int,
                        policy: KeepPolicy, metadata: dict[int, Any] | None = None,
                        layout: StripeLayout | None = None) -> set[int]:
    """The complete iterations ``policy`` keeps (``metadata``: by iteration, its manifest's
    ``metadata``: metrics and save time): every other shard of this world size in a root may
    be deleted."""
    metadata = metadata or {}
    metrics = {it: m["metrics"] for it, m in metadata.items() if m.get("metrics") is not None}
    times = {it: float(m["saved_unix"]) for it, m in metadata.items()
             if isinstance(m.get("saved_unix"), (int, float))}
    return policy.keep(complete_iterations(inventories, world_size, layout), metrics=metrics,
                       times=times)


def merge_metadata(docs: Sequence[Any]) -> dict[int, Any]:
    """Every rank's ``"metadata"`` report (iteration -> its manifest's metadata, from the
    shards it holds) merged, the lowest rank's first: the same on every rank, whatever each
    one holds."""
    out: dict[int, Any] = {}
    for doc in docs:
        if isinstance(doc, dict) and isinstance(doc.get("metadata"), dict):
            for it, values in doc["metadata"].items():
                if isinstance(values, dict):
                    out.setdefault(int(it), values)
    return out


def lineage_keeps(inventories: Sequence[Inventory], world_size: int,
                  policy: KeepPolicy) -> set[int] | None:
    """The iterations of every world size a resharding job's retention keeps, the job's own
    lineage taken together: the newest ``policy.last`` complete iterations of any world size,
    and the multiples of ``policy.every``. None (keep every other world size's shard) when the
    policy also ranks by metrics, a predicate or time, which only this world size's shards
    report."""
    if policy.best is not None or policy.predicate is not None or policy.interval is not None:
        return None
    listings = [shards for shards, _ in _distinct_listings(inventories)]
    worlds = {key[2] for shards in listings for key in shards}
    return policy.keep({it for w in worlds for it in complete_from_listings(listings, w)})


def shards_to_delete(mine: Inventory, keep: Iterable[int], world_size: int,
                     lineage: set[int] | None = None) -> list[ShardKey]:
    """Every shard of ``world_size`` in this rank's root outside ``keep``: incomplete or beyond
    retention. Shards of other world sizes are left alone (see :func:`other_world_shards`),
    unless ``lineage`` (a job that reshards: :func:`lineage_keeps`) is given: then those older
    than every kept iteration of this world size and outside ``lineage`` go too.

    Ranks of a node share the root and may delete the same shard; deletion is a rename that only
    one of them wins, so that race is harmless and no rank needs to own the cleanup."""
    keep = set(keep)
    floor = min(keep) if lineage is not None and keep else -1
    spared = (lineage or set()) | keep
    return sorted(k for k in mine.shards if (k[2] == world_size and k[0] not in keep)
                  or (k[2] != world_size and k[0] < floor and k[0] not in spared))


def check_capacity(needed: Sequence[int], free: Sequence[int], node_of: Sequence[int]) -> None:
    """Raise InsufficientSpaceError if some node's free space (as its ranks report it) is below
    what all its ranks will write there: own shards plus the replicas they receive."""
    per_node: dict[int, int] = defaultdict(int)
    node_free: dict[int, int] = {}
    ranks: dict[int, list[int]] = defaultdict(list)
    for rank, (need, avail) in enumerate(zip(needed, free, strict=True)):
        node = node_of[rank]
        per_node[node] += need
        node_free[node] = min(node_free.get(node, avail), avail)
        ranks[node].append(rank)
    short = [(n, per_node[n], node_free[n]) for n in sorted(per_node)
             if per_node[n] > node_free[n]]
    if short:
        node, need, avail = short[0]
        raise InsufficientSpaceError(
            f"the checkpoint root of node {node} (ranks {ranks[node]}) has {avail / 2**20:.1f} MiB "
            f"free, this save writes {need / 2**20:.1f} MiB there (own shards and replicas). "
            "Enlarge the file system (for /dev/shm in Docker: `docker run --shm-size=<size>`; for "
            "a tmpfs: `mount -o remount,size=<size>`), lower keep_last, or choose another root."
            + (f" {len(short) - 1} more node(s) are short too." if len(short) > 1 else ""))
