"""The hollow structure: a state dict's non-tensor part as plain JSON, tensors replaced by their
index (decoded back by :mod:`localckpt.hollow_decode`).

Every JSON object node has exactly one tag key, so decoding is exact: ``{"T": i}`` a tensor,
``{"DT": ...}`` a DTensor's local shard (:mod:`localckpt.dtensors`), ``{"S": ...}`` what a
Stateful object's ``state_dict()`` returned, ``{"dict"|"odict"|"tuple": ...}`` containers (a list
is a JSON list), ``{"f"|"c"|"b": ...}`` float (bit-exact as hex, but for a NaN's sign and
payload), complex and bytes; format 4 adds ``{"np": ...}`` / ``{"npg": ...}`` numpy arrays
and scalars, ``{"G": ...}`` torch Generators, ``{"dc"|"nt": ...}`` dataclasses and named tuples,
``{"enum": ...}`` enum members, ``{"ns": ...}`` argparse Namespaces, ``{"dtype": ...}`` torch
dtypes and ``{"slice": ...}`` slices (:mod:`localckpt.leaves`).
"""

from __future__ import annotations

import argparse
import base64
import enum
import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import leaves
from .dtensors import DTensorLayout, is_dtensor

logger = logging.getLogger(__name__)

JSON = Any  # a value json.dumps accepts: None, bool, int, float, str, list, dict[str, JSON]

_SCALAR_TYPES = (type(None), bool, int, str)

#: Tags a format-4 reader knows and older ones do not.
EXTENDED_TAGS = frozenset({"np", "npg", "G", "dc", "nt", "enum", "ns", "dtype", "slice"})

SUPPORTED = ("a tensor, DTensor, numpy array or scalar, torch.Generator, torch.dtype, "
             "torch.Size, dict, "
             "OrderedDict, list, tuple, named tuple, dataclass, enum member, argparse.Namespace, "
             "slice, an object with state_dict() and load_state_dict(), None, bool, int, float, "
             "complex, str or bytes")

_EXTENDED_TYPES = (np.ndarray, np.generic, torch.Generator, torch.dtype, slice, enum.Enum,
                   argparse.Namespace)


def path_str(path: tuple[Any, ...]) -> str:
    return "/".join(map(str, path)) if path else "<root>"


def _encode_key(key: Any, walk: Walk, path: tuple[Any, ...], whole: Any = None) -> JSON:
    if type(key) is tuple or type(key) is torch.Size:  # a torch.Size loads back as a tuple
        return {"tuple": [_encode_key(k, walk, path, key if whole is None else whole)
                          for k in key]}
    if isinstance(key, (np.generic, torch.dtype, enum.Enum)):
        walk.extended = True  # a format-4 node, as such a value is
        return _encode_extended(key, walk, path)
    if type(key) not in (*_SCALAR_TYPES, float, complex, bytes):
        within = "" if whole is None else f" (in the tuple key {whole!r:.100})"
        raise TypeError(
            f"state dict key at {path_str(path)!r}: expected a key of str, int, float, complex, "
            "bool, None, bytes, numpy scalar, torch.dtype, enum member or a tuple of them, got "
            f"{type(key).__module__}.{type(key).__qualname__}{within}"
        )
    return _encode_leaf(key, path)


# A high surrogate followed by a low one, as two code points: JSON writes them as the escapes of
# the one character they pair into, and reads that character back (a str would load changed).
_SURROGATE_PAIR = re.compile("[\ud800-\udbff][\udc00-\udfff]")


def _exact_str(value: str, path: tuple[Any, ...], what: str = "value") -> str:
    """``value`` when JSON gives it back as it is; else TypeError naming the key."""
    if not value.isascii() and _SURROGATE_PAIR.search(value):
        raise TypeError(f"state dict key {path_str(path)!r}: a str {what} holding a UTF-16 "
                        "surrogate pair as two code points (not valid Unicode) would load back "
                        "as the one character they pair into; store it as bytes "
                        "(value.encode('utf-16', 'surrogatepass'))")
    return value


# Python reads back no int of more than 4,300 decimal digits from JSON (a process that raised
# sys.set_int_max_str_digits writes them): refused at save, not found corrupt at load.
_INT_TOO_BIG = 10 ** 4300
_INT_SURELY_SMALLER_BITS = _INT_TOO_BIG.bit_length() - 1


def _encode_leaf(value: Any, path: tuple[Any, ...]) -> JSON:
    kind = type(value)
    if kind is str:
        return _exact_str(value, path)
    if kind is int and value.bit_length() > _INT_SURELY_SMALLER_BITS and \
            abs(value) >= _INT_TOO_BIG:
        raise TypeError(f"state dict key {path_str(path)!r}: an int of {value.bit_length()} "
                        "bits, more than the 4,300 decimal digits JSON readers take; store it "
                        "as bytes (value.to_bytes(...)) or a tensor")
    if kind in _SCALAR_TYPES:
        return value
    if kind is float:
        return {"f": value.hex()}
    if kind is complex:
        return {"c": [value.real.hex(), value.imag.hex()]}
    if kind is bytes:
        return {"b": base64.b64encode(value).decode("ascii")}
    raise TypeError(
        f"unsupported value at state dict key {path_str(path)!r}: expected {SUPPORTED}, "
        f"got {kind.__module__}.{kind.__qualname__}"
    )


def _check_tensor(t: torch.Tensor, path: tuple[Any, ...]) -> None:
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(
            f"unsupported tensor at state dict key {path_str(path)!r}: expected a plain "
            f"torch.Tensor or nn.Parameter, got subclass {type(t).__qualname__}"
        )
    if t.layout != torch.strided:
        raise TypeError(
            f"unsupported tensor at state dict key {path_str(path)!r}: expected layout "
            f"torch.strided, got {t.layout}"
        )
    if t.is_nested:
        raise TypeError(
            f"unsupported tensor at state dict key {path_str(path)!r}: nested tensors are not "
            "supported; store their components (unbind()) instead")
    if t.device.type == "meta":
        raise TypeError(
            f"unsupported tensor at state dict key {path_str(path)!r}: meta tensors hold no data"
        )


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` follows the Stateful protocol (torch.distributed.checkpoint's)."""
    kind = type(obj)
    return not isinstance(obj, type) and callable(getattr(kind, "state_dict", None)) and \
        callable(getattr(kind, "load_state_dict", None))


@dataclass
class Walk:
    """What :func:`encode_hollow` collects: the tensors in order, their key paths, the DTensors,
    Stateful objects and Generators it met, and the dataclass / named tuple types."""

    tensors: list[torch.Tensor] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    dtensors: dict[int, Any] = field(default_factory=dict)
    layouts: dict[int, DTensorLayout] = field(default_factory=dict)
    statefuls: dict[str, Any] = field(default_factory=dict)  # outermost ones, by key path
    within: int = 0  # how many Stateful objects the walk is inside
    open: set[int] = field(default_factory=set)  # ids of the Statefuls being walked (cycles)
    dtensor_paths: set[str] = field(default_factory=set)
    types: dict[str, type] = field(default_factory=dict)  # dataclass / named tuple types met
    extended: bool = False  # a format-4 node was written
    copies: set[int] = field(default_factory=set)  # tensors that are not the caller's memory
    # on_tensor(index, tensor): each plain tensor of more than on_tensor_above bytes, as it is
    # met (a save starts copying it); on_stateful(obj): before each Stateful's state_dict() runs
    # (user code: it may change tensors met before).
    on_tensor: Callable[[int, torch.Tensor], None] | None = None
    on_tensor_above: int = 0  # bytes: smaller tensors are not handed to on_tensor (a call each)
    on_stateful: Callable[[Any], None] | None = None

    def add(self, t: torch.Tensor, path: tuple[Any, ...]) -> int:
        return self.add_at(t, path_str(path))

    def add_at(self, t: torch.Tensor, where: str) -> int:
        self.tensors.append(t)
        self.paths.append(where)
        return len(self.tensors) - 1

    def plain_tensor(self, t: torch.Tensor, where: str) -> JSON:
        """``{"T": i}`` for a plain strided tensor at key path ``where`` (handed to on_tensor
        when large)."""
        i = self.add_at(t, where)
        if self.on_tensor is not None and t.nbytes > self.on_tensor_above:
            self.on_tensor(i, t)
        return {"T": i}

    def restorable(self, obj: Any, path: tuple[Any, ...]) -> None:
        """Record a Stateful object or Generator that ``load(into=...)`` restores in place
        (the outermost ones only: an outer one restores those its state dict holds)."""
        if self.within:
            return
        where = path_str(path)
        if where in self.statefuls:
            raise TypeError(f"two Stateful objects at state dict key {where!r}: a key path "
                            "must name one object for load(into=...) to restore it")
        self.statefuls[where] = obj


def encode_hollow(obj: Any, walk: Walk, path: tuple[Any, ...] = ()) -> JSON:
    """JSON form of ``obj`` with tensors appended to ``walk`` and replaced by ``{"T": i}``."""
    kind = type(obj)
    if kind is torch.Tensor or kind is torch.nn.Parameter:  # the common case: no subclass
        if obj.layout is not torch.strided or obj.is_meta or obj.is_nested:
            _check_tensor(obj, path)  # raises, naming the key
        return walk.plain_tensor(obj, path_str(path))
    if isinstance(obj, torch.Tensor):
        if is_dtensor(obj):
            where = path_str(path)
            if where in walk.dtensor_paths:  # resharding and dedupe find leaves by key path
                raise TypeError(f"two DTensors at state dict key {where!r} (keys whose str() "
                                "joined by '/' coincide): a DTensor's key path must be unique")
            walk.dtensor_paths.add(where)
            layout = DTensorLayout.of(obj, where)
            local: torch.Tensor = obj._local_tensor  # type: ignore[attr-defined]  # the very
            # storage, which load(into=...) reads into
            _check_tensor(local, path)
            i = walk.add(local, path)
            walk.dtensors[i], walk.layouts[i] = obj, layout
            return {"DT": {"T": i, "layout": layout.json}}
        _check_tensor(obj, path)
        return {"T": walk.add(obj, path)}
    if kind is dict or kind is OrderedDict:
        items = []
        prefix = None  # this dict's key path and "/", made once (10,000 tensors: 10,000 joins)
        for k, v in obj.items():
            str_key = type(k) is str
            key = (k if k.isascii() else _exact_str(k, path, "key")) if str_key \
                else _encode_key(k, walk, path)
            vkind = type(v)
            # the common leaf inline: a plain tensor under a str key
            if str_key and (vkind is torch.Tensor or vkind is torch.nn.Parameter) and \
                    v.layout is torch.strided and not v.is_meta and not v.is_nested:
                if prefix is None:
                    prefix = path_str(path) + "/" if path else ""
                items.append([key, walk.plain_tensor(v, prefix + k)])
            else:
                items.append([key, encode_hollow(v, walk, (*path, k))])
        return {"odict" if kind is OrderedDict else "dict": items}
    if kind is list:
        return [encode_hollow(v, walk, (*path, i)) for i, v in enumerate(obj)]
    if kind is tuple:
        return {"tuple": [encode_hollow(v, walk, (*path, i)) for i, v in enumerate(obj)]}
    if kind is torch.Size:  # a tuple of ints, loaded back as a tuple (equal to it)
        return {"tuple": list(obj)}
    if is_stateful(obj):
        return _encode_stateful(obj, walk, path)
    if isinstance(obj, _EXTENDED_TYPES) or leaves.is_record(obj):
        walk.extended = True
        return _encode_extended(obj, walk, path)
    return _encode_leaf(obj, path)


def _encode_extended(obj: Any, walk: Walk, path: tuple[Any, ...]) -> JSON:
    what = f"state dict key {path_str(path)!r}"
    if isinstance(obj, np.ndarray):
        t, descr, exact = leaves.array_to_tensor(obj, what)
        i = walk.add(t, path)
        if not exact:
            walk.copies.add(i)
        return {"np": {"T": i, "dtype": descr, "shape": list(obj.shape)}}
    if isinstance(obj, np.generic):
        return {"npg": leaves.scalar_to_json(obj, what)}
    if isinstance(obj, torch.Generator):
        walk.restorable(obj, path)
        return {"G": {"T": walk.add(obj.get_state(), path), "device": str(obj.device)}}
    if isinstance(obj, torch.dtype):
        return {"dtype": str(obj).removeprefix("torch.")}
    if isinstance(obj, slice):
        return {"slice": [encode_hollow(v, walk, (*path, i))
                          for i, v in enumerate((obj.start, obj.stop, obj.step))]}
    if isinstance(obj, argparse.Namespace):
        if type(obj) is not argparse.Namespace:
            _encode_leaf(obj, path)  # a subclass: refused, naming the type
        return {"ns": [[_exact_str(k, (*path, k), "attribute name") if type(k) is str else k,
                        encode_hollow(v, walk, (*path, k))] for k, v in vars(obj).items()]}
    kind = type(obj)
    name = leaves.type_name(kind)
    if walk.types.setdefault(name, kind) is not kind:
        raise TypeError(f"two types named {name!r} in one state dict (at {what})")
    if isinstance(obj, enum.Enum):
        if obj.name is None or obj.name not in kind.__members__:  # a combination of Flags
            raise TypeError(f"{what}: {obj!r} combines members of the enum.Flag "
                            f"{kind.__qualname__} (a load rebuilds members by name): save "
                            "its int value, or each member")
        return {"enum": {"type": name, "name": obj.name}}
    if getattr(obj, "is_hollow", False) is True:  # NVIDIA's tensor-aware state dict protocol
        raise TypeError(f"{what}: the {kind.__qualname__} is hollow (its tensors were popped): "
                        "insert them back (insert_tensors) before saving")
    named_tuple = leaves.is_named_tuple(obj)
    if not named_tuple and isinstance(obj, (dict, list, tuple, set)):
        raise TypeError(f"{what}: a dataclass that is also a {type(obj).__mro__[1].__name__} "
                        "would lose its items (only its fields are stored)")
    if id(obj) in walk.open:
        raise TypeError(f"{what}: the {kind.__qualname__} holds itself (a cycle)")
    if not named_tuple and (extra := leaves.attributes_not_fields(obj)):
        raise TypeError(f"{what}: the {kind.__qualname__} has attributes that are not fields "
                        f"({', '.join(map(repr, extra[:5]))}): a load builds it from its fields "
                        "without __init__, so they would be lost; declare them as fields "
                        "(dataclasses.field(init=False)) or leave them out of the state dict")
    walk.open.add(id(obj))
    try:
        fields = [[f, encode_hollow(v, walk, (*path, f))] for f, v in leaves.record_fields(obj)]
    finally:
        walk.open.discard(id(obj))
    return {"nt" if named_tuple else "dc": {"type": name, "fields": fields}}


def _encode_stateful(obj: Any, walk: Walk, path: tuple[Any, ...]) -> JSON:
    """``{"S": obj.state_dict()}``. Two Stateful objects at one key path, or one whose state dict
    holds itself, are refused (TypeError)."""
    if id(obj) in walk.open:
        raise TypeError(f"Stateful object at state dict key {path_str(path)!r}: its "
                        "state_dict() holds the object itself")
    walk.restorable(obj, path)
    walk.open.add(id(obj))
    walk.within += 1
    try:
        if walk.on_stateful is not None:
            walk.on_stateful(obj)
        return {"S": encode_hollow(obj.state_dict(), walk, path)}
    finally:
        walk.within -= 1
        walk.open.discard(id(obj))


def tagged_nodes(hollow: JSON) -> Iterator[tuple[str, Any]]:
    """``(tag, value)`` of every tagged node (a one-key object) of ``hollow``, at any depth, in
    no particular order; the values are the structure's own objects."""
    stack = [hollow]
    while stack:
        node = stack.pop()
        if type(node) is list:
            stack.extend(node)
        elif type(node) is dict:
            if len(node) == 1:
                yield next(iter(node.items()))
            stack.extend(node.values())


def format_nodes(hollow: JSON) -> tuple[bool, bool]:
    """Whether ``hollow`` holds a node only format 4 describes, and a Stateful's ``{"S": ...}``
    (format 2): what the manifest's format version must cover. One walk."""
    tags = {tag for tag, _ in tagged_nodes(hollow)}
    return bool(tags & EXTENDED_TAGS), "S" in tags


def resolve_device(recorded: str, _cache: dict[str, torch.device] | None = None) -> torch.device:
    """The device a tensor saved from ``recorded`` goes back to: itself when it exists here, else
    CPU (with a warning, once per device string per call site cache)."""
    if _cache is not None and recorded in _cache:
        return _cache[recorded]
    device = torch.device("cpu")
    if leaves.recorded_device_type(recorded) != "cpu":
        try:
            device = torch.device(recorded)  # RuntimeError: a backend no package registered
            torch.empty(0, device=device)
        except Exception as exc:  # torch imports the backend's module (torch.hpu) for some
            # device types: ImportError on a machine without it, not a RuntimeError
            logger.warning(
                "checkpoint tensor was saved on %s, which does not exist here (%s); "
                "restoring it to CPU",
                recorded,
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            )
            device = torch.device("cpu")
    if _cache is not None:
        _cache[recorded] = device
    return device
