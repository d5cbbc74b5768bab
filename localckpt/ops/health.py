"""GPU inventory, health and node identity through NVML (nvidia-ml-py).

Everything degrades cleanly: without an NVIDIA driver (or without the library) the inventory is
empty and ``nvml_status`` says "no NVIDIA driver"; that is logged once, never raised. Tests pass
a fake module with the same functions as ``pynvml``.
"""

from __future__ import annotations

import importlib
import logging
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)
_warned = False


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    uuid: str
    memory_total_bytes: int
    ecc_uncorrected_volatile: int | None = None
    retired_pages: int | None = None
    throttle_reasons: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return not self.ecc_uncorrected_volatile and not self.retired_pages


_THROTTLE_NAMES = {
    "clocksThrottleReasonHwSlowdown": "hardware slowdown",
    "clocksThrottleReasonHwThermalSlowdown": "thermal slowdown",
    "clocksThrottleReasonHwPowerBrakeSlowdown": "power brake",
    "clocksThrottleReasonSwThermalSlowdown": "software thermal slowdown",
    "clocksThrottleReasonSwPowerCap": "power cap",
}


def _load_nvml(nvml: Any | None) -> tuple[Any | None, str]:
    global _warned
    try:
        lib = nvml if nvml is not None else importlib.import_module("pynvml")
        lib.nvmlInit()
        return lib, "ok"
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError...
        if not _warned:
            logger.info("no NVIDIA driver (%s): GPU inventory and health are empty", exc)
            _warned = True
        return None, "no NVIDIA driver"


def _optional(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:  # not supported on this GPU / driver
        return None


def gpu_inventory(nvml: Any | None = None) -> tuple[str, list[GpuInfo]]:
    """(status, GPUs): status is "ok" or "no NVIDIA driver"; never raises."""
    lib, status = _load_nvml(nvml)
    if lib is None:
        return status, []
    gpus = []
    try:
        for i in range(lib.nvmlDeviceGetCount()):
            h = lib.nvmlDeviceGetHandleByIndex(i)
            name = lib.nvmlDeviceGetName(h)
            uuid = lib.nvmlDeviceGetUUID(h)
            ecc = _optional(lib.nvmlDeviceGetTotalEccErrors, h,
                            getattr(lib, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
                            getattr(lib, "NVML_VOLATILE_ECC", 0))
            retired = _optional(lambda h=h: len(lib.nvmlDeviceGetRetiredPages(
                h, getattr(lib, "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR", 1))))
            mask = _optional(lib.nvmlDeviceGetCurrentClocksThrottleReasons, h) or 0
            reasons = [text for attr, text in _THROTTLE_NAMES.items()
                       if mask & int(getattr(lib, "nvml" + attr[0].upper() + attr[1:], 0) or 0)]
            gpus.append(GpuInfo(
                i, name.decode() if isinstance(name, bytes) else str(name),
                uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                int(lib.nvmlDeviceGetMemoryInfo(h).total), ecc, retired, reasons))
    finally:
        _optional(lib.nvmlShutdown)
    return status, gpus


def node_identity(nvml: Any | None = None) -> dict[str, Any]:
    """hostname, boot id and GPU UUIDs: recorded in every manifest."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = None
    _, gpus = gpu_inventory(nvml)
    return {"hostname": socket.gethostname(), "boot_id": boot_id,
            "gpu_uuids": [g.uuid for g in gpus]}


def as_json(gpus: list[GpuInfo]) -> list[dict[str, Any]]:
    return [asdict(g) | {"healthy": g.healthy} for g in gpus]
