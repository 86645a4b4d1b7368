"""The device key a calibration is valid for (GPU or CPU, plus the software that builds our kernels)."""

from __future__ import annotations

import functools
import os
import platform

import torch

from ..tuning_db.records import DeviceKey

__all__ = ["device_key"]


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__


def _driver_version() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 - optional: NVML is not everywhere
        pass
    try:
        v = torch._C._cuda_getDriverVersion()
        return f"cuda-driver-api {v // 1000}.{v % 1000 // 10}"
    except Exception:  # noqa: BLE001
        return "unknown"


@functools.lru_cache(maxsize=16)
def device_key(device: torch.device | str) -> DeviceKey:
    """The `DeviceKey` of `device` (cached: it never changes within a process)."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return DeviceKey(
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            memory_mb=props.total_memory // 2**20,
            driver=_driver_version(),
            torch=torch.__version__,
            triton=_triton_version(),
        )
    try:
        memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    except (ValueError, OSError, AttributeError):
        memory_mb = 0
    return DeviceKey(
        name=f"cpu: {platform.processor() or platform.machine()}",
        capability="cpu",
        sm_count=os.cpu_count() or 1,
        memory_mb=memory_mb,
        driver="",
        torch=torch.__version__,
        triton=_triton_version(),
    )
