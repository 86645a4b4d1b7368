"""Rotary position embedding on packed rows, rounded where HF's `apply_rotary_pos_emb` rounds.

HF computes `x * cos + rotate_half(x) * sin` in the model's dtype, with rotate_half(x) = cat(-x2, x1) for the
two halves of the head dim: five kernels and a concatenation over the queries (and again over the keys). This
is one pass: each program rotates every head of BLOCK_R rows, reading each row's cos and sin once. Each
product and the sum are rounded to the model's dtype as HF's separate kernels round them, and the kernel is
compiled without FMA contraction (which would fuse a product into the sum, skipping its rounding: an ulp off
HF on a quarter of the elements on the H100), so the result is HF's to the bit.

Shape contracts
    x:         (T, H, D), stride 1 on D (a view of a projection's (T, H * D) output is fine)
    cos, sin:  (T, D), stride 1 on D: row t's cos and sin (HF's `position_embeddings`, gathered per packed row)
    out:       (T, H, D) contiguous

A layer's queries and keys go through one launch (`rotary_pair`): the host pays one launch, not two.

Training: `rotary_train` and `rotary_pair_train` (an autograd.Function) differentiate in x with the forward
kernel run backwards (`rotary_backward`); cos and sin are constants.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .config import next_pow2
from .pdl import launch_kwargs, wait_prior
from .triton_compat import tl, triton

__all__ = [
    "rotary",
    "rotary_pair",
    "rotary_ref",
    "rotary_backward",
    "rotary_train",
    "rotary_pair_train",
    "RotaryFunction",
]


@triton.jit
def _rotate(X, Y, r64, stride_xr, stride_xh, stride_yr, stride_yh, H, h, d, dmask, c1, c2, s1, s2,
            HALF: tl.constexpr):  # fmt: skip
    dty = Y.dtype.element_ty
    mask = (h[:, None] < H) & dmask[None, :]
    xp = X + r64 * stride_xr + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xp + HALF, mask=mask, other=0.0).to(tl.float32)
    # HF: (x * cos) + (cat(-x2, x1) * sin), each product and the sum rounded to the model's dtype
    y1 = (x1 * c1).to(dty).to(tl.float32) + (-x2 * s1).to(dty).to(tl.float32)
    y2 = (x2 * c2).to(dty).to(tl.float32) + (x1 * s2).to(dty).to(tl.float32)
    yp = Y + r64 * stride_yr + h[:, None] * stride_yh + d[None, :]
    tl.store(yp, y1.to(dty), mask=mask)
    tl.store(yp + HALF, y2.to(dty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _rotary_kernel(
    X, C, S, Y, M, H, stride_xr, stride_xh, stride_c, stride_s, stride_yr, stride_yh,
    X2, Y2, H2, stride_x2r, stride_x2h, stride_y2r, stride_y2h,
    HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_H2: tl.constexpr,
    BLOCK_D: tl.constexpr, TRANSPOSE: tl.constexpr, TWO: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Rotates X's H heads (and, with TWO, X2's H2 heads: a layer's queries and keys in one launch, each row's
    cos and sin read once) for BLOCK_R rows."""
    wait_prior(PDL)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    for i in range(BLOCK_R):
        row = tl.program_id(0) * BLOCK_R + i
        if row < M:
            r64 = row.to(tl.int64)
            c1 = tl.load(C + r64 * stride_c + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
            c2 = tl.load(C + r64 * stride_c + HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
            s1 = tl.load(S + r64 * stride_s + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
            s2 = tl.load(S + r64 * stride_s + HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
            if TRANSPOSE:  # the backward (rotary_backward): sin's halves swapped and negated, both exact
                s1, s2 = -s2, -s1
            _rotate(X, Y, r64, stride_xr, stride_xh, stride_yr, stride_yh, H, tl.arange(0, BLOCK_H), d, dmask,
                    c1, c2, s1, s2, HALF)  # fmt: skip
            if TWO:
                _rotate(X2, Y2, r64, stride_x2r, stride_x2h, stride_y2r, stride_y2h, H2, tl.arange(0, BLOCK_H2), d,
                        dmask, c1, c2, s1, s2, HALF)  # fmt: skip


def check_inputs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() != 3 or x.shape[-1] % 2:
        raise ValueError(f"x must be (T, H, D) with D even, got {tuple(x.shape)}")
    want = (x.shape[0], x.shape[2])
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want or t.dtype != x.dtype:
            raise ValueError(f"{name} must be {want} of x's dtype {x.dtype}, got {tuple(t.shape)} {t.dtype}")


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated by each row's (cos, sin) -> (T, H, D) contiguous (the module docstring)."""
    return _rotary((x,), cos, sin, transpose=False)[0]


def rotary_pair(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotary(q, cos, sin), rotary(k, cos, sin)) in one launch: a layer's queries and keys (any head counts,
    one head dim)."""
    return _rotary((q, k), cos, sin, transpose=False)


def _rotary(xs: tuple, cos: torch.Tensor, sin: torch.Tensor, *, transpose: bool) -> tuple:
    """Each of the one or two tensors of `xs` rotated (transposed: the backward) in one launch."""
    for x in xs:
        check_inputs(x, cos, sin)
    xs = tuple(x if x.stride(2) == 1 else x.contiguous() for x in xs)
    cos = cos if cos.stride(1) == 1 else cos.contiguous()
    sin = sin if sin.stride(1) == 1 else sin.contiguous()
    outs = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in xs)
    M, _, D = xs[0].shape
    if M == 0 or D == 0:
        return outs
    block_hs = [next_pow2(x.shape[1]) for x in xs]
    block_d = next_pow2(D // 2)
    if max(block_hs) * block_d > 16384:
        raise ValueError(f"{max(x.shape[1] for x in xs)} heads of dim {D} are too many for one tile; the limit is "
                         "16384 (heads x D/2)")  # fmt: skip
    tile = max(block_hs) * block_d
    block_r = 4 if tile <= 4096 else 1
    x, y = xs[0], outs[0]
    x2, y2 = (xs[1], outs[1]) if len(xs) == 2 else (x, y)
    _rotary_kernel[(triton.cdiv(M, block_r),)](
        x, cos, sin, y, M, x.shape[1], x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), y.stride(0), y.stride(1),
        x2, y2, x2.shape[1], x2.stride(0), x2.stride(1), y2.stride(0), y2.stride(1),
        HALF=D // 2, BLOCK_R=block_r, BLOCK_H=block_hs[0], BLOCK_H2=block_hs[-1], BLOCK_D=block_d,
        TRANSPOSE=transpose, TWO=len(xs) == 2, num_warps=4 if tile >= 1024 else 1, enable_fp_fusion=False,
        **launch_kwargs(x.device),
    )  # fmt: skip
    return outs


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's own computation (`apply_rotary_pos_emb` with unsqueeze over the heads)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos[:, None]) + (rotated * sin[:, None])


# -- training: the backward launcher and the autograd.Function ------------------------------------------------------
def rotary_backward(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Gradient of `rotary` with respect to x: dy (T, H, D) rotated back -> (T, H, D) contiguous.

    The row-wise rotation [[c1, -s1], [s2, c2]] (halves of the head dim) has the transpose [[c1, s2], [-s1, c2]],
    which is the forward kernel with sin' = -(s2, s1): halves swapped and negated, both exact, and each product
    and sum rounded where PyTorch's autograd rounds rotary_ref's backward (the same bits). Plain -sin would be
    right only where the halves are equal (HF's cat(freqs, freqs)). The kernel swaps and negates as it loads
    (TRANSPOSE), not from a -sin.roll() copy: 0.081 ms against the copy's 0.095 at 16384 x 32 x 128 bf16 on an
    H200 (the forward: 0.078).
    """
    return _rotary((dy,), cos, sin, transpose=True)[0]


class RotaryFunction(torch.autograd.Function):
    """`rotary` of one or two tensors (`rotary_pair`) with a backward in each; cos and sin are constants
    (position tables)."""

    @staticmethod
    def forward(ctx, cos, sin, *xs):
        ctx.save_for_backward(cos, sin)
        return _rotary(xs, cos, sin, transpose=False)

    @staticmethod
    @once_differentiable  # (our kernels give first derivatives only: a second is an error, never silent)
    @torch.compiler.disable  # under a compiled step: eager, as the wrapped forward that ran it (models/hf.py)
    def backward(ctx, *dys):
        cos, sin = ctx.saved_tensors
        return None, None, *_rotary(dys, cos, sin, transpose=True)


def _constant_tables(cos: torch.Tensor, sin: torch.Tensor) -> None:
    if cos.requires_grad or sin.requires_grad:
        raise ValueError(
            "rotary_train: cos and sin require grad, but the rotary kernels give them none (they are position "
            "tables); pass cos.detach() and sin.detach(), or use rotary_ref to learn them"
        )


def rotary_train(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rotary` differentiable in x. cos and sin get no gradient: one that requires it is an error."""
    check_inputs(x, cos, sin)
    _constant_tables(cos, sin)
    return RotaryFunction.apply(cos, sin, x)[0]


def rotary_pair_train(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_pair` differentiable in q and k (one autograd node, one launch each way)."""
    check_inputs(q, cos, sin)
    check_inputs(k, cos, sin)
    _constant_tables(cos, sin)
    return RotaryFunction.apply(cos, sin, q, k)
