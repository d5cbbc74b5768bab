"""State dict leaves beyond tensors and JSON scalars, each with a restricted encoding (no pickle).

- **numpy arrays** of any dtype without Python objects in it (numbers, bool, datetime64,
  fixed-width strings and bytes, structured records): stored like a tensor, in torch's dtype
  where torch has one (plain zarr readers then see a typed array), else as bytes; the dtype is
  recorded as numpy's array-protocol description and parsed back without ``eval``.
- **numpy scalars** (``np.float32(1.5)``, ``np.int64(3)``): their bytes inline in the JSON.
- **torch.Generator**: its state is stored as a tensor and set on a new generator at load (on the
  caller's own generator with ``load(into=...)``). NumPy's and Python's RNG states need nothing
  of their own: ``np.random.get_state()``, ``Generator.bit_generator.state`` and
  ``random.getstate()`` are tuples, dicts, ints and arrays.
- **dataclasses and named tuples**: stored as their type's name and their fields. Loading builds
  an instance only of a type that is *allowed*: registered with :func:`add_safe_types`, or the
  type of an object of the state dict ``load(into=...)`` was given. No module is imported and no
  name is looked up anywhere else; any other type is :class:`UnsafeTypeError`. Fields the saved
  object lacks take the class's defaults; a saved field the class no longer has is an error. An
  instance attribute that is no field (set in ``__post_init__``) is refused at save: the load
  builds the instance without ``__init__`` and would not give it back.
  An object of NVIDIA's tensor-aware state dict protocol that is a dataclass (Megatron's
  ``MCoreTensorAwareStateDict``) is stored the same way; a hollow one is refused.
- **enum members** (allowed types, as above), **argparse.Namespace** (Megatron's ``args``),
  **torch.dtype** and **slice**: by name and value.

Numpy arrays of object dtype are refused at save (``TypeError`` naming the key path).
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import functools
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .errors import UnsafeTypeError

_registry_lock = threading.Lock()
_SAFE_TYPES: dict[str, type] = {}


def type_name(kind: type) -> str:
    """The name a dataclass or named tuple type is stored under: ``module:qualname``."""
    return f"{kind.__module__}:{kind.__qualname__}"


def _allowable(kind: Any) -> bool:
    return isinstance(kind, type) and (
        dataclasses.is_dataclass(kind) or issubclass(kind, enum.Enum)
        or (issubclass(kind, tuple) and isinstance(getattr(kind, "_fields", None), tuple)))


def is_named_tuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and isinstance(getattr(type(obj), "_fields", None), tuple)


def is_record(obj: Any) -> bool:
    """Whether ``obj`` is a dataclass instance or a named tuple."""
    kind = type(obj)
    return (dataclasses.is_dataclass(kind) and not isinstance(obj, type)) or \
        (isinstance(obj, tuple) and kind is not tuple and isinstance(getattr(kind, "_fields", None),
                                                                    tuple))


def add_safe_types(*types: type) -> None:
    """Allow ``load`` to build instances of these dataclasses, named tuples or enums, in every
    load of this process (like ``torch.serialization.add_safe_globals``). Raises ``TypeError``
    for anything else. A type registered under the ``module:qualname`` of another replaces it
    (the class was defined again)."""
    for kind in types:
        if not _allowable(kind):
            raise TypeError(f"add_safe_types: expected dataclass, named tuple or enum types, "
                            f"got {kind!r}")
    with _registry_lock:
        for kind in types:  # a class defined again (a notebook cell run twice) replaces it
            _SAFE_TYPES[type_name(kind)] = kind


def safe_types() -> dict[str, type]:
    """A copy of the registered types, by stored name."""
    with _registry_lock:
        return dict(_SAFE_TYPES)


def record_fields(obj: Any) -> list[tuple[str, Any]]:
    """The (name, value) pairs a dataclass instance or named tuple is stored as."""
    if is_named_tuple(obj):
        return list(zip(type(obj)._fields, obj, strict=True))
    return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]


def attributes_not_fields(obj: Any) -> list[str]:
    """The attributes of a dataclass instance a load would not give back (it builds the
    instance from its fields without ``__init__``): set in ``__post_init__`` or later. A
    ``functools.cached_property``'s value is computed again on use: not one of them."""
    names = {f.name for f in dataclasses.fields(obj)}
    kind = type(obj)
    return [k for k in getattr(obj, "__dict__", {}) if k not in names
            and not isinstance(getattr(kind, k, None), functools.cached_property)]


def _allowed(what: str, name: str, types: Mapping[str, type]) -> type:
    kind = types.get(name) or _SAFE_TYPES.get(name)
    if kind is None:
        raise UnsafeTypeError(
            f"load: the checkpoint holds a {what} of type {name!r}, which is not allowed: "
            "register it with localckpt.add_safe_types(<the class>) or pass an object of that "
            "type in load(into=...); nothing is imported from a checkpoint")
    return kind


def enum_member(value: Mapping[str, Any], types: Mapping[str, type]) -> Any:
    """The member ``value["name"]`` of the allowed enum ``value["type"]``; UnsafeTypeError if it
    is not allowed, ValueError if it has no such member."""
    name, member = str(value.get("type")), value.get("name")
    kind = _allowed("enum member", name, types)
    if not issubclass(kind, enum.Enum) or type(member) is not str or \
            member not in kind.__members__:
        raise ValueError(f"load: {name!r} has no member {member!r}")
    return kind[member]


# Looked up in torch's namespace as it is (vars, not getattr): getattr(torch, "_dynamo") imports
# hundreds of modules, which a manifest must not be able to make a load do.
_TORCH_DTYPES = {name: value for name, value in vars(torch).items()
                 if isinstance(value, torch.dtype)}


def dtype_by_name(name: Any) -> torch.dtype:
    """The torch dtype ``name`` ("float32"); ValueError for anything else."""
    dtype = _TORCH_DTYPES.get(name) if type(name) is str else None
    if dtype is None:
        raise ValueError(f"not a torch dtype: {str(name)[:100]!r}")
    return dtype


def build_record(tag: str, name: str, values: Sequence[tuple[str, Any]],
                 types: Mapping[str, type]) -> Any:
    """An instance of the allowed type ``name`` with the saved field ``values``, without running
    its ``__init__`` (as ``copy`` does). UnsafeTypeError if the type is not allowed; ValueError
    if a saved field is unknown to it or a field it requires was not saved."""
    what = "dataclass" if tag == "dc" else "named tuple"
    kind = _allowed(what, name, types)
    if (tag == "nt") != issubclass(kind, tuple) or issubclass(kind, enum.Enum) or \
            (tag == "dc" and not dataclasses.is_dataclass(kind)):
        raise ValueError(f"load: {name!r} is saved as a {what}, the allowed type is not one")
    saved = dict(values)
    if tag == "nt":
        defaults = getattr(kind, "_field_defaults", {})
        _check_fields(name, saved, kind._fields, defaults)  # type: ignore[attr-defined]
        return kind._make(saved[f] if f in saved else defaults[f]  # type: ignore[attr-defined]
                          for f in kind._fields)  # type: ignore[attr-defined]
    fields = dataclasses.fields(kind)  # type: ignore[arg-type]
    has_default = {f.name for f in fields if f.default is not dataclasses.MISSING
                   or f.default_factory is not dataclasses.MISSING}
    _check_fields(name, saved, [f.name for f in fields], has_default)
    obj: Any = kind.__new__(kind)
    for f in fields:
        if f.name in saved:
            value = saved[f.name]
        elif f.default is not dataclasses.MISSING:
            value = f.default
        else:
            value = f.default_factory()  # type: ignore[operator]
        object.__setattr__(obj, f.name, value)  # frozen dataclasses too
    return obj


def _check_fields(name: str, saved: Mapping[str, Any], fields: Sequence[str],
                  has_default: Any) -> None:
    unknown = sorted(set(saved) - set(fields))
    if unknown:
        raise ValueError(f"load: the saved {name!r} has fields {unknown} its class no longer has")
    missing = sorted(f for f in fields if f not in saved and f not in has_default)
    if missing:
        raise ValueError(f"load: the saved {name!r} lacks fields {missing}, which its class "
                         "requires (no default)")


# --------------------------------------------------------------------------------------------
# numpy


def _check_dtype(dtype: np.dtype[Any], what: str) -> None:
    if dtype.hasobject:
        raise TypeError(f"{what}: numpy dtype {dtype} holds Python objects, which cannot be "
                        "stored without pickle; convert it to a numeric, string or bytes dtype")


def dtype_descr(dtype: np.dtype[Any]) -> Any:
    """JSON form of a numpy dtype (numpy's array-protocol description)."""
    return np.lib.format.dtype_to_descr(dtype)


MAX_DTYPE_DEPTH = 16  # nested record dtypes; numpy parses them recursively


def _tuples(descr: Any, depth: int = 0) -> Any:
    """A JSON-decoded structured description with its tuples back (names with titles, shapes)."""
    if type(descr) is str:
        return descr
    if type(descr) not in (list, tuple) or depth > MAX_DTYPE_DEPTH:
        raise ValueError(f"numpy dtype description {str(descr)[:100]}")
    out = []
    for item in descr:
        if type(item) not in (list, tuple) or len(item) not in (2, 3):
            raise ValueError(f"numpy dtype field {str(item)[:100]}")
        name = tuple(item[0]) if type(item[0]) in (list, tuple) else item[0]
        rest = [_tuples(item[1], depth + 1)] + ([tuple(item[2])] if len(item) == 3 else [])
        out.append((name, *rest))
    return out


def dtype_from_descr(descr: Any) -> np.dtype[Any]:
    """Inverse of :func:`dtype_descr`; ValueError for a malformed one or one holding objects."""
    try:
        dtype = np.lib.format.descr_to_dtype(_tuples(descr))
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        raise ValueError(f"numpy dtype description {str(descr)[:100]}: {exc}") from None
    try:
        _check_dtype(dtype, "load")
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    return dtype


def array_to_tensor(arr: np.ndarray[Any, Any], what: str
                    ) -> tuple[torch.Tensor, Any, bool]:
    """The tensor a numpy array is stored as, its dtype description, and whether the tensor is
    the array itself (C-contiguous, writable, a dtype torch has): only then may
    ``load(into=...)`` read into it, since a tensor of bytes would take bytes of another dtype
    of the same size. TypeError (naming ``what``) for a subclass (a masked array's mask, a
    matrix's product would be lost) or an object dtype."""
    if type(arr) is not np.ndarray and type(arr) is not np.memmap:
        raise TypeError(f"{what}: a {type(arr).__module__}.{type(arr).__qualname__} (a numpy "
                        "array subclass) would come back as a plain array: store its parts "
                        "(np.asarray(x), a masked array's .data and .mask)")
    _check_dtype(arr.dtype, what)
    try:
        descr = dtype_descr(arr.dtype)
        dtype_from_descr(descr)
    except ValueError as exc:
        raise TypeError(f"{what}: numpy dtype {arr.dtype} cannot be stored: {exc}") from None
    exact = bool(arr.flags.c_contiguous and arr.flags.writeable)
    if not exact:
        arr = np.array(arr, order="C", copy=True)
    try:
        return torch.from_numpy(arr), descr, exact
    except (TypeError, ValueError, RuntimeError):  # a dtype torch lacks, or another byte order
        return torch.from_numpy(arr.reshape(-1).view(np.uint8)), descr, False


def tensor_to_array(t: torch.Tensor, descr: Any, shape: Sequence[int]) -> np.ndarray[Any, Any]:
    """The numpy array stored as ``t`` (sharing its memory when on CPU). ValueError if the bytes
    do not make an array of that dtype and shape."""
    dtype = dtype_from_descr(descr)
    flat = t.detach().cpu().contiguous().reshape(-1)
    raw = flat.numpy() if flat.dtype == torch.uint8 else flat.view(torch.uint8).numpy()
    count = 1
    for n in shape:
        count *= n
    if raw.nbytes != count * dtype.itemsize:
        raise ValueError(f"numpy array of {dtype} {list(shape)}: expected "
                         f"{count * dtype.itemsize} bytes, got {raw.nbytes}")
    if count == 0 or dtype.itemsize == 0:
        return np.zeros(tuple(shape), dtype=dtype)
    return raw.view(dtype).reshape(tuple(shape))


def scalar_to_json(value: np.generic, what: str) -> dict[str, Any]:
    """A numpy scalar as ``{"dtype": ..., "b": base64 of its bytes}``."""
    arr = np.asarray(value)
    _check_dtype(arr.dtype, what)
    return {"dtype": dtype_descr(arr.dtype),
            "b": base64.b64encode(arr.tobytes()).decode("ascii")}


def scalar_from_json(value: Mapping[str, Any]) -> Any:
    """Inverse of :func:`scalar_to_json`; ValueError for a malformed node."""
    dtype = dtype_from_descr(value["dtype"])
    raw = base64.b64decode(str(value["b"]).encode("ascii"), validate=True)
    if len(raw) != dtype.itemsize:
        raise ValueError(f"numpy scalar of {dtype}: expected {dtype.itemsize} bytes, "
                         f"got {len(raw)}")
    if dtype.itemsize == 0:  # np.void(b""): frombuffer refuses an itemsize of zero
        return np.zeros((), dtype=dtype)[()]
    return np.frombuffer(raw, dtype=dtype).reshape(())[()]


# --------------------------------------------------------------------------------------------
# torch.Generator


def generator_from_state(state: torch.Tensor, device: torch.device) -> torch.Generator:
    """A new generator on ``device`` in the saved ``state``; ValueError if it does not fit."""
    gen = torch.Generator(device=device)
    try:
        gen.set_state(state.detach().cpu().contiguous())
    except RuntimeError as exc:
        raise ValueError(f"torch.Generator state of {state.numel()} bytes for {device}: "
                         f"{str(exc).splitlines()[0]}") from None
    return gen


# A device string as torch writes it ("cuda:1", "hpu:0", "npu:0"): backends registered by a
# package this process may lack included.
_DEVICE_NAME = re.compile(r"([a-z_][a-z0-9_]{0,31})(?::(?:0|[1-9][0-9]{0,2}))?")


def recorded_device_type(name: Any) -> str:
    """The device type of a device string a manifest records ("cuda:1": "cuda"), whether this
    torch knows that backend or not (a tensor of one it lacks is restored to the CPU; torch
    cannot even parse the name of a backend a package registers, such as torch_npu's "npu").
    ValueError for what no device string looks like."""
    match = _DEVICE_NAME.fullmatch(name) if type(name) is str else None
    if match is None:
        raise ValueError(f"device: expected a device string such as 'cuda:0', got "
                         f"{str(name)[:100]!r}")
    return match.group(1)
