"""An all-gather through node leaders: the per-call cost grows with nodes, not ranks.

Once the job's topology is known, every agreement of a :class:`CheckpointGroup` gathers through
the lowest rank of each node (its leader) in three hops of point-to-point messages on the group:

1. every other rank of a node sends its payload to the node's leader;
2. the leaders send their node's payloads to each other (all at once, not in a ring);
3. each leader sends the whole job's payloads to the other ranks of its node.

gloo's all_gather is a ring of world-1 dependent steps: 176 ms for 8 bytes per rank at 64
processes on this 2-core machine, against about 35 ms for the three hops (see
docs/benchmarks-control.md). A node's ranks share a root and often send the same bytes (their
inventories): a node's message carries each distinct payload once.

Messages are a fixed frame carrying the length and, when it fits, the payload itself (one
message per hop for the small documents agreements exchange), then the rest in one message of
the exact size. A negative length is an abort: a leader that lost a member or another leader
tells every rank still waiting on it, so a failure on one rank surfaces on every rank at once
rather than after the timeout. Every wait is bounded by the caller's seconds.
"""

from __future__ import annotations

import contextlib
import struct
import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

FRAME = 1024  # bytes of the first message of every hop (header + inline payload)
_HEADER = 8
_ABORT = -1
TAG = 0x4C44  # its own tag: shard transfers use 0 and CheckpointGroup's barrier 0x4C43


class PeerAborted(RuntimeError):
    """A rank this one waited on reported that the exchange failed elsewhere."""


class LeaderExchange:
    """The three-hop all-gather of one group. Not thread-safe: one call at a time, on the thread
    that owns the group. Every rank of the group must call :meth:`all_gather` in the same order.
    """

    def __init__(self, group: dist.ProcessGroup | None, rank: int, node_of: Sequence[int]
                 ) -> None:
        members: dict[int, list[int]] = {}
        for r, node in enumerate(node_of):
            members.setdefault(node, []).append(r)
        self.group, self.rank, self.world_size = group, rank, len(node_of)
        self.nodes = sorted(members.values(), key=lambda m: m[0])
        self.node = next(m for m in self.nodes if rank in m)
        self.leader = self.node[0]
        self.leaders = [m[0] for m in self.nodes]
        # sends and receives not known to have completed, with their tensors (see _post)
        self._posted: list[tuple[object, object]] = []

    def all_gather(self, payload: bytes, seconds: float) -> list[bytes]:
        """Every rank's ``payload`` in rank order (equal payloads of one node are one object).
        Raises RuntimeError (PeerAborted when another rank saw the failure) when a peer is lost
        or any wait runs past ``seconds``; any other exception (out of memory, an interrupt)
        is raised as it is, after telling the peers too."""
        deadline = time.monotonic() + seconds
        try:
            job = self._gather(payload, deadline)
        except BaseException:
            # Everyone this rank talks to, whether or not it already sent to them: a rank
            # that finished reads the abort as the next exchange's message and fails at once.
            # A member's peers are reached through its leader (which then fails itself).
            if self.rank == self.leader:
                self._abort([*self.node[1:], *(x for x in self.leaders if x != self.rank)])
            raise
        self._posted.clear()  # every send of this exchange completed
        return decode_job(job, self.world_size)

    def _gather(self, payload: bytes, deadline: float) -> bytes:
        if self.rank != self.leader:
            # Listen for the answer while sending: a send completes only once the leader takes
            # it, and a leader that failed before taking it sends an abort instead.
            up = self._post(_pack(payload), [self.leader])
            job = self._recv([self.leader], deadline)[0]
            for work in up:
                _wait(work, deadline)
            return job
        others = [ldr for ldr in self.leaders if ldr != self.rank]
        node_payloads = [payload, *self._recv(self.node[1:], deadline)]
        mine = encode_node(self.node, node_payloads)
        across = self._post(_pack(mine), others)  # one copy, read by every send
        blobs = dict(zip(others, self._recv(others, deadline), strict=True))
        blobs[self.rank] = mine
        job = encode_job([blobs[ldr] for ldr in self.leaders])
        down = self._post(_pack(job), self.node[1:])
        for work in across + down:
            _wait(work, deadline)
        return job

    # ------------------------------------------------------------------ messages

    def _post(self, packed: tuple[torch.Tensor, torch.Tensor | None], peers: Sequence[int]
              ) -> list[dist.Work]:
        """Start sending a :func:`_pack`ed payload to each of ``peers``. The tensors and the
        handles are kept until the exchange succeeds: gloo drops a pending send whose handle is
        collected, and holds every later message to that peer behind it."""
        frame, rest = packed
        works = []
        for peer in peers:
            works.append(dist.isend(frame, peer, group=self.group, tag=TAG))
            if rest is not None:
                works.append(dist.isend(rest, peer, group=self.group, tag=TAG))
        posted = [w for w in works if w is not None]
        self._posted.append((packed, posted))
        return posted

    def _recv(self, peers: Sequence[int], deadline: float) -> list[bytes]:
        """One payload from each of ``peers``, received concurrently."""
        frames = [torch.empty(FRAME, dtype=torch.uint8) for _ in peers]
        works: list[dist.Work | None] = []
        # kept (see _post): a receive left pending by a failure must not write into freed memory
        self._posted.append((frames, works))
        for frame, peer in zip(frames, peers, strict=True):
            works.append(dist.irecv(frame, peer, group=self.group, tag=TAG))
        sizes, rests, tails = [], [], []
        for peer, frame, work in zip(peers, frames, works, strict=True):
            _wait(work, deadline)
            size = int(frame[:_HEADER].view(torch.int64).item())
            if size < 0:
                raise PeerAborted(f"rank {peer} reported that a peer failed in this step")
            sizes.append(size)
            rest = torch.empty(max(0, size - (FRAME - _HEADER)), dtype=torch.uint8)
            rests.append(rest)
            tails.append(dist.irecv(rest, peer, group=self.group, tag=TAG) if len(rest) else None)
            self._posted.append((rest, []))
        out = []
        for frame, size, rest, tail in zip(frames, sizes, rests, tails, strict=True):
            data = bytes(frame[_HEADER: _HEADER + min(size, FRAME - _HEADER)].numpy())
            if tail is not None:
                _wait(tail, deadline)
                data += bytes(rest.numpy())
            out.append(data)
        return out

    def _abort(self, peers: Sequence[int]) -> None:
        """Best effort, not waited for: tell ``peers`` (waiting on this leader's next message)
        that the exchange failed. Some may be gone or never listen; waiting on a send to a dead
        peer would hold up the frames to the live ones."""
        frame = _frame(_ABORT)
        works = []
        for peer in peers:
            with contextlib.suppress(RuntimeError):  # that one is gone: tell the others
                works.append(dist.isend(frame, peer, group=self.group, tag=TAG))
        self._posted.append((frame, [w for w in works if w is not None]))


def _frame(length: int) -> torch.Tensor:
    """A first message announcing ``length`` bytes (negative: an abort), its inline part zero."""
    frame = torch.zeros(FRAME, dtype=torch.uint8)
    frame[:_HEADER] = torch.tensor([length], dtype=torch.int64).view(torch.uint8)
    return frame


def _pack(payload: bytes) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A payload as its first message (the length, and the payload when it fits) and the rest
    (None if it fit), built once whatever the number of destinations."""
    frame = _frame(len(payload))
    inline = min(len(payload), FRAME - _HEADER)
    if inline:
        frame[_HEADER: _HEADER + inline] = torch.frombuffer(bytearray(payload[:inline]),
                                                            dtype=torch.uint8)
    rest = None
    if len(payload) > inline:
        rest = torch.frombuffer(bytearray(payload[inline:]), dtype=torch.uint8)
    return frame, rest


def _wait(work: dist.Work | None, deadline: float) -> None:
    if work is None or work.is_completed():  # None only for a rank outside the group
        if work is not None:
            work.wait()  # raises the work's error, if it failed
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise RuntimeError("timed out waiting for a peer")
    # never under a millisecond: gloo takes a zero timeout for "the group's timeout"
    work.wait(timeout=timedelta(seconds=max(left, 0.001)))


# ---------------------------------------------------------------------- encodings

def encode_node(ranks: Sequence[int], payloads: Sequence[bytes]) -> bytes:
    """One node's payloads: ``[n][ranks][index of each rank's payload]`` (uint32) ``[m]
    [lengths]`` (uint64) ``[bytes]``, each distinct payload once."""
    distinct: dict[bytes, int] = {}
    index = [distinct.setdefault(p, len(distinct)) for p in payloads]
    blobs = list(distinct)
    n, m = len(ranks), len(blobs)
    head = struct.pack(f"<I{n}I{n}IQ{m}Q", n, *ranks, *index, m, *(len(b) for b in blobs))
    return head + b"".join(blobs)


def encode_job(node_blobs: Sequence[bytes]) -> bytes:
    """The leaders' node messages, each prefixed with its length (uint64)."""
    return b"".join(struct.pack("<Q", len(b)) + b for b in node_blobs)


def decode_job(job: bytes, world_size: int) -> list[bytes]:
    """Every rank's payload from :func:`encode_job`'s bytes; equal payloads of a node are one
    object. RuntimeError if the bytes do not describe each of ``world_size`` ranks once."""
    out: list[bytes | None] = [None] * world_size
    view, at = memoryview(job), 0
    try:
        while at < len(view):
            (size,) = struct.unpack_from("<Q", view, at)
            at += 8
            _decode_node(view[at: at + size], out)
            at += size
    except (struct.error, IndexError, ValueError) as exc:
        raise RuntimeError(f"malformed exchange message ({exc})") from None
    if any(p is None for p in out):
        raise RuntimeError("malformed exchange message: some ranks' payloads are missing")
    return out  # type: ignore[return-value]


def _decode_node(node: memoryview, out: list[bytes | None]) -> None:
    (n,) = struct.unpack_from("<I", node, 0)
    ranks_index = struct.unpack_from(f"<{2 * n}I", node, 4)
    at = 4 + 8 * n
    (m,) = struct.unpack_from("<Q", node, at)
    lengths = struct.unpack_from(f"<{m}Q", node, at + 8)
    at += 8 + 8 * m
    blobs = []
    for size in lengths:
        if at + size > len(node):
            raise ValueError("payload past the end")
        blobs.append(bytes(node[at: at + size]))
        at += size
    for rank, i in zip(ranks_index[:n], ranks_index[n:], strict=True):
        if out[rank] is not None:
            raise ValueError(f"rank {rank} twice")
        out[rank] = blobs[i]
