"""Chunk files of deleted shards, kept to be written over by the next save (opt-in).

On tmpfs a write into a new file costs page allocation and zeroing (2.0 GB/s on the machines of
docs/benchmarks.md), a write over an existing file does not (3.9 GB/s), and deleting a shard
frees its pages at about the cost of writing them. With ``recycle_files=True`` retention does
not free the chunk files of the shards it deletes: it moves them into the node's pool
(``<session>/.recycle/``, one per node root, shared by its ranks), and the next writes of that
node take them from there, each by one ``rename`` into a new shard's temporary directory, before
writing over them.

The commit protocol is unchanged: a pooled file belongs to no shard (its shard was hidden by
the rename that deleted it), and once taken it is part of a ``.tmp-*`` directory that is either
renamed into place whole or removed as a leftover. Two ranks taking the same file race on the
rename: one wins, the other takes the next (or writes a new file). What a save does not take is
deleted after it (:meth:`FilePool.drain`), so between saves a node holds at most one retired
iteration's chunk files more than without recycling: that is the price, hence opt-in. Pooled
files are not counted as free space; a save short of space frees the pool first (saver.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from .fsutil import make_private_dir
from .layout import RECYCLE_DIR

_NAME = re.compile(r"[0-9]{20}-[0-9a-f]{12}")  # <arrival ns>-<uuid>: a complete pooled file
_RESCAN_S = 0.05  # a listing older than this is taken again even if the mtime did not change

logger = logging.getLogger(__name__)


class FilePool:
    """The pool of one node root's session. Thread-safe; several processes may share it.

    Only files with a single link are pooled or taken (a hard-linked copy of a session must
    never be written through), and only complete ones: a file is published under its final
    name by a rename once it is whole. A pool that is not a plain directory is never used."""

    def __init__(self, session_path: Path) -> None:
        self.path = session_path / RECYCLE_DIR
        self._lock = threading.Lock()
        self._names: list[str] = []  # what the last scan found and this process has not tried
        self._scanned: tuple[int, float] | None = None  # (dir mtime, monotonic) of that scan
        self._added: set[str] = set()  # what this process put in (see drain_own)

    def _usable(self) -> bool:
        try:
            return stat.S_ISDIR(os.lstat(self.path).st_mode)
        except FileNotFoundError:
            return False

    def _new_name(self) -> str:
        return f"{time.monotonic_ns():020d}-{uuid.uuid4().hex[:12]}"

    def add_chunks_of(self, shard_dir: Path) -> None:
        """Move the chunk files of a hidden (deleted) shard directory into the pool, each named
        by when it arrived; the rest of the directory is left to the caller."""
        make_private_dir(self.path)
        if not self._usable():
            return
        for d in (shard_dir, shard_dir / "data", shard_dir / "data" / "c"):
            if not stat.S_ISDIR(os.lstat(d).st_mode):  # a link: not this shard's files
                return
        with os.scandir(shard_dir / "data" / "c") as entries:
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                    continue  # a hard-linked copy shares it: only our name goes (rmtree)
                name = self._new_name()
                with contextlib.suppress(FileNotFoundError):
                    os.rename(entry.path, self.path / name)
                    with self._lock:
                        self._added.add(name)

    def preallocate(self, count: int, nbytes: int) -> None:
        """Have at least ``count`` pooled files of ``nbytes`` or more (pages touched): the first
        save of a fresh job then writes over them as later saves write over retired ones. Only
        the shortfall is created, only while the file system keeps room for the save itself;
        never raises (a failure is logged, and that save writes new files)."""
        try:
            if not (self._usable() or make_private_dir(self.path) or self._usable()):
                return
            have = sum(1 for _, size in self._pooled() if size >= nbytes)
            st = os.statvfs(self.path)
            room = (st.f_bavail * st.f_frsize) // 2 // max(nbytes, 1)  # half: the save's own
            block = memoryview(bytes(min(nbytes, 1 << 20)))
            for _ in range(min(count - have, room)):
                part = self.path / f".part-{uuid.uuid4().hex}"
                try:
                    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    try:
                        left = nbytes
                        while left:
                            left -= os.write(fd, block[:left])
                    finally:
                        os.close(fd)
                    name = self._new_name()
                    os.rename(part, self.path / name)  # published whole
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(part)
                    raise
                with self._lock:
                    self._added.add(name)
        except OSError as exc:
            logger.warning("recycle_files: could not prepare files for the first save under %s "
                           "(%s); it writes new files", self.path, exc)

    def _pooled(self) -> Iterator[tuple[str, int]]:
        """(name, size) of every complete, singly linked pooled file."""
        with contextlib.suppress(FileNotFoundError), os.scandir(self.path) as entries:
            for entry in entries:
                if _NAME.fullmatch(entry.name):
                    with contextlib.suppress(FileNotFoundError):
                        st = entry.stat(follow_symlinks=False)
                        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                            yield entry.name, st.st_size

    def take(self, target: Path) -> bool:
        """Move one pooled file to ``target`` (which must not exist); False when there is none
        or the pool cannot be used (then the caller writes a new file). The file is a regular
        file of one link that this library wrote, of any size."""
        while True:
            with self._lock:
                if not self._names and not self._rescan():
                    return False
                name = self._names.pop()
            with self._lock:  # taken (or gone): not this process's to remove at close
                self._added.discard(name)
            try:
                os.rename(self.path / name, target)
            except FileNotFoundError:  # another rank of the node took it, or it was drained
                continue
            except OSError as exc:  # not ours to fix here: write a new file
                logger.warning("recycle_files: cannot take %s (%s)", self.path / name, exc)
                return False
            st = os.lstat(target)
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                return True
            # linked elsewhere since it was pooled, or not a file: never written through
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(target, ignore_errors=True)
            else:
                os.unlink(target)

    def _rescan(self) -> bool:
        """List the pool again if it may have changed since the last listing; whether it holds
        any file to take."""
        if not self._usable():
            return False
        mtime = os.stat(self.path).st_mtime_ns
        now = time.monotonic()
        if self._scanned is not None and self._scanned[0] == mtime \
                and now - self._scanned[1] < _RESCAN_S:
            return False
        self._scanned = (mtime, now)
        self._names = sorted(name for name, _ in self._pooled())
        return bool(self._names)

    def holds_any(self) -> bool:
        """Whether some file is pooled (space that statvfs does not count as free). Asked by
        every save on the training thread: it stops at the first file."""
        return next(self._pooled(), None) is not None

    def drain_own(self) -> None:
        """Delete what this process put in the pool and nobody took (when it closes: other
        processes of the node may still be saving, and take what they put in themselves)."""
        with self._lock:
            names, self._added = self._added, set()
        for name in names:
            with contextlib.suppress(OSError):
                os.unlink(self.path / name)

    def drain(self, before_ns: int | None = None, deadline: float | None = None) -> None:
        """Delete the pooled files that arrived before ``before_ns`` (time.monotonic_ns), or
        before this boot: those the save that started then did not take. None: everything in
        the pool (no rank of the node may be writing then). Stops at ``deadline``
        (time.monotonic()), if given: freeing tmpfs pages takes about 0.4 s per GiB, and a
        caller inside an exchange must answer within the timeout."""
        if not self._usable():
            return
        with contextlib.suppress(FileNotFoundError), os.scandir(self.path) as entries:
            for entry in entries:
                if deadline is not None and time.monotonic() > deadline:
                    return
                stamp = entry.name.split("-", 1)[0]
                # a stamp past this boot's clock is an earlier boot's (a root on NVMe)
                if before_ns is None or (_NAME.fullmatch(entry.name) and (
                        int(stamp) < before_ns or int(stamp) > time.monotonic_ns())):
                    with self._lock:
                        self._added.discard(entry.name)
                    with contextlib.suppress(OSError):
                        if entry.is_dir(follow_symlinks=False):
                            shutil.rmtree(entry.path, ignore_errors=True)
                        else:
                            os.unlink(entry.path)
