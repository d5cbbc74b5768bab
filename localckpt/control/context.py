"""What every stage of a manager shares once it is bootstrapped: who this rank is, where its
shards live, how the ranks agree, and where metrics go. Built once by LocalCheckpointManager;
the save path and the load path read it and never change it (but for the record of iterations a
load found it cannot load, :attr:`Context.unloadable`).
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replication import Placement, StripeLayout, Topology

from ..ops.metrics import Metrics
from ..storage.layout import list_shards
from ..storage.peer_io import PieceRing
from ..storage.rollback_fence import ids_of
from ..storage.store import ShardStore
from .collectives import CheckpointGroup
from .coverage import Inventory, decode_inventories, job_done

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Context:
    """One rank's view of the job. ``placement`` names no holders when replication is off (no
    replication is a placement like any other for planning); with the ``erasure`` strategy it
    names none either, and ``erasure`` says where each stripe's parity blocks live (None
    otherwise). ``group`` is for agreement (the
    training thread only), ``data_group`` for shard transfers of a save (maybe on a background
    thread); neither is the training group."""

    rank: int
    world_size: int
    session_id: str
    root: Path
    timeout: float
    group: CheckpointGroup
    data_group: CheckpointGroup
    topology: Topology
    placement: Placement
    store: ShardStore
    metrics: Metrics
    job_identity: dict[str, Any]
    ring: PieceRing = field(default_factory=PieceRing)  # replica receive buffers, reused
    erasure: StripeLayout | None = None
    # Iterations of this world size a load agreed cannot be loaded (shards of two saves), and
    # why: left out of every inventory (find_latest, saves, retention) until a save of that
    # number is finalized. The same on every rank: set from gathered reports.
    unloadable: dict[tuple[int, int], str] = field(default_factory=dict)  # (it, world size)

    def inventory(self, also: int | None = None) -> Inventory:
        """The committed shards of this session in this rank's root (no data is read), but
        those of :attr:`unloadable` iterations (except ``also``: the save of that number being
        finalized, which replaces them)."""
        hidden = self.unloadable.keys() - {(also, self.world_size)}
        shards = frozenset((s.iteration, s.owner_rank, s.world_size)
                           for s in self.store.committed()
                           if (s.iteration, s.world_size) not in hidden)
        return Inventory(self.rank, self.session_id, shards, self.store.fence(),
                         self.store.rollbacks_done())

    def note_rollbacks_done(self, inventories: list[Inventory]) -> None:
        """Record on this rank's root the rollbacks another root of the job finished (see
        storage/rollback_fence.py), before anything is written here: a node that joined after
        a rollback holds only shards saved after it, which a fence of that rollback (on a node
        away then, back later) must not hide. Not one whose fence this root holds, nor one
        that would hide a shard this root holds (a node away during that rollback, back with
        what it discarded): those are finished here by deleting what they hide (the next
        save). Local; what fails is logged."""
        mine = inventories[self.rank]
        have = {d[0] for d in mine.done} | set(ids_of(mine.fence))
        missing = [d for d in sorted(job_done(inventories)) if d[0] not in have]
        if not missing:
            return
        held = list_shards(self.store.root, self.session_id, fenced=False)
        missing = [(rid, n, w) for rid, n, w in missing
                   if not any(s.iteration > n and w in (None, s.world_size) for s in held)]
        if missing:
            try:
                self.store.record_rollbacks_done(missing)
            except OSError as exc:
                logger.warning("rank %d: could not record the rollbacks %s as finished in %s "
                               "(%s): a node back with one of their fences would hide what "
                               "is written there", self.rank, [d[0] for d in missing],
                               self.store.session_path, exc)

    def gather_inventories(self, step: str) -> list[Inventory]:
        """Every rank's :meth:`inventory`. Collective (on ``group``)."""
        return decode_inventories(self.group.exchange(step, lambda: self.inventory().to_json()))

    def timed(self, phase: str, iteration: Any, nbytes: int = 0
              ) -> AbstractContextManager[dict[str, int]]:
        """Time a phase into :attr:`metrics` (see :class:`localckpt.ops.metrics.Metrics`)."""
        it = iteration if type(iteration) is int else -1
        return self.metrics.timed(phase, self.rank, it, self.session_id, nbytes)
