"""Fused residual add + RMSNorm over the feature dim, rounded where HF's Llama-family RMSNorm rounds.

The decoder layers of Llama, Mistral, Qwen2 and Qwen3 compute, in the model's dtype,

    s = residual + x                                   (`residual + hidden_states`: one rounding)
    y = weight * (s * rsqrt(mean(s^2) + eps)).to(dtype)  (statistics in fp32, the product rounded again)

HF runs that as seven kernels (a cast, pow, mean, rsqrt, product, cast, weight product) plus the add, each a
pass over the rows; this is one pass that reads x and the residual once and writes y (and the sum, which the
layer carries on as its residual). Each program normalises BLOCK_M rows (fp32 statistics). The rounding of the
sum before its statistics and of the normalised rows before the weight are HF's; what may differ is the order
of the fp32 sum of squares (an ulp now and then).

Shape contracts
    x, residual:   (T, N), stride 1 on N (residual may be None: y = RMSNorm(x))
    weight:        (N,) in x's dtype
    out:           (T, N); sum_out: (T, N) when store_sum (with a residual)

Training: `add_rms_norm_train` (an autograd.Function over the launcher and `add_rms_norm_backward`) computes
the gradients in fp32 and rounds each once; the forward's roundings pass gradients straight through, as
PyTorch's autograd passes them through HF's casts.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .config import KernelConfig, next_pow2
from .pdl import launch_kwargs, wait_prior
from .ragged_linear import persistent_programs
from .triton_compat import tl, triton

__all__ = [
    "add_rms_norm",
    "add_rms_norm_ref",
    "add_rms_norm_backward",
    "add_rms_norm_train",
    "AddRMSNormFunction",
    "default_config",
]


# M (rows) changes with every batch: not specialised (one compiled kernel for every row count)
@triton.jit(do_not_specialize=["M"])
def _add_rms_norm_kernel(
    X, R, Wt, Y, S, M, N, eps, stride_x, stride_r, stride_y, stride_s,
    HAS_RES: tl.constexpr, STORE_SUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_prior(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:  # the sum, rounded to the model's dtype as HF's `residual + hidden_states` is
        x += tl.load(R + rows64 * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = x.to(Y.dtype.element_ty).to(tl.float32)
        if STORE_SUM:
            tl.store(S + rows64 * stride_s + cols[None, :], x.to(S.dtype.element_ty), mask=mask)
    var = tl.sum(x * x, axis=1) / N
    y = x * tl.math.rsqrt((var + eps).to(tl.float32))[:, None]  # eps may arrive as fp64
    y = y.to(Y.dtype.element_ty).to(tl.float32)  # HF casts the normalised rows before the weight
    y = y * tl.load(Wt + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def default_config(n: int) -> KernelConfig:
    """About 4K elements per program with a warp per 512 of them (a 3584-wide row: one row, 8 warps)."""
    bn = next_pow2(n)
    block_m = max(1, min(16, 4096 // bn))
    return KernelConfig(block_m=block_m, num_warps=max(1, min(8, block_m * bn // 512)), num_stages=1)


def check_inputs(x, residual, weight) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be (T, N), got {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[1] or weight.dtype != x.dtype:
        raise ValueError(
            f"weight must be ({x.shape[1]},) of x's dtype {x.dtype}, got {tuple(weight.shape)} {weight.dtype}"
        )


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    store_sum: bool = False,
    config: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(RMSNorm(residual + x) * weight, residual + x if store_sum and a residual is given, else None)."""
    check_inputs(x, residual, weight)
    x = x if x.stride(1) == 1 else x.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    M, N = x.shape
    config = config or default_config(N)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    store = store_sum and residual is not None
    total = torch.empty_like(out) if store else None
    if M == 0 or N == 0:
        return out, total
    if next_pow2(N) > 65536:
        raise ValueError(f"feature dim {N} is too large for one tile; the limit is 65536")
    _add_rms_norm_kernel[(triton.cdiv(M, config.block_m),)](
        x, residual if residual is not None else x, weight, out, total if store else out, M, N, float(eps),
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), total.stride(0) if store else 0,
        HAS_RES=residual is not None, STORE_SUM=store, BLOCK_M=config.block_m, BLOCK_N=next_pow2(N),
        num_warps=config.num_warps, **launch_kwargs(x.device),
    )  # fmt: skip
    return out, total


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *, store_sum: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """HF's own computation (LlamaRMSNorm.forward after `residual + hidden_states`)."""
    total = x if residual is None else residual + x
    h = total.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(total.dtype)
    return out, (total if store_sum and residual is not None else None)


# -- training: the backward kernel, its launcher and the autograd.Function ------------------------------------------
# M (rows) changes with every batch: not specialised
@triton.jit(do_not_specialize=["M"])
def _add_rms_norm_bwd_kernel(
    X, R, Wt, DY, DS, DX, DR, DW, M, N, eps, stride_x, stride_r, stride_dy, stride_ds, stride_dx, stride_dr,
    HAS_RES: tl.constexpr, HAS_DS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Program p walks row blocks p, p + programs, ...: dx = dr = rstd * (w dy - xhat mean(w dy xhat)) (+ the sum
    output's gradient), and row p of DW gets the sum of dy xhat over its rows."""
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(Wt + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for block in range(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < M) & cmask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:  # the sum rounded as the forward rounds it: its statistics are the forward's
            x += tl.load(R + rows64 * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            x = x.to(DX.dtype.element_ty).to(tl.float32)
        rstd = tl.math.rsqrt((tl.sum(x * x, axis=1) / N + eps).to(tl.float32))
        # xhat unrounded: the forward's cast of it before the weight passes gradients straight through
        xhat = x * rstd[:, None]
        dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        wdy = dy * w
        ds = (wdy - xhat * (tl.sum(wdy * xhat, axis=1) / N)[:, None]) * rstd[:, None]
        if HAS_DS:  # the sum output's own gradient
            ds += tl.load(DS + rows64 * stride_ds + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows64 * stride_dx + cols[None, :], ds.to(DX.dtype.element_ty), mask=mask)
        if HAS_RES:
            tl.store(DR + rows64 * stride_dr + cols[None, :], ds.to(DR.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(DW + tl.program_id(0) * N + cols, tl.sum(dw, axis=0), mask=cmask)


def add_rms_norm_backward(
    dy: torch.Tensor | None,
    dsum: torch.Tensor | None,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Gradients (dx, dresidual, dweight) of `add_rms_norm` from dy (the gradient of out) and dsum (that of the
    sum output; None when it has none), each of its input's shape and dtype (dresidual None without a residual).

    rstd is recomputed, not saved: a whole row is one tile, so it is one in-register reduction over x and the
    residual, which the backward loads anyway; saving it would cost a forward variant and 4 bytes a row.
    """
    dy = torch.zeros_like(x) if dy is None else dy
    dy, x = (t if t.stride(1) == 1 else t.contiguous() for t in (dy, x))
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    if dsum is not None and dsum.stride(1) != 1:
        dsum = dsum.contiguous()
    M, N = x.shape
    config = default_config(N)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dr = None if residual is None else torch.empty_like(residual, memory_format=torch.contiguous_format)
    # two programs per SM (one row each of the partials): the partial sums are (programs, N), summed below
    programs = max(1, min(triton.cdiv(M, config.block_m), persistent_programs(x.device)))
    # every launched program writes its row of partials; with no rows there is no launch, and the sum is 0
    dw = (torch.empty if M else torch.zeros)((programs, N), dtype=torch.float32, device=x.device)
    if M and N:
        _add_rms_norm_bwd_kernel[(programs,)](
            x, residual if residual is not None else x, weight, dy, dsum if dsum is not None else dy, dx,
            dr if dr is not None else dx, dw, M, N, float(eps), x.stride(0),
            residual.stride(0) if residual is not None else 0, dy.stride(0), dsum.stride(0) if dsum is not None else 0,
            dx.stride(0), dr.stride(0) if dr is not None else 0,
            HAS_RES=residual is not None, HAS_DS=dsum is not None, BLOCK_M=config.block_m, BLOCK_N=next_pow2(N),
            num_warps=config.num_warps,
        )  # fmt: skip
    return dx, dr, dw.sum(0).to(weight.dtype)


class AddRMSNormFunction(torch.autograd.Function):
    """`add_rms_norm` with a backward: saves its inputs (no new memory) and recomputes rstd."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, store_sum):
        out, total = add_rms_norm(x, residual, weight, eps, store_sum=store_sum)
        ctx.save_for_backward(x, residual, weight)
        ctx.eps = eps
        ctx.set_materialize_grads(False)  # an unused sum output brings no gradient to read
        return out, total

    @staticmethod
    @once_differentiable  # (our kernels give first derivatives only: a second is an error, never silent)
    @torch.compiler.disable  # under a compiled step: eager, as the wrapped forward that ran it (models/hf.py)
    def backward(ctx, dy, dsum):
        x, residual, weight = ctx.saved_tensors
        dx, dr, dw = add_rms_norm_backward(dy, dsum, x, residual, weight, ctx.eps)
        return dx, dr, dw, None, None


def add_rms_norm_train(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, store_sum: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`add_rms_norm` differentiable in x, residual and weight; with store_sum (and a residual), the sum's
    gradient joins the normalisation's."""
    check_inputs(x, residual, weight)
    return AddRMSNormFunction.apply(x, residual, weight, eps, store_sum)
