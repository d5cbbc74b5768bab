"""A tensor's bytes as a buffer sharing its memory, without a copy."""

from __future__ import annotations

import ctypes

import torch


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor (any dtype, pinned included) as a writable
    memoryview sharing its memory: what os.write / preadv / crc32c take without a copy. The view
    keeps ``t`` alive. Raises ValueError for a non-contiguous or non-CPU tensor."""
    if not (t.is_cpu and t.is_contiguous()):
        raise ValueError(f"byte_view: expected a contiguous CPU tensor, got one on {t.device} "
                         f"with strides {t.stride()}")
    # ctypes instead of tensor.view(uint8).numpy(): a third of the cost per tensor, which is
    # what a 10,000-tensor load pays 10,000 times.
    array = (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())
    array.owner = t  # type: ignore[attr-defined]
    return memoryview(array).cast("B")


def device_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 tensor sharing its memory."""
    # One view instead of two for a 1-D tensor (most small ones: biases, norms, their moments):
    # each costs microseconds, which a load of 30,000 tensors pays 30,000 times.
    return t.view(torch.uint8) if t.dim() == 1 else t.reshape(-1).view(torch.uint8)
