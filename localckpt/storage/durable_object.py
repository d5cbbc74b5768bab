"""The durable tier on object storage (S3 and S3-compatible servers), through obstore.

obstore (Rust's ``object_store`` crate) was measured against s3fs on this machine, against a local
S3-protocol server, 16 MiB objects: single-part PUT 0.32 / 0.45 / 0.54 GB/s on 1 / 4 / 8 threads
against s3fs's 0.21 / 0.41 / 0.35, GET 1.1 / 1.7 / 1.7 GB/s against 0.67 / 0.77 / 0.71. It
releases the GIL for the whole request, has a blocking API that fits the tier's I/O threads, is one
wheel with no dependencies (s3fs brings aiobotocore, botocore and aiohttp), and zarr reads what it
writes through ``zarr.storage.ObjectStore``.

The objects are the files of a node root, under the same keys::

    <prefix>/<session>/iter_<iteration>/rank_<owner>_of_<world>/zarr.json      the manifest
    <prefix>/<session>/iter_<iteration>/rank_<owner>_of_<world>/data/zarr.json
    <prefix>/<session>/iter_<iteration>/rank_<owner>_of_<world>/data/c/<i>     chunk + CRC-32C

so ``zarr.open_group`` reads a persisted shard from the bucket as it reads one from a directory.
A PUT replaces an object atomically, which is all the tier's commit needs: a shard's chunks go
first and its ``zarr.json`` last (a shard without one is not there), the job's commit file after
every shard. Each chunk's CRC-32C is checked against the manifest before it is sent, and SigV4
signs every body's SHA-256, which the server checks before it stores the object.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Mapping
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ..errors import ConfigurationError, CorruptShardError
from .checksum import crc32c
from .layout import session_dir, shard_path
from .manifest import ShardManifest
from .shard_writer import array_metadata, group_metadata
from .views import byte_view

if TYPE_CHECKING:
    from .durable import ChunkFill, EachChunk

_ITER = re.compile(r"iter_([0-9]{10})")
_SCHEMES = ("s3://", "s3a://")
T = TypeVar("T")
_ROOT = Path("/")  # any root: a key is only the last names of a path


def is_object_url(root: object) -> bool:
    """Whether ``root`` names object storage (``s3://bucket/prefix``) rather than a directory."""
    return isinstance(root, str) and root.startswith(_SCHEMES)


def shard_key(iteration: int, owner: int, world_size: int) -> str:
    """``iter_<iteration>/rank_<owner>_of_<world>``: a shard's key under its session (the same
    names, and the same checks, as a node root's directories)."""
    path = shard_path(_ROOT, "", iteration, owner, world_size)
    return f"{path.parent.name}/{path.name}"


def _iteration_prefix(iteration: int) -> str:
    """``iter_<iteration>/``: the session-relative prefix of an iteration's objects."""
    return shard_key(iteration, 0, 1).split("/")[0] + "/"


def _last(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


# obstore reports a timeout, a refused or reset connection, a body cut off and a server that
# answers 5xx alike, as a GenericError; the structured part of its text (after "Debug source:",
# where strings such as a response body are quoted on one line) names the kind. Which it is
# decides a restore: a store that does not serve fails every older iteration alike
# (DurableTierUnavailableError: retry later), a bad object only its own (try an older one); the
# load tells them apart by the builtin class. A 5xx that concerns one object only (an
# unreadable one) is taken for the store's: the job then waits instead of loading an older one,
# which is recoverable; the other way round it could start afresh.
_TIMED_OUT = re.compile(r"^\s*(kind: Timeout|source: TimedOut),?$", re.MULTILINE)
_UNREACHABLE = re.compile(
    r"^\s*kind: (Connect|Interrupted|ConnectionRefused|ConnectionReset|ConnectionAborted|"
    r"NotConnected|UnexpectedEof|BrokenPipe),?$|^\s*status: 5\d\d,?$", re.MULTILINE)


def _translate(exc: Exception, what: str) -> OSError:
    import obstore.exceptions as obs_errors

    if isinstance(exc, (obs_errors.NotFoundError, FileNotFoundError)):
        return FileNotFoundError(f"{what}: not found")
    text = str(exc)
    first = text.splitlines()[0] if text else ""
    message = f"{what}: {type(exc).__name__}: {first}"
    if isinstance(exc, OSError):  # a builtin already says what it is
        return type(exc)(message)
    if isinstance(exc, obs_errors.GenericError) and "Debug source:" in text:
        structured = text.split("Debug source:", 1)[1]
        if _TIMED_OUT.search(structured):
            return TimeoutError(message)
        if _UNREACHABLE.search(structured):
            return ConnectionError(message)
    return OSError(message)


# obstore's S3 settings that name the endpoint (an http:// one needs allow_http), the bucket
# (the URL's; another one would put objects where no message says), and client settings.
_ENDPOINT_KEYS = {"endpoint", "aws_endpoint", "endpoint_url", "aws_endpoint_url",
                  "aws_endpoint_url_s3"}
_ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")
_BUCKET_KEYS = {"bucket", "bucket_name", "aws_bucket", "aws_bucket_name"}
_CLIENT_KEYS = {"allow_http", "allow_invalid_certificates", "connect_timeout", "timeout",
                "proxy_url", "proxy_ca_certificate", "proxy_excludes", "user_agent",
                "pool_idle_timeout", "pool_max_idle_per_host", "http1_only", "http2_only",
                "default_content_type"}


def _split_settings(url: str, options: Mapping[str, Any]) -> tuple[dict[str, Any],
                                                                   dict[str, Any]]:
    """(S3 settings, HTTP client settings) from a tier's ``options``; ConfigurationError for
    one naming a bucket."""
    config, client = {}, {}
    for key, value in options.items():
        name = key.lower().removeprefix("aws_")
        if key.lower() in _BUCKET_KEYS:
            raise ConfigurationError(f"durable tier {url}: options: {key!r} would put the "
                                     "objects in another bucket than the root names; name the "
                                     "bucket in the root (s3://bucket/prefix)")
        if name in _CLIENT_KEYS:
            client[name] = value
        else:
            config[key] = value
    return config, client


class ObjectBackend:
    """Byte moves for :class:`localckpt.storage.durable.DurableStore` on a bucket. Every method
    may raise OSError (the store's errors become OSError; a missing key FileNotFoundError) or
    CorruptShardError. ``options`` are obstore's S3 settings (``endpoint``, ``region``,
    ``access_key_id``...; the ``AWS_*`` environment fills in the rest); each request gives up
    after ``timeout`` seconds, retries included."""

    poll_s = 0.25  # a listing is a billed request

    def __init__(self, url: str, session_id: str, io_threads: int, timeout: float,
                 options: Mapping[str, Any] | None = None) -> None:
        try:
            import obstore
            from obstore.store import S3Store
        except ImportError as exc:  # pragma: no cover - the extra is not installed
            raise ConfigurationError(f"durable tier {url}: object storage needs obstore "
                                     f"(pip install 'localckpt[s3]'): {exc}") from exc
        config, client = _split_settings(url, options or {})
        endpoint = next((str(v) for k, v in config.items() if k.lower() in _ENDPOINT_KEYS),
                        "") or next((os.environ[k] for k in _ENDPOINT_ENV if os.environ.get(k)),
                                    "")
        client = {"timeout": timedelta(seconds=timeout),
                  "connect_timeout": timedelta(seconds=min(timeout, 10.0)),
                  "allow_http": endpoint.startswith("http://"),  # asked for by the endpoint
                  **client}
        retry = {"max_retries": 3, "retry_timeout": timedelta(seconds=timeout)}
        try:
            self._store = S3Store.from_url(
                url, config=config, client_options=client,  # type: ignore[arg-type]
                retry_config=retry)  # type: ignore[arg-type]
        except BaseException as exc:  # obstore panics (a BaseException) on some settings
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise ConfigurationError(f"durable tier: expected s3://bucket[/prefix] and obstore "
                                     f"S3 settings, got {url!r} with settings "
                                     f"{sorted(config)} and client settings {sorted(client)}: "
                                     f"{str(exc).splitlines()[0] if str(exc) else exc!r}"
                                     ) from None
        self._obstore = obstore
        self.where = url
        self._session = session_dir(_ROOT, session_id).name
        self.threads = max(io_threads, 8)  # requests in flight: latency, not cores, bounds them

    def close(self) -> None:
        """Nothing to release: obstore's client has no open state to close."""

    def _key(self, key: str) -> str:
        return f"{self._session}/{key}"

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, the store's errors made OSError naming the object (one line: a server's
        error body can be long, or carry tokens); a missing one FileNotFoundError."""
        try:
            return fn()
        except CorruptShardError:
            raise
        except Exception as exc:
            raise _translate(exc, f"{self.where}/{self._key(what)}") from None

    # ------------------------------------------------------------------ listing and records

    def _listing(self, prefix: str) -> tuple[list[str], list[str]]:
        """(sub-prefix names, object names) directly under ``prefix`` (a session-relative
        key ending in '/'), last path component only."""
        got = self._call(prefix, lambda: self._obstore.list_with_delimiter(
            self._store, self._key(prefix)))
        return ([_last(p) for p in got["common_prefixes"]],
                [_last(o["path"]) for o in got["objects"]])

    def sessions(self) -> list[str]:
        """Session ids with objects under the store's prefix ("" for the default session)."""
        got = self._call("", lambda: self._obstore.list_with_delimiter(self._store, None))
        names = [_last(p) for p in got["common_prefixes"]]
        default = session_dir(_ROOT, "").name
        out = []
        for name in names:
            try:
                sid = "" if name == default else name
                if session_dir(_ROOT, sid).name == name:
                    out.append(sid)
            except ConfigurationError:
                continue
        return sorted(out)

    def sizes(self, iteration: int) -> dict[str, int]:
        """Bytes under each entry of ``iteration`` (shard names, record names)."""
        out: dict[str, int] = {}
        prefix = _iteration_prefix(iteration)
        for path, size in self._all_under(prefix):
            entry = path[len(self._key(prefix)):].split("/", 1)[0]
            out[entry] = out.get(entry, 0) + size
        return out

    def iterations(self) -> list[int]:
        prefixes, _ = self._listing("")
        return sorted(int(m[1]) for p in prefixes if (m := _ITER.fullmatch(p)))

    def names(self, iteration: int) -> list[str]:
        prefixes, objects = self._listing(_iteration_prefix(iteration))
        return prefixes + objects

    def read(self, key: str) -> bytes:
        return bytes(self._fetch(key))

    def _fetch(self, key: str, expect_size: int | None = None) -> memoryview:
        """The object's bytes, not copied; CorruptShardError before the body is read when
        its size is not ``expect_size``."""
        def get() -> memoryview:
            result = self._obstore.get(self._store, self._key(key))
            size = result.meta["size"]
            if expect_size is not None and size != expect_size:
                raise CorruptShardError(f"{self.where}/{self._key(key)}: expected "
                                        f"{expect_size} bytes, the object has {size}")
            return memoryview(result.bytes())
        return self._call(key, get)

    def write(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self._call(key, lambda: self._obstore.put(self._store, self._key(key), data,
                                                  use_multipart=False))

    def remove(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._call(key, lambda: self._obstore.delete(self._store, self._key(key)))

    def _all_under(self, prefix: str) -> list[tuple[str, int]]:
        """(key, bytes) of every object under ``prefix`` (a session-relative key ending in
        '/'), keys relative to the store's prefix."""
        def listing() -> list[tuple[str, int]]:
            stream = self._obstore.list(self._store, self._key(prefix), chunk_size=1000)
            return [(o["path"], int(o["size"])) for batch in stream for o in batch]
        return self._call(prefix, listing)

    def _delete(self, keys: list[str], what: str) -> None:
        """Delete ``keys`` (relative to the store's prefix), a thousand per request (S3's
        limit)."""
        for start in range(0, len(keys), 1000):
            self._call(what, partial(self._obstore.delete, self._store,
                                     keys[start: start + 1000]))

    # ------------------------------------------------------------------ shards

    def put_shard(self, manifest: ShardManifest, fill: ChunkFill,
                  each_chunk: EachChunk) -> None:
        """Chunks in parallel, then the array's metadata, the manifest last. A shard already
        under this key (another save's) loses its manifest first: no reader pairs it with
        these chunks."""
        key = shard_key(manifest.iteration, manifest.owner_rank, manifest.world_size)
        self.remove(f"{key}/zarr.json")
        size = manifest.chunk_nbytes

        def put_chunk(index: int, buf: torch.Tensor) -> None:  # buf: chunk_nbytes + 4 bytes
            fill(index, buf[:size])
            body = byte_view(buf)
            crc = crc32c(body[:size])
            if manifest.chunk_crc32c and crc != manifest.chunk_crc32c[index]:
                raise CorruptShardError(f"shard {key}: chunk {index} changed since it was "
                                        f"verified (crc32c {crc:#010x}, manifest says "
                                        f"{manifest.chunk_crc32c[index]:#010x})")
            body[size:] = crc.to_bytes(4, "little")
            self.write(f"{key}/data/c/{index}", body)

        each_chunk(manifest, put_chunk, 4)
        self.write(f"{key}/data/zarr.json",
                   json.dumps(array_metadata(size, manifest.chunk_count)).encode())
        self.write(f"{key}/zarr.json", group_metadata(manifest))

    def fill_chunk(self, manifest: ShardManifest, index: int, out: torch.Tensor) -> None:
        """Chunk ``index`` into ``out``, checked against the object's trailer and the manifest
        (a shard replaced meanwhile does not pass)."""
        key = shard_key(manifest.iteration, manifest.owner_rank, manifest.world_size)
        size = manifest.chunk_nbytes
        name = f"{key}/data/c/{index}"
        data = self._fetch(name, expect_size=size + 4)
        crc = crc32c(data[:size])
        stored = int.from_bytes(data[size:], "little")
        if crc != stored or crc != manifest.chunk_crc32c[index]:
            raise CorruptShardError(
                f"{self.where}/{self._key(name)}: checksum mismatch (computed crc32c "
                f"{crc:#010x}, object says {stored:#010x}, manifest says "
                f"{manifest.chunk_crc32c[index]:#010x})")
        byte_view(out)[:] = data[:size]

    def delete_shards(self, iteration: int, world_size: int) -> None:
        """Every shard of ``world_size`` in ``iteration``: one listing, the manifests first
        (each shard is then no longer there), then the rest, a thousand keys per request."""
        tag = f"_of_{world_size:05d}/"
        keys = [k for k, _ in self._all_under(_iteration_prefix(iteration)) if tag in k]
        manifests = {k for k in keys if k.endswith(tag + "zarr.json")}  # .../rank_*_of_W/
        self._delete(sorted(manifests), _iteration_prefix(iteration))
        self._delete([k for k in keys if k not in manifests], _iteration_prefix(iteration))

    def remove_iteration(self, iteration: int) -> None:
        prefix = _iteration_prefix(iteration)
        self._delete([k for k, _ in self._all_under(prefix)], prefix)

    def remove_if_empty(self, iteration: int) -> None:
        """Nothing to do: a prefix is gone with its last object."""

    def remove_trash(self) -> None:
        """Nothing to do: objects are deleted, never hidden first."""
