"""Ragged flash-attention backward, and the autograd Function that pairs it with the forward kernel.

The forward (kernels/ragged_attention.py) stores each real row's log2-sum-exp2 of its scaled scores (`lse`,
(T, H) fp32), so the backward recomputes the probabilities tile by tile instead of keeping them (flash-attention
2's scheme). With delta = rowsum(dO * O) per (row, head):

    P = exp2(Q K^T * scale * log2(e) - lse)     dV = P^T dO      dP = dO V^T
    dS = P * (dP - delta)                       dQ = dS K * scale      dK = dS^T Q * scale

Two kernels, no atomics: one program per (query block, query head) accumulates dQ over the key tiles its rows
see; one program per (key block, kv head) accumulates dK and dV over the query tiles that see it and, for
grouped-query attention, over the group's query heads (k and v are never repeated). Both grids are the CoRa
prelude of one block size (query and key blocks share it), so a short component costs ceil(length / BLOCK)
programs per head. Every tile is masked (component end, causal, sliding window, query-only rows): the backward
is a training path, where the mask's few instructions per score are small next to its five dots per tile.

Gradients are written for real rows only; every other row (alignment gaps, rows past a component's keys for
dK and dV) is zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from . import ragged_attention as fwd
from .config import KernelConfig, dot_upcast, next_pow2
from .triton_compat import tl, triton

__all__ = ["ragged_attention_backward", "ragged_attention_train", "backward_config", "AttentionProblem"]

_LOG2E = 1.4426950408889634


@triton.jit
def _scores(q, k, lse, qk_scale, rows, cols, length, keys, left, right, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """P (rows x cols) of one tile from q (BLOCK_M, D), k (BLOCK_N, D), zero where a key is hidden."""
    if UPCAST:
        qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PRECISION)
    else:
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    keep = (rows[:, None] < length) & (cols[None, :] < keys)
    keep = keep & (cols[None, :] >= rows[:, None] - left) & (cols[None, :] <= rows[:, None] + right)
    return tl.where(keep, tl.math.exp2((qk * qk_scale).to(tl.float32) - lse[:, None]), 0.0)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ, offsets, lengths, key_lengths, grid_mapping, block_offsets,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_gqt, stride_gkt,
    qk_scale, sm_scale, left, right, DropSeed, drop_p, Out, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, GQA_GROUP: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, DROPOUT: tl.constexpr,
):  # fmt: skip
    """Also computes delta = rowsum(dO * O) of its rows and head (fp32) and stores it for the dK/dV kernel, which
    runs after it on the stream: no pass of its own (four on the host: two casts, a product, a sum)."""
    pid = tl.program_id(0)
    head = tl.program_id(1)
    heads = tl.num_programs(1)
    comp = tl.load(grid_mapping + pid)
    if comp >= 0:
        if DROPOUT:  # the forward's stream for this (component, head)
            seed = tl.load(DropSeed) + comp * heads + head
        else:
            seed = 0  # (unused)
        start = tl.load(offsets + comp).to(tl.int64)
        length = tl.load(lengths + comp)
        keys = tl.load(key_lengths + comp)
        r0 = (pid - tl.load(block_offsets + comp)) * BLOCK
        rows = r0 + tl.arange(0, BLOCK)
        offs_n = tl.arange(0, BLOCK)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        row_mask = rows < length
        io_mask = row_mask[:, None] & d_mask[None, :]
        rows64 = (start + rows).to(tl.int64)
        q = tl.load(Q + rows64[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=io_mask, other=0.0)
        do = tl.load(DO + rows64[:, None] * stride_dot + head * stride_doh + offs_d[None, :], mask=io_mask, other=0.0)
        lse = tl.load(Lse + rows64 * heads + head, mask=row_mask, other=0.0)
        o = tl.load(Out + rows64[:, None] * stride_ot + head * stride_oh + offs_d[None, :], mask=io_mask, other=0.0)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
        tl.store(Delta + rows64 * heads + head, delta, mask=row_mask)
        kv_head = head // GQA_GROUP
        k_base = K + start * stride_kt + kv_head * stride_kh
        v_base = V + start * stride_vt + kv_head * stride_vh
        # keys any row of the block may see: [r0 - left, r_last + right], within the component's keys
        r_last = tl.minimum(r0 + BLOCK, length) - 1
        n_lo = tl.maximum(r0 - left, 0) // BLOCK * BLOCK
        n_end = tl.minimum(keys, r_last + right + 1)
        dq = tl.zeros([BLOCK, BLOCK_D], tl.float32)
        for n0 in range(n_lo, n_end, BLOCK):
            cols = n0 + offs_n
            kv_mask = (cols[:, None] < keys) & d_mask[None, :]
            k = tl.load(k_base + cols.to(tl.int64)[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_base + cols.to(tl.int64)[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
            p = _scores(q, k, lse, qk_scale, rows, cols, length, keys, left, right, PRECISION, UPCAST)
            dp = _dot(do, tl.trans(v), PRECISION, UPCAST)
            if DROPOUT:  # the gradient reaches a probability only where it was kept, scaled as it was
                dp = tl.where(fwd.keep_mask(seed, drop_p, rows, n0, BLOCK), dp / (1.0 - drop_p), 0.0)
            ds = p * (dp - delta[:, None])
            dq += _dot(ds.to(k.dtype), k, PRECISION, UPCAST)
        tl.store(
            DQ + rows64[:, None] * stride_gqt + head * HEAD_DIM + offs_d[None, :],
            (dq * sm_scale).to(DQ.dtype.element_ty),
            mask=io_mask,
        )


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, offsets, lengths, key_lengths, grid_mapping, block_offsets,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_gqt, stride_gkt,
    qk_scale, sm_scale, left, right, DropSeed, drop_p, heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, GQA_GROUP: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, DROPOUT: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    comp = tl.load(grid_mapping + pid)
    if comp >= 0:
        start = tl.load(offsets + comp).to(tl.int64)
        length = tl.load(lengths + comp)
        keys = tl.load(key_lengths + comp)
        c0 = (pid - tl.load(block_offsets + comp)) * BLOCK
        if c0 < keys:  # blocks past the keys (query-only rows) have no key gradient: left zero
            cols = c0 + tl.arange(0, BLOCK)
            offs_m = tl.arange(0, BLOCK)
            offs_d = tl.arange(0, BLOCK_D)
            d_mask = offs_d < HEAD_DIM
            kv_mask = (cols[:, None] < keys) & d_mask[None, :]
            cols64 = (start + cols).to(tl.int64)
            k = tl.load(
                K + cols64[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0
            )
            v = tl.load(
                V + cols64[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0
            )
            # query rows that may see a key of the block: [c0 - right, c_last + left], within the component
            c_last = tl.minimum(c0 + BLOCK, keys) - 1
            m_lo = tl.maximum(c0 - right, 0) // BLOCK * BLOCK
            m_end = tl.minimum(length, c_last + left + 1)
            dk = tl.zeros([BLOCK, BLOCK_D], tl.float32)
            dv = tl.zeros([BLOCK, BLOCK_D], tl.float32)
            for g in range(GQA_GROUP):
                head = kv_head * GQA_GROUP + g
                if DROPOUT:
                    seed = tl.load(DropSeed) + comp * heads + head
                else:
                    seed = 0  # (unused)
                for m0 in range(m_lo, m_end, BLOCK):
                    rows = m0 + offs_m
                    row_mask = rows < length
                    io_mask = row_mask[:, None] & d_mask[None, :]
                    rows64 = (start + rows).to(tl.int64)
                    q = tl.load(
                        Q + rows64[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=io_mask, other=0.0
                    )
                    do = tl.load(
                        DO + rows64[:, None] * stride_dot + head * stride_doh + offs_d[None, :], mask=io_mask, other=0.0
                    )
                    lse = tl.load(Lse + rows64 * heads + head, mask=row_mask, other=0.0)
                    delta = tl.load(Delta + rows64 * heads + head, mask=row_mask, other=0.0)
                    p = _scores(q, k, lse, qk_scale, rows, cols, length, keys, left, right, PRECISION, UPCAST)
                    dp = _dot(do, tl.trans(v), PRECISION, UPCAST)
                    if DROPOUT:
                        keep = fwd.keep_mask(seed, drop_p, rows, c0, BLOCK)
                        dv += _dot(
                            tl.trans(tl.where(keep, p / (1.0 - drop_p), 0.0)).to(do.dtype), do, PRECISION, UPCAST
                        )
                        dp = tl.where(keep, dp / (1.0 - drop_p), 0.0)
                    else:
                        dv += _dot(tl.trans(p).to(do.dtype), do, PRECISION, UPCAST)
                    ds = p * (dp - delta[:, None])
                    dk += _dot(tl.trans(ds).to(q.dtype), q, PRECISION, UPCAST)
            tl.store(
                DK + cols64[:, None] * stride_gkt + kv_head * HEAD_DIM + offs_d[None, :],
                (dk * sm_scale).to(DK.dtype.element_ty),
                mask=kv_mask,
            )
            tl.store(
                DV + cols64[:, None] * stride_gkt + kv_head * HEAD_DIM + offs_d[None, :],
                dv.to(DV.dtype.element_ty),
                mask=kv_mask,
            )


def backward_config(head_dim: int, max_len: int) -> KernelConfig:
    """The backward's tile (block_m: query and key blocks alike): two fp32 accumulators of BLOCK x head dim per
    program (dK, dV), so wide heads take smaller blocks; short components take 32-row blocks."""
    if max_len <= 32 or head_dim > 128:
        return KernelConfig(block_m=32, block_n=32, num_warps=4 if head_dim <= 128 else 8, num_stages=1)
    return KernelConfig(block_m=64, block_n=64, num_warps=4 if head_dim <= 64 else 8, num_stages=1)


class AttentionProblem(NamedTuple):
    """What the forward and backward launches of one ragged attention share besides q, k and v.

    offsets, lengths:  (B + 1,) and (B,) int32 device tensors of the layout
    prelude:           block size -> (grid_mapping, block_offsets) of the layout for that block (cached by it)
    key_lengths:       optional (B,) int32: each component's keys, its first rows (the rest query-only)
    causal, scale, window: as `ragged_attention`; scale None is 1 / sqrt(head dim)
    config:            the forward's tiles; max_len the longest component (picks the backward's tiles)
    dropout:           attention dropout (its p and seed), or None
    written:           the rows the forward kernel writes (the layout's extents, offsets[-1]); rows past them, spare
                       rows of no component, are zeroed: a weight gradient sums every row, and 0 x a NaN left in
                       freed memory is NaN
    """

    offsets: torch.Tensor
    lengths: torch.Tensor
    prelude: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    key_lengths: torch.Tensor | None
    causal: bool
    scale: float | None
    window: tuple[int, int]
    config: KernelConfig
    max_len: int
    dropout: fwd.Dropout | None = None
    written: int | None = None


def _bounds(problem: AttentionProblem) -> tuple[int, int]:
    """(left, right) for the backward's masks: causal is right = 0, an unbounded side is farther than any row."""
    bounds = fwd._kernel_window(problem.window, problem.causal)
    if bounds is None:
        return (fwd._FAR, 0 if problem.causal else fwd._FAR)
    return bounds


def ragged_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    problem: AttentionProblem,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) for `out = ragged_attention(q, k, v, ...)` whose forward stored `lse`; shapes as q, k, v."""
    T, H, Dh = q.shape
    Hkv = k.shape[1]
    # contiguous gradients (q, k, v may be strided views of one fused qkv product); rows no kernel writes stay 0
    dq = torch.zeros((T, H, Dh), dtype=q.dtype, device=q.device)
    dk = torch.zeros((T, Hkv, Dh), dtype=k.dtype, device=k.device)
    dv = torch.zeros_like(dk)
    config = backward_config(Dh, problem.max_len)
    grid_mapping, block_offsets = problem.prelude(config.block_m)
    programs = grid_mapping.shape[0]
    if programs == 0 or H == 0:
        return dq, dk, dv
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    delta = torch.empty((T, H), dtype=torch.float32, device=q.device)  # rowsum(dO * O): the dQ kernel writes it
    scale = 1.0 / math.sqrt(Dh) if problem.scale is None else float(problem.scale)
    left, right = _bounds(problem)
    keys = problem.lengths if problem.key_lengths is None else problem.key_lengths
    drop = problem.dropout
    precision = "ieee" if q.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32 else "tf32"
    args = (
        problem.offsets, problem.lengths, keys, grid_mapping, block_offsets,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), dout.stride(0), dout.stride(1),
        H * Dh, Hkv * Dh, scale * _LOG2E, scale, left, right, keys if drop is None else drop.seed,
        drop.p if drop else 0.0,
    )  # fmt: skip
    flags = dict(HEAD_DIM=Dh, BLOCK_D=next_pow2(Dh), BLOCK=config.block_m, GQA_GROUP=H // Hkv,
                 PRECISION=precision, UPCAST=dot_upcast(str(q.dtype)[6:]), DROPOUT=problem.dropout is not None,
                 num_warps=config.num_warps,
                 num_stages=config.num_stages)  # fmt: skip
    if out.stride(-1) != 1:
        out = out.contiguous()
    _attn_bwd_dq_kernel[(programs, H)](q, k, v, dout, lse, delta, dq, *args, out, out.stride(0), out.stride(1), **flags)
    _attn_bwd_dkdv_kernel[(programs, Hkv)](q, k, v, dout, lse, delta, dk, dv, *args, H, **flags)
    return dq, dk, dv


class _RaggedAttention(torch.autograd.Function):
    """out = ragged_attention(q, k, v) with the backward above; `problem` carries the rest."""

    @staticmethod
    def forward(ctx, q, k, v, problem: AttentionProblem):
        T, H, _ = q.shape
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
        grid_mapping, block_offsets = problem.prelude(problem.config.block_m)
        out = fwd.ragged_attention(
            q, k, v, problem.offsets, problem.lengths, grid_mapping, block_offsets, causal=problem.causal,
            scale=problem.scale, config=problem.config, window=problem.window, key_lengths=problem.key_lengths,
            lse=lse, dropout=problem.dropout,
        )  # fmt: skip
        if problem.written is not None and problem.written < T:
            out[problem.written :].zero_()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.problem = problem
        return out

    @staticmethod
    @once_differentiable  # (our kernels give first derivatives only: a second is an error, never silent)
    @torch.compiler.disable  # under a compiled step: eager, as the wrapped forward that ran it (models/hf.py)
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ragged_attention_backward(dout, q, k, v, out, lse, ctx.problem)
        return dq, dk, dv, None


def ragged_attention_train(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problem: AttentionProblem
) -> torch.Tensor:
    """`ragged_attention` under autograd: the forward kernel (storing lse), then this file's backward.
    q (T, H, Dh), k and v (T, Hkv, Dh) as the forward; returns out (T, H, Dh), zero on gap rows."""
    fwd.check_inputs(q, k, v)
    return _RaggedAttention.apply(q, k, v, problem)
