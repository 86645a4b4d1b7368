"""Programmatic dependent launch (PDL): a kernel is launched while the kernel before it on the stream still runs.

A launch with `launch_pdl=True` lets the GPU schedule the kernel as soon as the kernel before it has no programs
left to start, instead of after it has finished and flushed; in a CUDA graph this hides part of each kernel
boundary. A chain of 96 small Triton kernels captured in a graph took 0.75-0.93 us a kernel against 1.04-1.42
without (H100; 4K-312K fp16 elements a kernel). A bert-base forward is about 90 kernels: each CoRa row's mask graph
replayed 0.992-1.000x as long as a geomean over the rows (the MiniLM shape's 0.984-0.987x), CoLA B=32's 3-4% faster
(0.591 ms against 0.611), the long rows within the runs' noise (benchmarks/diagnostics/graph_pdl.py).

The contract that keeps it exact: every program of such a kernel calls `wait_prior` before it touches memory, and
`wait_prior` returns once the kernel before it has completed and its writes are visible. So no kernel reads an
input early or overwrites one its predecessor still reads, and since each kernel completes only after its own
wait, it also completes after every kernel before it: an output of two kernels back is ready too. Kernels never
trigger their dependents early (a trigger at their start made mid-sized chains slower: 2.31 us a kernel against
1.67 at 1.5M elements; likely the early programs taking room on the SMs). A kernel launched without PDL (cuBLAS,
PyTorch's) is ordered as always.

On for NVIDIA Hopper and newer GPUs. Off in the interpreter (it has no grid dependency control), for launches
torch.compile traces (`wrap_triton`: inductor launches those itself) and where `AUTORAGGED_PDL=0` was set before
import.
"""

from __future__ import annotations

import os

import torch

from .config import interpreting
from .triton_compat import HAS_TRITON, tl, triton

__all__ = ["enabled", "set_enabled", "launch_kwargs", "wait_prior"]

if HAS_TRITON:
    try:
        from triton.language.extra.cuda import gdc_wait
    except ImportError:  # pragma: no cover - a Triton without grid dependency control
        gdc_wait = None
else:  # pragma: no cover - exercised only on platforms without Triton
    gdc_wait = None

_ON = os.environ.get("AUTORAGGED_PDL", "1").strip().lower() not in ("0", "false", "no", "off")
_BY_DEVICE: dict[int, bool] = {}


def enabled(device: torch.device) -> bool:
    """Whether kernels launched on `device` chain by PDL (the module docstring)."""
    if device.type != "cuda" or not _ON or gdc_wait is None or interpreting() or torch.version.hip is not None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    on = _BY_DEVICE.get(index)
    if on is None:
        on = _BY_DEVICE[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return on


def set_enabled(on: bool) -> None:
    """Turn PDL on or off for the launches from now on, as `AUTORAGGED_PDL` does at import (graphs already captured
    keep theirs; benchmarks/diagnostics/graph_pdl.py alternates the two in one process)."""
    global _ON
    _ON = bool(on)


_CHAINED = {"PDL": True, "launch_pdl": True}  # shared: callers never change them
_UNCHAINED = {"PDL": False}


def launch_kwargs(device: torch.device, wrap=None) -> dict:
    """A kernel's `PDL` constexpr and its launch option, for a launch on `device` (`wrap`: torch.compile's
    `wrap_triton`, which launches without PDL)."""
    return _CHAINED if wrap is None and enabled(device) else _UNCHAINED


@triton.jit
def wait_prior(PDL: tl.constexpr):
    """A kernel's first step: with PDL, wait until the kernel before it has completed (the module docstring)."""
    if PDL:
        gdc_wait()
