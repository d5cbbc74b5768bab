"""Loading into the caller's tensors: ``load(into=state_dict)`` puts each saved tensor into the
tensor of ``into`` at the same key path, in place, when dtype and shape match.

On CPU the shard's chunks are read (or received) straight into that tensor: no allocation and no
page faults, which on a fresh process cost more than the read itself. On another device the
tensor is read into host memory, then copied into the caller's. Two destinations sharing memory
(tied weights) are filled the same way, by a copy after the read: reading into both at once
would make healthy chunks fail their checksums, and a healthy copy must never be quarantined
for that.

A DTensor of ``into`` is loaded into through its local shard, when the saved shard lies at the
same place (:meth:`DTensorLayout.same_place`); the returned state holds the caller's DTensor.
A saved DTensor with no DTensor at its path in ``into`` (the state of a fresh optimizer) is
wrapped on the mesh of another DTensor of ``into`` with the same mesh shape and dim names.
Stateful objects of ``into`` get ``load_state_dict`` with what was loaded for them (saved as the
object or as its state dict), and one the checkpoint holds nothing for is an error.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from ..dtensors import DTensorLayout, mesh_key, wrap
from ..errors import ConfigurationError, LayoutMismatchError
from ..state_dict import BasicTensorAwareStateDict, as_tensor_aware
from ..storage.manifest import ShardManifest, dtype_from_name
from ..storage.views import (
    distinct_elements,
    extent,
    first_read_only_span,
    refuse_past_storage,
)
from .tied import shared_destinations, split_tied, tied_groups

logger = logging.getLogger(__name__)


@dataclass
class Target:
    """One tensor of ``into``: the tensor read into (a DTensor's local shard), and the DTensor
    with its layout when it is one."""

    tensor: torch.Tensor
    dtensor: Any = None
    layout: DTensorLayout | None = None


def targets_by_path(into: Any) -> tuple[dict[str, Target], dict[str, Any], dict[Any, Any],
                                        dict[str, type]]:
    """The tensors of ``into`` (a state dict as ``save`` takes it) by key path (a path that
    occurs twice is left out), its Stateful objects and Generators by key path, its device
    meshes by (shape, dim names), and its dataclass and named tuple types by stored name.
    Raises TypeError on a leaf ``save`` would refuse."""
    tasd = as_tensor_aware(into)
    dtensors = tasd.dtensors if isinstance(tasd, BasicTensorAwareStateDict) else {}
    out: dict[str, Target] = {}
    twice: set[str] = set()
    meshes: dict[Any, Any] = {}
    copies = tasd.copies if isinstance(tasd, BasicTensorAwareStateDict) else set()
    for i, (path, t) in enumerate(zip(tasd.key_paths, tasd.tensors, strict=True)):
        if i in copies:  # a numpy array read into would not be the caller's (or of its dtype)
            continue
        if path in out:
            twice.add(path)
        layout = tasd.layouts.get(i)
        out[path] = Target(t, dtensors.get(i), layout)
        if layout is not None and i in dtensors:
            meshes.setdefault(mesh_key(layout), dtensors[i].device_mesh)
    for path in twice:
        del out[path]
    if isinstance(tasd, BasicTensorAwareStateDict):
        return out, tasd.statefuls, meshes, tasd.types
    return out, {}, meshes, {}


class Into:
    """The caller's ``into`` state dict, its tensors by path computed once, on first use (inside
    an agreed step, so a bad ``into`` on one rank is the same error on every rank)."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self._paths: dict[str, Target] | None = None
        self.statefuls: dict[str, Any] = {}
        self.meshes: dict[Any, Any] = {}
        self.types: dict[str, type] = {}

    def paths(self) -> dict[str, Target] | None:
        if self.state is not None and self._paths is None:
            self._paths, self.statefuls, self.meshes, self.types = targets_by_path(self.state)
        return self._paths


@dataclass
class Destinations:
    """For one manifest: ``direct[i]``, the caller's tensor entry i is read into (on the CPU, or
    on the device of a read through pinned memory; None: a fresh one), ``copied``: entry index
    -> caller's tensor filled by a copy after the read, ``dtensors``: entry index -> the
    caller's DTensor whose local shard receives it, and ``mismatched``: why a saved DTensor
    cannot go where ``into`` has one (raised once the data is in)."""

    direct: list[torch.Tensor | None]
    copied: dict[int, torch.Tensor] = field(default_factory=dict)
    dtensors: dict[int, Any] = field(default_factory=dict)
    mismatched: list[str] = field(default_factory=list)
    elsewhere: list[str] = field(default_factory=list)  # replicas another rank stored
    # groups of copied entries whose tensors are one memory (tied weights)
    tied: list[tuple[int, ...]] = field(default_factory=list)
    paths: dict[int, str] = field(default_factory=dict)  # key paths of the tied entries

    @property
    def placed(self) -> dict[int, torch.Tensor]:
        """Every entry that ends up in a caller's tensor."""
        out = {i: t for i, t in enumerate(self.direct) if t is not None}
        return out | self.copied


def _layouts_differ(path: str, saved: DTensorLayout | None,
                    target: DTensorLayout | None) -> str | None:
    """Why a shard saved as ``saved`` cannot be loaded into a tensor of layout ``target`` (both
    None for plain tensors), or None when it can."""
    if saved is None and target is None:
        return None
    if saved is None:
        return (f"{path!r} was saved as a plain tensor; `into` has a DTensor there "
                f"({target.describe()})")  # type: ignore[union-attr]
    if target is None:
        return f"{path!r} was saved as a DTensor ({saved.describe()}); `into` has a plain tensor"
    if not saved.same_place(target):
        return (f"{path!r} was saved as a DTensor shard of {saved.describe()}; `into` has "
                f"{target.describe()}")
    return None


def match(manifest: ShardManifest, by_path: dict[str, Target] | None,
          device: torch.device | None = None) -> Destinations:
    """Which entries of ``manifest`` go into which of the caller's tensors (pure). A plain
    contiguous CPU tensor is read into, as is one on ``device`` (a read through pinned memory:
    ShardStore.read_tensors; if it shares memory with another, it is filled by a copy instead);
    one on another device, non-contiguous (channels_last; not one whose elements share memory,
    as an expanded one's do, or where torch cannot tell),
    with a lazy conjugate or negative bit, or empty is filled by a copy after the read; a sparse,
    nested or meta one, or a path the manifest names twice, is not used. A DTensor shard saved
    at another place than ``into``'s goes to ``mismatched``. A numpy array stored as bytes
    (a dtype torch lacks) is never read into ``into``: bytes of the same size may be another
    dtype there."""
    direct: list[torch.Tensor | None] = [None] * len(manifest.tensors)
    elsewhere = [manifest.tensors[i].key_path for i in manifest.replicas]
    if not by_path:
        return Destinations(direct, elsewhere=elsewhere)
    copied: dict[int, torch.Tensor] = {}
    dtensors: dict[int, Any] = {}
    mismatched: list[str] = []
    layouts = manifest.layouts
    # (device, start, end, entry) of the memory of destinations read into
    spans: list[tuple[str, int, int, int]] = []
    seen = Counter(e.key_path for e in manifest.tensors)
    twice = {path for path, n in seen.items() if n > 1}
    # Per entry only what differs: this runs once per tensor, 10,000 times for a small-tensor
    # state dict (the dtype and device lookups are cached, a contiguous tensor's extent is its
    # size).
    dtypes: dict[str, torch.dtype] = {}
    replicas = manifest.replicas
    as_bytes = manifest.numpy_bytes
    strided = torch.strided
    for i, (key_path, dtype_str, shape, _, nbytes, _) in enumerate(manifest.tensors):
        target = by_path.get(key_path)
        if target is None or key_path in twice or i in replicas or i in as_bytes:
            continue
        if layouts or target.layout is not None:
            why = _layouts_differ(key_path, layouts.get(i), target.layout)
            if why is not None:
                mismatched.append(why)
                continue
        t = target.tensor
        dtype = dtypes.get(dtype_str) or dtypes.setdefault(dtype_str, dtype_from_name(dtype_str))
        kind = "cpu" if t.is_cpu else t.device.type  # .device.type costs 0.2 us
        if t.layout is not strided or t.is_nested or kind == "meta" \
                or t.dtype != dtype or t.shape != shape:
            if target.dtensor is not None:
                mismatched.append(f"{key_path!r}: the local shard is {dtype_str} of shape "
                                  f"{list(shape)}; `into`'s is {t.dtype} of shape "
                                  f"{list(t.shape)}")
            continue
        contiguous = t.is_contiguous()
        if nbytes and not contiguous and not distinct_elements(t):
            continue  # elements sharing memory (expanded, unfolded) cannot hold the values
        if target.dtensor is not None:
            dtensors[i] = target.dtensor
        readable = kind == "cpu" or (device is not None and t.device == device)
        # A read or copy into it would write memory it does not own; the usual case inline
        # (contiguous, inside its storage): 10,000 tensors pay it.
        if nbytes and not (contiguous and t.storage_offset() * dtype.itemsize + nbytes
                           <= t.untyped_storage().nbytes()):
            refuse_past_storage(t, f"load(into=...): the tensor at key {key_path!r}")
        if readable and nbytes and contiguous and not t.is_conj() and not t.is_neg():
            direct[i] = t
        else:
            copied[i] = t
        if nbytes and (readable or kind == "cuda"):
            # the memory it spans, views and strides included (tied weights, a view of another);
            # a device tensor filled by a copy too, so tied ones are checked alike on every path
            start = t.data_ptr()
            end = start + (nbytes if contiguous else t.element_size() * extent(t))
            spans.append((kind if kind == "cpu" else str(t.device), start, end, i))
    spans.sort()
    _refuse_read_only(manifest, [(start, end, i) for kind, start, end, i in spans
                                 if kind == "cpu"])
    shared = shared_destinations(spans, direct, copied)
    tied = tied_groups(shared, spans, direct, copied)
    in_groups = {i for group in tied for i in group}
    apart = sorted(shared - in_groups)
    if apart:
        logger.warning("load(into=...): the tensors of `into` at %s overlap in part: their "
                       "saved values are returned in fresh tensors, not read into that memory",
                       ", ".join(repr(manifest.tensors[i].key_path) for i in apart[:8]))
    for i in shared:
        held = direct[i] if direct[i] is not None else copied.get(i)
        direct[i] = None
        if held is not None and i in in_groups:
            # Tied weights: filled by a copy after the read (into fresh memory: reading into
            # both at once, healthy chunks would fail their checksums), if their saved values
            # agree (fill_copied).
            copied[i] = held
            continue
        copied.pop(i, None)  # left out, on any device: one would overwrite part of the other
        dtensors.pop(i, None)
    return Destinations(direct, copied, dtensors, mismatched, elsewhere, tied,
                        {i: manifest.tensors[i].key_path for group in tied for i in group})


def _refuse_read_only(manifest: ShardManifest, spans: list[tuple[int, int, int]]) -> None:
    """ConfigurationError naming the key when the memory of a host tensor of ``into`` that
    ``load`` writes (``spans``: start, end, entry) is not writable (a read-only mapping of a
    file): bytes received from a peer, a copy or a memmove into it would kill the process where
    a read from disk only fails."""
    k = first_read_only_span([(start, end) for start, end, _ in spans])
    if k is not None:
        raise read_only_error(manifest.tensors[spans[k][2]].key_path)


def read_only_error(key_path: str) -> ConfigurationError:
    return ConfigurationError(
        f"load(into=...): the tensor at key {key_path!r} is read-only memory (e.g. "
        "torch.frombuffer of a read-only mapping): load writes into the tensors of `into`; "
        "pass writable ones, or leave that key out of `into`")


def check_layouts(destinations: Destinations) -> None:
    """LayoutMismatchError if a saved DTensor shard does not lie where ``into``'s does, or is
    a replica another rank of its group stored (the manager then reshards)."""
    if destinations.elsewhere:
        raise LayoutMismatchError(
            f"load: {len(destinations.elsewhere)} replicated DTensor shards of this rank were "
            f"stored by another member of their replica group (e.g. "
            f"{destinations.elsewhere[0]!r}): they are loaded from there")
    if destinations.mismatched:
        shown = "; ".join(destinations.mismatched[:3])
        more = f" (and {len(destinations.mismatched) - 3} more)" \
            if len(destinations.mismatched) > 3 else ""
        raise LayoutMismatchError(
            f"load(into=...): {len(destinations.mismatched)} saved tensors do not fit the "
            f"layout of `into`: {shown}{more}; they are loaded through resharding")


def fill_copied(destinations: Destinations, tensors: list[torch.Tensor]) -> None:
    """Copy each loaded tensor into the caller's tensor that could not be read into. Raises
    LayoutMismatchError first if a saved DTensor shard does not fit ``into``'s."""
    check_layouts(destinations)
    # Tied weights of ``into`` hold what was saved for them only if those values agree (saved
    # tied); otherwise no one key's value is theirs: each key gets its loaded tensor back.
    tied = {i: (destinations.copied[i], tensors[i]) for group in destinations.tied
            for i in group if i in destinations.copied}
    for i in split_tied(tied, destinations.paths):
        del destinations.copied[i]
        destinations.dtensors.pop(i, None)
    with torch.no_grad():  # a Parameter that requires grad is filled like any tensor
        for i, t in destinations.copied.items():
            t.copy_(tensors[i])


class Rewrap:
    """Puts the loaded DTensor shards and Stateful objects back (for rebuild_state_dict)."""

    def __init__(self, manifest: ShardManifest, into: Into,
                 destinations: Destinations | None) -> None:
        self.manifest, self.into = manifest, into
        self.dtensors = destinations.dtensors if destinations is not None else {}
        self.resharding = False  # set by the resharding load: no further fallback

    def dtensor(self, i: int, local: torch.Tensor) -> Any:
        """The DTensor entry i becomes: the caller's (its local shard filled), else ``local``
        wrapped on a mesh of ``into`` of the saved shape and dim names at the saved
        coordinate. ConfigurationError when there is none."""
        if i in self.dtensors:
            return self.dtensors[i]
        layout = self.manifest.layouts[i]
        path = self.manifest.tensors[i].key_path
        mesh = self.into.meshes.get(mesh_key(layout))
        if mesh is None:
            have = sorted(str(list(shape)) + (f" {list(names)}" if names else "")
                          for shape, names in self.into.meshes)
            raise ConfigurationError(
                f"load: {path!r} is a DTensor shard ({layout.describe()}): pass load(into=...) "
                "with the model's and optimizer's state (or the objects themselves) so "
                f"localckpt knows the device mesh; `into` has meshes {have or 'none'}")
        coordinate = tuple(mesh.get_coordinate() or ())
        if coordinate != layout.coordinate and self.resharding:
            raise ConfigurationError(
                f"load: `into` has no DTensor at {path!r}, and this rank's place on the mesh "
                f"changed ({list(layout.coordinate)} -> {list(coordinate)}): pass the state "
                "with its DTensors (an optimizer's through get_state_dict) so localckpt knows "
                "the new layout")
        if coordinate != layout.coordinate:
            raise LayoutMismatchError(
                f"load: {path!r} was saved at mesh coordinate {list(layout.coordinate)}, this "
                f"rank is at {list(coordinate)} of that mesh: it is loaded through resharding")
        return wrap(local, layout, mesh, repr(path))

    def stateful(self, path: str, value: Any) -> Any:
        """The Stateful object of ``into`` at ``path`` restored from ``value`` (its
        ``load_state_dict``; a Generator's ``set_state``), or ``value`` when ``into`` has none
        there."""
        obj = self.into.statefuls.get(path)
        if obj is None:
            return value
        if isinstance(obj, torch.Generator):
            if not isinstance(value, torch.Generator):
                raise ConfigurationError(
                    f"load(into=...): {path!r} is a torch.Generator in `into`, the checkpoint "
                    f"holds a {type(value).__name__} there")
            obj.set_state(value.get_state())
        else:
            obj.load_state_dict(value)
        self.restored.add(path)
        return obj

    @property
    def restorer(self) -> Any:
        """The hook for rebuild_state_dict: None when ``into`` has no Stateful object."""
        self.restored: set[str] = set()
        return self.stateful if self.into.statefuls else None

    def check_restored(self) -> None:
        """ConfigurationError naming each Stateful object (or Generator) of ``into`` the
        checkpoint held no state for (nothing restored it)."""
        missing = sorted(set(self.into.statefuls) - self.restored)
        if missing:
            kinds = sorted({"torch.Generator" if isinstance(self.into.statefuls[p],
                                                            torch.Generator)
                            else "Stateful object" for p in missing})
            raise ConfigurationError(
                f"load(into=...): the checkpoint holds no state for the {' and '.join(kinds)}s "
                f"at {missing} (nothing was saved at those key paths, or not a dict / a "
                "generator), so they cannot be restored; leave them out of `into` or save them")
