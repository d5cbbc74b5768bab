"""Named fault points for failure-injection (chaos) testing. Off by default and free when off.

A fault is armed by the environment variable ``LOCALCKPT_FAULTS`` (read at import) or by
:func:`arm`. The variable holds faults separated by ``;``, each ``POINT:ACTION[:key=value]...``::

    LOCALCKPT_FAULTS="replica_send:kill:rank=1:iteration=19"
    LOCALCKPT_FAULTS="local_write:enospc:rank=0:iteration=9;find_latest:sleep:seconds=30"

Points (where localckpt calls :func:`fault_point`):

================ ==========================================================================
staging          in ``save``, after the walk (large tensors copied early), before the others are
                 copied into the staging arena
local_write      writing the first chunk file of the rank's own shard
before_commit    the own shard is fully written, before the rename that commits it
replica_send     handing a shard to the executor for a peer (save or restore)
replica_receive  writing the first chunk of a replica received from a peer
after_commit     the save's background part is done, before the finalize step
finalize         every rank agreed the iteration is complete, before retention cleanup
find_latest      at the start of ``find_latest``
load_retrieval   in ``load``, before shards are read or fetched
load_write_back  after ``load`` returned, sending or receiving a shard a node must hold again
                 (the background write-back; a raise fails that transfer, tried again later)
================ ==========================================================================

Actions: ``kill`` (SIGKILL this process), ``kill_node`` (SIGKILL this process, its parent, e.g.
the torchrun agent, and every sibling: the whole simulated node), ``raise`` (InjectedFault),
``enospc`` (OSError ENOSPC), ``sleep`` (``seconds``, default 3600: a rank slower than any
timeout). Keys: ``rank`` and ``iteration`` (default: any), ``attempt`` (default 0: only in the
first attempt, ``$TORCHELASTIC_RESTART_COUNT``, so a restarted job is not killed again; ``*``
for every attempt), ``times`` (how often it fires in one process, default 1).

With several torchrun agents the restart counts differ per node (an agent that restarts because
another node failed does not count a restart), so a restarted rank can see attempt 0 again. Set
``LOCALCKPT_FAULTS_ONCE_DIR`` to a directory shared by the job's processes and each fault fires
at most once in the whole job: the first process to fire it leaves a marker file there.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

POINTS = ("staging", "local_write", "before_commit", "replica_send", "replica_receive",
          "after_commit", "finalize", "find_latest", "load_retrieval", "load_write_back",
          "persist_write", "persist_commit", "durable_fetch")
ACTIONS = ("kill", "kill_node", "raise", "enospc", "sleep")


class InjectedFault(RuntimeError):
    """Raised by a fault point armed with the ``raise`` action."""


@dataclass
class Fault:
    point: str
    action: str
    rank: int | None = None
    iteration: int | None = None
    attempt: int | None = 0  # None: every attempt
    seconds: float = 3600.0
    times: int = 1

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ValueError(f"fault point: expected one of {POINTS}, got {self.point!r}")
        if self.action not in ACTIONS:
            raise ValueError(f"fault action: expected one of {ACTIONS}, got {self.action!r}")

    def matches(self, point: str, rank: int, iteration: int | None) -> bool:
        return (self.times > 0 and point == self.point
                and (self.rank is None or self.rank == rank)
                and (self.iteration is None or self.iteration == iteration)
                and (self.attempt is None or self.attempt == _attempt()))


_armed: list[Fault] | None = None  # None: nothing armed, fault_point returns at once


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def parse(spec: str) -> list[Fault]:
    """Faults from the ``LOCALCKPT_FAULTS`` syntax; raises ValueError naming the bad part."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        fields = part.split(":")
        if len(fields) < 2:
            raise ValueError(f"LOCALCKPT_FAULTS: expected POINT:ACTION[:key=value...], got "
                             f"{part!r}")
        kwargs: dict[str, object] = {}
        for kv in fields[2:]:
            key, sep, value = kv.partition("=")
            if not sep or key not in ("rank", "iteration", "attempt", "seconds", "times"):
                raise ValueError(f"LOCALCKPT_FAULTS: expected rank=, iteration=, attempt=, "
                                 f"seconds= or times=, got {kv!r} in {part!r}")
            if key == "attempt" and value == "*":
                kwargs[key] = None
            else:
                kwargs[key] = float(value) if key == "seconds" else int(value)
        faults.append(Fault(fields[0], fields[1], **kwargs))  # type: ignore[arg-type]
    return faults


def arm(*faults: Fault) -> None:
    """Arm ``faults`` in this process (in addition to those already armed)."""
    global _armed
    _armed = [*(_armed or []), *faults]


def disarm() -> None:
    global _armed
    _armed = None


def fault_point(point: str, rank: int, iteration: int | None = None) -> None:
    """Fire the first armed fault matching (point, rank, iteration), if any."""
    if _armed is None:
        return
    for fault in _armed:
        if fault.matches(point, rank, iteration) and _first_in_job(fault):
            fault.times -= 1
            _fire(fault, rank, iteration)
            return


def fired_marker(fault: Fault) -> str:
    """The name of the file that says ``fault`` fired, in ``LOCALCKPT_FAULTS_ONCE_DIR``."""
    return f"fired-{fault.point}-{fault.action}-{fault.rank}-{fault.iteration}-{fault.attempt}"


def _first_in_job(fault: Fault) -> bool:
    once_dir = os.environ.get("LOCALCKPT_FAULTS_ONCE_DIR")
    if not once_dir:
        return True
    marker = os.path.join(once_dir, fired_marker(fault))
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _fire(fault: Fault, rank: int, iteration: int | None) -> None:
    what = f"fault {fault.point}:{fault.action} on rank {rank}, iteration {iteration}"
    logger.warning("injecting %s", what)
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "kill_node":
        _kill_node()
    elif fault.action == "raise":
        raise InjectedFault(f"injected {what}")
    elif fault.action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected {what})")
    elif fault.action == "sleep":
        time.sleep(fault.seconds)


def _kill_node() -> None:
    """SIGKILL the parent (the node's torchrun agent), its other children (this node's ranks)
    and this process: the node is gone at once, as when a machine dies."""
    me, parent = os.getpid(), os.getppid()
    siblings = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                siblings.append(int(entry))
    for pid in (parent, *siblings, me):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


if os.environ.get("LOCALCKPT_FAULTS"):
    arm(*parse(os.environ["LOCALCKPT_FAULTS"]))
