"""The part of a restore that brings redundancy back, after ``load`` has returned.

``load`` hands each rank its own shard as fast as the wire allows and returns; the shards a
replaced node must hold again (its ranks' own, the replicas the placement puts on it) are then
sent a second time, streamed from the serving ranks' disks, and committed on the receivers'
roots (:class:`localckpt.storage.peer_io.StoreReceiver`: checksummed, atomic), on a background
thread and the manager's data group, while training goes on. Sending twice instead of writing the
owner's tensors back keeps them the caller's alone (training changes them in place) and memory
bounded by a few pieces.

Every rank runs one (the plan is the same on every rank). Transfers that failed are agreed
across ranks and tried again, up to ATTEMPTS times; a source copy that failed its checksums, or
that another save of the iteration wrote than the one loaded (a copy restored by hand), is
quarantined and the transfer planned from another holder. What still fails is logged (the next
save brings redundancy back for the new iteration). A failed transfer never fails the load and
never leaves a half-written shard (a receiver commits by rename or not at all). A failure of the
data group itself (a peer lost) is raised by :meth:`WriteBack.wait`, leaving both groups
unusable: the job must restart. The manager waits for it before its next collective (save,
find_latest, load) and in ``close``.
"""

from __future__ import annotations

import logging
import threading
import time

from replication import ExchangePlan, Transfer, retrieval_plan
from replication.executor import Outgoing
from replication.plans import ShardId
from replication.stripe_plans import Repair

from ..control.context import Context
from ..errors import CollectiveError, CollectiveTimeoutError, CorruptShardError
from ..ops.faults import fault_point
from ..storage.peer_io import StoreReceiver, run_transfers
from ..storage.shard_stream import outgoing_from_disk, wire_messages
from .parity_repair import fold_parity
from .rounds import transfer_seconds

logger = logging.getLogger(__name__)

ATTEMPTS = 3


class WriteBack:
    """One rank's part of a restore's write-back, started at construction. ``seconds``: how
    long the slowest rank may take for one attempt (every piece is bounded by the timeout);
    None: not known yet (no load step counted the pieces of the shards sent): the ranks
    exchange them first, on the thread."""

    def __init__(self, ctx: Context, plan: ExchangePlan, holders: dict[ShardId, list[int]],
                 iteration: int, seconds: float | None, repair: Repair | None = None,
                 save_id: str | None = None) -> None:
        self.ctx = ctx
        # the save loaded: a copy of another save of the iteration is set aside, never sent
        self.save_id = save_id
        self.holders = {s: list(h) for s, h in holders.items()}  # minus quarantined copies
        self.iteration = iteration
        self._count = seconds is None
        # until counted, each shard taken as one piece: that covers the count's own exchange
        self.seconds = transfer_seconds(ctx, plan, {}) if seconds is None else seconds
        # erasure coding: the parity blocks to fold again (see fold_parity)
        self.repair = repair
        self.repair_seconds = 0.0 if repair is None else 2 * ctx.timeout + transfer_seconds(
            ctx, repair.plan, {})  # the pieces on the wire are counted once the sizes are known
        self.repaired: list[tuple[int, int]] = []  # parity blocks this rank committed
        self.written: list[tuple[int, int]] = []  # shards this rank committed
        self.failed: list[Transfer] = []  # what still failed after the last attempt (agreed)
        self.error: BaseException | None = None  # the group failed: no redundancy came back
        self.done = threading.Event()
        self._stopped = threading.Event()  # see stop()
        self._thread = threading.Thread(target=self._run, args=(plan,), daemon=True,
                                        name="localckpt-write-back")
        self._thread.start()

    def stop(self, seconds: float) -> bool:
        """After :meth:`wait` gave up (close): from now on nothing received is committed and
        no attempt starts; waits up to ``seconds`` for the thread. Whether it ended (if not,
        the caller keeps what the thread may still use: the session lock)."""
        self._stopped.set()
        self._thread.join(seconds)
        return not self._thread.is_alive()

    def _source(self, t: Transfer) -> Outgoing:
        fault_point("load_write_back", self.ctx.rank, t.iteration)
        fault_point("replica_send", self.ctx.rank, t.iteration)
        ref = self.ctx.store.ref(*t.shard, self.ctx.world_size)
        manifest = self.ctx.store.read_manifest(ref)
        save = manifest.metadata.get("save_id")
        if self.save_id is not None and save != self.save_id:
            # quarantined and sent from another holder, as a load sets such copies aside
            raise CorruptShardError(
                f"{ref.path}: a copy of another save of iteration {t.iteration} (save {save}; "
                f"the load's is {self.save_id}): not sent")
        return outgoing_from_disk(self.ctx.store, ref, manifest, self.ctx.ring)

    def _sink(self, t: Transfer, meta: bytes, nbytes: int) -> StoreReceiver:
        fault_point("load_write_back", self.ctx.rank, t.iteration)
        receiver = StoreReceiver(self.ctx.store, t, meta, nbytes, self.ctx.world_size,
                                 self.ctx.ring)
        commit, stopped = receiver.finish, self._stopped

        def finish() -> None:
            if stopped.is_set():  # close() gave up on us: commit nothing now
                receiver.abort()
                raise RuntimeError("the write-back was stopped by close()")
            commit()

        receiver.finish = finish  # type: ignore[method-assign]
        return receiver

    def _run(self, plan: ExchangePlan) -> None:
        try:
            if plan.transfers:  # the same plan on every rank
                if self._count:
                    self.seconds = transfer_seconds(self.ctx, plan, self._pieces(plan))
                self._write_replicas(plan)
            if self.repair is not None:
                self.repaired = fold_parity(self.ctx, self.iteration, self.repair,
                                            self._repair_takes)
        except BaseException as exc:  # the data group failed: nothing more can be sent on it
            self.error = exc  # (SystemExit too: wait() must not take it for success)
            logger.error("rank %d: write-back of iteration %d failed: %s", self.ctx.rank,
                         self.iteration, exc)
        finally:
            self.done.set()

    def _write_replicas(self, plan: ExchangePlan) -> None:
        ctx, it = self.ctx, self.iteration
        for attempt in range(1, ATTEMPTS + 1):
            if self._stopped.is_set():
                return
            failures = run_transfers(plan, ctx.data_group, self._source, self._sink)
            bad = {t for t, _ in failures}
            self.written += [t.shard for t in plan.involving(ctx.rank)
                             if t.dst == ctx.rank and t not in bad]
            corrupt = [t.shard for t, exc in failures
                       if t.src == ctx.rank and isinstance(exc, CorruptShardError)]
            for shard, exc in ((t.shard, e) for t, e in failures if t.shard in corrupt):
                try:  # a local failure here must not skip the agreement below
                    moved = ctx.store.quarantine(ctx.store.ref(*shard, ctx.world_size))
                except Exception as qexc:
                    logger.error("rank %d: write-back: %s; quarantining this copy failed: %s",
                                 ctx.rank, exc, qexc)
                else:
                    logger.warning("rank %d: write-back: %s; this copy was quarantined to %s",
                                   ctx.rank, exc, moved)
            mine = {"failed": [[t.src, t.dst, t.iteration, t.owner] for t in sorted(bad)],
                    "corrupt": [list(s) for s in corrupt]}
            agreed = ctx.data_group.exchange(
                f"write-back of iteration {it}: attempt {attempt}", mine.copy,
                wait=self.seconds)
            self.failed = sorted({Transfer(*x) for v in agreed for x in v["failed"]})
            for r, v in enumerate(agreed):  # that node's copy is gone for all its ranks
                for s in v["corrupt"]:
                    shard = (s[0], s[1])
                    self.holders[shard] = [h for h in self.holders.get(shard, [])
                                           if not ctx.topology.same_node(r, h)]
            if not self.failed:
                return
            shown = ", ".join(f"{t.shard} to rank {t.dst}" for t in self.failed[:6])
            if attempt < ATTEMPTS:
                # from another holder where a copy was quarantined (pure: same everywhere)
                retry = retrieval_plan([(t.dst, t.shard) for t in self.failed], self.holders)
                if retry.missing:  # no copy left anywhere: retrying them cannot help
                    logger.error("rank %d: write-back of iteration %d: no copy of %s is left "
                                 "to send; they are not restored", ctx.rank, it,
                                 list(retry.missing))
                    if not retry.exchange.transfers:
                        return
                logger.warning("rank %d: write-back of iteration %d: %d transfers failed "
                               "(%s); trying them again", ctx.rank, it, len(self.failed),
                               shown)
                plan = retry.exchange
        logger.error("rank %d: write-back of iteration %d gave up after %d attempts: %s are "
                     "not restored; the next save brings redundancy back for the new "
                     "iteration", ctx.rank, it, ATTEMPTS, shown)

    def _pieces(self, plan: ExchangePlan) -> dict[str, int]:
        """How many messages each shard sent takes on the wire, as every rank's sender counts
        them (collective on the data group). A shard whose manifest a sender cannot read now
        (a bad copy, which the attempt quarantines and sends from another holder; no file
        descriptors left) is taken to be as large as the largest counted."""
        ctx = self.ctx

        def mine() -> dict[str, int]:
            counted: dict[str, int] = {}
            for t in plan.transfers:
                if t.src == ctx.rank:
                    try:
                        m = ctx.store.read_manifest(ctx.store.ref(*t.shard, ctx.world_size))
                    except OSError as exc:  # the attempt meets it, fails that transfer alone
                        logger.warning("rank %d: write-back: %s", ctx.rank, exc)
                        continue
                    counted[f"{t.iteration}:{t.owner}"] = wire_messages(m)
            return counted

        gathered = ctx.data_group.exchange(
            f"write-back of iteration {self.iteration}: sizes", mine)
        pieces = {k: n for counted in gathered for k, n in counted.items()}
        largest = max(pieces.values(), default=1)
        return {f"{t.iteration}:{t.owner}": pieces.get(f"{t.iteration}:{t.owner}", largest)
                for t in plan.transfers}

    def _repair_takes(self, seconds: float) -> None:
        self.repair_seconds = seconds

    def bound(self) -> float:
        """The longest :meth:`wait` may take."""
        return self.seconds * ATTEMPTS + self.repair_seconds + self.ctx.timeout

    def wait(self) -> None:
        """Block until this rank's write-back is over (it logs failed transfers). Raises, and
        leaves both groups unusable: CollectiveTimeoutError if it overran every bound,
        CollectiveError if the data group failed under it (a peer lost: the job must restart;
        raised at once rather than as a timeout of the next collective)."""
        called = time.monotonic()
        while not self.done.wait(0.05):  # the bound grows once the parity's sizes are known
            if time.monotonic() - called > self.bound():
                break
        if self.done.is_set():
            if self.error is None:
                return
            failed = CollectiveError(f"the write-back of iteration {self.iteration} after the "
                                     f"last load failed: {self.error}")
            self.ctx.data_group.mark_broken(failed)
            self.ctx.group.mark_broken(failed)
            raise failed from self.error
        err = CollectiveTimeoutError(
            f"the write-back of iteration {self.iteration} did not finish within "
            f"{self.bound():g}s")
        self.ctx.data_group.mark_broken(err)
        self.ctx.group.mark_broken(err)
        raise err

