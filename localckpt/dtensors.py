"""DTensor leaves: how a sharded tensor (FSDP2's ``fully_shard``, tensor parallelism, any
``torch.distributed.tensor.DTensor``) is saved and put back.

A rank saves only its local shard, as an ordinary tensor of its shard, and records the layout in
the manifest (:class:`DTensorLayout`, JSON: global shape and stride, mesh shape and dim names,
placements, this rank's mesh coordinate and the shard's offset in the global tensor). Loading
wraps the local shard again on the caller's mesh: the mesh of the DTensor at the same key path of
``load(into=...)``, else the mesh of any DTensor of ``into`` with the same shape and dim names
(the optimizer state of a fresh optimizer has none of its own yet).

``torch.distributed.tensor`` is imported only once a DTensor exists, so a job without one never
pays for it.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

_SHARD = re.compile(r"S\(([0-9]{1,4})\)")
_STRIDED = re.compile(r"SS\(([0-9]{1,4}),([0-9]{1,9})\)")
_LIMIT = 1 << 62  # bound on every recorded size, stride and offset
_MAX_SPLIT = 1 << 16  # bound on a layout's _StridedShard split factors, added (FSDP2: TP degree)
_LAYOUTS: dict[Any, DTensorLayout] = {}  # see DTensorLayout.of


def is_dtensor(obj: Any) -> bool:
    """Whether ``obj`` is a DTensor (without importing torch.distributed.tensor: if nobody has,
    nothing can be one)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(obj, module.DTensor)


def _placement_str(p: Any, where: str) -> str:
    """``p`` as a short, stable string: ``R``, ``S(d)``, ``SS(d,split_factor)``. TypeError for a
    placement a checkpoint cannot hold (Partial: an unreduced value) or one this code does not
    know."""
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    if isinstance(p, _StridedShard):
        text = f"SS({p.dim},{int(p.split_factor)})"
    elif isinstance(p, Shard):
        text = f"S({p.dim})"
    elif isinstance(p, Replicate):
        text = "R"
    elif p.is_partial():
        raise TypeError(f"DTensor at state dict key {where!r} has placement {p}: a partial "
                        "(unreduced) value cannot be checkpointed; redistribute it to Shard or "
                        "Replicate first")
    else:
        raise TypeError(f"DTensor at state dict key {where!r}: unsupported placement {p!r}; "
                        "expected Shard, _StridedShard or Replicate")
    if placement_from_str(text) != p:  # a field this code does not record
        raise TypeError(f"DTensor at state dict key {where!r}: placement {p!r} has state "
                        f"localckpt does not record (it would come back as {text})")
    return text


def placement_from_str(text: str) -> Any:
    """Inverse of the encoding above; ValueError for anything else."""
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    if text == "R":
        return Replicate()
    if m := _SHARD.fullmatch(text):
        return Shard(int(m.group(1)))
    if m := _STRIDED.fullmatch(text):
        return _StridedShard(int(m.group(1)), split_factor=int(m.group(2)))
    raise ValueError(f"unknown DTensor placement {text!r}")


def _ints(value: Any, what: str, least: int = 0) -> tuple[int, ...]:
    if type(value) is not list or len(value) > 64 or \
            any(type(v) is not int or not least <= v < _LIMIT for v in value):
        raise ValueError(f"{what}: expected a list of ints in [{least}, 2**62), got "
                         f"{str(value)[:200]}")
    return tuple(value)


@dataclass(frozen=True)
class DTensorLayout:
    """Where one rank's local shard lies in a DTensor."""

    global_shape: tuple[int, ...]
    global_stride: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] | None
    placements: tuple[str, ...]
    coordinate: tuple[int, ...]  # this rank's place on the mesh
    offset: tuple[int, ...]  # of the local shard in the global tensor, per dim

    @classmethod
    def of(cls, dt: Any, where: str) -> DTensorLayout:
        """The layout of DTensor ``dt`` as this rank holds it. TypeError (naming ``where``) for
        a placement a checkpoint cannot hold, or a rank outside the DTensor's mesh. Computed
        once per mesh, shape, stride and placements: a save describes every leaf, on the
        training thread."""
        key = (dt.device_mesh, tuple(dt.shape), tuple(dt.stride()), tuple(dt.placements))
        layout = _LAYOUTS.get(key)
        if layout is None:
            layout = _LAYOUTS[key] = cls._compute(dt, where)
            if len(_LAYOUTS) > 65536:  # meshes come and go in tests, not in a job
                _LAYOUTS.clear()
        return layout

    @classmethod
    def _compute(cls, dt: Any, where: str) -> DTensorLayout:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        mesh = dt.device_mesh
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise TypeError(f"DTensor at state dict key {where!r}: this rank is not on its "
                            f"device mesh {mesh}")
        placements = tuple(_placement_str(p, where) for p in dt.placements)
        _, offset = compute_local_shape_and_global_offset(dt.shape, mesh, dt.placements)
        names = mesh.mesh_dim_names
        return cls(tuple(dt.shape), tuple(dt.stride()), tuple(mesh.shape),
                   tuple(names) if names is not None else None, placements,
                   tuple(int(c) for c in coordinate), tuple(int(o) for o in offset))

    @functools.cached_property
    def json(self) -> dict[str, Any]:
        """:meth:`to_json`, built once (shared by every node of this layout; never mutated)."""
        return self.to_json()

    def to_json(self) -> dict[str, Any]:
        return {"global_shape": list(self.global_shape),
                "global_stride": list(self.global_stride), "mesh_shape": list(self.mesh_shape),
                "mesh_dim_names": list(self.mesh_dim_names)
                if self.mesh_dim_names is not None else None,
                "placements": list(self.placements), "coordinate": list(self.coordinate),
                "offset": list(self.offset)}

    @classmethod
    def from_json(cls, doc: Any) -> DTensorLayout:
        """Parse and check a recorded layout; ValueError saying what is wrong."""
        if type(doc) is not dict:
            raise ValueError(f"DTensor layout: expected an object, got {type(doc).__name__}")
        try:
            names = doc["mesh_dim_names"]
            if names is not None and (type(names) is not list
                                      or any(type(n) is not str for n in names)):
                raise ValueError(f"mesh_dim_names: expected a list of str, got {names!r}")
            placements = doc["placements"]
            if type(placements) is not list or any(type(p) is not str for p in placements):
                raise ValueError(f"placements: expected a list of str, got {placements!r}")
            layout = cls(_ints(doc["global_shape"], "global_shape"),
                         _ints(doc["global_stride"], "global_stride"),
                         _ints(doc["mesh_shape"], "mesh_shape", least=1),
                         tuple(names) if names is not None else None, tuple(placements),
                         _ints(doc["coordinate"], "coordinate"), _ints(doc["offset"], "offset"))
        except KeyError as exc:
            raise ValueError(f"DTensor layout: missing {exc}") from None
        layout._check()
        return layout

    def _check(self) -> None:
        rank = len(self.global_shape)
        mesh = len(self.mesh_shape)
        if len(self.global_stride) != rank or len(self.offset) != rank:
            raise ValueError(f"DTensor layout: shape {list(self.global_shape)}, stride "
                             f"{list(self.global_stride)} and offset {list(self.offset)} differ "
                             "in length")
        if len(self.placements) != mesh or len(self.coordinate) != mesh or (
                self.mesh_dim_names is not None and len(self.mesh_dim_names) != mesh):
            raise ValueError(f"DTensor layout: a mesh of shape {list(self.mesh_shape)} with "
                             f"placements {list(self.placements)}, coordinate "
                             f"{list(self.coordinate)}, dim names {self.mesh_dim_names}")
        if any(not 0 <= c < n for c, n in zip(self.coordinate, self.mesh_shape, strict=True)):
            raise ValueError(f"DTensor layout: coordinate {list(self.coordinate)} is off the "
                             f"mesh of shape {list(self.mesh_shape)}")
        for text in self.placements:
            m = _SHARD.fullmatch(text) or _STRIDED.fullmatch(text)
            if not (text == "R" or (m and int(m.group(1)) < rank
                                    and (len(m.groups()) == 1 or int(m.group(2)) >= 1))):
                raise ValueError(f"DTensor layout: placement {text!r} for a tensor of {rank} "
                                 "dims")
        factors = sum(int(m.group(2)) for p in self.placements if (m := _STRIDED.fullmatch(p)))
        if factors > _MAX_SPLIT:  # torch's cut goes piece by piece: bound the pieces
            raise ValueError(f"DTensor layout: split factors {list(self.placements)} add up "
                             f"to {factors}, over {_MAX_SPLIT} (an interleave that no mesh "
                             "makes)")

    @functools.cached_property
    def is_block(self) -> bool:
        """Whether this rank's shard is one block of the global tensor (``offset`` and the
        local shape), as resharding assumes: always with Shard and Replicate; with
        _StridedShard only where the interleaving it stands for gives contiguous indices
        (FSDP2 over tensor parallelism does; a flattened view of a tensor sharded on two mesh
        dims does not). Each strided dim's indices are cut as torch cuts a tensor (torch.chunk:
        pieces of ceil(n / k), the last ones short or empty), held as runs of indices rather
        than the indices themselves: a dim's size costs nothing, whatever a manifest says."""
        strided = {int(m.group(1)) for p in self.placements if (m := _STRIDED.fullmatch(p))}
        for dim in strided:
            held: list[tuple[int, int]] = [(0, self.global_shape[dim])]
            for i, text in enumerate(self.placements):
                m = _SHARD.fullmatch(text) or _STRIDED.fullmatch(text)
                if m and int(m.group(1)) == dim:
                    factor = int(m.group(2)) if len(m.groups()) == 2 else None
                    held = _cut(held, self.mesh_shape[i], self.coordinate[i], factor)
            start = self.offset[dim]
            if held and held != [(start, held[0][1])]:
                return False
        return True

    def same_place(self, other: DTensorLayout) -> bool:
        """Whether a shard of ``self`` is the shard ``other`` holds: the same global tensor cut
        the same way on a mesh of the same shape, at the same coordinate (dim names may
        differ: they do not move data)."""
        return (self.global_shape, self.mesh_shape, self.placements, self.coordinate) == \
            (other.global_shape, other.mesh_shape, other.placements, other.coordinate)

    def describe(self) -> str:
        names = f" ({', '.join(self.mesh_dim_names)})" if self.mesh_dim_names else ""
        return (f"global shape {list(self.global_shape)}, mesh {list(self.mesh_shape)}{names}, "
                f"placements [{', '.join(self.placements)}], coordinate {list(self.coordinate)}")


Runs = list[tuple[int, int]]  # index ranges [start, stop), in order, none empty


def _cut(held: Runs, parts: int, index: int, split_factor: int | None) -> Runs:
    """The ``index``-th of ``parts`` pieces of the indices ``held``, cut as torch's Shard
    (``split_factor`` None) or _StridedShard cuts a tensor: first into ``split_factor`` pieces,
    each of those into ``parts``, then the ``index``-th of each, joined."""
    at = list(itertools.accumulate((stop - start for start, stop in held), initial=0))
    n = at[-1]
    if split_factor is None:
        return _chunk(held, at, 0, n, parts, index)
    joined: Runs = []
    size = -(-n // split_factor)
    for j in range(min(split_factor, -(-n // size) if n else 0)):  # the non-empty pieces
        for start, stop in _chunk(held, at, j * size, min((j + 1) * size, n), parts, index):
            if joined and joined[-1][1] == start:
                joined[-1] = (joined[-1][0], stop)
            else:
                joined.append((start, stop))
    return joined


def _chunk(held: Runs, at: Sequence[int], lo: int, hi: int, parts: int, index: int) -> Runs:
    """torch.chunk(indices[lo:hi], parts)[index] (nothing where torch makes fewer pieces) of
    the indices ``held``, whose runs begin at positions ``at``."""
    size = -(-(hi - lo) // parts)
    lo, hi = min(lo + index * size, hi), min(lo + (index + 1) * size, hi)
    out: Runs = []
    k = bisect.bisect_right(at, lo) - 1
    while lo < hi:
        start, stop = held[k]
        a, b = lo - at[k], min(hi - at[k], stop - start)
        out.append((start + a, start + b))
        lo = at[k] + b
        k += 1
    return out


def mesh_key(layout: DTensorLayout) -> tuple[tuple[int, ...], tuple[str, ...] | None]:
    return layout.mesh_shape, layout.mesh_dim_names


def wrap(local: torch.Tensor, layout: DTensorLayout, mesh: Any, where: str) -> Any:
    """A DTensor of ``layout`` on ``mesh`` whose local shard is ``local`` (not copied).
    CorruptShardError (naming ``where``) when ``local`` is not the shard the layout puts at
    this rank's coordinate of ``mesh``."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from .errors import CorruptShardError

    placements: Sequence[Any] = [placement_from_str(p) for p in layout.placements]
    shape, offset = compute_local_shape_and_global_offset(layout.global_shape, mesh, placements)
    if tuple(shape) != tuple(local.shape) or tuple(offset) != layout.offset:
        raise CorruptShardError(
            f"{where}: the saved DTensor shard has shape {list(local.shape)} at offset "
            f"{list(layout.offset)}; its layout ({layout.describe()}) puts one of shape "
            f"{list(shape)} at {list(offset)} there")
    return DTensor.from_local(local, mesh, placements, run_check=False,
                              shape=torch.Size(layout.global_shape),
                              stride=layout.global_stride)
