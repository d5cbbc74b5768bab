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
iteration's chunk files more than without recycling: that is the price, hence opt-in.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import threading
import time
import uuid
from pathlib import Path

from .fsutil import make_private_dir

RECYCLE_DIR = ".recycle"


class FilePool:
    """The pool of one node root's session. Thread-safe; several processes may share it."""

    def __init__(self, session_path: Path) -> None:
        self.path = session_path / RECYCLE_DIR
        self._lock = threading.Lock()
        self._names: list[str] = []  # what the last scan found and this process has not tried
        self._added: set[str] = set()  # what this process put in (see drain_own)
        self._scanned: int | None = None  # the directory's mtime at that scan

    def add_chunks_of(self, shard_dir: Path) -> None:
        """Move the chunk files of a hidden (deleted) shard directory into the pool, each named
        by when it arrived; the rest of the directory is left to the caller."""
        chunks = shard_dir / "data" / "c"
        make_private_dir(self.path)
        with os.scandir(chunks) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    name = f"{time.monotonic_ns():020d}-{uuid.uuid4().hex[:12]}"
                    with contextlib.suppress(FileNotFoundError):
                        os.rename(entry.path, self.path / name)
                        with self._lock:
                            self._added.add(name)

    def preallocate(self, count: int, nbytes: int) -> None:
        """Put ``count`` new files of ``nbytes`` (pages touched) in the pool: the first save of
        a fresh job then writes over them as later saves write over retired ones."""
        make_private_dir(self.path)
        block = memoryview(bytes(min(nbytes, 1 << 20)))
        for _ in range(count):
            name = f"{time.monotonic_ns():020d}-{uuid.uuid4().hex[:12]}"
            fd = os.open(self.path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                left = nbytes
                while left:
                    left -= os.write(fd, block[:left])
            finally:
                os.close(fd)
            with self._lock:
                self._added.add(name)

    def take(self, target: Path) -> bool:
        """Move one pooled file to ``target`` (which must not exist); False when there is none.
        The file is a regular file this library wrote, of any size."""
        while True:
            with self._lock:
                if not self._names and not self._rescan():
                    return False
                name = self._names.pop()
            try:
                os.rename(self.path / name, target)
            except FileNotFoundError:  # another rank of the node took it, or it was drained
                continue
            st = os.lstat(target)
            if stat.S_ISREG(st.st_mode):
                return True
            # never a file this library put there: not written through
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(target, ignore_errors=True)
            else:
                os.unlink(target)

    def _rescan(self) -> bool:
        """List the pool again if it changed since the last listing; whether it holds any."""
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            return False
        if mtime == self._scanned:
            return False
        self._scanned = mtime
        with os.scandir(self.path) as entries:
            self._names = sorted(e.name for e in entries)
        return bool(self._names)

    def nbytes(self) -> int:
        """Bytes held by the pool: space a save may count as free."""
        total = 0
        with contextlib.suppress(FileNotFoundError), os.scandir(self.path) as entries:
            for entry in entries:
                with contextlib.suppress(FileNotFoundError):
                    total += entry.stat(follow_symlinks=False).st_size
        return total

    def drain_own(self) -> None:
        """Delete what this process put in the pool and nobody took (when it closes: other
        processes of the node may still be saving, and take what they put in themselves)."""
        with self._lock:
            names, self._added = self._added, set()
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path / name)

    def drain(self, before_ns: int | None = None) -> None:
        """Delete the pooled files that arrived before ``before_ns`` (time.monotonic_ns; None:
        all): those the save that started then did not take."""
        with contextlib.suppress(FileNotFoundError), os.scandir(self.path) as entries:
            for entry in entries:
                stamp = entry.name.split("-", 1)[0]
                if before_ns is None or not stamp.isdigit() or int(stamp) < before_ns:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
