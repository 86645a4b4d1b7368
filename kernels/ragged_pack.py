"""Padded <-> ragged copies: the gather behind `RaggedTensor.from_padded` and the scatter behind `to_padded`.

Both kernels use a 2-D grid (component, row block); programs whose block lies past the component's
extent exit at once, so no metadata beyond `offsets` and `lengths` is needed (no prelude copy).
Features are flattened: the padded tensor is viewed as `[B, L, D]` with a contiguous last dim.

Shape contracts
    src (pack):    (B, L, D), any strides on B and L, stride 1 on D
    values:        (T, D), row stride arbitrary, stride 1 on D; component i at rows offsets[i] : offsets[i+1]
    offsets:       (B + 1,), int32, on the values' device; offsets[-1] = T
    lengths:       (B,), int32; lengths[i] <= offsets[i+1] - offsets[i]; rows past lengths[i] are gap rows
    out (unpack):  (B, L_out, D), any strides on B and L, stride 1 on D; L_out >= max(lengths)

Indirect forms (`pack_from`, `unpack_to`), for CUDA-graph replays: the padded side is not a tensor the
graph was captured with but whatever the per-batch `args` buffer (int64, on the device) points at, so a
replay reads the caller's input and writes a fresh output in place, with no copy into or out of static
buffers. args holds, in elements: ARG_SRC / ARG_DST the data pointers, ARG_SRC_SB, ARG_SRC_SL,
ARG_DST_SB, ARG_DST_SL their strides along batch and sequence, ARG_B the batch's real size, ARG_L its
padded length; then, from ARGS_HEAD, the lengths (kernels/graph_layout.py reads those). The caller
guarantees that the pointed-at tensors are alive, of the values' dtype, on the values' device, with
stride 1 on D, and at least (ARG_B, ARG_L, D) in size.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .config import next_pow2
from .pdl import launch_kwargs, wait_prior
from .triton_compat import tl, triton

__all__ = ["pack", "unpack", "pack_from", "unpack_to", "pack_ref", "unpack_ref", "PACK_BLOCK_M", "ARGS_HEAD"]

ARG_SRC, ARG_DST, ARG_SRC_SB, ARG_SRC_SL, ARG_DST_SB, ARG_DST_SL, ARG_B, ARG_L = range(8)
ARGS_HEAD = 8

# 32 rows x up to 256 features per program: the copies are bandwidth-bound and this keeps 16-byte
# accesses with enough programs in flight on the CoRa shapes (D = 512, B = 32..128).
PACK_BLOCK_M = 32
_MAX_BLOCK_D = 256


@triton.jit
def _pack_kernel(
    src_ptr,
    dst_ptr,
    offsets_ptr,
    lengths_ptr,
    D,
    stride_sb,
    stride_sl,
    stride_dt,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INDIRECT: tl.constexpr,  # src_ptr is the args buffer (module docstring)
    PDL: tl.constexpr,
):
    wait_prior(PDL)
    b = tl.program_id(0)
    row0 = tl.program_id(1) * BLOCK_M
    start = tl.load(offsets_ptr + b)
    extent = tl.load(offsets_ptr + b + 1) - start
    length = tl.load(lengths_ptr + b)
    if INDIRECT:  # a compile-time branch: the names may change type here, not under the run-time `if` below
        stride_sb = tl.load(src_ptr + 2)  # ARG_SRC_SB
        stride_sl = tl.load(src_ptr + 3)  # ARG_SRC_SL
        src_ptr = tl.load(src_ptr).to(tl.pointer_type(dst_ptr.dtype.element_ty))  # ARG_SRC
    if row0 < extent:
        rows = row0 + tl.arange(0, BLOCK_M)
        src_rows = src_ptr + b.to(tl.int64) * stride_sb + rows.to(tl.int64)[:, None] * stride_sl
        dst_rows = dst_ptr + (start + rows).to(tl.int64)[:, None] * stride_dt
        load_rows = rows[:, None] < length
        store_rows = rows[:, None] < extent  # rows in [length, extent) are gap rows: written as zeros
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)[None, :]
            x = tl.load(src_rows + cols, mask=load_rows & (cols < D), other=0.0)
            tl.store(dst_rows + cols, x, mask=store_rows & (cols < D))


# L_out changes with every batch: not specialised (one compiled kernel for every padded length)
@triton.jit(do_not_specialize=["L_out"])
def _unpack_kernel(
    src_ptr,
    dst_ptr,
    offsets_ptr,
    lengths_ptr,
    D,
    L_out,
    pad_value,
    stride_st,
    stride_db,
    stride_dl,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INDIRECT: tl.constexpr,  # dst_ptr is the args buffer (module docstring); L_out is read from it
    PDL: tl.constexpr,
):
    wait_prior(PDL)
    b = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    start = tl.load(offsets_ptr + b)
    length = tl.load(lengths_ptr + b)
    if INDIRECT:
        # ARG_L, and ARG_B: the graph's spare components (b >= ARG_B) write nothing
        L_out = tl.where(b < tl.load(dst_ptr + 6), tl.load(dst_ptr + 7), 0).to(tl.int32)
        stride_db = tl.load(dst_ptr + 4)  # ARG_DST_SB
        stride_dl = tl.load(dst_ptr + 5)  # ARG_DST_SL
        dst_ptr = tl.load(dst_ptr + 1).to(tl.pointer_type(src_ptr.dtype.element_ty))  # ARG_DST
    src_rows = src_ptr + (start + rows).to(tl.int64)[:, None] * stride_st
    dst_rows = dst_ptr + b.to(tl.int64) * stride_db + rows.to(tl.int64)[:, None] * stride_dl
    load_rows = rows[:, None] < length
    store_rows = rows[:, None] < L_out
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)[None, :]
        x = tl.load(src_rows + cols, mask=load_rows & (cols < D), other=pad_value)
        tl.store(dst_rows + cols, x.to(dst_ptr.dtype.element_ty), mask=store_rows & (cols < D))


def _block_d(D: int) -> int:
    return min(next_pow2(max(D, 1)), _MAX_BLOCK_D)


def pack(
    src: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    rows: int,
    max_extent: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather `src` (B, L, D) into values (rows, D), new or the first `rows` rows of `out`; gap rows are
    zeros. `max_extent` is the host-known largest `offsets[i+1] - offsets[i]` (it sizes the grid)."""
    B, _, D = src.shape
    if out is None:
        out = torch.empty((rows, D), dtype=src.dtype, device=src.device)
    elif out.shape[0] < rows or out.shape[1:] != (D,) or out.stride(1) != 1:
        raise ValueError(f"out {tuple(out.shape)} cannot hold ({rows}, {D}) packed rows")
    if B == 0 or rows == 0 or D == 0:
        return out[:rows].zero_()
    grid = (B, triton.cdiv(max_extent, PACK_BLOCK_M))
    _pack_kernel[grid](
        src,
        out,
        offsets,
        lengths,
        D,
        src.stride(0),
        src.stride(1),
        out.stride(0),
        BLOCK_M=PACK_BLOCK_M,
        BLOCK_D=_block_d(D),
        INDIRECT=False,
        num_warps=4,
        **launch_kwargs(out.device),
    )
    return out


def pack_from(args: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor,
              max_extent: int) -> torch.Tensor:  # fmt: skip
    """`pack` from the padded tensor `args` points at into `values` (rows, D) (module docstring): one
    program row per component of `offsets`, `max_extent` (>= every extent) sizes the grid."""
    B, D = lengths.shape[0], values.shape[1]
    if B == 0 or max_extent == 0 or D == 0:
        return values
    _pack_kernel[(B, triton.cdiv(max_extent, PACK_BLOCK_M))](
        args, values, offsets, lengths, D, 0, 0, values.stride(0),
        BLOCK_M=PACK_BLOCK_M, BLOCK_D=_block_d(D), INDIRECT=True, num_warps=4, **launch_kwargs(values.device),
    )  # fmt: skip
    return values


def unpack_to(args: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor,
              max_len: int) -> None:  # fmt: skip
    """`unpack` of `values` into the padded tensor `args` points at (module docstring), pads zero;
    `max_len` (>= the batch's padded length) sizes the grid."""
    B, D = lengths.shape[0], values.shape[1]
    if B == 0 or max_len == 0 or D == 0:
        return
    _unpack_kernel[(B, triton.cdiv(max_len, PACK_BLOCK_M))](
        values, args, offsets, lengths, D, 0, 0.0, values.stride(0), 0, 0,
        BLOCK_M=PACK_BLOCK_M, BLOCK_D=_block_d(D), INDIRECT=True, num_warps=4, **launch_kwargs(values.device),
    )  # fmt: skip


def unpack(
    values: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor, pad_value: float
) -> torch.Tensor:
    """Scatter `values` (T, D) into `out` (B, L_out, D), every element of which is written: real rows
    from values, the rest `pad_value`."""
    B, L_out, D = out.shape
    if B == 0 or L_out == 0 or D == 0:
        return out
    grid = (B, triton.cdiv(L_out, PACK_BLOCK_M))
    _unpack_kernel[grid](
        values,
        out,
        offsets,
        lengths,
        D,
        L_out,
        float(pad_value),
        values.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_M=PACK_BLOCK_M,
        BLOCK_D=_block_d(D),
        INDIRECT=False,
        num_warps=4,
        **launch_kwargs(out.device),
    )
    return out


def _row_indices(offsets: Sequence[int], lengths: Sequence[int], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(values rows, flattened padded rows) of every real token, built with vectorised numpy."""
    lens = np.asarray(lengths, dtype=np.int64)
    starts = np.asarray(offsets[:-1], dtype=np.int64)
    comp = np.repeat(np.arange(len(lens), dtype=np.int64), lens)
    first = np.repeat(np.cumsum(lens) - lens, lens)
    within = np.arange(int(lens.sum()), dtype=np.int64) - first
    return starts[comp] + within, comp * seq_len + within


def pack_ref(src: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int], rows: int) -> torch.Tensor:
    """PyTorch reference of `pack` with host offsets/lengths."""
    B, L, D = src.shape
    out = src.new_zeros((rows, D))
    dst_idx, src_idx = _row_indices(offsets, lengths, L)
    if len(dst_idx):
        out[torch.from_numpy(dst_idx).to(src.device)] = src.reshape(B * L, D)[torch.from_numpy(src_idx).to(src.device)]
    return out


def unpack_ref(
    values: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int], out: torch.Tensor, pad_value: float
) -> torch.Tensor:
    """PyTorch reference of `unpack` with host offsets/lengths; writes into `out` (B, L_out, D)."""
    B, L_out, D = out.shape
    out.fill_(pad_value)
    src_idx, dst_idx = _row_indices(offsets, lengths, L_out)
    if len(src_idx):
        dst = torch.from_numpy(dst_idx).to(out.device)
        out[dst // L_out, dst % L_out] = values[torch.from_numpy(src_idx).to(values.device)].to(out.dtype)
    return out
