"""Ragged batched matmul (PyCoRa's): component i of the values times its own weight `weights[i]`.

A 2-D grid: axis 0 over the real row blocks of all components (the CoRa prelude), axis 1 over
output-column tiles. Rows past a component's length are neither read nor written.

Shape contracts
    x:              (T, K), stride 1 on K; component i at rows offsets[i] : offsets[i] + lengths[i]
    weights:        (B, K, N), any strides
    offsets:        (B + 1,), int32;  lengths: (B,), int32
    grid_mapping:   (P,), int32;  block_offsets: (B + 1,), int32 — the prelude for config.block_m
    out:            (T, N), written on real rows only
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.library import triton_op, wrap_triton

from .config import KernelConfig, _identity, dot_upcast
from .triton_compat import tl, triton

__all__ = ["ragged_bmm", "ragged_bmm_ref", "CONFIGS", "DEFAULT_CONFIG", "prune"]


@triton.jit
def _ragged_bmm_kernel(
    X, W, Y, offsets, lengths, grid_mapping, block_offsets, N, K,
    stride_xt, stride_wb, stride_wk, stride_wn, stride_yt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_n = tl.program_id(1)
    comp = tl.load(grid_mapping + pid)
    block = pid - tl.load(block_offsets + comp)
    start = tl.load(offsets + comp).to(tl.int64)
    length = tl.load(lengths + comp)

    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < length
    col_ok = offs_n < N
    x_ptrs = X + (start + offs_m)[:, None] * stride_xt + offs_k[None, :]
    w_ptrs = W + comp.to(tl.int64) * stride_wb + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    y_ptrs = Y + (start + offs_m)[:, None] * stride_yt + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# Keyed by (K, N, dtype) and a max_len bucket: block_m beyond the longest component is wasted.
CONFIGS = [
    KernelConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s)
    for bm in (16, 32, 64, 128)
    for bn in (32, 64, 128)
    for bk in (32, 64)
    for w in (4, 8)
    for s in (2, 3)
]
DEFAULT_CONFIG = KernelConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=2)


def prune(config: KernelConfig, *, max_len: int, n: int, k: int) -> bool:
    return (
        config.block_m <= max(16, triton.next_power_of_2(max(max_len, 1)))
        and config.block_n <= max(32, 2 * n)
        and config.block_k <= max(16, k)
    )


def ragged_bmm(
    x: torch.Tensor,
    weights: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    grid_mapping: torch.Tensor,
    block_offsets: torch.Tensor,
    *,
    config: KernelConfig = DEFAULT_CONFIG,
    out: torch.Tensor | None = None,
    wrap=None,
) -> torch.Tensor:
    if x.dim() != 2 or weights.dim() != 3 or weights.shape[1] != x.shape[1]:
        raise ValueError(f"x (T, K) and weights (B, K, N) disagree: {tuple(x.shape)} vs {tuple(weights.shape)}")
    if weights.shape[0] != lengths.shape[0]:
        raise ValueError(f"weights holds {weights.shape[0]} matrices for {lengths.shape[0]} components")
    if x.dtype != weights.dtype:
        raise TypeError(f"x and weights must share a dtype, got {x.dtype} and {weights.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    T, K = x.shape
    N = weights.shape[2]
    if out is None:
        out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    programs = grid_mapping.shape[0]
    if programs == 0 or N == 0:
        return out
    if K == 0:
        raise ValueError("ragged_bmm needs K >= 1")
    precision = "ieee" if x.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32 else "tf32"
    bk = min(config.block_k, max(16, triton.next_power_of_2(K)))
    grid = (programs, triton.cdiv(N, config.block_n))
    (wrap or _identity)(_ragged_bmm_kernel)[grid](
        x, weights, out, offsets, lengths, grid_mapping, block_offsets, N, K,
        x.stride(0), weights.stride(0), weights.stride(1), weights.stride(2), out.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=bk,
        PRECISION=precision, UPCAST=dot_upcast(str(x.dtype)[6:]),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def ragged_bmm_ref(
    x: torch.Tensor, weights: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int], *, upcast: bool = True
) -> torch.Tensor:
    """PyTorch reference with host offsets/lengths; rows outside components are zero."""
    compute = torch.float32 if upcast and x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    out = torch.zeros((x.shape[0], weights.shape[2]), dtype=x.dtype, device=x.device)
    for i, (start, n) in enumerate(zip(offsets, lengths)):
        if n:
            out[start : start + n] = (x[start : start + n].to(compute) @ weights[i].to(compute)).to(x.dtype)
    return out


# -- the torch.library op: torch.compile traces the kernel itself through it (`autoragged.ops` calls it
# while compiling; eager calls take the launcher, a dispatcher hop costs microseconds on a launch-bound path)
@triton_op("autoragged::ragged_bmm", mutates_args={})
def ragged_bmm_op(
    x: torch.Tensor,
    weights: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    grid_mapping: torch.Tensor,
    block_offsets: torch.Tensor,
    block_m: int,
    block_n: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
) -> torch.Tensor:
    config = KernelConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages)
    return ragged_bmm(x, weights, offsets, lengths, grid_mapping, block_offsets, config=config, wrap=wrap_triton)


@ragged_bmm_op.register_fake
def _(x, weights, offsets, lengths, grid_mapping, block_offsets, block_m, block_n, block_k, num_warps, num_stages):
    return x.new_empty((x.shape[0], weights.shape[2]))
