"""localckpt's own process group and the few collectives it needs.

Every collective runs on a gloo group created by the manager from the default group (never on the
training group), with a timeout, and exchanges JSON (never pickle: a peer's bytes are data, not
code). :meth:`CheckpointGroup.exchange` is the exception-robust collective every global decision
goes through: each rank runs a local step, all ranks gather (value or error), and either every rank
gets every value or every rank raises the same exception listing each failing rank's cause.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..errors import (
    CollectiveError,
    CollectiveTimeoutError,
    describe_failure,
    error_from_failures,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")
_SLOT = 4096  # bytes per rank in the first all_gather round


class CheckpointGroup:
    """A gloo group spanning the default group's ranks, or a world of one without distributed.

    Construction is collective: every rank of the default group must create it, in the same order
    as any other ``new_group`` call. Once a collective failed (peer lost, timeout) the group is
    marked broken and every later call raises CollectiveError at once: a gloo group cannot be
    trusted to realign after a partial collective, so the job must restart.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._broken: CollectiveError | None = None
        self.group: dist.ProcessGroup | None = None
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank()
            self.world_size = dist.get_world_size()
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        else:
            self.rank, self.world_size = 0, 1

    def close(self) -> None:
        if self.group is not None and dist.is_initialized():
            try:
                dist.destroy_process_group(self.group)
            except (RuntimeError, ValueError) as exc:  # already torn down with the default group
                logger.debug("destroying localckpt group: %s", exc)
        self.group = None

    def all_gather_bytes(self, payload: bytes, what: str) -> list[bytes]:
        """Every rank's ``payload``, in rank order. Blocks until all ranks called it or the
        timeout passed (CollectiveTimeoutError); a lost peer raises CollectiveError."""
        if self._broken is not None:
            raise CollectiveError(f"{what}: localckpt's process group is unusable after an "
                                  f"earlier failure ({self._broken}); restart the job")
        if self.group is None:
            return [payload]
        started = time.monotonic()
        try:
            # Round 1: a fixed slot carrying the length and, when it fits, the payload itself,
            # so small exchanges (validation, done?) cost one collective. Everyone sees every
            # length and so agrees whether round 2 (a slot of the longest payload) is needed.
            slot = torch.zeros(_SLOT, dtype=torch.uint8)
            slot[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
            if len(payload) <= _SLOT - 8 and payload:
                slot[8 : 8 + len(payload)] = torch.frombuffer(bytearray(payload),
                                                              dtype=torch.uint8)
            slots = [torch.empty(_SLOT, dtype=torch.uint8) for _ in range(self.world_size)]
            dist.all_gather(slots, slot, group=self.group)
            sizes = [int(s[:8].view(torch.int64).item()) for s in slots]
            if max(sizes) <= _SLOT - 8:
                return [bytes(s[8 : 8 + n].numpy()) for s, n in zip(slots, sizes, strict=True)]
            longest = max(sizes)
            mine = torch.zeros(longest, dtype=torch.uint8)
            if payload:
                mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
            dist.all_gather(out, mine, group=self.group)
        except RuntimeError as exc:  # gloo reports timeouts and lost peers as RuntimeError
            self._broken = _collective_error(what, exc, time.monotonic() - started, self.timeout)
            raise self._broken from exc
        return [bytes(o[:n].numpy()) for o, n in zip(out, sizes, strict=True)]

    def exchange(self, step: str, local: Callable[[], T]) -> list[T]:
        """Run ``local()`` on this rank, then gather every rank's JSON-able result.

        Returns all results in rank order, or raises on every rank the same exception built from
        each failing rank's error (see :func:`localckpt.errors.error_from_failures`); on the rank
        whose ``local()`` failed it is chained to the original exception.
        """
        local_exc: BaseException | None = None
        try:
            doc: dict[str, Any] = {"ok": local()}
        except Exception as exc:
            local_exc = exc
            doc = {"error": describe_failure(exc)}
        gathered = [json.loads(b) for b in self.all_gather_bytes(
            json.dumps(doc, allow_nan=False).encode(), step)]
        failures = {r: (str(d["error"][0]), str(d["error"][1]))
                    for r, d in enumerate(gathered) if "error" in d}
        if failures:
            err = error_from_failures(step, failures)
            raise err from local_exc
        return [d["ok"] for d in gathered]


def _collective_error(what: str, exc: BaseException, elapsed: float,
                      timeout: float) -> CollectiveError:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    timed_out = "timeout" in text.lower() or "timed out" in text.lower() or elapsed >= timeout
    cls = CollectiveTimeoutError if timed_out else CollectiveError
    return cls(
        f"{what}: collective on localckpt's gloo group failed after {elapsed:.1f}s "
        f"(timeout {timeout:g}s): {text}. A peer rank probably died or is stuck; "
        "restart the job (its last finalized checkpoint is intact)."
    )
