"""Decoding the hollow structure (:mod:`localckpt.hollow`) back into a state dict's non-tensor
part, with only the types :mod:`localckpt.leaves` allows."""

from __future__ import annotations

import argparse
import base64
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from . import leaves
from .hollow import EXTENDED_TAGS, JSON, path_str, resolve_device

logger = logging.getLogger(__name__)

Restorer = Callable[[str, Any], Any]


class Decoder:
    """Inverse of :func:`encode_hollow`. ``dtensors``: the object each ``{"DT": ...}`` node
    becomes, by tensor index; ``stateful(key_path, value)``: what each ``{"S": ...}`` and
    ``{"G": ...}`` node and each dict becomes (default: its value), called for the outermost ones
    only, with a value whose nested Stateful nodes are plain state dicts; ``types``: dataclass and
    named tuple types allowed besides the registered ones (:func:`leaves.add_safe_types`).
    Decoding raises ValueError on a malformed node or a DTensor node ``dtensors`` lacks, and
    UnsafeTypeError on a type that is not allowed. Key paths are tracked only for ``stateful``
    (a plain load of many small tensors would pay for them)."""

    def __init__(self, tensors: Sequence[torch.Tensor], dtensors: Mapping[int, Any] | None = None,
                 stateful: Restorer | None = None,
                 types: Mapping[str, type] | None = None) -> None:
        self.tensors, self.dtensors, self.stateful = tensors, dtensors, stateful
        self.types = types or {}
        self._devices: dict[str, torch.device] = {}

    def __call__(self, node: JSON) -> Any:
        return self._node(node, () if self.stateful is not None else None)

    def _tensor(self, value: Any) -> torch.Tensor:
        if type(value) is not int or not 0 <= value < len(self.tensors):
            raise ValueError(f"hollow structure refers to tensor {value!r} of "
                             f"{len(self.tensors)}")
        return self.tensors[value]

    def _node(self, node: JSON, path: tuple[Any, ...] | None) -> Any:
        if node is None or type(node) in (bool, int, str):
            return node
        if type(node) is list:
            if path is None:
                return [self._node(v, None) for v in node]
            return [self._node(v, (*path, i)) for i, v in enumerate(node)]
        if type(node) is dict and len(node) == 1:
            (tag, value), = node.items()
            if tag == "T":
                return self._tensor(value)
            if tag == "f":
                return float.fromhex(value)
            if tag in ("dict", "odict"):
                pairs = []
                tensors, count = self.tensors, len(self.tensors)
                for k, v in value:
                    key = k if type(k) is str else self._node(k, None)
                    # The common leaf inline: a load of 10,000 tensors decodes 10,000 of them.
                    if type(v) is dict and len(v) == 1 and type(i := v.get("T")) is int \
                            and 0 <= i < count:
                        pairs.append((key, tensors[i]))
                    else:
                        pairs.append((key, self._node(v, None if path is None else
                                                      (*path, key))))
                out = OrderedDict(pairs) if tag == "odict" else dict(pairs)
                # a Stateful of load(into=...) where a plain state dict was saved
                return self._restore(path, out)
            if tag == "tuple":
                if path is None:
                    return tuple([self._node(v, None) for v in value])
                return tuple(self._node(v, (*path, i)) for i, v in enumerate(value))
            if tag == "DT":
                i = value.get("T") if type(value) is dict else None
                if self.dtensors is None or type(i) is not int or i not in self.dtensors:
                    raise ValueError(f"hollow structure: no DTensor for tensor {i!r}")
                return self.dtensors[i]
            if tag == "S":
                return self._restore(path, self._node(value, None))
            if tag == "c":
                return complex(float.fromhex(value[0]), float.fromhex(value[1]))
            if tag == "b":
                return base64.b64decode(value.encode("ascii"), validate=True)
            if tag in EXTENDED_TAGS:
                return self._extended(tag, value, path)
        raise ValueError(f"malformed hollow structure node: {str(node)[:200]}")

    def _restore(self, path: tuple[Any, ...] | None, value: Any) -> Any:
        return value if self.stateful is None or path is None else \
            self.stateful(path_str(path), value)

    def _extended(self, tag: str, value: Any, path: tuple[Any, ...] | None) -> Any:
        if tag in ("np", "npg", "G", "dc", "nt", "enum") and type(value) is not dict:
            raise ValueError(f"malformed {tag!r} node: {str(value)[:200]}")
        if tag == "np":
            return leaves.tensor_to_array(self._tensor(value.get("T")), value.get("dtype"),
                                          value.get("shape"))
        if tag == "npg":
            return leaves.scalar_from_json(value)
        if tag == "G":
            state, recorded = self._tensor(value.get("T")), str(value.get("device"))
            device = resolve_device(recorded, self._devices)
            if device.type == "cpu" and leaves.recorded_device_type(recorded) != "cpu":
                logger.warning("a torch.Generator of %s cannot be rebuilt here: its state "
                               "tensor is returned instead", recorded)
                return state
            return self._restore(path, leaves.generator_from_state(state, device))
        if tag == "dtype":
            return leaves.dtype_by_name(value)
        if tag == "slice":
            if type(value) is not list or len(value) != 3:
                raise ValueError(f"malformed slice node: {str(value)[:200]}")
            return slice(*(self._node(v, None) for v in value))
        if tag == "ns":
            if type(value) is not list or any(type(f) is not list or len(f) != 2
                                              or type(f[0]) is not str for f in value):
                raise ValueError(f"malformed Namespace node: {str(value)[:200]}")
            # its attributes set as a dict's items, as vars() gave them: any name is data
            # (a setattr of __class__ would change the object)
            ns = argparse.Namespace()
            vars(ns).update({k: self._node(v, None if path is None else (*path, k))
                             for k, v in value})
            return ns
        if tag == "enum":
            return leaves.enum_member(value, self.types)
        fields = value.get("fields")
        if type(fields) is not list or any(type(f) is not list or len(f) != 2
                                           or type(f[0]) is not str for f in fields):
            raise ValueError(f"malformed {tag!r} node: {str(value)[:200]}")
        decoded = [(f, self._node(v, None if path is None else (*path, f))) for f, v in fields]
        return leaves.build_record(tag, str(value.get("type")), decoded, self.types)


def decode_hollow(node: JSON, tensors: Sequence[torch.Tensor],
                  dtensors: Mapping[int, Any] | None = None,
                  stateful: Restorer | None = None,
                  types: Mapping[str, type] | None = None) -> Any:
    """Inverse of :func:`encode_hollow` (see :class:`Decoder`)."""
    return Decoder(tensors, dtensors, stateful, types)(node)
