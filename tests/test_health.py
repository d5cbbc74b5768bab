"""GPU inventory, health and node identity through a fake NVML, and without any driver."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from localckpt.ops import health


class FakeNVML:
    """The pynvml functions localckpt calls, for two GPUs: one healthy, one with ECC errors."""

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
    nvmlClocksThrottleReasonHwThermalSlowdown = 0x40
    nvmlClocksThrottleReasonSwPowerCap = 0x4

    def __init__(self) -> None:
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-0000-{h}"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return SimpleNamespace(total=80 << 30)

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        return 3 if h == 1 else 0

    def nvmlDeviceGetRetiredPages(self, h: int, cause: int) -> list[int]:
        if h == 0:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return [0x1000, 0x2000]

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: int) -> int:
        return 0x40 | 0x4 if h == 1 else 0


def test_fake_nvml_inventory_health_and_throttling() -> None:
    fake = FakeNVML()
    status, gpus = health.gpu_inventory(fake)
    assert status == "ok" and fake.shutdowns == 1
    assert [(g.index, g.name, g.uuid, g.memory_total_bytes) for g in gpus] == [
        (0, "NVIDIA H100 80GB HBM3", "GPU-0000-0", 80 << 30),
        (1, "NVIDIA H100 80GB HBM3", "GPU-0000-1", 80 << 30)]
    assert gpus[0].healthy and gpus[0].retired_pages is None  # unsupported -> None, no crash
    assert not gpus[1].healthy and gpus[1].ecc_uncorrected_volatile == 3
    assert gpus[1].retired_pages == 2
    assert set(gpus[1].throttle_reasons) == {"thermal slowdown", "power cap"}
    assert [d["healthy"] for d in health.as_json(gpus)] == [True, False]
    assert health.node_identity(fake)["gpu_uuids"] == ["GPU-0000-0", "GPU-0000-1"]


def test_without_a_driver_everything_works_and_says_so_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    class NoDriver:
        def nvmlInit(self) -> None:
            raise OSError("NVML Shared Library Not Found")

    monkeypatch.setattr(health, "_warned", False)
    with caplog.at_level(logging.INFO, "localckpt"):
        assert health.gpu_inventory(NoDriver()) == ("no NVIDIA driver", [])
        identity = health.node_identity(NoDriver())
    assert identity["gpu_uuids"] == [] and identity["hostname"]
    assert sum("no NVIDIA driver" in r.getMessage() for r in caplog.records) == 1


def test_real_pynvml_on_this_machine_never_raises() -> None:
    status, gpus = health.gpu_inventory()
    assert status in ("ok", "no NVIDIA driver")
    assert status == "ok" or gpus == []
