"""Triton kernels of autoragged: one op per file (`@triton.jit` body, launcher, config space, PyTorch
reference). This package knows nothing of modules or decisions; `autoragged.ops` is its public face."""

from .config import KernelConfig

__all__ = ["KernelConfig"]
