"""storage/views.py: which memory load may write (pure, and against this process's maps)."""

from __future__ import annotations

import mmap
import warnings

import pytest
import torch

from localckpt.storage.views import first_read_only, outside, writable_memory


def test_outside_finds_the_first_span_not_inside_one_writable_range() -> None:
    writable = [(100, 200), (300, 400)]
    assert outside([], writable) is None
    assert outside([(100, 200), (310, 320), (399, 400)], writable) is None
    assert outside([(100, 150), (150, 201)], writable) == 1  # past the end of its range
    assert outside([(100, 150), (250, 260)], writable) == 1  # in the gap
    assert outside([(90, 110)], writable) == 0  # starts before the first range
    assert outside([(120, 130), (350, 450)], writable) == 1
    assert outside([(400, 401)], writable) == 0  # after the last


def test_a_read_only_mapping_is_told_from_writable_memory() -> None:
    assert writable_memory()  # Linux: read from /proc/self/maps
    pages = mmap.mmap(-1, 2 * mmap.PAGESIZE)
    pages.write(b"\0" * len(pages))
    read_only = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns about a non-writable buffer
        ro = torch.frombuffer(read_only, dtype=torch.uint8)
    rw = torch.frombuffer(pages, dtype=torch.uint8)
    ordinary = torch.zeros(1 << 20)
    assert first_read_only([ordinary, rw, rw[::7]]) is None
    assert first_read_only([ordinary, torch.zeros(0), ro, rw]) == 2
    assert first_read_only([ro[:0], ordinary]) is None  # an empty tensor writes nothing


def test_distinct_elements_tells_overlapping_views_from_strided_ones() -> None:
    from localckpt.storage.views import distinct_elements

    base = torch.zeros(4, 8)
    apart = [base, base.t(), base[:, :4], base[::2], base[:, ::3], torch.zeros(8)[::2],
             torch.zeros(2, 3, 4).permute(2, 0, 1), torch.zeros(1, 5)[:, ::2]]
    assert all(distinct_elements(t) for t in apart)
    shared = [torch.zeros(1).expand(4, 2), torch.zeros(5).unfold(0, 2, 1),
              torch.zeros(10).as_strided((3, 3), (2, 1))]
    assert not any(distinct_elements(t) for t in shared)


def test_sharing_tells_interleaved_views_from_overlapping_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from localckpt.storage import views

    w = torch.zeros(4, 8)
    q, k = w.split(4, dim=1)
    assert views.sharing([q, k]) == [False, False]
    assert views.sharing([w[:, :5], w[:, 3:], w[:, 1:2].t()]) == [True, True, True]
    assert views.sharing([w.view(-1)[::2], w.view(-1)[1::2]]) == [False, False]
    # one byte of a float and of its int8 view: another dtype, the same memory
    assert views.sharing([w[0, :1], w[0].view(torch.int8)[3:4], w[1, :1]]) == [True, True, False]
    monkeypatch.setattr(views, "SHARED_BYTES_MAX_SPAN", 16)  # too long to compare: taken to
    assert views.sharing([q, k]) == [True, True]  # overlap
