"""Loading into the caller's tensors: ``load(into=state_dict)`` puts each saved tensor into the
tensor of ``into`` at the same key path, in place, when dtype and shape match.

On CPU the shard's chunks are read (or received) straight into that tensor: no allocation and no
page faults, which on a fresh process cost more than the read itself. On another device the
tensor is read into host memory, then copied into the caller's. Two destinations sharing memory
(tied weights) are left out: reading both at once would make healthy chunks fail their
checksums, and a healthy copy must never be quarantined for that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..state_dict import as_tensor_aware
from ..storage.manifest import ShardManifest, dtype_from_name


def tensors_by_path(into: Any) -> dict[str, torch.Tensor]:
    """The tensors of ``into`` (a state dict as ``save`` takes it) by key path; a path that
    occurs twice is left out. Raises TypeError on a leaf ``save`` would refuse."""
    tasd = as_tensor_aware(into)
    out: dict[str, torch.Tensor] = {}
    twice: set[str] = set()
    for path, t in zip(tasd.key_paths, tasd.tensors, strict=True):
        if path in out:
            twice.add(path)
        out[path] = t
    for path in twice:
        del out[path]
    return out


class Into:
    """The caller's ``into`` state dict, its tensors by path computed once, on first use (inside
    an agreed step, so a bad ``into`` on one rank is the same error on every rank)."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self._paths: dict[str, torch.Tensor] | None = None

    def paths(self) -> dict[str, torch.Tensor] | None:
        if self.state is not None and self._paths is None:
            self._paths = tensors_by_path(self.state)
        return self._paths


@dataclass
class Destinations:
    """For one manifest: ``direct[i]``, the caller's CPU tensor entry i is read into (None: a
    fresh one), and ``copied``: entry index -> caller's tensor on another device."""

    direct: list[torch.Tensor | None]
    copied: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def placed(self) -> dict[int, torch.Tensor]:
        """Every entry that ends up in a caller's tensor."""
        out = {i: t for i, t in enumerate(self.direct) if t is not None}
        return out | self.copied


def match(manifest: ShardManifest, by_path: dict[str, torch.Tensor] | None) -> Destinations:
    """Which entries of ``manifest`` go into which of the caller's tensors (pure). A plain
    contiguous CPU tensor is read into; one on another device, non-contiguous (channels_last),
    with a lazy conjugate or negative bit, or empty is filled by a copy after the read; a sparse,
    nested or meta one, or a path the manifest names twice, is not used."""
    direct: list[torch.Tensor | None] = [None] * len(manifest.tensors)
    if not by_path:
        return Destinations(direct)
    copied: dict[int, torch.Tensor] = {}
    spans: list[tuple[int, int, int]] = []  # (start, end, entry) of CPU destinations' memory
    seen: dict[str, int] = {}
    for e in manifest.tensors:
        seen[e.key_path] = seen.get(e.key_path, 0) + 1
    for i, e in enumerate(manifest.tensors):
        t = by_path.get(e.key_path)
        if t is None or seen[e.key_path] > 1 or t.layout != torch.strided or t.is_nested \
                or t.device.type == "meta" or t.dtype != dtype_from_name(e.dtype) \
                or tuple(t.shape) != tuple(e.shape):
            continue
        if t.device.type == "cpu" and e.nbytes and t.is_contiguous() and not t.is_conj() \
                and not t.is_neg():
            direct[i] = t
            spans.append((t.data_ptr(), t.data_ptr() + e.nbytes, i))
        else:
            copied[i] = t
    spans.sort()
    shared: set[int] = set()
    reach, last = -1, -1
    for start, end, i in spans:
        if start < reach:  # overlaps the furthest-reaching span so far
            shared.update((i, last))
        if end > reach:
            reach, last = end, i
    for i in shared:
        direct[i] = None
    return Destinations(direct, copied)


def fill_copied(destinations: Destinations, tensors: list[torch.Tensor]) -> None:
    """Copy each loaded tensor into the caller's tensor that could not be read into."""
    with torch.no_grad():  # a Parameter that requires grad is filled like any tensor
        for i, t in destinations.copied.items():
            t.copy_(tensors[i])
