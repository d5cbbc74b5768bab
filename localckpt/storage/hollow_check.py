"""The grammar check of a manifest's hollow structure (see :mod:`localckpt.hollow`): what a
reader runs before it decodes anything, so that decoding a manifest that passed cannot fail for
what the manifest holds. Pure: no I/O.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..dtensors import DTensorLayout
from ..errors import CorruptShardError
from ..hollow import EXTENDED_TAGS, tagged_nodes
from ..leaves import dtype_by_name, dtype_from_descr, recorded_device_type, scalar_from_json

if TYPE_CHECKING:
    from .manifest import TensorEntry

MAX_HOLLOW_DEPTH = 100  # decoding recurses; state dicts are a handful of levels deep


def check_hollow(hollow: Any, count: int, where: str,
                 replicas: dict[int, tuple[int, ...]] | None = None,
                 entries: Sequence[TensorEntry] | None = None,
                 version: int | None = None) -> dict[int, DTensorLayout]:
    """Check the hollow structure against its grammar (see :mod:`localckpt.hollow`): every
    node well formed and known to format ``version`` (None: the newest), every ``{"T": i}`` /
    ``{"DT": ...}`` naming one of the ``count`` tensors (each tensor once), every DTensor
    layout well formed,
    dict keys hashable, nesting at most MAX_HOLLOW_DEPTH deep, and with ``entries`` (the
    tensors' table) a numpy array's bytes and a Generator's state what their tensors hold; so
    decoding a manifest that parsed cannot fail for what it holds (a type the loading process
    does not allow, or whose class changed, is its own error). Returns the layouts by tensor
    index, in order; ``replicas`` gets the shard shapes of replicas stored elsewhere
    (``"replica"``). CorruptShardError naming ``where`` otherwise."""
    def bad(what: str) -> CorruptShardError:
        return CorruptShardError(f"{where}: inconsistent manifest: {what}")

    layouts: dict[int, DTensorLayout] = {}
    plain: set[int] = set()

    def tensor(ref: Any, seen: set[int] | dict[int, DTensorLayout]) -> int:
        if type(ref) is not int or not 0 <= ref < count or ref in layouts:
            raise bad(f"the structure refers to tensor {ref!r} of {count}")
        if isinstance(seen, set):
            seen.add(ref)
        return ref

    stack: list[tuple[Any, int]] = [(hollow, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_HOLLOW_DEPTH:
            raise bad(f"the structure nests deeper than {MAX_HOLLOW_DEPTH} levels")
        if node is None or type(node) in (bool, int, str):
            continue
        if type(node) is list:
            stack.extend((v, depth + 1) for v in node)
            continue
        if type(node) is not dict or len(node) != 1:
            raise bad(f"malformed structure node {str(node)[:100]}")
        (tag, value), = node.items()
        try:
            if tag == "T":
                tensor(value, plain)
            elif tag == "DT":
                if type(value) is not dict or not {"T", "layout"} <= set(value) <= {
                        "T", "layout", "replica"}:
                    raise ValueError(f"DTensor node {str(value)[:100]}")
                i = tensor(value["T"], layouts)
                if i in plain:
                    raise ValueError(f"tensor {i} is both a plain tensor and a DTensor shard")
                layouts[i] = DTensorLayout.from_json(value["layout"])
                if "replica" in value:
                    shape = value["replica"]
                    if type(shape) is not list or len(shape) != len(layouts[i].global_shape) \
                            or any(type(n) is not int or not 0 <= n < 1 << 62 for n in shape):
                        raise ValueError(f"replica shape {str(shape)[:100]}")
                    if replicas is not None:
                        replicas[i] = tuple(shape)
            elif tag == "f":
                float.fromhex(value)
            elif tag == "c":
                if type(value) is not list or len(value) != 2:
                    raise ValueError(f"complex {value!r}")
                float.fromhex(value[0]), float.fromhex(value[1])
            elif tag == "b":
                base64.b64decode(value.encode("ascii"), validate=True)
            elif tag == "S":
                stack.append((value, depth + 1))
            elif tag in EXTENDED_TAGS:
                if version is not None and version < 4:
                    raise ValueError(f"a {tag!r} node in a format {version} manifest")
                stack.extend((v, depth + 1) for v in _check_extended(
                    tag, value, lambda ref: entries[tensor(ref, plain)] if entries is not None
                    else tensor(ref, plain)))
            elif tag == "tuple" and type(value) is list:
                stack.extend((v, depth + 1) for v in value)
            elif tag in ("dict", "odict") and type(value) is list:
                leaf_ok = depth + 1 <= MAX_HOLLOW_DEPTH
                for pair in value:
                    if type(pair) is not list or len(pair) != 2:
                        raise ValueError(f"dict item {str(pair)[:100]}")
                    key, item = pair
                    if type(key) is not str:
                        if not _hashable_key(key):
                            raise ValueError(f"dict key {str(key)[:100]}")
                        stack.append((key, depth + 1))
                    # The common leaf inline (a manifest of 10,000 tensors has 10,000): a str
                    # key and a tensor not named before as a DTensor shard.
                    if leaf_ok and type(item) is dict and len(item) == 1 and \
                            type(ref := item.get("T")) is int and 0 <= ref < count and \
                            ref not in layouts:
                        plain.add(ref)
                    else:
                        stack.append((item, depth + 1))
            else:
                raise ValueError(f"node {str(node)[:100]}")
        except (ValueError, TypeError, AttributeError, RuntimeError, OverflowError,
                binascii.Error) as exc:
            raise bad(f"malformed structure: {exc}") from None
    return dict(sorted(layouts.items()))


def numpy_byte_tensors(hollow: Any, entries: Sequence[TensorEntry]) -> frozenset[int]:
    """See :attr:`ShardManifest.numpy_bytes` (the hollow is already checked)."""
    out: set[int] = set()
    for tag, value in tagged_nodes(hollow):
        if tag == "np" and type(value) is dict:
            i = value.get("T")
            if type(i) is int and entries[i].dtype == "uint8" and value.get("dtype") != "|u1":
                out.add(i)
    return frozenset(out)


_KEY_TAGS = ("f", "c", "b", "npg", "enum", "dtype")
_NUMPY_MAX_DIMS = 64


def _hashable_key(node: Any) -> bool:
    """Whether a dict key node decodes to a hashable value (scalars, tuples of them)."""
    if node is None or type(node) in (bool, int, str):
        return True
    if type(node) is not dict or len(node) != 1:
        return False
    (tag, value), = node.items()
    if tag == "tuple":
        return type(value) is list and all(_hashable_key(v) for v in value)
    if tag == "npg":  # a structured or void scalar is not hashable
        try:
            hash(scalar_from_json(value))
        except (TypeError, ValueError, KeyError, binascii.Error):
            return False
    return tag in _KEY_TAGS


def _check_extended(tag: str, value: Any, tensor: Any) -> list[Any]:
    """Check a format-4 node (see :mod:`localckpt.hollow`); returns the nodes it holds.
    ``tensor(ref)``: the entry of tensor ``ref`` (or its index, without a table)."""
    if tag == "dtype":
        dtype_by_name(value)
        return []
    if tag == "slice":
        if type(value) is not list or len(value) != 3:
            raise ValueError(f"slice node {str(value)[:100]}")
        return list(value)
    if tag == "ns":
        if type(value) is not list or any(type(f) is not list or len(f) != 2
                                          or type(f[0]) is not str for f in value):
            raise ValueError(f"Namespace node {str(value)[:100]}")
        return [f[1] for f in value]
    if type(value) is not dict:
        raise ValueError(f"{tag!r} node {str(value)[:100]}")
    if tag == "enum":
        if set(value) != {"type", "name"} or type(value["type"]) is not str or \
                type(value["name"]) is not str:
            raise ValueError(f"enum node {str(value)[:100]}")
        return []
    if tag == "np":
        shape = value.get("shape")
        if set(value) != {"T", "dtype", "shape"} or type(shape) is not list or \
                len(shape) > _NUMPY_MAX_DIMS or \
                any(type(n) is not int or not 0 <= n < 1 << 62 for n in shape):
            raise ValueError(f"numpy array node {str(value)[:100]}")
        itemsize = dtype_from_descr(value["dtype"]).itemsize
        nbytes = itemsize * math.prod(shape)
        if max(itemsize, 1) * math.prod(n for n in shape if n) >= 1 << 62:  # numpy refuses
            raise ValueError(f"numpy array of shape {shape} of {value['dtype']}")
        entry = tensor(value["T"])
        if not isinstance(entry, int) and entry.nbytes != nbytes:
            raise ValueError(f"numpy array of {nbytes} bytes stored in {entry.nbytes}")
    elif tag == "npg":
        if set(value) != {"dtype", "b"} or type(value["b"]) is not str:
            raise ValueError(f"numpy scalar node {str(value)[:100]}")
        scalar_from_json(value)
    elif tag == "G":
        if set(value) != {"T", "device"} or type(value["device"]) is not str or \
                recorded_device_type(value["device"]) == "meta":
            raise ValueError(f"Generator node {str(value)[:100]}")
        entry = tensor(value["T"])
        if not isinstance(entry, int) and (entry.dtype != "uint8" or len(entry.shape) != 1):
            raise ValueError(f"Generator state of {entry.dtype} {list(entry.shape)}")
    else:
        fields = value.get("fields")
        if set(value) != {"type", "fields"} or type(value["type"]) is not str or \
                type(fields) is not list or any(type(f) is not list or len(f) != 2
                                                or type(f[0]) is not str for f in fields):
            raise ValueError(f"{tag!r} node {str(value)[:100]}")
        return [f[1] for f in fields]
    return []


