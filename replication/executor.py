"""The executor: moves shard payloads between ranks over a process group, following a plan.

A payload is opaque here: metadata bytes plus bytes the sender produces piece by piece
(:class:`Outgoing`: from one tensor, or read from disk as they go). Per transfer the sender sends
a tag header ``[iteration, owner, meta_nbytes, data_nbytes, piece_nbytes, n_splits]``, the
metadata, the extra split offsets, then the data in *segments*: the pieces, cut again at the split
offsets (so a receiver can take a segment straight into the tensor it belongs to; no per-tensor
traffic otherwise). The receiver checks the tag against the plan (a stale or misrouted shard
raises StaleTransferError), asks its sink where each segment goes, and tells it when the segment
has arrived, so the sink can write segment i while segment i+1 is on the wire and recycle a few
buffers instead of holding the whole shard.

Transfers run round by round (see :func:`replication.plans.schedule`): every rank sends or
receives one stream at a time. Every wait is bounded by the process group's timeout.

Failures stay aligned: a sender whose payload cannot be produced sends a header with
``data_nbytes = -1`` and the error text instead; one whose piece cannot be produced mid-stream
sends zeros for the rest (the receiver's checksums reject them) and reports its error; a receiver
whose sink fails keeps draining the stream. Each rank gets back its own failures, for the
caller to agree on across ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from .errors import StaleTransferError
from .plans import ExchangePlan, Transfer

_HEADER = 6


class Receiver(Protocol):
    """Where one incoming payload goes."""

    def piece_buffer(self, index: int, start: int, end: int) -> torch.Tensor:
        """A contiguous uint8 CPU tensor of end - start bytes to receive segment ``index`` into
        (without splits, segments are the pieces)."""

    def piece_received(self, index: int, start: int, end: int) -> None:
        """Segment ``index`` (bytes [start, end) of the payload) is in its buffer."""

    def finish(self) -> None:
        """Every piece arrived: verify and commit. May raise."""

    def abort(self) -> None:
        """The transfer failed: drop what was received."""


@dataclass(frozen=True)
class Outgoing:
    """What a sender sends: ``meta``, then ``nbytes`` of data in pieces of ``piece_nbytes``,
    ``read(start, end)`` giving bytes [start, end) of one piece at a time, in order (a
    contiguous uint8 CPU tensor, valid until the next call; it may raise). ``splits``: offsets
    where segments are cut besides the piece boundaries. ``close`` runs when the transfer is
    over, whatever happened."""

    meta: bytes
    nbytes: int
    piece_nbytes: int
    read: Callable[[int, int], torch.Tensor]
    splits: tuple[int, ...] = ()
    close: Callable[[], None] = lambda: None

    @classmethod
    def of_tensor(cls, meta: bytes, data: torch.Tensor, piece_nbytes: int) -> Outgoing:
        if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
            raise ValueError("payload data: expected a contiguous 1-D uint8 tensor, got "
                             f"{data.dtype} of shape {tuple(data.shape)}")
        return cls(meta, data.numel(), piece_nbytes, lambda start, end: data[start:end])


def segments(nbytes: int, piece_nbytes: int, splits: Sequence[int]
             ) -> list[tuple[int, int, int]]:
    """``(piece, start, end)`` of every segment on the wire, in order: the pieces of
    ``piece_nbytes`` cut again at ``splits``. The same on both ends (pure)."""
    cuts = sorted({s for s in splits if 0 < s < nbytes})
    out, k = [], 0
    for index, start in enumerate(range(0, nbytes, piece_nbytes)):
        end = min(start + piece_nbytes, nbytes)
        while k < len(cuts) and cuts[k] <= start:
            k += 1
        pos = start
        while k < len(cuts) and cuts[k] < end:
            out.append((index, pos, cuts[k]))
            pos = cuts[k]
            k += 1
        out.append((index, pos, end))
    return out


Source = Callable[[Transfer], Outgoing]
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
        out = source(t)
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}".encode()
        _send_bytes(t, torch.tensor([t.iteration, t.owner, len(text), -1, 0, 0]), text, group)
        return exc
    error: BaseException | None = None
    try:
        header = torch.tensor([t.iteration, t.owner, len(out.meta), out.nbytes, out.piece_nbytes,
                               len(out.splits)], dtype=torch.int64)
        _send_bytes(t, header, out.meta, group)
        if out.splits:
            dist.send(torch.tensor(out.splits, dtype=torch.int64), t.dst, group=group)
        piece, zeros = -1, None
        data = torch.empty(0, dtype=torch.uint8)
        for index, start, end in segments(out.nbytes, out.piece_nbytes, out.splits):
            if index != piece:
                piece = index
                base = index * out.piece_nbytes
                if error is None:
                    want = min(out.piece_nbytes, out.nbytes - base)
                    try:
                        data = out.read(base, base + want)
                        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != want:
                            raise ValueError(f"piece {index}: expected {want} uint8 bytes, got "
                                             f"{data.dtype} of shape {tuple(data.shape)}")
                    except Exception as exc:  # the stream goes on with zeros: see the module
                        error = exc
                if error is not None:
                    if zeros is None:
                        zeros = torch.zeros(out.piece_nbytes, dtype=torch.uint8)
                    data = zeros
            dist.send(data[start - base : end - base], t.dst, group=group)
    finally:
        out.close()
    return error


def _send_bytes(t: Transfer, header: torch.Tensor, meta: bytes,
                group: dist.ProcessGroup | None) -> None:
    dist.send(header.to(torch.int64), t.dst, group=group)
    if meta:
        dist.send(torch.frombuffer(bytearray(meta), dtype=torch.uint8), t.dst, group=group)


def _receive(t: Transfer, sink: Sink, group: dist.ProcessGroup | None) -> BaseException | None:
    header = torch.empty(_HEADER, dtype=torch.int64)
    dist.recv(header, t.src, group=group)
    iteration, owner, meta_nbytes, data_nbytes, piece, n_splits = (int(x) for x in header)
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
    if not 0 <= n_splits <= max(data_nbytes, 0) or piece <= 0 < data_nbytes:
        raise StaleTransferError(f"rank {t.src} sent a malformed header for shard {t.shard}: "
                                 f"{data_nbytes} bytes in pieces of {piece}, {n_splits} splits")
    splits = torch.empty(n_splits, dtype=torch.int64)
    if n_splits:
        dist.recv(splits, t.src, group=group)
    error: BaseException | None = None
    receiver: Receiver | None = None
    drain: torch.Tensor | None = None  # where pieces go once the sink failed
    try:
        receiver = sink(t, meta, data_nbytes)
    except Exception as exc:
        error = exc
    for index, (_, start, end) in enumerate(segments(data_nbytes, piece, splits.tolist())):
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
        try:
            dist.recv(target, t.src, group=group)
        except BaseException:  # the stream is lost: the receiver must not go on writing
            if receiver is not None:
                receiver.abort()
            raise
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
