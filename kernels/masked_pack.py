"""Padded <-> ragged copies driven by a key padding mask on the device: any padding pattern, no host lengths.

A mask-only batch whose lengths are never read runs a ragged graph (autoragged/runtime/graphs.py, io="mask")
that packs the batch's real tokens back to back: row b's real tokens (mask False), in order, go to
values rows offsets[b], offsets[b] + 1, ..., where the graph's layout kernel counted the offsets from the
same mask (kernels/graph_layout.py). Ranks come from prefix sums of the mask inside each program, so
left padding, holes and all-pad rows are all fine.

Everything the kernels touch on the padded side comes through the per-batch args (int64, on the device;
kernels/ragged_pack.py's ARG_* layout, plus ARG_MASK / ARG_MASK_SB / ARG_MASK_SL: the (B, L) bool mask,
True = pad, and its strides), so a CUDA graph replays them on tensors it was not captured with.

Shape contracts
    args:     (MASK_ARGS,) int64: ARG_SRC, ARG_DST (B, L, D) of the values' dtype, stride 1 on D;
              ARG_B <= the grid's batch, ARG_L <= width
    offsets:  (>= batch,) int32 on the device: where each row's tokens start in values
    values:   (batch * width, D), stride 1 on D: room for any mask of the grid's shape
    pack:     values[offsets[b] + r] = x[b, t] for the r-th real t of row b; other rows untouched
    unpack:   out[b, t] = values[offsets[b] + r] for the r-th real t, 0 at pads; out[b, L:] untouched
"""

from __future__ import annotations

import torch

from ._config import next_pow2
from ._triton import tl, triton

__all__ = ["pack_masked", "unpack_masked", "pack_masked_ref", "unpack_masked_ref", "ARG_MASK", "MASK_ARGS"]

ARG_MASK, ARG_MASK_SB, ARG_MASK_SL = 8, 9, 10
MASK_ARGS = 11
BLOCK_T = 32
_MAX_BLOCK_D = 256


@triton.jit
def _real_before(mask_row, stride_ml, t0, BLOCK_T: tl.constexpr):
    """Real tokens (mask 0) of a mask row in positions [0, t0)."""
    count = 0
    for s in range(0, t0, BLOCK_T):
        t = s + tl.arange(0, BLOCK_T)
        pad = tl.load(mask_row + t * stride_ml, mask=t < t0, other=1)
        count += tl.sum((pad == 0).to(tl.int32), 0)
    return count


@triton.jit
def _masked_kernel(
    args_ptr,
    values_ptr,
    offsets_ptr,
    D,
    stride_vt,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UNPACK: tl.constexpr,
):
    b = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK_T
    n_rows = tl.load(args_ptr + 6)  # ARG_B
    L = tl.load(args_ptr + 7).to(tl.int32)  # ARG_L
    if (b < n_rows) & (t0 < L):
        mask_row = tl.load(args_ptr + 8).to(tl.pointer_type(tl.int8)) + b.to(tl.int64) * tl.load(args_ptr + 9)
        stride_ml = tl.load(args_ptr + 10)
        t = t0 + tl.arange(0, BLOCK_T)
        inside = t < L
        pad = tl.load(mask_row + t * stride_ml, mask=inside, other=1)
        real = (pad == 0) & inside
        rank = _real_before(mask_row, stride_ml, t0, BLOCK_T) + tl.cumsum(real.to(tl.int32), 0) - 1
        start = tl.load(offsets_ptr + b).to(tl.int64)
        value_rows = values_ptr + (start + rank)[:, None] * stride_vt
        if UNPACK:
            padded = tl.load(args_ptr + 1).to(tl.pointer_type(values_ptr.dtype.element_ty))  # ARG_DST
            row = padded + b.to(tl.int64) * tl.load(args_ptr + 4) + t.to(tl.int64)[:, None] * tl.load(args_ptr + 5)
        else:
            padded = tl.load(args_ptr).to(tl.pointer_type(values_ptr.dtype.element_ty))  # ARG_SRC
            row = padded + b.to(tl.int64) * tl.load(args_ptr + 2) + t.to(tl.int64)[:, None] * tl.load(args_ptr + 3)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)[None, :]
            if UNPACK:
                v = tl.load(value_rows + cols, mask=real[:, None] & (cols < D), other=0.0)
                tl.store(row + cols, v, mask=inside[:, None] & (cols < D))
            else:
                v = tl.load(row + cols, mask=real[:, None] & (cols < D), other=0.0)
                tl.store(value_rows + cols, v, mask=real[:, None] & (cols < D))


def _launch(args: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, batch: int, width: int, unpack: bool):
    if args.numel() < MASK_ARGS or args.dtype != torch.int64:
        raise ValueError(f"args must be int64 of at least {MASK_ARGS} elements")
    if values.shape[0] < batch * width or values.stride(1) != 1:
        raise ValueError(f"values {tuple(values.shape)} cannot hold {batch} rows of up to {width} tokens")
    if offsets.numel() < batch or offsets.dtype != torch.int32 or offsets.device != values.device:
        raise ValueError(f"offsets must be int32 of at least {batch} elements on {values.device}")
    D = values.shape[1]
    if batch == 0 or width == 0 or D == 0:
        return
    _masked_kernel[(batch, triton.cdiv(width, BLOCK_T))](
        args, values, offsets, D, values.stride(0),
        BLOCK_T=BLOCK_T, BLOCK_D=min(next_pow2(D), _MAX_BLOCK_D), UNPACK=unpack, num_warps=4,
    )  # fmt: skip


def pack_masked(args: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, batch: int, width: int):
    """Gather the real tokens of the padded input `args` points at into `values` (module docstring); the
    grid covers `batch` rows of up to `width` tokens."""
    _launch(args, values, offsets, batch, width, unpack=False)
    return values


def unpack_masked(args: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, batch: int, width: int) -> None:
    """Scatter `values` into the padded output `args` points at, zeros at pads (module docstring)."""
    _launch(args, values, offsets, batch, width, unpack=True)


def pack_masked_ref(x: torch.Tensor, mask: torch.Tensor, values: torch.Tensor, offsets) -> torch.Tensor:
    """PyTorch reference of `pack_masked`: x (B, L, D), mask (B, L) True = pad; writes into `values`."""
    for b in range(x.shape[0]):
        real = (~mask[b]).nonzero().flatten()
        start = int(offsets[b])
        values[start : start + real.numel()] = x[b, real]
    return values


def unpack_masked_ref(values: torch.Tensor, mask: torch.Tensor, out: torch.Tensor, offsets) -> torch.Tensor:
    """PyTorch reference of `unpack_masked` into `out` (B, L, D)."""
    out.zero_()
    for b in range(out.shape[0]):
        real = (~mask[b]).nonzero().flatten()
        start = int(offsets[b])
        out[b, real] = values[start : start + real.numel()].to(out.dtype)
    return out
