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


def test_the_fallback_is_taken_on_request() -> None:
    code = ("from localckpt.storage import checksum; "
            "print(checksum.IMPLEMENTATION, checksum.crc32c(b'123456789'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "LOCALCKPT_CRC32C": "crc32c"}).stdout
    assert out.split() == ["crc32c", str(0xE3069283)]  # the check value of CRC-32C
    assert checksum.crc32c(np.frombuffer(b"123456789", dtype=np.uint8)) == 0xE3069283


def test_text_is_refused_whichever_implementation() -> None:
    with pytest.raises(TypeError, match="expected a bytes-like object, got str"):
        checksum.crc32c("123456789")
