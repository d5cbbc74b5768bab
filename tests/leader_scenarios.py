"""Rank programs for tests/test_leaders.py: the node-leader all-gather of CheckpointGroup on real
gloo ranks (run by dist_harness.run_ranks)."""

from __future__ import annotations

import os
import time
from typing import Any

from localckpt.control.collectives import CheckpointGroup
from localckpt.control.leaders import FRAME


def payload(rank: int, size: int) -> bytes:
    return bytes((rank * 7 + i) % 251 for i in range(size))


def gather_sizes(rank: int, world: int, node_of: list[int], rounds: list[list[int]]
                 ) -> list[bool]:
    """One all_gather_bytes per round, rank r sending ``payload(r, round[r])``: whether each
    round gave every rank's payload in rank order."""
    group = CheckpointGroup(20.0)
    group.use_nodes(node_of)
    ok = []
    for sizes in rounds:
        got = group.all_gather_bytes(payload(rank, sizes[rank]), "test")
        ok.append(got == [payload(r, sizes[r]) for r in range(world)])
    group.close()
    return ok


def exchange_with_a_failing_rank(rank: int, world: int, node_of: list[int]) -> dict[str, Any]:
    """exchange() through leaders: rank 2's local step raises; then an exchange that works."""
    group = CheckpointGroup(20.0)
    group.use_nodes(node_of)

    def local() -> int:
        if rank == 2:
            raise ValueError("rank two failed")
        return rank

    out: dict[str, Any] = {}
    try:
        group.exchange("step one", local)
    except Exception as exc:
        out["error"] = [type(exc).__name__, str(exc)]
    out["after"] = group.exchange("step two", lambda: {"rank": rank, "blob": "x" * 3000})
    group.close()
    return out


def peer_vanishes(rank: int, world: int, node_of: list[int], victim: int, timeout: float,
                  hang: bool, hold: float) -> dict[str, Any]:
    """One exchange works; then ``victim`` exits (or, with ``hang``, stays away past the timeout)
    and the others exchange again: the error and how long it took. Each rank then lives on for
    ``hold`` seconds."""
    group = CheckpointGroup(timeout)
    group.use_nodes(node_of)
    group.all_gather_bytes(b"warm", "first")
    if rank == victim:
        if not hang:
            os._exit(3)
        time.sleep(timeout * 1.5)
    started = time.monotonic()
    try:
        group.all_gather_bytes(b"x" * (FRAME * 2), "second")
    except Exception as exc:
        out = {"error": [c.__name__ for c in type(exc).__mro__], "message": str(exc),
               "seconds": time.monotonic() - started}
    else:
        out = {"error": None, "seconds": time.monotonic() - started}
    # Stay alive (as a job handling the error would): a rank that exits closes its connections,
    # which would wake its peers whether or not the exchange told them.
    time.sleep(hold)
    return out


def leader_fails_with_memory_error(rank: int, world: int, node_of: list[int], hold: float
                                   ) -> dict[str, Any]:
    """One exchange works; in the second, rank 0 (a leader) runs out of memory while building
    its node's message. Its peers must hear of it at once; its group must be unusable after."""
    from localckpt.control import leaders

    group = CheckpointGroup(20.0)
    group.use_nodes(node_of)
    group.all_gather_bytes(b"warm", "first")
    if rank == 0:
        def no_memory(*args: Any) -> bytes:
            raise MemoryError("injected")
        leaders.encode_node = no_memory  # type: ignore[assignment]
    started = time.monotonic()
    out: dict[str, Any] = {}
    try:
        group.all_gather_bytes(b"x", "second")
    except BaseException as exc:
        out["error"] = [c.__name__ for c in type(exc).__mro__]
    out["seconds"] = time.monotonic() - started
    try:
        group.all_gather_bytes(b"y", "third")
    except BaseException as exc:
        out["after"] = type(exc).__name__
    time.sleep(hold)
    return out


def local_step_interrupted_or_unencodable(rank: int, world: int, node_of: list[int],
                                          victim: int, what: str) -> dict[str, Any]:
    """``victim``'s local step raises KeyboardInterrupt (``what="interrupt"``) or returns what
    JSON refuses (``"nan"``); the victim, having handled the interrupt, goes on to a second
    step, as do the others. Each rank's outcome of both steps, and how long the first took."""
    group = CheckpointGroup(5.0)
    group.use_nodes(node_of)

    def local() -> Any:
        if rank == victim:
            if what == "interrupt":
                raise KeyboardInterrupt
            return float("nan")
        return rank

    out: dict[str, Any] = {}
    started = time.monotonic()
    try:
        group.exchange("step one", local)
        out["one"] = "ok"
    except BaseException as exc:  # the victim's KeyboardInterrupt included
        out["one"] = type(exc).__name__
    out["seconds"] = time.monotonic() - started
    try:
        out["two"] = group.exchange("step two", lambda: {"rank": rank})
    except BaseException as exc:
        out["two"] = type(exc).__name__
    group.close()
    return out


def wait_known_after_the_local_step(rank: int, world: int) -> str:
    """The wait of an exchange is what its local step learns (a write-back's bound once it
    counted its pieces): every rank learns 6 s in its step; rank 0 returns at once, rank 1
    works 2.5 s against a group timeout of 1 s."""
    import time

    group = CheckpointGroup(1.0)
    learned = {"wait": 1.0}

    def local() -> int:
        learned["wait"] = 6.0
        if rank == 1:
            time.sleep(2.5)
        return rank

    try:
        got = group.exchange("learns its wait", local, wait=lambda: learned["wait"])
    finally:
        group.close()
    return "ok" if got == [0, 1] else f"got {got}"
