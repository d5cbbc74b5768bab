"""Folding parity blocks lost with their nodes again after a restore (erasure coding), so the job
survives the next loss: the last part of the write-back, on its thread and the data group
(:class:`localckpt.load.write_back.WriteBack`), while training goes on.

1. every rank reports the packed size of each member shard it serves (one exchange; a shard it
   cannot read is reported, and the blocks over it are left to the next save);
2. the members' shards stream from their disks to the blocks' holders, which fold and commit
   each block as at a save (:class:`localckpt.storage.parity_io.ParityFolder`).

A failed transfer or commit is logged, never raised (the next save folds new parity); a failure
of the data group itself is raised to the write-back, which reports it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from replication import Transfer, schedule
from replication.executor import Outgoing
from replication.stripe_plans import Repair

from ..control.context import Context
from ..errors import CorruptShardError
from ..ops.faults import fault_point
from ..storage.parity_io import ParityFolder
from ..storage.peer_io import built_or_draining, run_transfers
from ..storage.shard_stream import outgoing_from_disk, wire_messages
from .rounds import transfer_seconds

logger = logging.getLogger(__name__)


def fold_parity(ctx: Context, iteration: int, repair: Repair,
                takes: Callable[[float], None]) -> list[tuple[int, int]]:
    """This rank's part of folding ``repair.blocks`` again from the members' shards; (stripe,
    block) of each block this rank committed. ``takes`` is told how long the transfers may take
    once the sizes are known. Every rank calls it alike."""
    layout = ctx.erasure
    assert layout is not None
    every = (*repair.plan.transfers, *repair.local)

    def sizes() -> dict[str, Any]:
        known, failed = {}, []
        for member in sorted({t.owner for t in every if t.src == ctx.rank}):
            try:
                m = ctx.store.read_manifest(ctx.store.ref(iteration, member, ctx.world_size))
            except Exception as exc:  # a later save folds new parity; no block over it now
                logger.warning("rank %d: folding parity of iteration %d: shard of rank %d "
                               "unreadable: %s", ctx.rank, iteration, member, exc)
                failed.append(member)
                continue
            known[str(member)] = [m.chunk_count * m.chunk_nbytes, wire_messages(m)]
        return {"sizes": known, "failed": failed}

    reports = ctx.data_group.exchange(f"parity of iteration {iteration}: sizes", sizes)
    known: dict[int, list[int]] = {}
    failed = {int(r) for report in reports for r in report["failed"]}
    for report in reports:
        for r, v in report["sizes"].items():
            if known.setdefault(int(r), v) != v:  # two copies of two saves: fold neither
                failed.add(int(r))
    kept = [(s, j) for s, j in repair.blocks if not failed & set(layout.stripes[s].members)]
    targets = {(s, layout.stripes[s].parity[j]) for s, j in kept}
    plan = schedule(t for t in repair.plan.transfers
                    if (layout.stripe_of(t.owner), t.dst) in targets)
    # Each holder's folds from its own disk, one piece at a time, after the transfers: the
    # most any rank has, which the others wait for in the last step.
    local_pieces = [0] * ctx.world_size
    for t in repair.local:
        if (layout.stripe_of(t.owner), t.dst) in targets and t.owner in known:
            local_pieces[t.dst] += known[t.owner][1]
    local_seconds = ctx.timeout * (1 + max(local_pieces))
    takes(transfer_seconds(ctx, plan, {f"{iteration}:{r}": v[1] for r, v in known.items()})
          + 2 * ctx.timeout + local_seconds)
    mine = [(s, j) for s, j in kept if layout.stripes[s].parity[j] == ctx.rank]
    folder, sink = built_or_draining(lambda: ParityFolder(
        ctx.store, layout, iteration, ctx.rank, ctx.world_size,
        {r: v[0] for r, v in known.items()}, ctx.ring, None, mine))

    def source(t: Transfer) -> Outgoing:
        fault_point("load_write_back", ctx.rank, t.iteration)
        ref = ctx.store.ref(*t.shard, ctx.world_size)
        return outgoing_from_disk(ctx.store, ref, ctx.store.read_manifest(ref), ctx.ring)

    errors: list[tuple[tuple[int, int], BaseException]] = []
    for t, failure in run_transfers(plan, ctx.data_group, source, sink):
        if t.src == ctx.rank and isinstance(failure, CorruptShardError):
            errors.append((t.shard, failure))
    # After the transfers, so that no peer waits in them for a whole shard read from disk (no
    # timeout bounds that read; a fold is the same in any order).
    for t in repair.local:  # the holder's own node keeps this member's shard
        if t.dst == ctx.rank and (layout.stripe_of(t.owner), t.dst) in targets:
            try:
                folder().fold_local(ctx.store.ref(*t.shard, ctx.world_size))
            except Exception as exc:
                errors.append((t.shard, exc))
    for shard, error in errors:  # a damaged copy of this rank's is set aside, as a load would
        moved = ctx.store.quarantine(ctx.store.ref(*shard, ctx.world_size)) \
            if isinstance(error, CorruptShardError) else None
        logger.warning("rank %d: folding parity of iteration %d: shard %s: %s%s", ctx.rank,
                       iteration, shard, error, f"; quarantined to {moved}" if moved else "")
    committed: list[tuple[int, int]] = []
    made = None
    try:
        if mine:
            made = folder()
            committed = made.commit()
    except Exception as exc:  # blocks whose members all arrived were committed
        logger.error("rank %d: folding parity blocks %s of iteration %d again: %s; the next "
                     "save folds new parity", ctx.rank, mine, iteration, exc)
        committed = made.committed if made is not None else []
    # Every rank ends here together: a rank whose write-back is over goes on to a save, whose
    # exchanges wait only the timeout for a rank still folding from its own disk.
    ctx.data_group.exchange(f"parity of iteration {iteration}: folded", lambda: None,
                            wait=local_seconds)
    return committed
