"""Which implementation an op takes for a tensor: Triton on CUDA, the interpreter on CPU when asked for,
the PyTorch reference otherwise."""

from __future__ import annotations

import numpy as np
import torch

from ..kernels.config import interpreting
from ..kernels.triton_compat import HAS_TRITON

_TRITON_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64})


def use_triton(t: torch.Tensor) -> bool:
    """True when `t`'s op should run our Triton kernel (compiled on CUDA, interpreted on CPU when
    `TRITON_INTERPRET=1` was set before import); False means the PyTorch reference."""
    if not HAS_TRITON or t.dtype not in _TRITON_DTYPES:
        return False
    if t.device.type == "cuda":
        return True
    return t.device.type == "cpu" and interpreting()


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Copy a small host array to `device` without a device sync: through pinned memory with
    `non_blocking=True` on CUDA (a pageable blocking copy would synchronize the stream)."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
