"""Who sends which block to whom for erasure-coded stripes. Pure: every rank computes the same
plans from the same layout and listings.

A block is named like a shard: ``(iteration, slot)``, the slot being the member's rank for its
shard and :func:`replication.erasure.parity_slot` for a parity block. ``holders[slot]``: the
ranks whose node holds that block of the iteration (ranks of a node share its root).

- :func:`parity_save_plan`: every member streams its new shard to each parity holder of its
  stripe, which folds it into the block it keeps;
- :func:`rebuild_plan`: the owner of a lost shard receives as many blocks of its stripe as the
  stripe has members, and folds each in with its weight (:func:`replication.parity.
  rebuild_weights`);
- :func:`parity_repair_plan`: a parity block lost with its node is folded again, on the rank
  the layout names, from the members' shards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .erasure import StripeLayout, parity_slot
from .parity import rebuild_weights
from .plans import ExchangePlan, Transfer, schedule

Holders = Mapping[int, Sequence[int]]


def parity_save_plan(layout: StripeLayout, iteration: int) -> ExchangePlan:
    """Every member sends its shard to every parity holder of its stripe."""
    return schedule(Transfer(member, holder, iteration, member)
                    for stripe in layout.stripes for member in stripe.members
                    for holder in stripe.parity)


@dataclass(frozen=True)
class Rebuild:
    """``owner`` (member ``index`` of stripe ``stripe``) rebuilds its shard from ``sources``:
    (slot, serving rank, weight) each, the shard being the XOR of ``weight * block``. A source
    served by ``owner`` itself is read from its own node's root (ranks moved between nodes)."""

    stripe: int
    owner: int
    index: int
    sources: tuple[tuple[int, int, int], ...]


def lost_members(layout: StripeLayout, holders: Holders) -> list[int]:
    """Members no node holds the shard of, in rank order."""
    return sorted(r for stripe in layout.stripes for r in stripe.members if not holders.get(r))


def rebuild_plan(layout: StripeLayout, iteration: int, holders: Holders
                 ) -> tuple[tuple[Rebuild, ...], ExchangePlan] | None:
    """The rebuild of every lost member and its transfers (local reads left out); None when
    some lost member cannot be rebuilt (fewer blocks of its stripe held than it has members).
    Sources: the stripe's held members first (no multiplication for m = 1), then its parity
    blocks. A member's shard is served by the member itself when its node holds it (that copy
    is the one the member loads: a copy elsewhere may be another save's); otherwise, and for
    parity, by the holder with the fewest blocks to send so far (ties: the lowest rank) other
    than the owner, or by the owner itself when only its node holds it."""
    k, m = layout.k, layout.m
    load: dict[int, int] = {}
    rebuilds: list[Rebuild] = []
    for owner in lost_members(layout, holders):
        s = layout.stripe_of(owner)
        stripe = layout.stripes[s]
        candidates = [(b, r) for b, r in enumerate(stripe.members)]
        candidates += [(k + j, parity_slot(s, j)) for j in range(len(stripe.parity))]
        chosen: list[tuple[int, int, int]] = []  # (block number, slot, serving rank)
        for block, slot in candidates:
            serving = [h for h in holders.get(slot, ()) if h != owner] or \
                [h for h in holders.get(slot, ()) if h == owner]
            if slot in serving:  # a member serves its own shard
                serving = [slot]
            if serving and len(chosen) < len(stripe.members):
                src = min(serving, key=lambda h: (load.get(h, 0), h))
                load[src] = load.get(src, 0) + 1
                chosen.append((block, slot, src))
        if len(chosen) < len(stripe.members):
            return None
        # a short stripe's absent members are blocks of zeros: known, never sent
        absent = tuple(range(len(stripe.members), k))
        blocks = absent + tuple(b for b, _, _ in chosen)
        weights = rebuild_weights(k, m, blocks, stripe.members.index(owner))[len(absent):]
        rebuilds.append(Rebuild(s, owner, stripe.members.index(owner), tuple(
            (slot, src, w) for (_, slot, src), w in zip(chosen, weights, strict=True))))
    transfers = [Transfer(src, r.owner, iteration, slot)
                 for r in rebuilds for slot, src, _ in r.sources if src != r.owner]
    return tuple(rebuilds), schedule(transfers)


def missing_parity(layout: StripeLayout, holders: Holders) -> list[tuple[int, int]]:
    """(stripe, block) of every parity block its holder's node does not hold."""
    return [(s, j) for s, stripe in enumerate(layout.stripes)
            for j, holder in enumerate(stripe.parity)
            if holder not in holders.get(parity_slot(s, j), ())]


@dataclass(frozen=True)
class Repair:
    """Parity blocks to fold again (``blocks``: (stripe, block) each), the members' shards
    sent to their holders (``plan``) and those a holder reads from its own node (``local``:
    transfers with src == dst, never in the plan)."""

    blocks: tuple[tuple[int, int], ...]
    plan: ExchangePlan
    local: tuple[Transfer, ...] = ()


def parity_repair_plan(layout: StripeLayout, iteration: int, holders: Holders) -> Repair:
    """The parity blocks to fold again on their holders ((stripe, block) each) and the
    transfers of the members' shards to them: only blocks whose members are all held (the
    lost shards are rebuilt first). Each member's shard is served by the member itself when its
    node holds it, else by its least busy holder; by the block's holder itself (a local read)
    only when only its node holds it."""
    load: dict[int, int] = {}
    repairs: list[tuple[int, int]] = []
    transfers: list[Transfer] = []
    for s, j in missing_parity(layout, holders):
        stripe, holder = layout.stripes[s], layout.stripes[s].parity[j]
        if not all(holders.get(r) for r in stripe.members):
            continue
        repairs.append((s, j))
        for member in stripe.members:
            ranks = [h for h in holders[member] if h != holder] or [holder]
            src = member if member in ranks else min(ranks, key=lambda h: (load.get(h, 0), h))
            load[src] = load.get(src, 0) + 1
            transfers.append(Transfer(src, holder, iteration, member))
    return Repair(tuple(repairs), schedule(transfers),
                  tuple(t for t in transfers if t.local))
