"""A lock on one session directory of one node: shared by every live manager of the session,
exclusive for an operator command that deletes (``localckpt gc``).

It is an ``flock`` on the session directory itself: the kernel drops it when its holder dies, so
a killed job never leaves a stale lock behind, and there is no lock file that someone could
delete (a new file would let a second holder in beside the first).
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from ..errors import SessionInUseError


class SessionLock:
    """Holds the lock of ``session_path`` (an existing directory) until :meth:`release`.

    Shared: waits up to ``wait`` seconds for an operator command to finish. Exclusive: does not
    wait. Raises SessionInUseError naming the session and who holds it.
    """

    def __init__(self, session_path: Path, exclusive: bool, wait: float = 0.0) -> None:
        self.path = session_path
        self._fd: int | None = os.open(
            session_path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            self._take(fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, wait)
        except BaseException:
            self.release()
            raise

    def _take(self, mode: int, wait: float) -> None:
        deadline = time.monotonic() + wait
        while True:
            assert self._fd is not None
            try:
                fcntl.flock(self._fd, mode | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = ("a running job (a LocalCheckpointManager of this session is live "
                              "on this node)" if mode == fcntl.LOCK_EX else
                              "an operator command (localckpt gc) that is deleting in it, "
                              "or a starting manager removing crash leftovers")
                    raise SessionInUseError(
                        f"session directory {self.path} is in use by {holder}; try again "
                        "when it has finished") from None
                time.sleep(0.05)

    def share(self, wait: float) -> None:
        """Turn an exclusive lock into a shared one, waiting up to ``wait`` seconds: flock
        converts by releasing, then taking, so gc may get in between (SessionInUseError, the
        lock then released)."""
        try:
            self._take(fcntl.LOCK_SH, wait)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> SessionLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
