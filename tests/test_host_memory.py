"""Fresh host memory advised for huge pages (no processes but one subprocess)."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest
import torch
from dist_harness import run_python

from localckpt.storage import host_memory
from localckpt.storage.host_memory import MIN_NBYTES, advise_huge_pages, empty_host

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _advised(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(host_memory, "_MADVISE", lambda a, n, f: calls.append((a, n, f)) or 0)
    return calls


def test_large_tensors_are_advised_on_the_whole_pages_they_touch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _advised(monkeypatch)
    t = empty_host((MIN_NBYTES // 4 + 3,), torch.float32)
    assert t.dtype == torch.float32 and t.shape == (MIN_NBYTES // 4 + 3,)
    [(start, length, flag)] = calls
    end = t.data_ptr() + t.numel() * 4
    assert flag == mmap.MADV_HUGEPAGE
    assert start % mmap.PAGESIZE == 0 and length % mmap.PAGESIZE == 0
    assert start <= t.data_ptr() < start + mmap.PAGESIZE  # the pages it touches, no more
    assert end <= start + length < end + mmap.PAGESIZE


def test_advised_tensors_cost_no_memory_mappings() -> None:
    """Advice inside a tensor split its mapping in three: 32k tensors of 4 MiB (128 GiB) met
    vm.max_map_count, and threads could no longer start (from a review). Tensors above glibc's
    largest mmap threshold (32 MiB) are mappings of their own (untouched, they take no memory):
    advised whole, each costs at most the mapping it is (most merge with their neighbours)."""
    def mappings() -> int:
        return len(Path("/proc/self/maps").read_text().splitlines())

    size = 40 << 20
    before = mappings()
    held = [torch.empty(size, dtype=torch.uint8) for _ in range(30)]
    plain = mappings() - before
    before = mappings()
    held += [empty_host(size) for _ in range(30)]
    assert mappings() - before <= plain + 30, (mappings() - before, plain)


def test_small_non_contiguous_and_advice_off_are_left_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _advised(monkeypatch)
    empty_host(MIN_NBYTES - 1)
    advise_huge_pages(torch.empty(2, MIN_NBYTES)[:, :-8])  # large, but not contiguous
    assert calls == []
    monkeypatch.setattr(host_memory, "_MADVISE", None)
    t = empty_host(2 * MIN_NBYTES)
    assert t.numel() == 2 * MIN_NBYTES and calls == []


def _vm_flags(address: int) -> list[str]:
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"{address:#x} is in no mapping")


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists()
                    or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_the_kernel_records_the_advice() -> None:
    t = empty_host(4 * MIN_NBYTES)
    t.fill_(1)  # written after the advice, as a load does
    assert "hg" in _vm_flags(t.data_ptr() + 2 * MIN_NBYTES)
    assert int(t.sum()) == t.numel()


def test_the_environment_turns_the_advice_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALCKPT_HUGE_PAGES", "0")
    done = run_python("from localckpt.storage import host_memory\n"
                      "print(host_memory._MADVISE is None)\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"]
