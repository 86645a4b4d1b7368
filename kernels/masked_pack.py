"""Padded <-> ragged copies driven by a key padding mask on the device: any padding pattern, no host lengths.

A mask-only batch whose lengths are never read runs a ragged graph (autoragged/graphs/capture.py, "mask")
that packs the batch's real tokens back to back: row b's real tokens (mask False), in order, go to
values rows offsets[b], offsets[b] + 1, ..., where the graph's layout kernel counted the offsets from the
same mask (kernels/graph_layout.py). Ranks come from prefix sums of the mask inside each program, so
left padding, holes and all-pad rows are all fine.

first_column (a model whose pooler or task head reads column 0 of its padded output, as BERT's do): where
column 0 of a row with real tokens is a pad (left padding), the original computes that pad's output too,
attending to the row's real tokens, and pools it. The layout then gives the row one more row
(kernels/graph_layout.py, first_column), after its real tokens: pack puts x[b, 0] there, the attention treats
it as a query only (kernels/ragged_attention.py, key_lengths), and unpack writes its output back to out[b, 0].
A row with no real tokens at all is one the original computes (attending over its pads) and this graph cannot,
not without reading the mask on the host: with first_column, unpack writes NaN over it, never a quiet zero.

Everything the kernels touch on the padded side comes through the per-batch args (int64, on the device;
kernels/ragged_pack.py's ARG_* layout, plus ARG_MASK / ARG_MASK_SB / ARG_MASK_SL: the (B, L) bool mask,
True = pad, and its strides, and ARG_PADS), so a CUDA graph replays them on tensors it was not captured with.

post_pads: each row's pad count over the graph's width, for the decision record, stored by the graph itself
at ARG_PADS, an address in pinned host memory the host polls: a device->host copy after each replay cost a
stream of batches 5-20 us a batch (the CoRa encoder's mask graph, CoLA B=64: 0.303 ms a batch against 0.282,
H200), up to 7% of a short row.

Shape contracts
    args:     (MASK_ARGS,) int64: ARG_SRC, ARG_DST (B, L, D) of the values' dtype, stride 1 on D;
              ARG_B <= the grid's batch, ARG_L <= width; ARG_PADS: an int32 (ARG_B,) destination (0: none)
    offsets:  (>= batch,) int32 on the device: where each row's tokens start in values
    values:   (batch * width, D), stride 1 on D: room for any mask of the grid's shape
    pack:     values[offsets[b] + r] = x[b, t] for the r-th real t of row b; other rows untouched
    unpack:   out[b, t] = values[offsets[b] + r] for the r-th real t, 0 at pads (NaN over a row with no real
              token, with first_column); out[b, L:] untouched
    first_column: also values[offsets[b + 1] - 1] <-> column 0 of a row whose column 0 is a pad and whose
              component is not empty (offsets back to back, as a mask's layout lays them)
    post_pads: *ARG_PADS[b] = width - lengths[b] for b < ARG_B, where ARG_PADS is not 0
"""

from __future__ import annotations

import torch

from .config import next_pow2
from .pdl import launch_kwargs, wait_prior
from .triton_compat import tl, triton

__all__ = ["pack_masked", "unpack_masked", "post_pads", "pack_masked_ref", "unpack_masked_ref", "post_pads_ref",
           "batch_row", "real_before", "ARG_MASK", "ARG_PADS", "MASK_ARGS"]  # fmt: skip

ARG_MASK, ARG_MASK_SB, ARG_MASK_SL, ARG_PADS = 8, 9, 10, 11
MASK_ARGS = 12
BLOCK_T = 32
_MAX_BLOCK_D = 256


@triton.jit
def real_before(mask_row, stride_ml, t0, BLOCK_T: tl.constexpr):
    """Real tokens (mask 0) of a mask row in positions [0, t0)."""
    count = 0
    for s in range(0, t0, BLOCK_T):
        t = s + tl.arange(0, BLOCK_T)
        pad = tl.load(mask_row + t * stride_ml, mask=t < t0, other=1)
        count += tl.sum((pad == 0).to(tl.int32), 0)
    return count


@triton.jit
def batch_row(args_ptr, b):
    """From the args: the batch's rows and length, and row b's mask pointer and column stride."""
    n_rows = tl.load(args_ptr + 6)  # ARG_B
    L = tl.load(args_ptr + 7).to(tl.int32)  # ARG_L
    mask_row = tl.load(args_ptr + 8).to(tl.pointer_type(tl.int8)) + b.to(tl.int64) * tl.load(args_ptr + 9)
    return n_rows, L, mask_row, tl.load(args_ptr + 10)


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
    FIRST_COL: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_prior(PDL)
    b = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK_T
    n_rows, L, mask_row, stride_ml = batch_row(args_ptr, b)
    if (b < n_rows) & (t0 < L):
        t = t0 + tl.arange(0, BLOCK_T)
        inside = t < L
        pad = tl.load(mask_row + t * stride_ml, mask=inside, other=1)
        real = (pad == 0) & inside
        rank = real_before(mask_row, stride_ml, t0, BLOCK_T) + tl.cumsum(real.to(tl.int32), 0) - 1
        start = tl.load(offsets_ptr + b).to(tl.int64)
        if FIRST_COL:  # a left-padded row's column 0 is its component's last row (query only)
            n = tl.load(offsets_ptr + b + 1).to(tl.int64) - start
            first = (t == 0) & (pad != 0) & (t * 0 < n)
            rank = tl.where(first, n - 1, rank)
            real = real | first
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
                if FIRST_COL:  # an all-pad row: the original computes its pads, this graph cannot
                    v = tl.where(n == 0, float("nan"), v)
                tl.store(row + cols, v, mask=inside[:, None] & (cols < D))
            else:
                v = tl.load(row + cols, mask=real[:, None] & (cols < D), other=0.0)
                tl.store(value_rows + cols, v, mask=real[:, None] & (cols < D))


def _launch(args, values, offsets, batch: int, width: int, unpack: bool, first_column: bool, fits: bool = False):
    if args.numel() < MASK_ARGS or args.dtype != torch.int64:
        raise ValueError(f"args must be int64 of at least {MASK_ARGS} elements")
    if (values.shape[0] < batch * width and not fits) or values.stride(1) != 1:
        raise ValueError(f"values {tuple(values.shape)} cannot hold {batch} rows of up to {width} tokens")
    need = batch + 1 if first_column else batch  # first_column reads where each row's component ends
    if offsets.numel() < need or offsets.dtype != torch.int32 or offsets.device != values.device:
        raise ValueError(f"offsets must be int32 of at least {need} elements on {values.device}")
    D = values.shape[1]
    if batch == 0 or width == 0 or D == 0:
        return
    _masked_kernel[(batch, triton.cdiv(width, BLOCK_T))](
        args, values, offsets, D, values.stride(0),
        BLOCK_T=BLOCK_T, BLOCK_D=min(next_pow2(D), _MAX_BLOCK_D), UNPACK=unpack, FIRST_COL=first_column, num_warps=4,
        **launch_kwargs(values.device),
    )  # fmt: skip


def pack_masked(args, values, offsets, batch: int, width: int, first_column: bool = False):
    """Gather the real tokens of the padded input `args` points at into `values` (module docstring); the
    grid covers `batch` rows of up to `width` tokens."""
    _launch(args, values, offsets, batch, width, unpack=False, first_column=first_column)
    return values


def unpack_masked(args, values, offsets, batch: int, width: int, first_column=False, fits: bool = False) -> None:
    """Scatter `values` into the padded output `args` points at, zeros at pads (module docstring). fits: the
    caller guarantees the batch's rows fit in `values` though it has fewer than `batch` x `width` (the graphs
    pass False: their values hold `batch` x `width` rows)."""
    _launch(args, values, offsets, batch, width, unpack=True, first_column=first_column, fits=fits)


@triton.jit
def _post_pads_kernel(args_ptr, lengths_ptr, width, BLOCK_B: tl.constexpr, PDL: tl.constexpr):
    wait_prior(PDL)
    dst = tl.load(args_ptr + 11)  # ARG_PADS
    if dst != 0:
        b = tl.arange(0, BLOCK_B)
        rows = b < tl.load(args_ptr + 6)  # ARG_B
        lengths = tl.load(lengths_ptr + b, mask=rows, other=0)
        tl.store(dst.to(tl.pointer_type(tl.int32)) + b, width - lengths, mask=rows)


def post_pads(args, lengths, width: int, batch: int) -> None:
    """Store each row's pads over `width` (width - lengths[b], `lengths` (>= batch,) int32 on the device) at the
    args' ARG_PADS (module docstring); one program."""
    if args.numel() < MASK_ARGS or args.dtype != torch.int64:
        raise ValueError(f"args must be int64 of at least {MASK_ARGS} elements")
    if lengths.numel() < batch or lengths.dtype != torch.int32:
        raise ValueError(
            f"lengths must be int32 of at least {batch} elements, got {lengths.dtype} of {lengths.numel()}"
        )
    if batch > 0:
        _post_pads_kernel[(1,)](args, lengths, width, BLOCK_B=next_pow2(batch), num_warps=1,
                                **launch_kwargs(args.device))  # fmt: skip


def _rows_of(mask_row: torch.Tensor, first_column: bool) -> torch.Tensor:
    """The columns a row packs, in values order: its real ones, then column 0 where first_column adds it."""
    real = (~mask_row).nonzero().flatten()
    if first_column and real.numel() and bool(mask_row[0]):
        real = torch.cat([real, real.new_zeros(1)])
    return real


def pack_masked_ref(x: torch.Tensor, mask: torch.Tensor, values: torch.Tensor, offsets, first_column=False):
    """PyTorch reference of `pack_masked`: x (B, L, D), mask (B, L) True = pad; writes into `values`."""
    for b in range(x.shape[0]):
        cols = _rows_of(mask[b], first_column)
        start = int(offsets[b])
        values[start : start + cols.numel()] = x[b, cols]
    return values


def unpack_masked_ref(values: torch.Tensor, mask: torch.Tensor, out: torch.Tensor, offsets, first_column=False):
    """PyTorch reference of `unpack_masked` into `out` (B, L, D)."""
    out.zero_()
    for b in range(out.shape[0]):
        if first_column and bool(mask[b].all()):
            out[b] = float("nan")
            continue
        cols = _rows_of(mask[b], first_column)
        start = int(offsets[b])
        out[b, cols] = values[start : start + cols.numel()].to(out.dtype)
    return out


def post_pads_ref(lengths: torch.Tensor, width: int, n_rows: int, out: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of `post_pads` into `out` (its first `n_rows` entries)."""
    out[:n_rows] = width - lengths[:n_rows].to(out.dtype)
    return out
