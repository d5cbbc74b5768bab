"""The CRC-32C implementation: the same values as the crc32c package (and so as zarr's codec)
on every kind of buffer localckpt checksums, continued across pieces; the fallback on request."""

from __future__ import annotations

import os
import subprocess
import sys

import crc32c as package
import numpy as np
import pytest
import torch

from localckpt.storage import checksum
from localckpt.storage.views import byte_view


def _buffers() -> dict[str, object]:
    t = torch.randint(0, 256, (1_000_003,), dtype=torch.uint8,
                      generator=torch.Generator().manual_seed(3))
    view = byte_view(t)
    return {"bytes": bytes(view[:1000]), "bytearray": bytearray(view[:777]),
            "tensor bytes": view, "slice": view[3:500_001], "numpy": t.numpy()[5:],
            "read-only": memoryview(bytes(view[:4096])), "empty": b"",
            "float32": byte_view(torch.randn(1001, generator=torch.Generator().manual_seed(4)))}


@pytest.mark.parametrize("name", list(_buffers()))
def test_same_value_as_the_crc32c_package_whole_and_continued(name: str) -> None:
    data = _buffers()[name]
    whole = checksum.crc32c(data)
    assert whole == package.crc32c(data)
    half = len(data) // 2  # type: ignore[arg-type]
    assert checksum.crc32c(data[half:], checksum.crc32c(data[:half])) == whole  # type: ignore[index]


def _run_with(name: str) -> subprocess.CompletedProcess[str]:
    code = ("from localckpt.storage import checksum; "
            "print(checksum.IMPLEMENTATION, checksum.crc32c(b'123456789'))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "LOCALCKPT_CRC32C": name})


@pytest.mark.parametrize("name", checksum.CANDIDATES)
def test_each_installed_implementation_is_taken_on_request(name: str) -> None:
    if name != "crc32c" and checksum._load(name) is None:
        pytest.skip(f"{name} is not installed here")
    out = _run_with(name)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [name, str(0xE3069283)]  # the check value of CRC-32C
    assert checksum.crc32c(np.frombuffer(b"123456789", dtype=np.uint8)) == 0xE3069283


def test_an_unknown_implementation_is_a_clear_error() -> None:
    out = _run_with("zlib")
    assert out.returncode != 0
    assert "LOCALCKPT_CRC32C: expected one of crc32c_rs, awscrt, crc32c" in out.stderr
    assert "got 'zlib'" in out.stderr


def test_an_implementation_that_disagrees_or_fails_is_passed_over(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A candidate whose values differ from the package's on any length (a broken build, an
    API that changed) is not used: the next one is."""
    import types

    def wrong_on_long(data: object, value: int = 0) -> int:
        v = package.crc32c(data, value)
        return v ^ 1 if len(data) > 4096 else v  # type: ignore[arg-type]

    def raises(data: object, value: int = 0) -> int:
        raise TypeError("value must be keyword")

    def wrong_on_a_window(data: object, value: int = 0) -> int:
        v = package.crc32c(data, value)
        return v ^ 1 if len(data) >= 1 << 20 else v  # type: ignore[arg-type]

    def numpy_ints(data: object, value: int = 0) -> int:
        return np.uint32(package.crc32c(data, value))  # type: ignore[return-value]

    assert checksum._agrees(package.crc32c)
    bad_ones = (wrong_on_long, raises, wrong_on_a_window, numpy_ints)
    assert not any(map(checksum._agrees, bad_ones))
    for bad in bad_ones:
        monkeypatch.setitem(sys.modules, "crc32c_rs", types.SimpleNamespace(crc32c=bad))
        monkeypatch.setitem(sys.modules, "awscrt.checksums", None)  # as if not installed
        monkeypatch.delenv("LOCALCKPT_CRC32C", raising=False)
        assert checksum._choose()[0] == "crc32c"


def test_text_is_refused_whichever_implementation() -> None:
    with pytest.raises(TypeError, match="expected a bytes-like object, got str"):
        checksum.crc32c("123456789")
