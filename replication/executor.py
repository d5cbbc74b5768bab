"""The executor: moves shard payloads between ranks over a process group, following a plan.

A payload is opaque here: metadata bytes plus one contiguous uint8 CPU tensor. Per transfer the
sender sends a tag header ``[iteration, owner, meta_nbytes, data_nbytes, piece_nbytes]``, the
metadata, then the data in pieces (no per-tensor traffic). The receiver checks the tag against the
plan (a stale or misrouted shard raises StaleTransferError), asks its sink where each piece goes,
and tells it when the piece has arrived, so the sink can write piece i while piece i+1 is on the
wire and recycle a few piece buffers instead of holding the whole shard.

Transfers run round by round (see :func:`replication.plans.schedule`): every rank sends or
receives one stream at a time. Every wait is bounded by the process group's timeout.

Failures stay aligned: a sender whose payload cannot be produced sends a header with
``data_nbytes = -1`` and the error text instead; a receiver whose sink fails keeps draining the
stream. Each rank gets back its own failures, for the caller to agree on across ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from .errors import StaleTransferError
from .plans import ExchangePlan, Transfer

_HEADER = 5


class Receiver(Protocol):
    """Where one incoming payload goes."""

    def piece_buffer(self, index: int, start: int, end: int) -> torch.Tensor:
        """A contiguous uint8 CPU tensor of end - start bytes to receive piece ``index`` into."""

    def piece_received(self, index: int, start: int, end: int) -> None:
        """Piece ``index`` (bytes [start, end) of the payload) is in its buffer."""

    def finish(self) -> None:
        """Every piece arrived: verify and commit. May raise."""

    def abort(self) -> None:
        """The transfer failed: drop what was received."""


Source = Callable[[Transfer], tuple[bytes, torch.Tensor, int]]  # meta, data, piece_nbytes
Sink = Callable[[Transfer, bytes, int], Receiver]  # meta, data_nbytes -> receiver


def run_exchange(plan: ExchangePlan, rank: int, source: Source, sink: Sink,
                 group: dist.ProcessGroup | None) -> list[tuple[Transfer, BaseException]]:
    """Perform this rank's transfers of ``plan`` in order; return (transfer, error) for every
    transfer that failed on this rank's side. Errors of the process group itself (a peer died,
    timeout) propagate: the stream cannot be realigned after them."""
    failures: list[tuple[Transfer, BaseException]] = []
    for t in plan.involving(rank):
        error = _send(t, source, group) if t.src == rank else _receive(t, sink, group)
        if error is not None:
            failures.append((t, error))
    return failures


def _send(t: Transfer, source: Source, group: dist.ProcessGroup | None) -> BaseException | None:
    try:
        meta, data, piece = source(t)
        if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
            raise ValueError("payload data: expected a contiguous 1-D uint8 tensor, got "
                             f"{data.dtype} of shape {tuple(data.shape)}")
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}".encode()
        _send_bytes(t, torch.tensor([t.iteration, t.owner, len(text), -1, 0]), text, group)
        return exc
    header = torch.tensor([t.iteration, t.owner, len(meta), data.numel(), piece],
                          dtype=torch.int64)
    _send_bytes(t, header, meta, group)
    for start in range(0, data.numel(), piece):
        dist.send(data[start : start + piece], t.dst, group=group)
    return None


def _send_bytes(t: Transfer, header: torch.Tensor, meta: bytes,
                group: dist.ProcessGroup | None) -> None:
    dist.send(header.to(torch.int64), t.dst, group=group)
    if meta:
        dist.send(torch.frombuffer(bytearray(meta), dtype=torch.uint8), t.dst, group=group)


def _receive(t: Transfer, sink: Sink, group: dist.ProcessGroup | None) -> BaseException | None:
    header = torch.empty(_HEADER, dtype=torch.int64)
    dist.recv(header, t.src, group=group)
    iteration, owner, meta_nbytes, data_nbytes, piece = (int(x) for x in header)
    meta_t = torch.empty(meta_nbytes, dtype=torch.uint8)
    if meta_nbytes:
        dist.recv(meta_t, t.src, group=group)
    meta = bytes(meta_t.numpy())
    if (iteration, owner) != (t.iteration, t.owner):
        # The stream is not the one the plan expects: nothing after this can be trusted.
        raise StaleTransferError(
            f"rank {t.src} sent shard (iteration {iteration}, owner {owner}), the plan expects "
            f"(iteration {t.iteration}, owner {t.owner})")
    if data_nbytes < 0:
        return RuntimeError(f"rank {t.src} could not send shard {t.shard}: {meta.decode()}")
    error: BaseException | None = None
    receiver: Receiver | None = None
    drain: torch.Tensor | None = None  # where pieces go once the sink failed
    try:
        receiver = sink(t, meta, data_nbytes)
    except Exception as exc:
        error = exc
    for index, start in enumerate(range(0, data_nbytes, piece)):
        end = min(start + piece, data_nbytes)
        target = None
        if error is None and receiver is not None:
            try:
                target = receiver.piece_buffer(index, start, end)
            except Exception as exc:
                error = exc
        if target is None:
            if drain is None:
                drain = torch.empty(piece, dtype=torch.uint8)
            target = drain[: end - start]
        dist.recv(target, t.src, group=group)
        if error is None and receiver is not None:
            try:
                receiver.piece_received(index, start, end)
            except Exception as exc:
                error = exc
    if receiver is not None:
        try:
            if error is None:
                receiver.finish()
            else:
                receiver.abort()
        except Exception as exc:
            error = error or exc
    return error
