"""Tensor-aware state dicts: a state dict split into a hollow structure and a list of tensors.

The hollow structure is plain JSON (:mod:`localckpt.hollow`), so the non-tensor part of a
checkpoint is read back without unpickling anything. Supported leaves: ``torch.Tensor`` (any dtype,
any device, strided layout), ``None``, ``bool``, ``int``, ``float`` (bit-exact, nan/inf included),
``complex``, ``str`` and ``bytes``; containers: ``dict``, ``collections.OrderedDict``, ``list`` and
``tuple`` (dict keys: any supported scalar, or a tuple of them). Besides:

- a ``DTensor`` (FSDP2, tensor parallelism): its local shard is the tensor, and the node
  ``{"DT": {"T": i, "layout": ...}}`` records where the shard lies (:mod:`localckpt.dtensors`);
- a *Stateful* object (``state_dict()`` and ``load_state_dict()``: modules, optimizers, LR
  schedulers, stateful data loaders): ``state_dict()`` is called and its result stored under
  ``{"S": ...}``; a load into such an object calls its ``load_state_dict`` with what was loaded;
- numpy arrays and scalars, ``torch.Generator``, dataclasses and named tuples
  (:mod:`localckpt.leaves`: what a load may rebuild, and how).

Anything else raises ``TypeError`` naming the key path and the type.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .dtensors import DTensorLayout
from .hollow import JSON, Walk, encode_hollow, format_nodes, is_stateful, resolve_device
from .hollow_decode import Restorer, decode_hollow
from .save.staging import GATHER_MAX_NBYTES, GATHER_RUN_MAX_NBYTES, split_runs

__all__ = ["JSON", "BasicTensorAwareStateDict", "TensorAwareStateDict", "Walk", "as_tensor_aware",
           "decode_hollow", "encode_hollow", "is_stateful", "rebuild_state_dict",
           "resolve_device", "restore_devices"]


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

    def __init__(self, state_dict: Any,
                 on_tensor: Callable[[int, torch.Tensor], None] | None = None,
                 on_stateful: Callable[[Any], None] | None = None,
                 on_tensor_above: int = 0) -> None:
        """``on_tensor(index, tensor)``: called for each plain tensor of more than
        ``on_tensor_above`` bytes as the walk meets it (a save starts copying large ones then);
        ``on_stateful(obj)``: before each Stateful's ``state_dict()`` runs (it may change
        tensors met before)."""
        walk = Walk(on_tensor=on_tensor, on_tensor_above=on_tensor_above,
                    on_stateful=on_stateful)
        try:
            self._hollow = encode_hollow(state_dict, walk)
        except RecursionError:  # not worth a check per container: the error says what to fix
            raise TypeError("the state dict holds itself (a dict or list that contains itself) "
                            "or nests deeper than Python's recursion limit") from None
        self._tensors = walk.tensors
        self._paths = walk.paths
        self._dtensors = walk.dtensors
        self._layouts = walk.layouts
        self.statefuls = walk.statefuls  # key path -> the Stateful object or Generator there
        self.types = walk.types  # the dataclass and named tuple types it holds, by stored name
        self.extended = walk.extended  # holds nodes only format 4 describes
        self.stateful_nodes = bool(walk.statefuls)  # holds {"S": ...} nodes (format 2)
        self.copies = walk.copies  # tensors not the caller's memory (no load(into=...) target)

    @classmethod
    def from_hollow(
        cls, hollow: JSON, tensors: Sequence[torch.Tensor], key_paths: Sequence[str],
        dtensors: Mapping[int, Any] | None = None,
        layouts: Mapping[int, DTensorLayout] | None = None,
        types: Mapping[str, type] | None = None,
    ) -> BasicTensorAwareStateDict:
        """Rebuild from a stored hollow structure and its tensors (in index order); ``dtensors``:
        the DTensor each ``{"DT": ...}`` node stands for, by tensor index."""
        obj = cls.__new__(cls)
        obj._hollow = hollow
        obj._tensors = list(tensors)
        obj._paths = list(key_paths)
        obj._dtensors = dict(dtensors or {})
        obj._layouts = dict(layouts or {})
        obj.statefuls, obj.types, obj.copies = {}, dict(types or {}), set()
        # What its structure holds decides the format a save of it is written in (a load
        # returns it, and a job may save it again as it is): read from the tags, once.
        obj.extended, obj.stateful_nodes = format_nodes(hollow)
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
        return decode_hollow(self._hollow, self._tensors, self._dtensors, types=self.types)


def as_tensor_aware(state_dict: Any, on_tensor: Callable[[int, torch.Tensor], None] | None = None,
                    on_stateful: Callable[[Any], None] | None = None,
                    on_tensor_above: int = 0) -> TensorAwareStateDict:
    """``state_dict`` itself if it is tensor-aware, else wrapped in BasicTensorAwareStateDict
    (whose walk calls ``on_tensor`` and ``on_stateful``)."""
    if isinstance(state_dict, TensorAwareStateDict):
        return state_dict
    return BasicTensorAwareStateDict(state_dict, on_tensor, on_stateful, on_tensor_above)


# --------------------------------------------------------------------------------------------
# Devices


def rebuild_state_dict(hollow: JSON, tensors: Sequence[torch.Tensor], key_paths: Sequence[str],
                       devices: Sequence[str], plain: bool,
                       placed: Mapping[int, torch.Tensor] | None = None,
                       layouts: Mapping[int, DTensorLayout] | None = None,
                       wrap: Callable[[int, torch.Tensor], Any] | None = None,
                       stateful: Restorer | None = None,
                       types: Mapping[str, type] | None = None) -> Any:
    """A loaded state dict: tensors (CPU, each in its own storage) moved to their recorded
    devices, as a plain structure when a plain one was saved, else a BasicTensorAwareStateDict.
    ``placed``: entries already in the caller's tensors (``load(into=...)``), kept as they are.
    ``wrap(i, local)``: the DTensor entry i of ``layouts`` becomes (its errors propagate);
    ``stateful``, ``types``: see :class:`localckpt.hollow_decode.Decoder` (Stateful objects are
    restored here, in order)."""
    moved = restore_devices(tensors, devices, set(placed or ()))
    for i, t in (placed or {}).items():
        moved[i] = t
    dtensors: dict[int, Any] = {}
    for i in layouts or {}:
        if wrap is None:
            raise ValueError(f"tensor {i} ({key_paths[i]}) is a DTensor shard: a device mesh "
                             "is needed to load it")
        dtensors[i] = wrap(i, moved[i])
    state = decode_hollow(hollow, moved, dtensors, stateful, types)
    if plain:
        return state
    return BasicTensorAwareStateDict.from_hollow(hollow, moved, key_paths, dtensors, layouts,
                                                 types)


def restore_devices(tensors: Sequence[torch.Tensor], devices: Sequence[str],
                    skip: Collection[int] = ()) -> list[torch.Tensor]:
    """``tensors`` (CPU) moved to their recorded devices; CPU where a device is absent; those at
    indices in ``skip``, and those already off the CPU (read onto their device), left where they
    are. Each result has a storage of its own.

    A host-to-device copy costs tens of microseconds whatever its size, so small tensors bound
    for a GPU cross as in staging: one copy of their concatenation per run of one device and
    dtype, then a batched device copy into their own storages."""
    cache: dict[str, torch.device] = {}
    out = list(tensors)
    batches: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (t, recorded) in enumerate(zip(tensors, devices, strict=True)):
        if recorded == "cpu" or i in skip or not t.is_cpu:  # CPU first: nothing to move
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

