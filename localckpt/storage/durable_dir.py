"""The durable tier on a shared file system (Lustre, GPFS, NFS): a directory every rank sees.

Shards are written by the same :class:`ShardStore` as a node root (committed by a directory
rename, fsynced); the job's records (commit files, progress records) by write, fsync, rename and
directory fsync. Keys are paths relative to the session directory.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .fsutil import fsync_dir
from .layout import iteration_dir, list_iterations
from .manifest import ShardManifest
from .store import ShardStore
from .views import byte_view

if TYPE_CHECKING:
    from .durable import ChunkFill, EachChunk


def _names(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []


_SHARD_NAME = re.compile(r"rank_([0-9]{5})_of_([0-9]{5})")
_SAFE_KEY = re.compile(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*")


class DirectoryBackend:
    """Byte moves for :class:`localckpt.storage.durable.DurableStore` on a directory. Every
    method may raise OSError; a missing key reads as FileNotFoundError."""

    poll_s = 0.05  # a listing is a system call

    def __init__(self, root: Path, session_id: str, rank: int, io_threads: int) -> None:
        self.threads = io_threads
        self.root = root
        self.where = str(root)
        self.session_id = session_id
        self.store = ShardStore(root, session_id, writer_rank=rank, io_threads=io_threads,
                                fault_points=False)

    def close(self) -> None:
        self.store.close()

    def _path(self, key: str) -> Path:
        if not _SAFE_KEY.fullmatch(key) or ".." in key.split("/"):
            raise ValueError(f"durable key: expected a relative name, got {key!r}")
        return self.store.session_path / key

    # ------------------------------------------------------------------ listing and records

    def iterations(self) -> list[int]:
        return list_iterations(self.root, self.session_id)

    def names(self, iteration: int) -> list[str]:
        return _names(iteration_dir(self.root, self.session_id, iteration))

    def read(self, key: str) -> bytes:
        with open(os.open(self._path(key), os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
            return f.read()

    def write(self, key: str, data: bytes) -> None:
        """Replace ``key`` atomically and durably (written, fsynced, renamed, directory
        fsynced)."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".tmp-record-{uuid.uuid4().hex}"
        try:
            with open(tmp, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)

    def remove(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        with contextlib.suppress(FileNotFoundError):
            fsync_dir(path.parent)

    # ------------------------------------------------------------------ shards

    def put_shard(self, manifest: ShardManifest, fill: ChunkFill,
                  each_chunk: EachChunk) -> None:
        """Chunk by chunk through a writer (each chunk's CRC checked against ``manifest`` as it
        is written), committed by rename."""
        self.store.session_path.mkdir(parents=True, exist_ok=True)
        writer = self.store.begin_write(manifest)
        try:
            def copy(index: int, buf: torch.Tensor) -> None:
                fill(index, buf)
                writer.submit_chunk(index, byte_view(buf))
                writer.wait_chunk(index)  # the buffer is then free for the next chunk
            each_chunk(manifest, copy, 0)
            self.store.commit(writer)
        except BaseException:
            writer.abort()
            raise

    def fill_chunk(self, manifest: ShardManifest, index: int, out: torch.Tensor) -> None:
        """Chunk ``index`` into ``out``, checked against ``manifest``'s CRCs: a shard replaced
        meanwhile does not pass."""
        ref = self.store.ref(manifest.iteration, manifest.owner_rank, manifest.world_size)
        self.store.read_range(ref, manifest, index * manifest.chunk_nbytes, out)

    def delete_shards(self, iteration: int, world_size: int) -> None:
        """Every shard of ``world_size`` in ``iteration`` (its directory listed, nothing else),
        each hidden by a rename first."""
        for name in self.names(iteration):
            if (m := _SHARD_NAME.fullmatch(name)) and int(m[2]) == world_size \
                    and int(m[1]) < world_size:  # else no shard of a job: not listed either
                self.store.delete(self.store.ref(iteration, int(m[1]), world_size))

    def remove_iteration(self, iteration: int) -> None:
        """Everything under ``iteration``: hidden by one rename, then deleted."""
        directory = iteration_dir(self.root, self.session_id, iteration)
        trash = directory.with_name(f".trash-durable-{uuid.uuid4().hex}")
        try:
            os.rename(directory, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def remove_if_empty(self, iteration: int) -> None:
        with contextlib.suppress(OSError):
            iteration_dir(self.root, self.session_id, iteration).rmdir()

    def remove_trash(self) -> None:
        """Rank 0's deletions a crash interrupted: the hidden ``.trash-*`` directories of the
        session (only deletions make them, and only rank 0 deletes here)."""
        with contextlib.suppress(FileNotFoundError), os.scandir(self.store.session_path) as it:
            trash = [e.path for e in it if e.name.startswith(".trash-")
                     and e.is_dir(follow_symlinks=False)]
        for path in trash:
            shutil.rmtree(path, ignore_errors=True)
