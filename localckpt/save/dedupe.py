"""Replicated DTensor shards are stored once per replica group, not once per rank.

How it is decided. A DTensor leaf with a ``Replicate`` placement on some mesh dims (HSDP's
replicate dim, tensor parallelism's replicated norms and biases) is held, box for box, by every
rank that differs from this one only on those dims: a replica group of R = the product of their
sizes. Exactly one member stores the shard: the one whose place in the group (its coordinate on
the Replicate dims, row-major) equals ``crc32(key path) % R``, a different member for each leaf,
so the bytes spread over the group instead of landing on its first member. The others record
the layout and the shard's shape with no data (``{"DT": {..., "replica": shape}}``); a load
assembles their shard from the keeper's (:mod:`localckpt.load.reshard`).

Shards under MIN_NBYTES are stored by every member: a load that reads another member's shard
takes the resharding path, slower than reading one's own, which only pays where it saves much
(HSDP's parameters and optimizer state, not tensor parallelism's norms). The size of a box is the
same for every member, so they all decide alike.

This relies on every member of a replica group holding the same leaves (SPMD). ``save`` checks
it the first time and whenever a rank's replicated leaves change: every box a rank skips must be
stored by the rank it names as the keeper, else ConfigurationError on every rank and nothing is
written (``LocalCheckpointManager(dedupe_replicated=False)`` stores every rank's copy).
"""

from __future__ import annotations

import json
import math
import zlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..state_dict import BasicTensorAwareStateDict, TensorAwareStateDict


@dataclass
class Deduped:
    """What a save stages: ``tensors`` (a skipped shard replaced by an empty tensor), the
    ``hollow`` structure (skipped shards marked), and for the check: hashes of the replicated
    boxes this rank stores (``provided``) and of those it expects each keeper rank to store."""

    tensors: list[torch.Tensor]
    hollow: Any
    provided: list[int] = field(default_factory=list)
    expected: dict[int, list[int]] = field(default_factory=dict)

    @property
    def digest(self) -> int:
        """Changes when what this rank provides or expects changes (0: nothing replicated)."""
        if not self.provided and not self.expected:
            return 0
        doc = json.dumps([sorted(self.provided), sorted(self.expected.items())])
        return zlib.crc32(doc.encode()) or 1


MIN_NBYTES = 1 << 20  # replicated shards smaller than this are stored by every member


def keeper_index(path: str, replicas: int) -> int:
    """The member of a replica group of ``replicas`` ranks that stores the leaf at ``path``."""
    return zlib.crc32(path.encode()) % replicas


def _box_hash(path: str, offset: Sequence[int], local: torch.Tensor) -> int:
    return zlib.crc32(f"{path}|{list(offset)}|{list(local.shape)}|{local.dtype}".encode())


def dedupe(tasd: TensorAwareStateDict, enabled: bool = True) -> Deduped:
    """The tensors and structure a save of ``tasd`` writes, replicated shards kept by one member
    of their group (see the module docstring); all of them unless ``enabled``. Not
    collective."""
    tensors = list(tasd.tensors)
    if not enabled or type(tasd) is not BasicTensorAwareStateDict or not tasd.layouts:
        return Deduped(tensors, tasd.hollow_structure())
    out = Deduped(tensors, tasd.hollow_structure())
    skipped: dict[int, list[int]] = {}
    expected: dict[int, list[int]] = defaultdict(list)
    for i, layout in tasd.layouts.items():
        dims = [d for d, p in enumerate(layout.placements) if p == "R"]
        count = math.prod(layout.mesh_shape[d] for d in dims)
        path, local = tasd.key_paths[i], tensors[i]
        if count <= 1 or local.numel() * local.element_size() < MIN_NBYTES:
            continue
        place = 0
        for d in dims:
            place = place * layout.mesh_shape[d] + layout.coordinate[d]
        keep = keeper_index(path, count)
        box = _box_hash(path, layout.offset, local)
        if place == keep:
            out.provided.append(box)
            continue
        coordinate = list(layout.coordinate)
        for d in reversed(dims):
            keep, coordinate[d] = divmod(keep, layout.mesh_shape[d])
        keeper = int(tasd.dtensors[i].device_mesh.mesh[tuple(coordinate)])
        expected[keeper].append(box)
        skipped[i] = list(local.shape)
        tensors[i] = torch.empty(0, dtype=local.dtype, device=local.device)
    if skipped:
        out.hollow = _mark(json.loads(json.dumps(out.hollow)), skipped)  # the caller's intact
    out.expected = dict(expected)
    return out


def _mark(hollow: Any, skipped: dict[int, list[int]]) -> Any:
    stack = [hollow]
    while stack:
        node = stack.pop()
        if type(node) is list:
            stack.extend(node)
        elif type(node) is dict:
            dt = node.get("DT")
            if type(dt) is dict and len(node) == 1 and dt.get("T") in skipped:
                dt["replica"] = skipped[dt["T"]]
            else:
                stack.extend(node.values())
    return hollow


def missing_replicas(provided: Sequence[Sequence[int]],
                     expected: Sequence[dict[str, list[int]]]) -> list[str]:
    """Pure check over every rank's report: each box a rank skipped must be stored by the rank
    it named. Returns a description of each one that is not (empty: all are)."""
    have = [set(p) for p in provided]
    missing = []
    for rank, wants in enumerate(expected):
        for keeper, boxes in wants.items():
            k = int(keeper)
            lost = [b for b in boxes if not (0 <= k < len(have) and b in have[k])]
            if lost:
                missing.append(f"rank {rank} left {len(lost)} replicated shards to rank {k}, "
                               "which does not store them")
    return missing
