"""Which tensors of ``load(into=...)``'s state dict share memory: tied weights (one memory
under several keys, seen alike), filled by a copy when the values saved for them agree, and
views that overlap in part, which cannot all hold their saved values. Tensors whose address
spans overlap are compared byte by byte (:func:`localckpt.storage.views.sharing`): the column
slices of one matrix span each other without sharing memory. Pure: addresses only."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..storage.views import extent, sharing

logger = logging.getLogger(__name__)


def shared_destinations(spans: list[tuple[str, int, int, int]],
                        direct: list[torch.Tensor | None],
                        copied: dict[int, torch.Tensor]) -> set[int]:
    """The entries whose destination shares memory with another's, of ``spans`` ((device,
    start, end, entry) of their [first, last] addresses, sorted): spans that overlap chain into
    clusters, compared byte by byte (:func:`sharing`)."""
    out: set[int] = set()
    for members in (c for c in chained(spans) if len(c) > 1):
        views = [held(i, direct, copied) for i in members]
        out.update(i for i, shares in zip(members, sharing(views), strict=True) if shares)
    return out


def tied_groups(shared: set[int], spans: list[tuple[str, int, int, int]],
                direct: list[torch.Tensor | None],
                copied: dict[int, torch.Tensor]) -> list[tuple[int, ...]]:
    """The entries of ``shared`` whose destinations are one tensor's memory seen alike (tied
    weights: same place, shape, strides, dtype and lazy conjugate and negative bits), in groups
    that share memory with no other entry."""
    groups = []
    for members in chained([span for span in spans if span[3] in shared]):
        for group, overlaps in seen_alike(members, lambda i: held(i, direct, copied)):
            if len(group) > 1 and not overlaps:
                groups.append(tuple(group))
    return groups


def seen_alike(members: list[int], tensor_of: Callable[[int], torch.Tensor]
               ) -> list[tuple[list[int], bool]]:
    """``members`` (one cluster of overlapping spans) in groups of one memory seen alike, each
    with whether it shares memory with another group (one byte mask for the cluster)."""
    seen: dict[Any, list[int]] = {}
    for i in members:
        t = tensor_of(i)
        seen.setdefault((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.is_conj(),
                         t.is_neg()), []).append(i)
    groups = list(seen.values())
    overlapping = sharing([tensor_of(g[0]) for g in groups]) if len(groups) > 1 else [False]
    return list(zip(groups, overlapping, strict=True))


def chained(spans: list[tuple[str, int, int, int]]) -> list[list[int]]:
    """The entries of ``spans`` ((device, start, end, entry), sorted) in clusters of spans that
    overlap, one after another."""
    clusters: list[list[int]] = []
    reach, on = -1, ""
    for kind, start, end, i in spans:
        if kind != on or start >= reach:
            clusters.append([])
            reach, on = -1, kind
        clusters[-1].append(i)
        reach = max(reach, end)
    return clusters


def held(i: int, direct: list[torch.Tensor | None],
         copied: dict[int, torch.Tensor]) -> torch.Tensor:
    """The caller's tensor entry ``i`` goes into (read into, or filled by a copy)."""
    t = direct[i]
    return copied[i] if t is None else t


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bytes (NaN payloads included, unlike torch.equal)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    return torch.equal(a.detach().reshape(-1).view(torch.uint8),
                       b.detach().reshape(-1).view(torch.uint8))


def split_tied(fills: dict[int, tuple[torch.Tensor, torch.Tensor]],
               paths: dict[int, str]) -> set[int]:
    """Of ``fills`` (entry -> (the caller's tensor, the loaded data)), the entries whose
    tensors share memory with another's and cannot all be filled: not one memory seen alike
    (tied weights), or saved with different values (a warning names them). Copying the others
    in any order leaves each tensor of the caller with its saved value."""
    spans = sorted((str(t.device), t.data_ptr(), t.data_ptr() + t.element_size() * extent(t), i)
                   for i, (t, _) in fills.items() if t.numel())
    apart: set[int] = set()
    for members in (c for c in chained(spans) if len(c) > 1):
        for group, overlaps in seen_alike(members, lambda i: fills[i][0]):
            data = fills[group[0]][1]
            if overlaps or not all(same_bytes(fills[i][1], data) for i in group[1:]):
                apart.update(group)
                logger.warning("load(into=...): %s share memory in `into` but were saved with "
                               "different values (or overlap in part): each is returned as "
                               "loaded, not read into that memory",
                               ", ".join(repr(paths.get(i, i)) for i in group))
    return apart
