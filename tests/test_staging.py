"""Staging arena pack / unpack (no processes)."""

from __future__ import annotations

import itertools

import pytest
import torch

from localckpt.errors import CorruptShardError
from localckpt.save.staging import StagingArena, plan_layout, unpack


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


def test_layout_packs_gathered_tensors_back_to_back_in_capped_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The runs' packing (CUDA tensors on a GPU machine) checked here with CPU tensors."""
    from localckpt.save import staging

    monkeypatch.setattr(staging, "_gatherable", lambda t, size: 0 < size <= 1024)
    monkeypatch.setattr(staging, "GATHER_RUN_MAX_NBYTES", 2048)
    tensors = [torch.arange(3, dtype=torch.float32), torch.zeros(5000),  # 20,000 B: not gathered
               torch.arange(7, dtype=torch.int16), torch.arange(250, dtype=torch.float32),
               torch.arange(250, dtype=torch.float32) + 1000, torch.ones(1, dtype=torch.int16),
               torch.arange(256, dtype=torch.float32) + 2000]
    layout = plan_layout(tensors)
    # float32 [0, 3, 4] fit 2,048 bytes; [6] starts the next run; int16 [2, 5] run apart
    assert layout.runs == ((0, 3, 4), (6,), (2, 5))
    for run in layout.runs:
        assert layout.offsets[run[0]] % 64 == 0
        for a, b in itertools.pairwise(run):
            assert layout.offsets[b] == layout.offsets[a] + layout.sizes[a]
    assert layout.offsets[1] % 64 == 0
    spans = sorted((o, o + n) for o, n in zip(layout.offsets, layout.sizes, strict=True))
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    assert layout.nbytes == max(end for _, end in spans)
    buf = StagingArena(pin=False).stage(tensors, layout, layout.nbytes)
    back = unpack(buf, [(o, n, t.dtype, t.shape) for t, o, n in
                        zip(tensors, layout.offsets, layout.sizes, strict=True)])
    assert all(torch.equal(t, b) for t, b in zip(tensors, back, strict=True))
