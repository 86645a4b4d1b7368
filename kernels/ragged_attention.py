"""Ragged flash-attention forward: a 1-D grid over the real query blocks only (the CoRa prelude).

Each program owns one block of BLOCK_M query rows of one component and one head, and streams that
component's keys in BLOCK_N tiles with an online softmax (fp32 statistics and accumulator, exp2 with
log2(e) folded into the scale). Key tiles that lie wholly inside the component (and, when causal,
wholly before the query block) run unmasked; only the last tile (and the causal diagonal) is masked.
A short component costs exactly ceil(length / BLOCK_M) programs per head: no empty programs.

Shape contracts
    q, k, v:        (T, H, Dh) values of one layout; any strides on T and H, stride 1 on Dh
    offsets:        (B + 1,), int32 — start of each component in values
    lengths:        (B,), int32 — real rows of each component (rows past it are never read)
    grid_mapping:   (P,), int32 — component of query block p; P = sum ceil(lengths / BLOCK_M), or more
                    with entries -1 for spare programs (a grid sized for a CUDA-graph bucket)
    block_offsets:  (B + 1,), int32 — first query block of each component (prefix sum of blocks)
    out:            (T, H, Dh); real rows, and zeros on the gap rows of each component's last query
                    block (all gap rows when align <= BLOCK_M); rows outside every extent untouched
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ._config import KernelConfig, _identity, dot_upcast, next_pow2
from ._triton import tl, triton

__all__ = [
    "ragged_attention",
    "ragged_attention_ref",
    "CONFIGS",
    "DEFAULT_CONFIG",
    "HEAD_DIMS",
    "prune",
    "default_config",
]

HEAD_DIMS = (32, 64, 80, 96, 128)
_LOG2E = 1.4426950408889634


@triton.jit
def _attn_tile(
    acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, qk_scale,
    offs_m, offs_n, offs_d, d_mask, n_lo, n_hi, length,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """Fold key tiles [n_lo, n_hi) into the running (acc, l_i, m_i). MASKED: mask keys >= length (and,
    when CAUSAL, keys after the query row)."""
    for n0 in range(n_lo, n_hi, BLOCK_N):
        cols = n0 + offs_n
        if MASKED:
            kv_mask = (cols[:, None] < length) & d_mask[None, :]
        else:
            kv_mask = d_mask[None, :]
        k = tl.load(k_base + cols.to(tl.int64)[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
        # (x * qk_scale) is cast back to fp32: torch.compile passes Python floats as fp64 scalars
        if UPCAST:
            qk = (tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PRECISION) * qk_scale).to(
                tl.float32
            )
        else:
            qk = (tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale).to(tl.float32)
        if MASKED:
            keep = cols[None, :] < length
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols.to(tl.int64)[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            acc = tl.dot(
                p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc * alpha[:, None], input_precision=PRECISION
            )
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _ragged_attn_fwd_kernel(
    Q, K, V, Out, offsets, lengths, grid_mapping, block_offsets,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    head = tl.program_id(1)
    comp = tl.load(grid_mapping + pid)
    if comp >= 0:  # -1: a spare program of a grid sized for a bucket (CUDA graphs), nothing to do
        block = pid - tl.load(block_offsets + comp)
        start = tl.load(offsets + comp).to(tl.int64)
        length = tl.load(lengths + comp)
        extent = tl.load(offsets + comp + 1) - tl.load(offsets + comp)

        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        row_mask = offs_m < length
        q = tl.load(
            Q + (start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
            mask=row_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        k_base = K + start * stride_kt + head * stride_kh
        v_base = V + start * stride_vt + head * stride_vh

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        if CAUSAL:
            # keys before this query block are visible to all of its rows; the diagonal needs the mask
            n_full = (block * BLOCK_M) // BLOCK_N * BLOCK_N
            n_end = tl.minimum(length, (block + 1) * BLOCK_M)
        else:
            n_full = length // BLOCK_N * BLOCK_N
            n_end = length
        acc, l_i, m_i = _attn_tile(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, qk_scale,
            offs_m, offs_n, offs_d, d_mask, 0, n_full, length,
            False, CAUSAL, BLOCK_N, PRECISION, UPCAST,
        )  # fmt: skip
        acc, l_i, m_i = _attn_tile(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, qk_scale,
            offs_m, offs_n, offs_d, d_mask, n_full, n_end, length,
            True, CAUSAL, BLOCK_N, PRECISION, UPCAST,
        )  # fmt: skip
        out = tl.where(row_mask[:, None], acc / l_i[:, None], 0.0)
        # rows in [length, extent) of this block are the component's alignment gap: written as zeros
        tl.store(
            Out + (start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=(offs_m < extent)[:, None] & d_mask[None, :],
        )


# -- config space -------------------------------------------------------------------------------
# The tuning key is (head_dim, dtype, causal, max_len bucket), never the total token count: the total
# changes with every batch and would re-tune every batch, while the best tile depends on how long the
# components are (a 128-row query block is mostly empty on CoLA's 13-token sentences).
CONFIGS = [
    KernelConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
    for bm in (16, 32, 64, 128)
    for bn in (16, 32, 64, 128)
    for w in (2, 4, 8)
    for s in (1, 2, 3, 4)
]
DEFAULT_CONFIG = KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)


def prune(config: KernelConfig, *, head_dim: int, max_len: int, causal: bool = False, element_size: int = 2) -> bool:
    """True if `config` is worth trying for this problem (the tuner's pruning predicate)."""
    bm, bn, bd = config.block_m, config.block_n, next_pow2(head_dim)
    if causal and bm % bn:
        return False  # the unmasked prefix must end on a key-tile boundary
    if config.align > bm:
        return False  # the last query block must cover the component's alignment gap
    if bm > max(16, next_pow2(max_len)) or bn > max(16, next_pow2(max_len)):
        return False  # tiles longer than the longest component only add masked work
    if config.num_warps * 32 > bm * bn // 8 or (bm >= 128 and config.num_warps < 4):
        return False  # too many threads for the tile, or too few for a big one
    smem = (bm * bd + config.num_stages * 2 * bn * bd) * element_size
    return smem <= 160 * 1024


def default_config(head_dim: int, max_len: int) -> KernelConfig:
    """The untuned choice: 64x64 tiles, smaller query blocks for short components."""
    if max_len <= 32:
        return KernelConfig(block_m=32, block_n=32, num_warps=4, num_stages=2)
    return DEFAULT_CONFIG


# -- launcher -----------------------------------------------------------------------------------
def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"q, k, v must share one (T, H, Dh) shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(
            f"q, k, v must share a dtype among float16/bfloat16/float32, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if q.shape[2] not in HEAD_DIMS:
        raise ValueError(f"head dim {q.shape[2]} is not supported; supported: {HEAD_DIMS}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1:
            raise ValueError(f"{name} must have a contiguous head dim (stride 1), got strides {t.stride()}")


def ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    grid_mapping: torch.Tensor,
    block_offsets: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    config: KernelConfig = DEFAULT_CONFIG,
    out: torch.Tensor | None = None,
    wrap=None,
) -> torch.Tensor:
    """Launch the kernel; `grid_mapping` / `block_offsets` must be the prelude for `config.block_m`.

    Returns `out` (T, H, Dh) (see the shape contract for gap rows). `wrap` is
    `torch.library.wrap_triton` when the registered op calls this (torch.compile), else None."""
    check_inputs(q, k, v)
    T, H, Dh = q.shape
    if out is None:
        out = torch.empty((T, H, Dh), dtype=q.dtype, device=q.device)
    programs = grid_mapping.shape[0]
    if programs == 0 or H == 0:
        return out
    scale = 1.0 / math.sqrt(Dh) if scale is None else float(scale)
    precision = "ieee" if q.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32 else "tf32"
    (wrap or _identity)(_ragged_attn_fwd_kernel)[(programs, H)](
        q, k, v, out, offsets, lengths, grid_mapping, block_offsets,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        scale * _LOG2E,
        HEAD_DIM=Dh, BLOCK_D=next_pow2(Dh), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        CAUSAL=bool(causal), PRECISION=precision, UPCAST=dot_upcast(str(q.dtype)[6:]),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


# -- reference ----------------------------------------------------------------------------------
def ragged_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: Sequence[int],
    lengths: Sequence[int],
    *,
    causal: bool = False,
    scale: float | None = None,
    upcast: bool = True,
) -> torch.Tensor:
    """PyTorch reference with host offsets/lengths: softmax(q k^T * scale) v per component and head.

    upcast=True computes in float32 (float64 stays float64) and returns the input dtype; upcast=False
    computes in the input dtype throughout (PyTorch's same-dtype error, the yardstick of the tests).
    Rows outside components are zero.
    """
    T, H, Dh = q.shape
    scale = 1.0 / math.sqrt(Dh) if scale is None else float(scale)
    compute = q.dtype
    if upcast and q.dtype in (torch.float16, torch.bfloat16):
        compute = torch.float32
    out = torch.zeros((T, H, Dh), dtype=q.dtype, device=q.device)
    for start, n in zip(offsets, lengths):
        if n == 0:
            continue
        qi, ki, vi = (t[start : start + n].transpose(0, 1).to(compute) for t in (q, k, v))  # (H, n, Dh)
        scores = (qi @ ki.transpose(1, 2)) * scale
        if causal:
            keep = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start : start + n] = (probs @ vi).transpose(0, 1).to(q.dtype)
    return out
