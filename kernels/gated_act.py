"""The gated activation of a Llama-family MLP, silu(gate) * up, rounded where HF rounds.

HF's MLP computes `down_proj(act_fn(gate_proj(x)) * up_proj(x))`: the activation is one pass over the
(T, F) gate rows (F is 3-5x the model width) and the product another, each reading and writing (T, F)
tensors. This is one pass, written over the gate's storage (the gate is not needed after it). The activation
is rounded to the model's dtype before the product, as HF's two kernels round it; silu is PyTorch's own
formula, x / (1 + exp(-x)) in fp32, with a fast division (two fp32 ulps, well inside the rounding that follows).

Shape contracts
    gate, up:  (T, F), stride 1 on F, same dtype
    out:       gate, overwritten (or a new tensor with inplace=False)

Training: `silu_mul_train` (an autograd.Function over the launcher and `silu_mul_backward`) never overwrites the
gate: its backward reads it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .pdl import launch_kwargs, wait_prior
from .triton_compat import tl, triton

__all__ = ["silu_mul", "silu_mul_ref", "silu_mul_backward", "silu_mul_train", "SiluMulFunction"]

# BLOCK_M rows x BLOCK_F columns a program. Rows are masked per row and columns against N = F, which is specialised
# (a multiple of 16 in every model): the loads stay vectorised. A flat 1-D pass masked against an unspecialised
# element count loses that and runs at half the bandwidth.
BLOCK_M, BLOCK_F = 4, 1024


@triton.jit(do_not_specialize=["M"])
def _silu_mul_kernel(G, U, Y, M, N, stride_g, stride_u, stride_y, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
                     PDL: tl.constexpr):  # fmt: skip
    wait_prior(PDL)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)[None, :]
    mask = (rows < M) & (cols < N)
    g = tl.load(G + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    # fdiv: the fast (2-ulp fp32) division; IEEE division costs more than this pass's memory traffic
    a = tl.fdiv(g, 1.0 + tl.exp(-g)).to(Y.dtype.element_ty).to(tl.float32)
    y = a * tl.load(U + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + rows * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


def check_inputs(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dim() != 2:
        raise ValueError(
            f"gate and up must be (T, F) of one dtype, got {tuple(gate.shape)} {gate.dtype} and "
            f"{tuple(up.shape)} {up.dtype}"
        )


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, inplace: bool = True) -> torch.Tensor:
    """silu(gate) * up, written over gate when inplace and gate is contiguous (the module docstring)."""
    check_inputs(gate, up)
    up = up if up.stride(1) == 1 else up.contiguous()
    if gate.stride(1) != 1:
        gate, inplace = gate.contiguous(), True  # a fresh copy: ours to overwrite
    out = gate if inplace else torch.empty_like(gate, memory_format=torch.contiguous_format)
    M, F = gate.shape
    if M and F:
        grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(F, BLOCK_F))
        _silu_mul_kernel[grid](
            gate, up, out, M, F, gate.stride(0), up.stride(0), out.stride(0), BLOCK_M=BLOCK_M, BLOCK_F=BLOCK_F,
            num_warps=4, **launch_kwargs(gate.device),
        )  # fmt: skip
    return out


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF's own computation (`act_fn(gate) * up` with act_fn = SiLU)."""
    return F.silu(gate) * up


# -- training: the backward kernel, its launcher and the autograd.Function ------------------------------------------
@triton.jit(do_not_specialize=["M"])
def _silu_mul_bwd_kernel(
    DY, G, U, DG, DU, M, N, stride_dy, stride_g, stride_u, stride_dg, stride_du,
    BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    """dup = dy silu(g); dgate = dy up (sigmoid(g) + silu(g) (1 - sigmoid(g))), in fp32 from the unrounded silu
    (the forward's cast of it passes gradients straight through)."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)[None, :]
    mask = (rows < M) & (cols < N)
    dy = tl.load(DY + rows * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    # IEEE divisions: free here (4.0 TB/s with fast or IEEE ones, 8192 x 14336 bf16 on an H200), and silu as one
    # division, not g * sigmoid(g), is a rounding fewer in dup
    e = 1.0 + tl.exp(-g)
    silu = g / e
    sig = 1.0 / e
    tl.store(DU + rows * stride_du + cols, (dy * silu).to(DU.dtype.element_ty), mask=mask)
    dg = dy * u * (sig + silu * (1.0 - sig))
    tl.store(DG + rows * stride_dg + cols, dg.to(DG.dtype.element_ty), mask=mask)


def silu_mul_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients (dgate, dup) of `silu_mul` from dy (T, F), each (T, F) contiguous of gate's dtype."""
    dy, gate, up = (t if t.stride(1) == 1 else t.contiguous() for t in (dy, gate, up))
    dgate = torch.empty_like(gate, memory_format=torch.contiguous_format)
    dup = torch.empty_like(up, memory_format=torch.contiguous_format)
    M, F = gate.shape
    if M and F:
        grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(F, BLOCK_F))
        _silu_mul_bwd_kernel[grid](
            dy, gate, up, dgate, dup, M, F, dy.stride(0), gate.stride(0), up.stride(0), dgate.stride(0),
            dup.stride(0), BLOCK_M=BLOCK_M, BLOCK_F=BLOCK_F, num_warps=4,
        )  # fmt: skip
    return dgate, dup


class SiluMulFunction(torch.autograd.Function):
    """`silu_mul` with a backward: the forward writes a new tensor, since the backward reads the gate."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return silu_mul(gate, up, inplace=False)

    @staticmethod
    @once_differentiable  # (our kernels give first derivatives only: a second is an error, never silent)
    @torch.compiler.disable  # under a compiled step: eager, as the wrapped forward that ran it (models/hf.py)
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return silu_mul_backward(dy, gate, up)


def silu_mul_train(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, differentiable in gate and up; gate is left as it was."""
    check_inputs(gate, up)
    return SiluMulFunction.apply(gate, up)
