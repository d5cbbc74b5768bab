"""One save after staging: the part that can run in the background.

``SaveJob.run`` writes the rank's shard from the staged payload and replicates it; it never
raises (the error is kept for the finalize step, which agrees on it across ranks) and sets
``done`` when it is finished. It only uses the manager's *data* group, so it can run on a
background thread while the main thread uses the control group or the training group.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from replication import ExchangePlan, Transfer

from ..ops.metrics import Metrics
from ..storage.manifest import ShardManifest
from ..storage.peer_io import StoreReceiver, exchange_shards

if TYPE_CHECKING:
    from ..control.context import Context

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class SaveJob:
    """A staged shard on its way to disk and to its replica holders."""

    iteration: int
    manifest: ShardManifest  # checksums not yet known
    payload: torch.Tensor  # the staging arena's bytes: must not be restaged before ``done``
    plan: ExchangePlan | None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    scheduled: bool = False  # set by the AsyncRequest's preload_fn (schedule or execute_sync)
    finalized: bool = False
    finalize_error: BaseException | None = None  # what finalizing it raised, on every rank
    # Units of work (chunks written, pieces on the wire along the replica schedule), each
    # bounded by the timeout, that the slowest rank may still have ahead when a fast one agrees.
    wait_steps: int = 2
    # When its staging began (time.monotonic_ns): recycled files older than that and not
    # written over by it are surplus once it is finalized (see storage/recycle.py).
    started_ns: int = field(default_factory=time.monotonic_ns)
    metrics: Metrics = field(default_factory=Metrics)

    def mark_scheduled(self) -> None:
        self.scheduled = True

    def run(self, ctx: Context) -> None:
        """Write, then replicate (this rank's part of the plan) on ``ctx.data_group``. Never
        raises; sets ``done``."""
        metrics, store = self.metrics, ctx.store
        rank, session = ctx.rank, self.manifest.session_id
        try:
            committed: ShardManifest | None = None
            try:
                with metrics.timed("write", rank, self.iteration, session,
                                   self.manifest.data_nbytes):
                    _, committed = store.write(self.manifest, self.payload)
            except Exception as exc:
                self.error = exc
                logger.error("rank %d: writing shard of iteration %d failed: %s",
                             rank, self.iteration, exc)
            if self.plan is not None:
                def source(t: Transfer) -> tuple[ShardManifest, torch.Tensor]:
                    if committed is None:
                        raise RuntimeError(f"rank {rank} has no shard to send: {self.error}")
                    return committed, self.payload
                received: dict[tuple[int, int], StoreReceiver] = {}
                sent = sum(1 for t in self.plan.transfers if t.src == rank)
                try:
                    with metrics.timed("replicate", rank, self.iteration, session) as box:
                        exchange_shards(self.plan, ctx.data_group, store, ctx.world_size,
                                        source, ctx.ring, received)
                        box["nbytes"] = sent * self.manifest.data_nbytes + sum(
                            r.manifest.data_nbytes for r in received.values())
                except Exception as exc:
                    self.error = self.error or exc
        except BaseException as exc:  # never let the worker die silently
            self.error = self.error or exc
        finally:
            self.done.set()
