"""Shared pieces of the kernel files: the config dataclass, the Triton import shim, dtype helpers.

This module imports neither torch nor triton at the top, so `KernelConfig` can cross into code that
must stay light (the tuning database stores it as a plain dict).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["KernelConfig", "interpreting", "dot_upcast", "next_pow2"]

_BACKENDS = ("triton", "cublas")


@dataclass(frozen=True)
class KernelConfig:
    """The tunable knobs of a ragged kernel.

    block_m:    rows of the query / row tile (attention, matmul, layer norm rows per program)
    block_n:    key tile (attention) or output-column tile (matmul)
    block_k:    reduction tile (matmuls only; ignored elsewhere)
    num_warps:  warps per program
    num_stages: software-pipelining depth of the inner loop
    align:      the RaggedTensor layout's alignment in rows (every component starts at a multiple)
    backend:    "triton" or "cublas" (only `ragged_linear` honours "cublas"; a shared weight makes
                the ragged product a dense one, so cuBLAS is a legitimate arm): "cublas" is
                torch.nn.functional.linear, cuBLAS on a GPU and PyTorch's own matmul on a CPU
    group_m:    matmul tile swizzle (programs sharing a weight tile run together for L2 reuse)
    """

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    align: int = 1
    backend: str = "triton"
    group_m: int = 8

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps", "group_m", "align"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a positive power of two, got {value!r}")
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"KernelConfig.num_stages must be an int in [1, 8], got {self.num_stages!r}")
        if self.backend not in _BACKENDS:
            raise ValueError(f"KernelConfig.backend must be one of {_BACKENDS}, got {self.backend!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KernelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown KernelConfig fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**data)

    def replace(self, **changes: Any) -> KernelConfig:
        return dataclasses.replace(self, **changes)

    def short(self) -> str:
        """A compact label for tables: `m64n64k64w4s2a1` (+ `cublas` when set)."""
        label = f"m{self.block_m}n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages}a{self.align}"
        return label + ("-cublas" if self.backend == "cublas" else "")


def _identity(kernel):
    return kernel


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def aligned(n: int) -> int:
    """n rounded up to a multiple of 16: where the next section of a packed int32 buffer starts, 64-byte
    aligned. Triton specialises a kernel on whether each pointer argument is 16-byte aligned, so views of one
    buffer at offsets that follow the batch (B + 1, the program count) would compile a second variant at
    whichever batch first flips an alignment: inside a CUDA-graph capture in a stream, 0.7 s (HF bert-base,
    CoLA B=128 on an H100, benchmarks/stream_table.py)."""
    return -(-n // 16) * 16


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (`TRITON_INTERPRET=1` at import time).

    Triton picks the interpreter when a kernel is *decorated*, so this reads the environment once,
    the same way Triton did when these modules were imported.
    """
    return _INTERPRET


def dot_upcast(dtype_name: str) -> bool:
    """Whether kernels must feed `tl.dot` fp32 operands instead of `dtype_name` ones.

    Only under the interpreter, only for bfloat16: Triton 3.9's interpreter computes bf16 x bf16 dots
    wrongly (a 16x16 product of randn inputs comes out 1e10 off), while casts and loads of bf16 are right.
    Compiled kernels always take the native path.
    """
    return _INTERPRET and dtype_name == "bfloat16"


_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")
