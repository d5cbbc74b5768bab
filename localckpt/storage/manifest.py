"""The shard manifest: versioned JSON, typed dataclasses, strict parsing.

The manifest is stored in the zarr group's attributes under ``"localckpt"`` together with a CRC-32C
of its canonical JSON form, so a flipped byte in the manifest is detected like one in the data.
Format history: version 1; version 2 adds DTensor (``{"DT": ...}``) and Stateful (``{"S": ...}``)
nodes to the hollow structure; version 3 DTensor nodes whose replicated shard another rank stored
(``"replica"``); version 4 (this one) numpy, torch.Generator, dataclass and named tuple nodes
(:mod:`localckpt.leaves`); version 5 parity blocks of erasure-coded stripes (``"parity"``,
see :mod:`localckpt.storage.parity_info`); version 6 the tensor table in columns, for shards of
COLUMNS_MIN_TENSORS tensors or more. A writer uses the lowest version that describes the shard;
a reader reads all six and rejects any other version with :class:`UnsupportedFormatError`
rather than guessing.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from replication import parity_slot

from ..dtensors import DTensorLayout
from ..errors import CorruptShardError, UnsupportedFormatError
from ..gc_pause import gc_paused
from .checksum import crc32c
from .hollow_check import MAX_HOLLOW_DEPTH, check_hollow, numpy_byte_tensors
from .parity_info import ParityInfo
from .tensor_table import (
    TensorEntry,
    check_entries,
    dtype_from_name,
    dtype_name,
    entries_from_columns,
    entries_from_rows,
)

__all__ = ["FORMAT_VERSION", "MAX_HOLLOW_DEPTH", "READABLE_VERSIONS", "ShardManifest",
           "TensorEntry", "check_consistent", "check_hollow", "dtype_from_name", "dtype_name",
           "numpy_byte_tensors", "writer_identity"]

FORMAT_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6)
# Version 6: the tensor table in columns ("tensor_table": {field: [value of each tensor]})
# instead of an object per tensor, written for shards of this many tensors or more: 10,000
# entries parse in a third of the time, and encode in half (a load and a save each pay it once
# per shard; smaller tables keep the rows older releases read).
COLUMNS_VERSION = 6
COLUMNS_MIN_TENSORS = 1024

# A shard group's zarr.json as localckpt writes it: this, the manifest's ``encoded`` bytes, "}}".
GROUP_PREFIX = b'{"zarr_format": 3, "node_type": "group", "attributes": {"localckpt": '
GROUP_SUFFIX = b"}}"

@dataclass(frozen=True)
class ShardManifest:
    """What a committed shard holds. ``data_nbytes`` bytes of the packed array are meaningful; the
    array is ``chunk_count * chunk_nbytes`` long (padding is zero)."""

    session_id: str
    iteration: int
    owner_rank: int
    world_size: int
    tensors: tuple[TensorEntry, ...]
    hollow: Any
    container: str  # "plain": the user passed a plain state dict; "basic": a TensorAwareStateDict
    data_nbytes: int
    chunk_nbytes: int
    chunk_count: int
    chunk_crc32c: tuple[int, ...]
    created_unix: float = field(default_factory=time.time)
    identity: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    # {"custom": ..., "metrics": ..., "saved_unix": ..., "save_id": ..., "most_chunks": ...}:
    # what save(..., custom_metadata=, metrics=) was given, rank 0's clock, the save's id and
    # the chunks of its largest shard, in every shard of the iteration (a key older readers
    # skip: it changes nothing they read)
    metadata: dict[str, Any] = field(default_factory=dict)
    # A parity block's (format version 5): what it is the parity of. Its owner_rank is then
    # its slot (replication.parity_slot), below zero.
    parity: ParityInfo | None = None

    @property
    def ckpt_id(self) -> tuple[int, int, str]:
        return (self.iteration, self.owner_rank, self.session_id)

    @functools.cached_property
    def layouts(self) -> dict[int, DTensorLayout]:
        """Tensor index -> the layout of the DTensor whose local shard it is (checked by
        :func:`check_consistent`, which fills this in)."""
        return check_hollow(self.hollow, len(self.tensors), "manifest")

    @functools.cached_property
    def numpy_bytes(self) -> frozenset[int]:
        """Indices of the tensors that hold a numpy array's bytes (not its values in a torch
        dtype): the array's dtype is another than their uint8."""
        if self.format_version < 4:  # older formats hold no numpy arrays: no walk
            return frozenset()
        return numpy_byte_tensors(self.hollow, self.tensors)

    @functools.cached_property
    def replicas(self) -> dict[int, tuple[int, ...]]:
        """Tensor index -> the shape of a replicated DTensor shard this rank did not store
        (another member of its replica group did; see localckpt.save.dedupe)."""
        found: dict[int, tuple[int, ...]] = {}
        check_hollow(self.hollow, len(self.tensors), "manifest", found)
        return found

    @functools.cached_property
    def encoded(self) -> bytes:
        """``to_json_dict()`` as JSON bytes, built once per manifest: the commit writes these
        bytes and replication sends them (tens of ms each for 10,000 tensors). The manifest is
        written in the canonical form its checksum is taken over (sorted keys, no spaces), so a
        reader verifies the bytes as they are, without encoding them again
        (:meth:`from_canonical_envelope`)."""
        with gc_paused():
            canonical = _canonical(self._body())
        return b"".join((_HEAD, canonical, _MARK, str(crc32c(canonical)).encode(), b"}"))

    @classmethod
    def from_json_bytes(cls, data: bytes, where: str) -> ShardManifest:
        """:meth:`from_json_dict` of JSON ``data`` as produced by :attr:`encoded` (a received
        manifest); ``data`` becomes the result's ``encoded``."""
        manifest = cls.from_canonical_envelope(data, where)
        if manifest is not None:
            return manifest
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise CorruptShardError(f"{where}: unreadable manifest ({exc})") from exc
        manifest = cls.from_json_dict(doc, where)
        # The checksum matched, so these bytes encode exactly this manifest.
        manifest.__dict__["encoded"] = bytes(data)
        return manifest

    @classmethod
    def from_canonical_envelope(cls, data: bytes, where: str) -> ShardManifest | None:
        """The manifest of ``data`` laid out as :attr:`encoded` writes it, its checksum taken
        over the manifest's bytes as they are (parsing 10,000 tensors' manifest without
        encoding it again saves about 16 ms), with ``data`` as its ``encoded``; None when
        ``data`` is laid out otherwise or its checksum does not match those bytes (an older
        writer's spacing, or damage: parse it whole, :meth:`from_json_dict`, which says which).
        CorruptShardError for matching bytes that are not one UTF-8 JSON object of finite
        numbers; otherwise raises as :meth:`from_json_dict` does."""
        if not (data.startswith(_HEAD) and data.endswith(b"}")):
            return None
        mark = data.rfind(_MARK)  # the envelope's own: after it come only digits and "}"
        digits = data[mark + len(_MARK) : -1]
        # As json.dumps writes them: the bytes are sent on as they are, and must stay JSON.
        if mark < 0 or not (digits.isdigit() and len(digits) <= 10) or \
                digits != str(int(digits)).encode():
            return None
        span = data[len(_HEAD) : mark]
        if crc32c(span) != int(digits):
            return None
        # The bytes the writer took the checksum over. Matching them proves no damage, not a
        # well-behaved writer: they must still be one UTF-8 JSON object of finite numbers (as
        # re-encoding them would require), which any reader can parse again.
        if not (span.startswith(b"{") and span.endswith(b"}")):
            raise CorruptShardError(f"{where}: unreadable manifest (not one JSON object)")
        with gc_paused():  # the entries too: tens of thousands of small objects
            try:
                body = json.loads(span.decode("utf-8"), parse_constant=_no_constant,
                                  parse_float=_finite_float)
            except (ValueError, RecursionError) as exc:  # UnicodeDecodeError included
                raise CorruptShardError(f"{where}: unreadable manifest ({exc})") from exc
            manifest = cls._from_verified(body, where)
        manifest.__dict__["encoded"] = bytes(data)
        return manifest

    def to_json_dict(self) -> dict[str, Any]:
        body = self._body()
        return {"manifest": body, "crc32c": _crc_of(body)}

    def _body(self) -> dict[str, Any]:
        # Built by hand: dataclasses.asdict deep-copies the hollow structure and every entry
        # (1.5 s for 10,000 tensors).
        body = {name: getattr(self, name) for name in _SCALAR_FIELDS}
        if self.format_version >= COLUMNS_VERSION:  # JSON writes tuples as arrays
            columns = list(zip(*self.tensors, strict=True)) if self.tensors \
                else [()] * len(TensorEntry._fields)
            body["tensor_table"] = dict(zip(TensorEntry._fields, columns, strict=True))
        else:
            body["tensors"] = [
                {"key_path": t.key_path, "dtype": t.dtype, "shape": list(t.shape),
                 "offset": t.offset, "nbytes": t.nbytes, "device": t.device}
                for t in self.tensors
            ]
        body["hollow"] = self.hollow
        body["chunk_crc32c"] = list(self.chunk_crc32c)
        body["identity"] = self.identity
        if self.metadata:
            body["metadata"] = self.metadata
        if self.parity is not None:
            body["parity"] = self.parity.to_json()
        return body

    @classmethod
    def from_json_dict(cls, doc: Any, where: str) -> ShardManifest:
        """Parse and verify a manifest read from ``where`` (named in every error).

        The checksum comes first: the envelope ``{"manifest": ..., "crc32c": ...}`` is the same
        in every format version, so a damaged manifest (a flipped version digit included) is a
        CorruptShardError and only an intact one of another version an UnsupportedFormatError.
        """
        if not isinstance(doc, dict) or "manifest" not in doc or "crc32c" not in doc:
            raise CorruptShardError(f"{where}: expected a localckpt manifest, found none")
        body = doc["manifest"]
        if not isinstance(body, dict):
            raise CorruptShardError(f"{where}: manifest is {type(body).__name__}, expected object")
        try:
            crc = _crc_of(body)
        except (TypeError, ValueError, RecursionError) as exc:  # a number damaged into inf,
            # nesting deeper than the encoder's stack
            raise CorruptShardError(f"{where}: manifest cannot be checked ({exc})") from exc
        if crc != doc["crc32c"]:
            raise CorruptShardError(f"{where}: manifest checksum mismatch")
        return cls._from_verified(body, where)

    @classmethod
    def _from_verified(cls, body: dict[str, Any], where: str) -> ShardManifest:
        """The manifest of a ``body`` whose checksum matched: its version readable, its fields
        well formed and consistent (CorruptShardError, UnsupportedFormatError)."""
        version = body.get("format_version")
        if version not in READABLE_VERSIONS:
            raise UnsupportedFormatError(
                f"{where}: manifest format version {version!r}; this localckpt reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}"
            )
        try:
            tensors = entries_from_columns(body["tensor_table"]) \
                if version >= COLUMNS_VERSION else entries_from_rows(body["tensors"])
            manifest = cls(
                session_id=str(body["session_id"]),
                iteration=int(body["iteration"]),
                owner_rank=int(body["owner_rank"]),
                world_size=int(body["world_size"]),
                tensors=tensors,
                hollow=body["hollow"],
                container=str(body["container"]),
                data_nbytes=int(body["data_nbytes"]),
                chunk_nbytes=int(body["chunk_nbytes"]),
                chunk_count=int(body["chunk_count"]),
                chunk_crc32c=tuple(int(c) for c in body["chunk_crc32c"]),
                created_unix=float(body["created_unix"]),
                identity=dict(body.get("identity") or {}),
                format_version=int(version),
                metadata=_metadata_of(body.get("metadata", {})),
                parity=None if "parity" not in body or version < 5 else ParityInfo.from_json(
                    body["parity"], int(body["world_size"]), where),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:  # float(10**400)
            raise CorruptShardError(f"{where}: malformed manifest ({exc!r})") from exc
        check_consistent(manifest, where)
        return manifest


def _metadata_of(value: Any) -> dict[str, Any]:
    """The manifest's ``metadata``, keeping only what localckpt reads in the form it reads it.
    Never an error: it describes no data, so an odd one (another writer's, a newer key) must
    not make an intact shard look corrupt."""
    if type(value) is not dict:
        return {}
    out: dict[str, Any] = {}
    if "custom" in value:
        out["custom"] = value["custom"]
    metrics = value.get("metrics")
    if type(metrics) is dict:
        out["metrics"] = {k: f for k, v in metrics.items()
                          if type(k) is str and (f := finite(v)) is not None}
    saved = finite(value.get("saved_unix"))
    if saved is not None:
        out["saved_unix"] = saved
    save_id = value.get("save_id")
    if type(save_id) is str and len(save_id) <= 64:
        out["save_id"] = save_id
    most = value.get("most_chunks")
    if type(most) is int and 0 <= most < 1 << 40:
        out["most_chunks"] = most
    return out


def finite(value: Any) -> float | None:
    """``value`` as a finite float, or None (bools, huge ints, NaN and other types)."""
    if type(value) not in (int, float):
        return None
    try:
        f = float(value)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def check_consistent(m: ShardManifest, where: str) -> None:
    """Raise CorruptShardError (naming ``where``) unless the manifest describes a shard that can
    be read safely: ids in range, the chunks hold the data, every tensor's shape matches its
    bytes and lies inside the data without overlapping another, every tensor the hollow
    structure names exists. Readers allocate what entries say only after this; a checksum over
    the manifest only shows it was not damaged, not that its writer was right.
    UnsupportedFormatError for a dtype this torch does not have."""
    def bad(what: str) -> CorruptShardError:
        return CorruptShardError(f"{where}: inconsistent manifest: {what}")

    owner_ok = 0 <= m.owner_rank < m.world_size if m.parity is None else \
        m.owner_rank == parity_slot(m.parity.stripe, m.parity.block)
    if not (m.iteration >= 0 and m.world_size >= 1 and owner_ok):
        raise bad(f"iteration {m.iteration}, owner rank {m.owner_rank} of world size "
                  f"{m.world_size}")
    if m.parity is not None and m.data_nbytes != max(m.parity.sizes):
        raise bad(f"a parity block of {m.data_nbytes} bytes over members of "
                  f"{list(m.parity.sizes)} bytes")
    if m.chunk_nbytes < 1 or m.chunk_count < 0 or \
            not 0 <= m.data_nbytes <= m.chunk_nbytes * m.chunk_count:
        raise bad(f"{m.data_nbytes} data bytes do not fit {m.chunk_count} chunks of "
                  f"{m.chunk_nbytes} bytes")
    if len(m.chunk_crc32c) != m.chunk_count:
        raise bad(f"{len(m.chunk_crc32c)} chunk checksums for {m.chunk_count} chunks")
    check_entries(m.tensors, m.data_nbytes, bad, where)
    replicas: dict[int, tuple[int, ...]] = {}
    layouts = check_hollow(m.hollow, len(m.tensors), where, replicas, m.tensors, m.format_version)
    for i, layout in layouts.items():
        e = m.tensors[i]
        shape = replicas.get(i, e.shape)
        if i in replicas and e.nbytes:
            raise bad(f"tensor {i} ({e.key_path}) is a replica stored elsewhere, with "
                      f"{e.nbytes} bytes here")
        if len(shape) != len(layout.global_shape) or any(
                o + n > g for o, n, g in zip(layout.offset, shape, layout.global_shape,
                                             strict=True)):
            raise bad(f"tensor {i} ({e.key_path}): a shard of shape {list(shape)} at offset "
                      f"{list(layout.offset)} does not fit its DTensor's "
                      f"{list(layout.global_shape)}")
    m.__dict__["layouts"] = layouts
    m.__dict__["replicas"] = replicas


_SCALAR_FIELDS = ("format_version", "session_id", "iteration", "owner_rank", "world_size",
                  "container", "data_nbytes", "chunk_nbytes", "chunk_count", "created_unix")


@functools.cache
def _node_identity() -> dict[str, Any]:
    from ..ops.health import node_identity

    return node_identity()


def writer_identity() -> dict[str, Any]:
    """Who wrote a shard (node: hostname, boot id, GPU UUIDs; process; versions): recorded in
    its manifest for operators and tools. NVML is asked once per process."""
    from .. import __version__

    return {**_node_identity(), "pid": os.getpid(), "torch": torch.__version__,
            "localckpt": __version__}


# The envelope as ``encoded`` writes it: _HEAD, the canonical manifest, _MARK, its CRC-32C, "}".
_HEAD, _MARK = b'{"manifest":', b',"crc32c":'


def _canonical(body: dict[str, Any]) -> bytes:
    """The bytes a manifest's checksum is taken over (the same in every format version)."""
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _crc_of(body: dict[str, Any]) -> int:
    return int(crc32c(_canonical(body)))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a manifest holds")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: the encoder the checksum is taken with refuses it
        raise ValueError(f"{text} is not a number a manifest holds")
    return value
