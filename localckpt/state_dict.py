"""Tensor-aware state dicts: a state dict split into a hollow structure and a list of tensors.

The hollow structure is plain JSON (see :func:`encode_hollow`), so the non-tensor part of a
checkpoint is read back without unpickling anything. Supported leaves: ``torch.Tensor`` (any dtype,
any device, strided layout), ``None``, ``bool``, ``int``, ``float`` (bit-exact, nan/inf included),
``complex``, ``str`` and ``bytes``; containers: ``dict``, ``collections.OrderedDict``, ``list`` and
``tuple`` (dict keys: any supported scalar, or a tuple of them). Two more:

- a ``DTensor`` (FSDP2, tensor parallelism): its local shard is the tensor, and the node
  ``{"DT": {"T": i, "layout": ...}}`` records where the shard lies (:mod:`localckpt.dtensors`);
- a *Stateful* object (``state_dict()`` and ``load_state_dict()``: modules, optimizers, LR
  schedulers, stateful data loaders): ``state_dict()`` is called and its result stored under
  ``{"S": ...}``; a load into such an object calls its ``load_state_dict`` with what was loaded.

Anything else raises ``TypeError`` naming the key path and the type.
"""

from __future__ import annotations

import base64
import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .dtensors import DTensorLayout, is_dtensor
from .save.staging import GATHER_MAX_NBYTES, GATHER_RUN_MAX_NBYTES, split_runs

logger = logging.getLogger(__name__)

JSON = Any  # a value json.dumps accepts: None, bool, int, float, str, list, dict[str, JSON]

_SCALAR_TYPES = (type(None), bool, int, str)


class TensorAwareStateDict(ABC):
    """A state dict whose tensors can be taken out, staged and put back.

    Implementations never mutate the caller's state dict. ``tensors`` and ``key_paths`` are in the
    same stable order; ``hollow_structure`` refers to tensors by their index in that order.
    """

    @property
    @abstractmethod
    def tensors(self) -> Sequence[torch.Tensor]:
        """The tensors, in the order the hollow structure refers to them."""

    @property
    @abstractmethod
    def key_paths(self) -> Sequence[str]:
        """A readable path per tensor, e.g. ``optimizer/state/0/exp_avg``."""

    @abstractmethod
    def hollow_structure(self) -> JSON:
        """The non-tensor part as JSON, tensors replaced by their index."""

    @abstractmethod
    def to_state_dict(self) -> Any:
        """The state dict this object stands for (the tensors currently held, not copies)."""

    @property
    def layouts(self) -> Mapping[int, DTensorLayout]:
        """Index -> layout of the tensors that are a DTensor's local shard (none by default)."""
        return {}


class BasicTensorAwareStateDict(TensorAwareStateDict):
    """Wraps a nested dict / list / tuple / OrderedDict state dict.

    The constructor walks the structure once (raising ``TypeError`` on an unsupported leaf) and
    keeps references to the caller's tensors; nothing is copied or mutated here. The snapshot is
    taken when the manager stages the tensors inside ``save``.
    """

    def __init__(self, state_dict: Any) -> None:
        walk = Walk()
        self._hollow = encode_hollow(state_dict, walk)
        self._tensors = walk.tensors
        self._paths = walk.paths
        self._dtensors = walk.dtensors
        self._layouts = walk.layouts
        self.statefuls = walk.statefuls  # key path -> the Stateful object found there

    @classmethod
    def from_hollow(
        cls, hollow: JSON, tensors: Sequence[torch.Tensor], key_paths: Sequence[str],
        dtensors: Mapping[int, Any] | None = None,
        layouts: Mapping[int, DTensorLayout] | None = None,
    ) -> BasicTensorAwareStateDict:
        """Rebuild from a stored hollow structure and its tensors (in index order); ``dtensors``:
        the DTensor each ``{"DT": ...}`` node stands for, by tensor index."""
        obj = cls.__new__(cls)
        obj._hollow = hollow
        obj._tensors = list(tensors)
        obj._paths = list(key_paths)
        obj._dtensors = dict(dtensors or {})
        obj._layouts = dict(layouts or {})
        obj.statefuls = {}
        return obj

    @property
    def layouts(self) -> Mapping[int, DTensorLayout]:
        return self._layouts

    @property
    def dtensors(self) -> Mapping[int, Any]:
        """Index -> the DTensor whose local shard ``tensors[index]`` is."""
        return self._dtensors

    @property
    def tensors(self) -> Sequence[torch.Tensor]:
        return self._tensors

    @property
    def key_paths(self) -> Sequence[str]:
        return self._paths

    def hollow_structure(self) -> JSON:
        return self._hollow

    def to_state_dict(self) -> Any:
        return decode_hollow(self._hollow, self._tensors, self._dtensors)


def as_tensor_aware(state_dict: Any) -> TensorAwareStateDict:
    """``state_dict`` itself if it is tensor-aware, else wrapped in BasicTensorAwareStateDict."""
    if isinstance(state_dict, TensorAwareStateDict):
        return state_dict
    return BasicTensorAwareStateDict(state_dict)


# --------------------------------------------------------------------------------------------
# Hollow structure encoding. Every JSON object node has exactly one tag key, so decoding is exact.


def _path_str(path: tuple[Any, ...]) -> str:
    return "/".join(str(p) for p in path) if path else "<root>"


def _encode_key(key: Any, path: tuple[Any, ...]) -> JSON:
    if isinstance(key, tuple) and type(key) is tuple:
        return {"tuple": [_encode_key(k, path) for k in key]}
    if isinstance(key, (torch.Tensor, list, dict)):
        raise TypeError(
            f"state dict key at {_path_str(path)!r}: expected a str, int, float, bool, None, bytes "
            f"or tuple key, got {type(key).__name__}"
        )
    return _encode_leaf(key, path)


def _encode_leaf(value: Any, path: tuple[Any, ...]) -> JSON:
    kind = type(value)
    if kind in _SCALAR_TYPES:
        return value
    if kind is float:
        return {"f": value.hex()}
    if kind is complex:
        return {"c": [value.real.hex(), value.imag.hex()]}
    if kind is bytes:
        return {"b": base64.b64encode(value).decode("ascii")}
    raise TypeError(
        f"unsupported value at state dict key {_path_str(path)!r}: expected a tensor, dict, "
        f"OrderedDict, list, tuple, None, bool, int, float, complex, str or bytes, "
        f"got {kind.__module__}.{kind.__qualname__}"
    )


def _check_tensor(t: torch.Tensor, path: tuple[Any, ...]) -> None:
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(
            f"unsupported tensor at state dict key {_path_str(path)!r}: expected a plain "
            f"torch.Tensor or nn.Parameter, got subclass {type(t).__qualname__}"
        )
    if t.layout != torch.strided:
        raise TypeError(
            f"unsupported tensor at state dict key {_path_str(path)!r}: expected layout "
            f"torch.strided, got {t.layout}"
        )
    if t.device.type == "meta":
        raise TypeError(
            f"unsupported tensor at state dict key {_path_str(path)!r}: meta tensors hold no data"
        )


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` follows the Stateful protocol (torch.distributed.checkpoint's)."""
    kind = type(obj)
    return not isinstance(obj, type) and callable(getattr(kind, "state_dict", None)) and \
        callable(getattr(kind, "load_state_dict", None))


@dataclass
class Walk:
    """What :func:`encode_hollow` collects: the tensors in order, their key paths, and the
    DTensors and Stateful objects it met."""

    tensors: list[torch.Tensor] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    dtensors: dict[int, Any] = field(default_factory=dict)
    layouts: dict[int, DTensorLayout] = field(default_factory=dict)
    statefuls: dict[str, Any] = field(default_factory=dict)  # outermost ones, by key path
    within: int = 0  # how many Stateful objects the walk is inside
    open: set[int] = field(default_factory=set)  # ids of the Statefuls being walked (cycles)
    dtensor_paths: set[str] = field(default_factory=set)

    def add(self, t: torch.Tensor, path: tuple[Any, ...]) -> int:
        self.tensors.append(t)
        self.paths.append(_path_str(path))
        return len(self.tensors) - 1


def encode_hollow(obj: Any, walk: Walk, path: tuple[Any, ...] = ()) -> JSON:
    """JSON form of ``obj`` with tensors appended to ``walk`` and replaced by ``{"T": i}``."""
    kind = type(obj)
    if isinstance(obj, torch.Tensor):
        if is_dtensor(obj):
            where = _path_str(path)
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
        items = [[_encode_key(k, path), encode_hollow(v, walk, (*path, k))]
                 for k, v in obj.items()]
        return {"odict" if kind is OrderedDict else "dict": items}
    if kind is list:
        return [encode_hollow(v, walk, (*path, i)) for i, v in enumerate(obj)]
    if kind is tuple:
        return {"tuple": [encode_hollow(v, walk, (*path, i)) for i, v in enumerate(obj)]}
    if is_stateful(obj):
        return _encode_stateful(obj, walk, path)
    return _encode_leaf(obj, path)


def _encode_stateful(obj: Any, walk: Walk, path: tuple[Any, ...]) -> JSON:
    """``{"S": obj.state_dict()}``. Only the outermost Stateful objects are restored by load
    (an outer one restores those its state dict holds), so only they are recorded; two at one
    key path, or one whose state dict holds itself, are refused (TypeError)."""
    where = _path_str(path)
    if id(obj) in walk.open:
        raise TypeError(f"Stateful object at state dict key {where!r}: its state_dict() holds "
                        "the object itself")
    if walk.within == 0:
        if where in walk.statefuls:
            raise TypeError(f"two Stateful objects at state dict key {where!r}: a key path "
                            "must name one object for load(into=...) to restore it")
        walk.statefuls[where] = obj
    walk.open.add(id(obj))
    walk.within += 1
    try:
        return {"S": encode_hollow(obj.state_dict(), walk, path)}
    finally:
        walk.within -= 1
        walk.open.discard(id(obj))


Restorer = Callable[[str, Any], Any]


def decode_hollow(node: JSON, tensors: Sequence[torch.Tensor],
                  dtensors: Mapping[int, Any] | None = None,
                  stateful: Restorer | None = None, path: tuple[Any, ...] = ()) -> Any:
    """Inverse of :func:`encode_hollow`. ``dtensors``: the object each ``{"DT": ...}`` node
    becomes, by tensor index; ``stateful(key_path, value)``: what each ``{"S": ...}`` node and
    each dict becomes (default: its value), called for the outermost ones only, with a value
    whose nested Stateful nodes are plain state dicts. Raises ``ValueError`` on a malformed node
    or a DTensor node ``dtensors`` lacks. Key paths are tracked only for ``stateful`` (a plain
    load of many small tensors would pay for them)."""
    if node is None or type(node) in (bool, int, str):
        return node
    if type(node) is list:
        if stateful is None:
            return [decode_hollow(v, tensors, dtensors) for v in node]
        return [decode_hollow(v, tensors, dtensors, stateful, (*path, i))
                for i, v in enumerate(node)]
    if type(node) is dict and len(node) == 1:
        (tag, value), = node.items()
        if tag == "T":
            if type(value) is not int or not 0 <= value < len(tensors):
                raise ValueError(f"hollow structure refers to tensor {value!r} of {len(tensors)}")
            return tensors[value]
        if tag == "DT":
            i = value.get("T") if type(value) is dict else None
            if dtensors is None or type(i) is not int or i not in dtensors:
                raise ValueError(f"hollow structure: no DTensor for tensor {i!r}")
            return dtensors[i]
        if tag == "S":
            inner = decode_hollow(value, tensors, dtensors, None, path)
            return stateful(_path_str(path), inner) if stateful is not None else inner
        if tag == "f":
            return float.fromhex(value)
        if tag == "c":
            return complex(float.fromhex(value[0]), float.fromhex(value[1]))
        if tag == "b":
            return base64.b64decode(value.encode("ascii"), validate=True)
        if tag == "tuple":
            if stateful is None:
                return tuple([decode_hollow(v, tensors, dtensors) for v in value])
            return tuple(decode_hollow(v, tensors, dtensors, stateful, (*path, i))
                         for i, v in enumerate(value))
        if tag in ("dict", "odict"):
            if stateful is None:
                pairs = [(decode_hollow(k, tensors), decode_hollow(v, tensors, dtensors))
                         for k, v in value]
                return OrderedDict(pairs) if tag == "odict" else dict(pairs)
            pairs = []
            for k, v in value:
                key = decode_hollow(k, tensors)
                pairs.append((key, decode_hollow(v, tensors, dtensors, stateful, (*path, key))))
            out = OrderedDict(pairs) if tag == "odict" else dict(pairs)
            # a Stateful of load(into=...) where a plain state dict was saved
            return stateful(_path_str(path), out) if stateful is not None else out
    raise ValueError(f"malformed hollow structure node: {str(node)[:200]}")


# --------------------------------------------------------------------------------------------
# Devices


def resolve_device(recorded: str, _cache: dict[str, torch.device] | None = None) -> torch.device:
    """The device a tensor saved from ``recorded`` goes back to: itself when it exists here, else
    CPU (with a warning, once per device string per call site cache)."""
    if _cache is not None and recorded in _cache:
        return _cache[recorded]
    device = torch.device(recorded)
    if device.type != "cpu":
        try:
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError, ValueError) as exc:
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


def rebuild_state_dict(hollow: JSON, tensors: Sequence[torch.Tensor], key_paths: Sequence[str],
                       devices: Sequence[str], plain: bool,
                       placed: Mapping[int, torch.Tensor] | None = None,
                       layouts: Mapping[int, DTensorLayout] | None = None,
                       wrap: Callable[[int, torch.Tensor], Any] | None = None,
                       stateful: Restorer | None = None) -> Any:
    """A loaded state dict: tensors (CPU, each in its own storage) moved to their recorded
    devices, as a plain structure when a plain one was saved, else a BasicTensorAwareStateDict.
    ``placed``: entries already in the caller's tensors (``load(into=...)``), kept as they are.
    ``wrap(i, local)``: the DTensor entry i of ``layouts`` becomes (its errors propagate);
    ``stateful``: see :func:`decode_hollow` (Stateful objects are restored here, in order)."""
    moved = restore_devices(tensors, devices, set(placed or ()))
    for i, t in (placed or {}).items():
        moved[i] = t
    dtensors: dict[int, Any] = {}
    for i in layouts or {}:
        if wrap is None:
            raise ValueError(f"tensor {i} ({key_paths[i]}) is a DTensor shard: a device mesh "
                             "is needed to load it")
        dtensors[i] = wrap(i, moved[i])
    state = decode_hollow(hollow, moved, dtensors, stateful)
    if plain:
        return state
    return BasicTensorAwareStateDict.from_hollow(hollow, moved, key_paths, dtensors, layouts)


def restore_devices(tensors: Sequence[torch.Tensor], devices: Sequence[str],
                    skip: Collection[int] = ()) -> list[torch.Tensor]:
    """``tensors`` (CPU) moved to their recorded devices; CPU where a device is absent; those at
    indices in ``skip`` left where they are. Each result has a storage of its own.

    A host-to-device copy costs tens of microseconds whatever its size, so small tensors bound
    for a GPU cross as in staging: one copy of their concatenation per run of one device and
    dtype, then a batched device copy into their own storages."""
    cache: dict[str, torch.device] = {}
    out = list(tensors)
    batches: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (t, recorded) in enumerate(zip(tensors, devices, strict=True)):
        if i in skip:
            continue
        device = resolve_device(recorded, cache)
        if device.type == "cuda" and 0 < t.numel() * t.element_size() <= GATHER_MAX_NBYTES:
            batches.setdefault((device, t.dtype), []).append(i)
        elif device.type != "cpu":
            out[i] = t.to(device)
    for (device, _), indices in batches.items():
        for batch in split_runs(indices, [tensors[i].numel() * tensors[i].element_size()
                                          for i in indices], GATHER_RUN_MAX_NBYTES):
            group = [tensors[i] for i in batch]
            flat = _flatten_dense_tensors(group).to(device)  # type: ignore[no-untyped-call]
            views = _unflatten_dense_tensors(flat, group)  # type: ignore[no-untyped-call]
            moved = [torch.empty_like(t, device=device) for t in group]
            torch._foreach_copy_(moved, views)
            for i, m in zip(batch, moved, strict=True):
                out[i] = m
    return out

