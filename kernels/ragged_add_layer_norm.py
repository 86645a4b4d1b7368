"""Fused residual add + LayerNorm over the feature dim: y = LN(x + residual) * weight + bias.

An encoder layer calls it twice (post-norm: after attention and after the feed-forward). Each program
normalises BLOCK_M rows at once (fp32 statistics), so short feature dims still give each program
enough work. With `store_sum`, the sum x + residual is written too (pre-norm layers carry it on).

Shape contracts
    x, residual:   (T, N), stride 1 on N (residual may be None)
    weight, bias:  (N,) or None
    out:           (T, N); sum_out: (T, N) when store_sum
    live:          optional (1,) int32/int64 on the device: only rows < live[0] are needed; a fixed grid walks
                   their row blocks and leaves the rest unspecified (as kernels/ragged_linear.py)

Training: `add_layer_norm_train` (an autograd.Function over the launcher and `add_layer_norm_backward`) takes
no `live`; its gradients are each of their input's shape and dtype.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.library import triton_op, wrap_triton

from .config import KernelConfig, _identity, next_pow2
from .pdl import launch_kwargs, wait_prior
from .ragged_linear import check_live, persistent_programs
from .triton_compat import tl, triton

__all__ = [
    "add_layer_norm",
    "add_layer_norm_ref",
    "add_layer_norm_backward",
    "add_layer_norm_train",
    "AddLayerNormFunction",
    "CONFIGS",
    "default_config",
    "prune",
]


@triton.jit
def _add_layer_norm_rows(
    X, R, Wt, Bs, Y, S, M, N, eps,
    stride_x, stride_r, stride_y, stride_s,
    HAS_RES: tl.constexpr, STORE_SUM: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, block,
):  # fmt: skip
    """Row block `block`: BLOCK_M rows."""
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(R + rows64 * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if STORE_SUM:
        tl.store(S + rows64 * stride_s + cols[None, :], x.to(S.dtype.element_ty), mask=mask)
    mean = tl.sum(x, axis=1) / N
    centered = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(centered * centered, axis=1) / N
    y = centered * tl.math.rsqrt((var + eps).to(tl.float32))[:, None]  # eps may arrive as fp64 (torch.compile)
    if HAS_W:
        y = y * tl.load(Wt + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(Bs + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


# M (rows) changes with every batch: not specialised (one compiled kernel for every row count)
@triton.jit(do_not_specialize=["M"])
def _add_layer_norm_kernel(
    X, R, Wt, Bs, Y, S, Live, M, N, eps,
    stride_x, stride_r, stride_y, stride_s,
    HAS_RES: tl.constexpr, STORE_SUM: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    HAS_LIVE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_prior(PDL)
    if HAS_LIVE:  # only rows < *Live are needed: a fixed grid walks their blocks (kernels/ragged_linear.py)
        blocks = tl.cdiv(tl.minimum(tl.load(Live), M), BLOCK_M)
        for block in range(tl.program_id(0), blocks, tl.num_programs(0)):
            _add_layer_norm_rows(X, R, Wt, Bs, Y, S, M, N, eps, stride_x, stride_r, stride_y, stride_s,
                                 HAS_RES, STORE_SUM, HAS_W, HAS_B, BLOCK_M, BLOCK_N, block)  # fmt: skip
    else:
        _add_layer_norm_rows(X, R, Wt, Bs, Y, S, M, N, eps, stride_x, stride_r, stride_y, stride_s,
                             HAS_RES, STORE_SUM, HAS_W, HAS_B, BLOCK_M, BLOCK_N, tl.program_id(0))  # fmt: skip


# Keyed by (N, dtype) only: the op is row-local, so lengths do not matter. block_m = rows per
# program; num_warps spread one tile.
CONFIGS = [KernelConfig(block_m=bm, num_warps=w, num_stages=1) for bm in (1, 2, 4, 8, 16) for w in (1, 2, 4, 8)]


def prune(config: KernelConfig, *, n: int) -> bool:
    elements = config.block_m * next_pow2(n)
    return 256 <= elements <= 32 * 1024 and config.num_warps * 32 * 4 <= elements


@functools.lru_cache(maxsize=256)
def default_config(n: int) -> KernelConfig:
    """About 4K elements per program (8 rows of 512) with a warp per 1K elements (one object per width: a graph's
    capture launches 24 of bert-base's norms)."""
    bn = next_pow2(n)
    block_m = max(1, min(16, 4096 // bn))
    return KernelConfig(block_m=block_m, num_warps=max(1, min(8, block_m * bn // 1024)), num_stages=1)


def check_inputs(x, residual, weight, bias) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be (T, N), got {tuple(x.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and (p.dim() != 1 or p.shape[0] != x.shape[1]):
            raise ValueError(f"{name} must be (N,) = ({x.shape[1]},), got {tuple(p.shape)}")


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    store_sum: bool = False,
    config: KernelConfig | None = None,
    wrap=None,
    live: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(LN(x + residual), x + residual if store_sum else None), both (T, N) in x's dtype; with `live`,
    only rows < live[0] (the module docstring)."""
    check_inputs(x, residual, weight, bias)
    check_live(live, x)
    x = x if x.stride(1) == 1 else x.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    M, N = x.shape
    config = config or default_config(N)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    total = torch.empty_like(out) if store_sum else None
    if M == 0 or N == 0:
        return out, total
    if next_pow2(N) > 65536:
        raise ValueError(f"feature dim {N} is too large for one tile; the limit is 65536")
    dummy = out
    grid = triton.cdiv(M, config.block_m)
    if live is not None:  # a few waves of programs per SM walk the live blocks
        grid = min(grid, 4 * persistent_programs(x.device))
    (wrap or _identity)(_add_layer_norm_kernel)[(grid,)](
        x, residual if residual is not None else dummy, weight if weight is not None else dummy,
        bias if bias is not None else dummy, out, total if total is not None else dummy,
        live if live is not None else dummy, M, N, float(eps),
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        total.stride(0) if total is not None else 0,
        HAS_RES=residual is not None, STORE_SUM=store_sum, HAS_W=weight is not None, HAS_B=bias is not None,
        HAS_LIVE=live is not None, BLOCK_M=config.block_m, BLOCK_N=next_pow2(N), num_warps=config.num_warps,
        **launch_kwargs(x.device, wrap),
    )  # fmt: skip
    return out, total


def add_layer_norm_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    store_sum: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """PyTorch's own computation: the sum in x's dtype, then F.layer_norm."""
    total = x if residual is None else x + residual
    out = F.layer_norm(total, (x.shape[1],), weight, bias, eps)
    return out, (total if store_sum else None)


# -- the torch.library op: torch.compile traces the kernel itself through it (`autoragged.ops` calls it
# while compiling; eager calls take the launcher, a dispatcher hop costs microseconds on a launch-bound path)
@triton_op("autoragged::add_layer_norm", mutates_args={})
def add_layer_norm_op(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    store_sum: bool,
    block_m: int,
    num_warps: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    config = KernelConfig(block_m=block_m, num_warps=num_warps, num_stages=1)
    out, total = add_layer_norm(x, residual, weight, bias, eps, store_sum=store_sum, config=config, wrap=wrap_triton)
    return out, (total if total is not None else x.new_empty(0))


@add_layer_norm_op.register_fake
def _(x, residual, weight, bias, eps, store_sum, block_m, num_warps):
    return x.new_empty(x.shape), x.new_empty(x.shape if store_sum else (0,))


# -- training: the backward kernel, its launcher and the autograd.Function ------------------------------------------
# M (rows) changes with every batch: not specialised
@triton.jit(do_not_specialize=["M"])
def _add_layer_norm_bwd_kernel(
    X, R, Wt, DY, DS, DX, DR, DW, DB, M, N, eps,
    stride_x, stride_r, stride_dy, stride_ds, stride_dx, stride_dr,
    HAS_RES: tl.constexpr, HAS_DS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Program p walks row blocks p, p + programs, ...: dx = dr = rstd * (w dy - mean(w dy) - xhat mean(w dy xhat))
    (+ the sum output's gradient), and row p of DW and DB gets the sums of dy xhat and dy over its rows."""
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HAS_W:
        w = tl.load(Wt + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    db = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for block in range(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < M) & cmask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        # the statistics exactly as the forward computes them (fp32 sum, two-pass variance)
        x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            x += tl.load(R + rows64 * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / N
        centered = tl.where(mask, x - mean[:, None], 0.0)
        rstd = tl.math.rsqrt((tl.sum(centered * centered, axis=1) / N + eps).to(tl.float32))
        xhat = centered * rstd[:, None]
        dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        wdy = dy * w if HAS_W else dy
        c_xhat = tl.sum(wdy * xhat, axis=1) / N
        c_mean = tl.sum(wdy, axis=1) / N
        ds = (wdy - xhat * c_xhat[:, None] - c_mean[:, None]) * rstd[:, None]
        if HAS_DS:  # the sum output's own gradient
            ds += tl.load(DS + rows64 * stride_ds + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows64 * stride_dx + cols[None, :], ds.to(DX.dtype.element_ty), mask=mask)
        if HAS_RES:
            tl.store(DR + rows64 * stride_dr + cols[None, :], ds.to(DR.dtype.element_ty), mask=mask)
        if HAS_W:
            dw += dy * xhat
        if HAS_B:
            db += dy
    if HAS_W:
        tl.store(DW + tl.program_id(0) * N + cols, tl.sum(dw, axis=0), mask=cmask)
    if HAS_B:
        tl.store(DB + tl.program_id(0) * N + cols, tl.sum(db, axis=0), mask=cmask)


def add_layer_norm_backward(
    dy: torch.Tensor | None,
    dsum: torch.Tensor | None,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients (dx, dresidual, dweight, dbias) of `add_layer_norm` from dy (the gradient of out) and dsum (that
    of the sum output; None when it has none), each of its input's shape and dtype, None for a None input.

    Mean and rstd are recomputed, not saved: a whole row is one tile, so they are two in-register reductions over
    x and residual, which the backward loads anyway; saving them would cost a forward variant and 8 bytes a row.
    """
    dy = torch.zeros_like(x) if dy is None else dy
    dy, x = (t if t.stride(1) == 1 else t.contiguous() for t in (dy, x))
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    if dsum is not None and dsum.stride(1) != 1:
        dsum = dsum.contiguous()
    M, N = x.shape
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dr = None if residual is None else torch.empty_like(residual, memory_format=torch.contiguous_format)
    # two programs per SM (one row each of the partials): the partial sums are (programs, N), summed below
    programs = max(1, min(triton.cdiv(M, default_config(N).block_m), persistent_programs(x.device)))
    dw = None if weight is None else torch.zeros((programs, N), dtype=torch.float32, device=x.device)
    db = None if bias is None else torch.zeros((programs, N), dtype=torch.float32, device=x.device)
    if M and N:
        config = default_config(N)
        _add_layer_norm_bwd_kernel[(programs,)](
            x, residual if residual is not None else x, weight if weight is not None else x, dy,
            dsum if dsum is not None else dy, dx, dr if dr is not None else dx,
            dw if dw is not None else dx, db if db is not None else dx, M, N, float(eps),
            x.stride(0), residual.stride(0) if residual is not None else 0, dy.stride(0),
            dsum.stride(0) if dsum is not None else 0, dx.stride(0), dr.stride(0) if dr is not None else 0,
            HAS_RES=residual is not None, HAS_DS=dsum is not None, HAS_W=weight is not None, HAS_B=bias is not None,
            BLOCK_M=config.block_m, BLOCK_N=next_pow2(N), num_warps=config.num_warps,
        )  # fmt: skip
    dw = None if dw is None else dw.sum(0).to(weight.dtype)
    db = None if db is None else db.sum(0).to(bias.dtype)
    return dx, dr, dw, db


class AddLayerNormFunction(torch.autograd.Function):
    """`add_layer_norm` with a backward: saves its inputs (no new memory) and recomputes the statistics."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, store_sum, config):
        out, total = add_layer_norm(x, residual, weight, bias, eps, store_sum=store_sum, config=config)
        ctx.save_for_backward(x, residual, weight, bias)
        ctx.eps = eps
        ctx.set_materialize_grads(False)  # an unused sum output brings no gradient to read
        return out, total

    @staticmethod
    @once_differentiable  # (our kernels give first derivatives only: a second is an error, never silent)
    @torch.compiler.disable  # under a compiled step: eager, as the wrapped forward that ran it (models/hf.py)
    def backward(ctx, dy, dsum):
        x, residual, weight, bias = ctx.saved_tensors
        dx, dr, dw, db = add_layer_norm_backward(dy, dsum, x, residual, weight, bias, ctx.eps)
        return dx, dr, dw, db, None, None, None


def add_layer_norm_train(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    store_sum: bool = False,
    *,
    config: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`add_layer_norm` (every row; `config` is the forward's) differentiable in x, residual, weight and bias;
    with store_sum, the sum's gradient joins the normalisation's."""
    check_inputs(x, residual, weight, bias)
    return AddLayerNormFunction.apply(x, residual, weight, bias, eps, store_sum, config)
