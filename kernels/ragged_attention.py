"""Ragged flash-attention forward: a 1-D grid over the real query blocks only (the CoRa prelude).

Each program owns one block of BLOCK_M query rows of one component and one query head, and streams that
component's keys in BLOCK_N tiles with an online softmax (fp32 statistics and accumulator, exp2 with
log2(e) folded into the scale). Key tiles that lie wholly inside the component (and, when causal,
wholly before the query block) run unmasked; only the last tile (and the causal diagonal) is masked.
A short component costs exactly ceil(length / BLOCK_M) programs per head: no empty programs.

Grouped-query attention: k and v may have Hkv heads with H % Hkv == 0; query head h reads kv head
h // (H // Hkv) (Llama/Qwen2/Mistral; Hkv = 1 is multi-query attention).

Sliding windows (flash-attention's `window_size`): query row i of a component attends to the keys j of
that component with i - left <= j <= i + right (and j <= i when causal); -1 leaves a side unbounded.
Key tiles wholly outside a block's window are never visited (a block of BLOCK_M rows visits about
(BLOCK_M + left + right) / BLOCK_N tiles); tiles wholly inside it for every row of the block run unmasked.
`window_from_hf` turns a transformers `config.sliding_window` into (left, right); see its docstring.
GQA and windows are constexpr features: with Hkv = H and no window, the plain and causal kernels' PTX
instructions equal those of a kernel without them, on sm_90a (benchmarks/diagnostics/attention_ptx.py); only
two unused int arguments are added (measured before the training features below). Query-only rows
(`key_lengths`) are a constexpr feature too: off, the kernel takes one more pointer and never reads it.

Training (kernels/ragged_attention_backward.py) adds two more constexpr features, off for inference: `STORE_LSE`
writes each real row's log2-sum-exp2 for the backward, `DROPOUT` drops probabilities with `keep_mask` (one Philox
stream per component and head, so the backward redraws the same mask). Off, they add a pointer and two scalars.

Shape contracts
    q:              (T, H, Dh) values of one layout; any strides on T and H, stride 1 on Dh
    k, v:           (T, Hkv, Dh), Hkv dividing H; same strides rule
    offsets:        (B + 1,), int32 — start of each component in values
    lengths:        (B,), int32 — real rows of each component (rows past it are never read)
    key_lengths:    optional (B,), int32 <= lengths — keys of each component: its first key_lengths rows
                    are keys and queries, the rest queries only (they see the keys, no key sees them).
                    A first-token pooler's column 0 of a left-padded row, a pad the original computes
                    and then pools (autoragged/graphs/capture.py, "mask"). Not causal, no window; at least
                    1 wherever lengths is (a query with no key has no softmax).
    grid_mapping:   (P,), int32 — component of query block p; P = sum ceil(lengths / BLOCK_M), or more
                    with entries -1 for spare programs (a grid sized for a CUDA graph's capacity)
    block_offsets:  (B + 1,), int32 — first query block of each component (prefix sum of blocks)
    out:            (T, H, Dh); real rows, and zeros on the gap rows of each component's last query
                    block (all gap rows when align <= BLOCK_M); rows outside every extent untouched
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.library import triton_op, wrap_triton

from . import ahead
from .config import KernelConfig, _identity, dot_upcast, next_pow2
from .pdl import launch_kwargs, wait_prior
from .triton_compat import tl, triton

__all__ = [
    "ragged_attention",
    "ragged_attention_ref",
    "CONFIGS",
    "DEFAULT_CONFIG",
    "HEAD_DIMS",
    "UNBOUNDED",
    "prune",
    "default_config",
    "supports",
    "check_window",
    "window_mask",
    "window_from_hf",
    "Dropout",
    "keep_mask",
]

HEAD_DIMS = (32, 64, 80, 96, 128, 256)
UNBOUNDED = -1  # a window side without a bound (flash-attention's -1)
_LOG2E = 1.4426950408889634
_FAR = 1 << 30  # an unbounded window side inside the kernel: farther than any component is long


class Dropout(NamedTuple):
    """Attention dropout of one launch: drop probability p, a multiple of 2^-16 in [0, 1) (the kernels draw 16-bit
    uniforms; `draw` rounds p down), and the Philox seed of its masks, a (1,) int64 tensor on the device that the
    kernels read (a CUDA graph's replay draws it anew, its backward reads it there)."""

    p: float
    seed: torch.Tensor

    @classmethod
    def draw(cls, p: float, device: torch.device | str) -> Dropout:
        """p rounded down to 2^-16 steps (0.1 drops 0.099991 of the probabilities), a new seed on `device`."""
        return cls(math.floor(p * _DROP_STEPS) / _DROP_STEPS, torch.randint(0, 2**31 - 1, (1,), device=device))


_DROP_STEPS = 1 << 16


@triton.jit
def keep_mask(seed, p, rows, col0, WIDTH: tl.constexpr):
    """Attention dropout's keep mask of a tile: row `rows` (local to the component) keeps key col0 + j (j < WIDTH)
    unless its 16-bit uniform falls below p. One Philox stream per (component, head) in `seed`; counter (row, key //
    8) gives 4 x 32 bits, the uniforms of 8 keys: a draw per probability cost a RACE B=32 BERT training step 25%.
    The forward and both backward kernels draw the same mask from any tiling whose WIDTH and col0 are multiples of 8."""
    tl.static_assert(WIDTH % 8 == 0)
    groups = (col0 // 8 + tl.arange(0, WIDTH // 8)).to(tl.int64)
    r0, r1, r2, r3 = tl.randint4x(seed, (rows.to(tl.int64)[:, None] << 32) | groups[None, :])
    lo = tl.join(tl.join(r0 & 0xFFFF, r1 & 0xFFFF), tl.join(r2 & 0xFFFF, r3 & 0xFFFF))
    hi = tl.join(tl.join(r0 >> 16, r1 >> 16), tl.join(r2 >> 16, r3 >> 16))
    u16 = tl.reshape(tl.join(lo, hi), (rows.shape[0], WIDTH))
    return u16 >= tl.cast(p * 65536.0, tl.uint32)


@triton.jit
def _attn_tile(
    acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, qk_scale,
    offs_m, offs_n, offs_d, d_mask, n_lo, n_hi, length, left, right, drop_seed, drop_p,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, DROPOUT: tl.constexpr,
):  # fmt: skip
    """Fold key tiles [n_lo, n_hi) into the running (acc, l_i, m_i). MASKED: mask keys >= length and, when
    WINDOW, keys outside [row - left, row + right] (else, when CAUSAL, keys after the query row). DROPOUT: the
    probabilities that reach acc are dropped (`keep_mask`); l_i sums them all."""
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
            if WINDOW:
                keep = keep & (cols[None, :] >= offs_m[:, None] - left) & (cols[None, :] <= offs_m[:, None] + right)
            elif CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_ref = m_new
        if MASKED:
            if WINDOW:
                # a row may have seen no key yet (its window starts in a later tile): subtract 0, not -inf - -inf
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols.to(tl.int64)[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
        if DROPOUT:
            p = tl.where(keep_mask(drop_seed, drop_p, offs_m, n0, BLOCK_N), p, 0.0)
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
    Q, K, V, Out, offsets, lengths, grid_mapping, block_offsets, key_lengths, Lse,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    qk_scale, left, right, DropSeed, drop_p,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    GQA_GROUP: tl.constexpr, WINDOW: tl.constexpr, KEYS: tl.constexpr, STORE_LSE: tl.constexpr,
    DROPOUT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_prior(PDL)
    pid = tl.program_id(0)
    head = tl.program_id(1)
    comp = tl.load(grid_mapping + pid)
    if comp >= 0:  # -1: a spare program of a grid sized for a CUDA graph's capacity, nothing to do
        block = pid - tl.load(block_offsets + comp)
        start = tl.load(offsets + comp).to(tl.int64)
        length = tl.load(lengths + comp)
        extent = tl.load(offsets + comp + 1) - tl.load(offsets + comp)
        if KEYS:  # the component's rows past its keys are queries only (neither causal nor windowed)
            keys = tl.load(key_lengths + comp)
        else:
            keys = length

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
        kv_head = head // GQA_GROUP  # GQA_GROUP 1 (no grouping) folds away
        if DROPOUT:
            seed = tl.load(DropSeed) + comp * tl.num_programs(1) + head
        else:
            seed = 0  # (unused)
        k_base = K + start * stride_kt + kv_head * stride_kh
        v_base = V + start * stride_vt + kv_head * stride_vh

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        if WINDOW:
            # (causal arrives as right = 0.) Rows r0..r1 are the block's real rows. Keys before n_lo or from
            # n_end on are outside every row's window: never visited. Tiles in [n_full_lo, n_full) are inside
            # every row's window and the component: unmasked. The edges on both sides are masked.
            r0 = block * BLOCK_M
            r1 = tl.minimum(r0 + BLOCK_M, length) - 1
            n_lo = tl.maximum(r0 - left, 0) // BLOCK_N * BLOCK_N
            n_end = tl.minimum(length, r1 + right + 1)
            n_full_lo = n_lo + tl.cdiv(tl.maximum(r1 - left - n_lo, 0), BLOCK_N) * BLOCK_N  # r1 - left < n_end
            n_full = tl.maximum(n_full_lo, tl.minimum(r0 + right + 1, length) // BLOCK_N * BLOCK_N)
            acc, l_i, m_i = _attn_tile(
                acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, qk_scale,
                offs_m, offs_n, offs_d, d_mask, n_lo, n_full_lo, length, left, right, seed, drop_p,
                True, CAUSAL, True, BLOCK_N, PRECISION, UPCAST, DROPOUT,
            )  # fmt: skip
        else:
            n_full_lo = 0
            if CAUSAL:
                # keys before this query block are visible to all of its rows; the diagonal needs the mask
                n_full = (block * BLOCK_M) // BLOCK_N * BLOCK_N
                n_end = tl.minimum(length, (block + 1) * BLOCK_M)
            else:
                n_full = keys // BLOCK_N * BLOCK_N
                n_end = keys
        acc, l_i, m_i = _attn_tile(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, qk_scale,
            offs_m, offs_n, offs_d, d_mask, n_full_lo, n_full, keys, left, right, seed, drop_p,
            False, CAUSAL, WINDOW, BLOCK_N, PRECISION, UPCAST, DROPOUT,
        )  # fmt: skip
        acc, l_i, m_i = _attn_tile(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, qk_scale,
            offs_m, offs_n, offs_d, d_mask, n_full, n_end, keys, left, right, seed, drop_p,
            True, CAUSAL, WINDOW, BLOCK_N, PRECISION, UPCAST, DROPOUT,
        )  # fmt: skip
        if WINDOW:  # rows past the length may have seen no key at all (l_i = 0); real rows see their own key
            l_i = tl.where(row_mask, l_i, 1.0)
        if DROPOUT:  # kept probabilities scaled by 1 / (1 - p)
            l_i = l_i * (1.0 - drop_p)
        out = tl.where(row_mask[:, None], acc / l_i[:, None], 0.0)
        if STORE_LSE:  # training: each real row's log2-sum-exp2 of its scaled scores, (T, H) fp32
            lse = m_i + tl.math.log2(l_i / (1.0 - drop_p) if DROPOUT else l_i)  # of all the probabilities
            tl.store(Lse + (start + offs_m) * tl.num_programs(1) + head, lse, mask=row_mask)
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
# Head dim 256 (Gemma), the largest tiles that compile without a spill on sm_90a (ptxas -v,
# benchmarks/diagnostics/attention_ptx.py; speed untimed): bf16 64 x 32 on 8 warps, 2 stages, 200 registers and
# 96 KB shared (4 warps spill); fp32 (tf32 dots) 32 x 64 on 8 warps, 1 stage, 205 registers and 104 KB.
_WIDE_CONFIG = KernelConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)
_WIDE_FP32_CONFIG = KernelConfig(block_m=32, block_n=64, num_warps=8, num_stages=1)
_SMEM_BUDGET = 160 * 1024  # bytes of Q tile + pipelined K/V tiles (Hopper: 227 KB per block); exact for 2 bytes
_ACC_REGISTERS = 128  # fp32 accumulator registers per thread, at most (at 128, ptxas reports small spills)


def _smem_bytes(config: KernelConfig, head_dim: int, element_size: int) -> int:
    bd = next_pow2(head_dim)
    return (config.block_m * bd + config.num_stages * 2 * config.block_n * bd) * element_size


def prune(
    config: KernelConfig,
    *,
    head_dim: int,
    max_len: int,
    causal: bool = False,
    element_size: int = 2,
    window: tuple[int, int] = (UNBOUNDED, UNBOUNDED),
) -> bool:
    """True if `config` is worth trying for this problem (the tuner's pruning predicate). GQA constrains
    no tile; a bounded window lifts the causal rule (its edges are masked on either side)."""
    bm, bn, bd = config.block_m, config.block_n, next_pow2(head_dim)
    if causal and _kernel_window(window, causal) is None and bm % bn:
        return False  # the unmasked prefix must end on a key-tile boundary
    if config.align > bm:
        return False  # the last query block must cover the component's alignment gap
    if bm > max(16, next_pow2(max_len)) or bn > max(16, next_pow2(max_len)):
        return False  # tiles longer than the longest component only add masked work
    if config.num_warps * 32 > bm * bn // 8 or (bm >= 128 and config.num_warps < 4):
        return False  # too many threads for the tile, or too few for a big one
    if bm * bd > _ACC_REGISTERS * 32 * config.num_warps:
        return False  # the accumulator would spill (bites at head dim 256 only: 128 x 128 at 4 warps is 128)
    return _smem_bytes(config, head_dim, element_size) <= _SMEM_BUDGET


def default_config(head_dim: int, max_len: int, element_size: int = 2) -> KernelConfig:
    """The untuned choice: 64x64 tiles, smaller query blocks for short components; head dim 256 takes the
    tiles above (`element_size` 4: the fp32 ones)."""
    if max_len <= 32:
        return KernelConfig(block_m=32, block_n=32, num_warps=4, num_stages=2)  # 256 fp32: a 96 B spill
    if head_dim > 128:
        return _WIDE_CONFIG if element_size <= 2 else _WIDE_FP32_CONFIG
    return DEFAULT_CONFIG


# -- support and validation ---------------------------------------------------------------------
def supports(
    head_dim: int,
    *,
    heads: int | None = None,
    kv_heads: int | None = None,
    window: tuple[int, int] = (UNBOUNDED, UNBOUNDED),
    softcap: float | None = None,
    dtype: torch.dtype | None = None,
) -> str | None:
    """None if this kernel can run the attention described, else the reason it cannot (for callers that
    choose between it and another path, e.g. a model adapter deciding whether a layer can go ragged).

    Supported: head dims HEAD_DIMS; fp16 / bf16 / fp32; kv heads dividing the query heads (GQA, MQA);
    sliding windows (left, right) with -1 unbounded; causal or not. Not supported: logit softcapping
    (Gemma-2), ALiBi, attention sinks, dropout, cross-attention (q and kv of different layouts)."""
    if head_dim not in HEAD_DIMS:
        return f"head dim {head_dim} is not supported; supported: {HEAD_DIMS}"
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {dtype} is not supported; supported: float16, bfloat16, float32"
    if heads is not None and kv_heads is not None and (kv_heads < 1 or heads % kv_heads):
        return f"{kv_heads} kv heads do not divide {heads} query heads"
    if softcap:
        return "attention logit softcapping (Gemma-2) is not supported"
    try:
        check_window(window)
    except (TypeError, ValueError) as error:
        return str(error)
    return None


def check_window(window: object) -> tuple[int, int]:
    """`window` as a (left, right) pair of Python ints >= -1; a clear error otherwise."""
    if not isinstance(window, (tuple, list)) or len(window) != 2 or any(isinstance(w, bool) for w in window):
        raise TypeError(f"window must be a (left, right) pair of ints, got {window!r}")
    try:
        left, right = (operator.index(w) for w in window)
    except TypeError:
        raise TypeError(f"window must be a (left, right) pair of ints, got {window!r}") from None
    if left < UNBOUNDED or right < UNBOUNDED:
        raise ValueError(f"window sides must be >= 0, or -1 for unbounded, got {window!r}")
    return left, right


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"q must be (T, H, Dh) and k, v one (T, Hkv, Dh) shape, got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    (T, H, Dh), (Tk, Hkv, Dk) = q.shape, k.shape
    if Tk != T or Dk != Dh:
        raise ValueError(
            f"k and v must have q's rows and head dim ({T}, Hkv, {Dh}), got {tuple(k.shape)} for q {tuple(q.shape)}"
        )
    if (Hkv == 0) != (H == 0) or (Hkv and H % Hkv):
        raise ValueError(f"k and v have {Hkv} heads, which must divide q's {H} heads (grouped-query attention)")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(
            f"q, k, v must share a dtype among float16/bfloat16/float32, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if Dh not in HEAD_DIMS:
        raise ValueError(f"head dim {Dh} is not supported; supported: {HEAD_DIMS}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1:
            raise ValueError(f"{name} must have a contiguous head dim (stride 1), got strides {t.stride()}")


def _kernel_window(window: tuple[int, int], causal: bool) -> tuple[int, int] | None:
    """The (left, right) the kernel masks with, unbounded sides as _FAR, or None when nothing is bounded
    (then the plain or causal kernel runs). Causal is a right bound of 0: j <= i."""
    left, right = check_window(window)
    if causal:
        right = 0
        if left == UNBOUNDED:
            return None
    elif left == right == UNBOUNDED:
        return None
    return (_FAR if left == UNBOUNDED else left), (_FAR if right == UNBOUNDED else right)


# -- launcher -----------------------------------------------------------------------------------
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
    window: tuple[int, int] = (UNBOUNDED, UNBOUNDED),
    key_lengths: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    dropout: Dropout | None = None,
) -> torch.Tensor:
    """Launch the kernel; `grid_mapping` / `block_offsets` must be the prelude for `config.block_m`.

    q (T, H, Dh), k and v (T, Hkv, Dh) with Hkv dividing H (grouped-query attention, inferred from k).
    `window` (left, right): row i of a component sees keys j with i - left <= j <= i + right, -1 unbounded;
    with `causal` also j <= i. `key_lengths` (B,) int32: each component's keys, its first rows (the rest
    are queries only; neither causal nor windowed). Returns `out` (T, H, Dh) (see the shape contract for
    gap rows). `lse` (T, H) fp32, when given, gets each real row's log2-sum-exp2 (what the backward needs).
    `dropout`: drop each probability with `dropout.p` (the rest scaled by 1 / (1 - p)), the mask `keep_mask`'s.
    `wrap` is `torch.library.wrap_triton` when the registered op calls this (torch.compile)."""
    check_inputs(q, k, v)
    T, H, Dh = q.shape
    if out is None:
        out = torch.empty((T, H, Dh), dtype=q.dtype, device=q.device)
    programs = grid_mapping.shape[0]
    kernel_window = _kernel_window(window, causal)
    if key_lengths is not None and (causal or kernel_window is not None):
        raise ValueError("key_lengths (query-only rows) needs attention that is neither causal nor windowed")
    if dropout is not None and not (0.0 <= dropout.p < 1.0 and (dropout.p * _DROP_STEPS).is_integer()):
        raise ValueError(f"attention dropout p must be a multiple of 2^-16 in [0, 1) (Dropout.draw), got {dropout.p!r}")
    if programs == 0 or H == 0:
        return out
    left, right = kernel_window or (0, 0)
    scale = 1.0 / math.sqrt(Dh) if scale is None else float(scale)
    precision = "ieee" if q.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32 else "tf32"
    args = (
        q, k, v, out, offsets, lengths, grid_mapping, block_offsets, lengths if key_lengths is None else key_lengths,
        out if lse is None else lse,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        scale * _LOG2E, left, right, lengths if dropout is None else dropout.seed, dropout.p if dropout else 0.0,
    )  # fmt: skip
    flags = dict(HEAD_DIM=Dh, BLOCK_D=next_pow2(Dh), CAUSAL=bool(causal), PRECISION=precision,
                 UPCAST=dot_upcast(str(q.dtype)[6:]), GQA_GROUP=H // k.shape[1], WINDOW=kernel_window is not None,
                 KEYS=key_lengths is not None, STORE_LSE=lse is not None, DROPOUT=dropout is not None,
                 **launch_kwargs(q.device, wrap))  # fmt: skip
    if wrap is None:
        compile_sibling_tiles(args, flags, config)
    (wrap or _identity)(_ragged_attn_fwd_kernel)[(programs, H)](
        *args, **flags, BLOCK_M=config.block_m, BLOCK_N=config.block_n, num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip
    return out


def sibling_tiles(config: KernelConfig, head_dim: int, element_size: int) -> list[KernelConfig]:
    """`default_config`'s tiles for the other longest-component ranges than `config`'s: what a later batch of
    other lengths may launch."""
    tiles = {default_config(head_dim, n, element_size) for n in (32, 33)}
    mine = (config.block_m, config.block_n, config.num_warps, config.num_stages)
    return [t for t in tiles if (t.block_m, t.block_n, t.num_warps, t.num_stages) != mine]


def compile_sibling_tiles(args: tuple, flags: dict, config: KernelConfig) -> None:
    """The first launch of a variant (flags, argument specialisation) outside a capture compiles its sibling
    tiles in the background (kernels/ahead.py): compiled inside a CUDA-graph capture, a short batch's 32 x 32
    tiles stall a stream of HF bert-base batches 0.3-0.7 s (CoLA B=128 on an H100, benchmarks/stream_table.py)."""
    q = args[0]
    # per launch: a tuple and a set lookup (the argument specialisation is the launch's own, taken by the warmups)
    if not ahead.first_sight(("attention", q.dtype, q.device, *flags.values()), q):
        return
    jobs = [
        functools.partial(
            _ragged_attn_fwd_kernel.warmup,
            *args,
            **flags,
            BLOCK_M=t.block_m,
            BLOCK_N=t.block_n,
            num_warps=t.num_warps,
            num_stages=t.num_stages,
            grid=(1, 1),
        )  # fmt: skip
        for t in sibling_tiles(config, flags["HEAD_DIM"], q.element_size())
    ]
    ahead.submit(q.device, jobs, "attention tiles")


# -- the window convention ----------------------------------------------------------------------
def window_mask(
    n: int, window: tuple[int, int] = (UNBOUNDED, UNBOUNDED), causal: bool = False, device=None
) -> torch.Tensor:
    """(n, n) bool, True where query row i may see key j: i - left <= j <= i + right (a -1 side is
    unbounded) and, when causal, j <= i. The rule the kernel, the reference and the tests share."""
    left, right = check_window(window)
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    keep = torch.ones(n, n, dtype=torch.bool, device=device)
    if left != UNBOUNDED:
        keep &= j >= i - left
    if right != UNBOUNDED:
        keep &= j <= i + right
    if causal:
        keep &= j <= i
    return keep


def window_from_hf(sliding_window: int | None, *, causal: bool) -> tuple[int, int]:
    """(left, right) for a transformers (5.x) model's `config.sliding_window` (None: no window).

    Causal (Mistral, Qwen2, Gemma's local layers): (W - 1, 0). transformers' padded path keeps key j for
    query i where `kv_idx > q_idx - sliding_window` and `kv_idx <= q_idx` (masking_utils.py,
    sliding_window_overlay and sliding_window_causal_mask_function, used by create_sliding_window_causal_mask):
    W keys including the query's own. Its flash path agrees: modeling_flash_attention_utils.py
    `_process_flash_attention_kwargs` passes window_size = (W - 1, W - 1) with causal=True.

    Bidirectional (ModernBERT's local layers): (W, W). masking_utils.py sliding_window_bidirectional_overlay
    keeps `abs(q_idx - kv_idx) <= sliding_window` (create_bidirectional_sliding_window_mask), where
    ModernBertConfig.sliding_window = local_attention // 2 (64 for local_attention = 128), so 2W + 1 keys.
    Its flash path agrees: modeling_modernbert.py passes sliding_window = config.sliding_window + 1, which
    `_process_flash_attention_kwargs` turns into window_size = (W, W).
    tests/test_attention_variants.py builds both masks with transformers and compares them with window_mask."""
    if sliding_window is None:
        return (UNBOUNDED, UNBOUNDED)
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 (or None), got {sliding_window}")
    return (sliding_window - 1, 0) if causal else (sliding_window, sliding_window)


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
    window: tuple[int, int] = (UNBOUNDED, UNBOUNDED),
    key_lengths: Sequence[int] | None = None,
    dropout: float = 0.0,
    keep: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """PyTorch reference with host offsets/lengths: softmax(q k^T * scale) v per component and head, keys
    limited by `window_mask(n, window, causal)`; k and v may have fewer heads (GQA, as the kernel).

    upcast=True computes in float32 (float64 stays float64) and returns the input dtype; upcast=False
    computes in the input dtype throughout (PyTorch's same-dtype error, the yardstick of the tests).
    Rows outside components are zero. `key_lengths`: each component's keys, its first rows (the rest are
    queries only), as the kernel's. `dropout` drops probabilities with PyTorch's own generator, or where `keep`
    (per component, (H, n, keys) bool: the kernel's `keep_mask`) is False; the rest scaled by 1 / (1 - p).
    """
    T, H, Dh = q.shape
    group = H // k.shape[1] if k.shape[1] else 1
    scale = 1.0 / math.sqrt(Dh) if scale is None else float(scale)
    compute = q.dtype
    if upcast and q.dtype in (torch.float16, torch.bfloat16):
        compute = torch.float32
    out = torch.zeros((T, H, Dh), dtype=q.dtype, device=q.device)
    if key_lengths is not None and (causal or _kernel_window(window, causal) is not None):
        raise ValueError("key_lengths (query-only rows) needs attention that is neither causal nor windowed")
    keys_of = [int(n) for n in (lengths if key_lengths is None else key_lengths)]
    for i, (start, n, nk) in enumerate(zip(offsets, lengths, keys_of)):
        start, n = int(start), int(n)
        if n == 0 or nk == 0:
            continue
        qi = q[start : start + n].transpose(0, 1).to(compute)  # (H, n, Dh)
        ki, vi = (t[start : start + nk].repeat_interleave(group, 1).transpose(0, 1).to(compute) for t in (k, v))
        scores = (qi @ ki.transpose(1, 2)) * scale
        visible = window_mask(n, window, causal, q.device)[:, :nk]
        if not visible.all():
            scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if dropout and keep is not None:
            probs = probs * keep[i].to(probs.device) / (1.0 - dropout)
        elif dropout:
            probs = torch.nn.functional.dropout(probs, dropout)
        out[start : start + n] = (probs @ vi).transpose(0, 1).to(q.dtype)
    return out


# -- the torch.library op: torch.compile traces the kernel itself through it (`autoragged.ops` calls it
# while compiling; eager calls take the launcher, a dispatcher hop costs microseconds on a launch-bound path)
@triton_op("autoragged::ragged_attention", mutates_args={})
def ragged_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    grid_mapping: torch.Tensor,
    block_offsets: torch.Tensor,
    causal: bool,
    scale: float,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    window_left: int = -1,
    window_right: int = -1,
) -> torch.Tensor:
    config = KernelConfig(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    return ragged_attention(
        q,
        k,
        v,
        offsets,
        lengths,
        grid_mapping,
        block_offsets,
        causal=causal,
        scale=scale,
        config=config,
        wrap=wrap_triton,
        window=(window_left, window_right),
    )


@ragged_attention_op.register_fake
def _(
    q, k, v, offsets, lengths, grid_mapping, block_offsets, causal, scale, block_m, block_n, num_warps, num_stages,
    window_left=-1, window_right=-1,
):  # fmt: skip
    return q.new_empty(q.shape)  # q's heads: GQA's k and v may have fewer
