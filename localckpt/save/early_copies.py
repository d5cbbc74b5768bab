"""Copies of a save's large tensors queued while its state dict is still being walked.

From the second save on, the staging arena is as large as the last save needed, so a large
tensor's place in it is known the moment the walk meets it: the device copies it while the
Python work of the rest of the walk, the layout and the manifest runs (the stall is then that
work or the copy, whichever is longer, instead of both).
"""

from __future__ import annotations

from typing import Any

import torch

from ..storage.views import past_storage
from .staging import (
    GATHER_MAX_NBYTES,
    StagingArena,
    _check_storable,
    _plain_memory,
    aligned,
    tensor_view,
)

_Module, _Optimizer = torch.nn.Module, torch.optim.Optimizer
_LRScheduler = torch.optim.lr_scheduler.LRScheduler


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _own_module(m: Any) -> bool:
    """A module whose part of torch's state_dict runs no user code: no override of what it
    calls, on the class or patched onto the instance, no hook, and plain tensors only (a
    subclass's __torch_function__ runs at their detach())."""
    kind, own = type(m), m.__dict__
    return kind.state_dict is _Module.state_dict and \
        kind._save_to_state_dict is _Module._save_to_state_dict and \
        kind.get_extra_state is _Module.get_extra_state and \
        "state_dict" not in own and "_save_to_state_dict" not in own and \
        not m._state_dict_pre_hooks and not m._state_dict_hooks and \
        all(t is None or type(t) in _PLAIN for t in m._parameters.values()) and \
        all(t is None or type(t) is torch.Tensor for t in m._buffers.values())


def only_reads(obj: Any) -> bool:
    """Whether ``obj.state_dict()`` is torch's own, running no user code that could write a
    tensor met before it: no override (of a module below it either, nor of what a module's
    state_dict calls on it, on the class or the instance), no state dict hook, no tensor
    subclass. A version counter cannot stand in for that: a write through another tensor over
    the same memory (a flat buffer the parameters view, a ``.data``) moves none of the
    parameters'."""
    kind = type(obj)
    if isinstance(obj, _Module):
        return all(_own_module(m) for m in obj.modules())
    own = getattr(obj, "__dict__", {})
    if isinstance(obj, _Optimizer):
        return kind.state_dict is _Optimizer.state_dict and "state_dict" not in own and \
            not getattr(obj, "_optimizer_state_dict_pre_hooks", None) and \
            not getattr(obj, "_optimizer_state_dict_post_hooks", None)
    return isinstance(obj, _LRScheduler) and kind.state_dict is _LRScheduler.state_dict and \
        "state_dict" not in own


class EagerCopies:
    """Copies of a save's large tensors queued while its state dict is still being walked.

    :meth:`offer` is the walk's ``on_tensor`` (:func:`localckpt.state_dict.as_tensor_aware`):
    each large CPU or CUDA tensor it is handed goes into the arena's buffer as it is, at the next
    aligned offset in the order met, as long as it fits: the device copies it while the walk,
    the layout and the manifest are built. Small CUDA tensors (gathered later, in runs), lazy
    views and efficient zero tensors are left to the layout, and so is every tensor of a save
    the buffer cannot hold yet (the first one). After the walk, :meth:`placement` goes to
    :func:`plan_layout`, which places the others after them, and
    :meth:`StagingArena.stage_begin` copies the others, and again those the walk may have
    changed after their copy: the user code it runs (a Stateful's ``state_dict()``, see
    :meth:`stateful_met`) may write into tensors met before. Training thread; whoever gives
    up before the stage began must call :meth:`abandon` (no copy may write into the arena
    after)."""

    def __init__(self, arena: StagingArena) -> None:
        self._arena = arena
        self._full = arena.capacity == 0  # before the first save: nothing is copied early
        self._streams: set[torch.device] = set()
        self._storable: set[torch.dtype] = set()
        self._stale: set[int] = set()
        # index -> the tensor, and what it was when it was copied (see _as_copied)
        self._copied: dict[int, tuple[torch.Tensor, tuple[Any, ...]]] = {}
        self.placed: dict[int, int] = {}  # tensor index -> its offset in the arena
        self.end = 0

    def stateful_met(self, obj: Any) -> None:
        """The walk is about to run ``obj.state_dict()``: unless it is torch's own, which only
        reads (:func:`only_reads`), the tensors copied so far are copied again at the stage (in
        place, after the early copy)."""
        if len(self._stale) < len(self.placed) and not only_reads(obj):
            self._stale.update(self.placed)

    def placement(self) -> tuple[dict[int, int], int, frozenset[int]]:
        """After the walk, for :func:`plan_layout`: the tensors placed (index -> offset), where
        the others start, and those whose early copy is their value. One changed since its
        copy (a new version, other memory) is copied again; one of another size no longer fits
        its slot and is placed anew (the slot stays unused)."""
        placed: dict[int, int] = {}
        copied: set[int] = set()
        for i, offset in self.placed.items():
            t, was = self._copied[i]
            if t.nbytes != was[1]:
                continue
            placed[i] = offset
            if i not in self._stale and _as_copied(t) == was:
                copied.add(i)
        return placed, self.end, frozenset(copied)

    def offer(self, i: int, t: torch.Tensor) -> None:
        """Copy tensor ``i`` of the walk into the arena now, if it is one copied early."""
        if self._full:
            return
        size = t.nbytes
        if size <= GATHER_MAX_NBYTES or t.device.type not in ("cpu", "cuda"):
            return
        dtype = t.dtype
        if dtype not in self._storable:  # the layout raises on a dtype that cannot be stored
            try:
                _check_storable(t)
            except TypeError:
                return
            self._storable.add(dtype)
        if not _plain_memory(t) or past_storage(t) is not None:  # the stage refuses the latter
            return
        try:
            version = t._version  # how placement() tells a tensor changed after its copy
        except RuntimeError:  # an inference tensor keeps none: copied at the stage
            return
        offset = aligned(self.end)
        buffer = self._arena._buffer
        if buffer is None or offset + size > buffer.numel():
            self._full = True  # the rest go where the layout puts them
            return
        dst = tensor_view(buffer, offset, size, dtype, t.shape)
        with torch.no_grad():
            if t.is_cuda:
                stream = self._arena.side_stream(t.device)
                self._streams.add(t.device)
                # After all that is queued so far, each time: the walk runs user code (a
                # Stateful's state_dict()) that may have queued the kernels making this tensor.
                stream.wait_stream(torch.cuda.current_stream(t.device))
                with torch.cuda.stream(stream):
                    dst.copy_(t, non_blocking=self._arena._pin)
            else:
                dst.copy_(t)
        self.placed[i] = offset
        self._copied[i] = (t, _as_copied(t, version))
        self.end = offset + size

    def abandon(self) -> None:
        """The save gave up before its stage began: wait for the copies queued."""
        if self._streams:
            self._arena.synchronize()


def _as_copied(t: torch.Tensor, version: int | None = None) -> tuple[Any, ...]:
    """What an early copy of ``t`` stands for: its memory, size, version and how its bytes are
    read (``t.data = t.data.t()`` keeps address, size and version, not the layout)."""
    return (t.data_ptr(), t.nbytes, t._version if version is None else version, t.dtype,
            t.shape, t.stride(), t.is_conj(), t.is_neg())
