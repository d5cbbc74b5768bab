"""Staging arena pack / unpack (no processes)."""

from __future__ import annotations

import pytest
import torch

from localckpt.errors import CorruptShardError
from localckpt.staging import StagingArena, plan_layout, unpack


def test_unpack_inverts_stage_into_separate_storages() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=g), torch.tensor(7, dtype=torch.int64),
               torch.randn(0), torch.randn(200_000, generator=g).to(torch.bfloat16),
               torch.randn(4, 4, generator=g).t()]
    layout = plan_layout(tensors)
    buf = StagingArena(pin=False).stage(tensors, layout, layout.nbytes + 100)
    back = unpack(buf, [(o, n, t.dtype, t.shape) for t, o, n in
                        zip(tensors, layout.offsets, layout.sizes, strict=True)])
    for t, b in zip(tensors, back, strict=True):
        assert torch.equal(t, b) and b.dtype == t.dtype and b.is_contiguous()
    assert len({b.untyped_storage().data_ptr() for b in back if b.numel()}) == 4


@pytest.mark.parametrize("entry", [(0, 8, torch.float32, (3,)), (96, 8, torch.float32, (2,)),
                                   (-4, 4, torch.float32, (1,))])
def test_unpack_refuses_entries_outside_the_data(entry: tuple) -> None:
    with pytest.raises(CorruptShardError, match="does not fit its 100-byte data"):
        unpack(torch.zeros(100, dtype=torch.uint8), [entry])
