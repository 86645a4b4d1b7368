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

Training: `rotary_train` (an autograd.Function) differentiates in x with the forward kernel run backwards
(`rotary_backward`); cos and sin are constants.
"""

from __future__ import annotations

import torch

from ._config import next_pow2
from ._triton import tl, triton

__all__ = ["rotary", "rotary_ref", "rotary_backward", "rotary_train", "RotaryFunction"]


@triton.jit(do_not_specialize=["M"])
def _rotary_kernel(
    X, C, S, Y, M, H, stride_xr, stride_xh, stride_c, stride_s, stride_yr, stride_yh,
    HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    TRANSPOSE: tl.constexpr,
):  # fmt: skip
    dty = Y.dtype.element_ty
    d = tl.arange(0, BLOCK_D)
    h = tl.arange(0, BLOCK_H)
    dmask = d < HALF
    mask = (h[:, None] < H) & dmask[None, :]
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
            xp = X + r64 * stride_xr + h[:, None] * stride_xh + d[None, :]
            x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(xp + HALF, mask=mask, other=0.0).to(tl.float32)
            # HF: (x * cos) + (cat(-x2, x1) * sin), each product and the sum rounded to the model's dtype
            y1 = (x1 * c1).to(dty).to(tl.float32) + (-x2 * s1).to(dty).to(tl.float32)
            y2 = (x2 * c2).to(dty).to(tl.float32) + (x1 * s2).to(dty).to(tl.float32)
            yp = Y + r64 * stride_yr + h[:, None] * stride_yh + d[None, :]
            tl.store(yp, y1.to(dty), mask=mask)
            tl.store(yp + HALF, y2.to(dty), mask=mask)


def check_inputs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() != 3 or x.shape[-1] % 2:
        raise ValueError(f"x must be (T, H, D) with D even, got {tuple(x.shape)}")
    want = (x.shape[0], x.shape[2])
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want or t.dtype != x.dtype:
            raise ValueError(f"{name} must be {want} of x's dtype {x.dtype}, got {tuple(t.shape)} {t.dtype}")


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated by each row's (cos, sin) -> (T, H, D) contiguous (the module docstring)."""
    return _rotary(x, cos, sin, transpose=False)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, transpose: bool) -> torch.Tensor:
    check_inputs(x, cos, sin)
    x = x if x.stride(2) == 1 else x.contiguous()
    cos = cos if cos.stride(1) == 1 else cos.contiguous()
    sin = sin if sin.stride(1) == 1 else sin.contiguous()
    M, H, D = x.shape
    out = torch.empty((M, H, D), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_h, block_d = next_pow2(H), next_pow2(D // 2)
    if block_h * block_d > 16384:
        raise ValueError(f"{H} heads of dim {D} are too many for one tile; the limit is 16384 (heads x D/2)")
    block_r = 4 if block_h * block_d <= 4096 else 1
    _rotary_kernel[(triton.cdiv(M, block_r),)](
        x, cos, sin, out, M, H, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), out.stride(0), out.stride(1),
        HALF=D // 2, BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_D=block_d,
        TRANSPOSE=transpose, num_warps=4 if block_h * block_d >= 1024 else 1, enable_fp_fusion=False,
    )  # fmt: skip
    return out


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
    return _rotary(dy, cos, sin, transpose=True)


class RotaryFunction(torch.autograd.Function):
    """`rotary` with a backward in x; cos and sin are constants (position tables)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rotary(x, cos, sin)

    @staticmethod
    @torch.compiler.disable  # under a compiled step: eager, as the wrapped forward that ran it (models/hf.py)
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return rotary_backward(dy, cos, sin), None, None


def rotary_train(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rotary` differentiable in x. cos and sin get no gradient: one that requires it is an error."""
    check_inputs(x, cos, sin)
    if cos.requires_grad or sin.requires_grad:
        raise ValueError(
            "rotary_train: cos and sin require grad, but the rotary kernels give them none (they are position "
            "tables); pass cos.detach() and sin.detach(), or use rotary_ref to learn them"
        )
    return RotaryFunction.apply(x, cos, sin)
