"""A ragged layout built on the device from lengths: the first node of a replayed ragged graph.

A CUDA graph replays fixed launches on fixed buffers, so a ragged graph keeps its layout in one static
int32 buffer. Building that layout on the host (offsets, prelude) costs tens of microseconds of numpy
per batch on a slow host, which on a launch-bound batch is latency. Here the graph builds it itself
from the batch's lengths, which arrive with the rest of the per-batch arguments (see `ragged_pack.ARGS`),
fetched by the graph's first kernel from a pinned slot the host wrote (kernels/graph_args.py).

Shape contracts
    args:   (ARGS_HEAD + batch,) int64 on the device; args[ARGS_HEAD + i] = length of component i
            (0 for the graph's spare components)
    meta:   (meta_size(batch, programs),) int32, sections (each starting at a multiple of 16 elements,
            `starts`; the padding between them is never read nor written):
              offsets        (batch + 1,)  start of each component, aligned to `align` rows
              lengths        (batch,)      real rows of each component
              grid_mapping   (programs,)   component of attention program p, -1 past the last
              block_offsets  (batch + 1,)  first attention program of each component
            for attention row blocks of `block_m` rows; `programs` must be >= the batch's row blocks.
    From a mask (from_mask): args as kernels/masked_pack.py has them; lengths[i] = real tokens of mask
    row i (0 for i >= ARG_B); align must be 1 (components back to back). offsets[batch] is then the rows
    the batch fills, which the graph's row-wise kernels read as their live row count.
    With first_column (from a mask only): a row whose column 0 is a pad but which has real tokens (left
    padding) gets one more row, a query-only row for that column (a first-token pooler reads it: see
    kernels/masked_pack.py); lengths[i] counts it, and meta grows by a section:
              key_lengths    (batch,)      real tokens of each row (the attention's keys)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from . import ahead
from .config import aligned, next_pow2
from .masked_pack import MASK_ARGS
from .pdl import launch_kwargs, wait_prior
from .ragged_pack import ARGS_HEAD
from .triton_compat import tl, triton

__all__ = ["layout", "layout_ref", "meta_size", "sections"]


def starts(batch: int, programs: int) -> tuple[int, int, int, int]:
    """Where the lengths, grid_mapping, block_offsets and key_lengths sections of `meta` start (offsets
    starts at 0): each at a multiple of 16 elements, so every view is 64-byte aligned whatever the batch and
    the program count (`aligned`: one compiled variant of each kernel that reads them)."""
    at_lengths = aligned(batch + 1)
    at_grid = at_lengths + aligned(batch)
    at_blocks = at_grid + aligned(programs)
    return at_lengths, at_grid, at_blocks, at_blocks + aligned(batch + 1)


def meta_size(batch: int, programs: int, first_column: bool = False) -> int:
    at_blocks, at_keys = starts(batch, programs)[2:]
    return at_keys + batch if first_column else at_blocks + batch + 1


def sections(meta, batch: int, programs: int):
    """(offsets, lengths, grid_mapping, block_offsets): views of `meta` (a tensor or an array)."""
    at_lengths, at_grid, at_blocks, _ = starts(batch, programs)
    return (meta[: batch + 1], meta[at_lengths : at_lengths + batch], meta[at_grid : at_grid + programs],
            meta[at_blocks : at_blocks + batch + 1])  # fmt: skip


def key_lengths(meta, batch: int, programs: int):
    """The key_lengths section of a first_column layout's `meta` (module docstring)."""
    start = starts(batch, programs)[3]
    return meta[start : start + batch]


# batch and programs change with the bucket: not specialised (one compiled kernel for every bucket)
@triton.jit(do_not_specialize=["batch", "programs"])
def _layout_kernel(
    args_ptr,
    meta_ptr,
    batch,
    programs,
    at_lengths,  # where meta's sections start (`starts`): multiples of 16
    at_grid,
    at_blocks,
    at_keys,
    BLOCK_M: tl.constexpr,
    ALIGN: tl.constexpr,
    HEAD: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_P: tl.constexpr,
    FROM_MASK: tl.constexpr,  # lengths counted from the mask args point at (kernels/masked_pack.py)
    BLOCK_L: tl.constexpr,
    FIRST_COL: tl.constexpr,  # (from a mask) a left-padded row's column 0 as one more, query-only, row
    PDL: tl.constexpr,
):
    wait_prior(PDL)
    pid = tl.program_id(0)
    b = tl.arange(0, BLOCK_B)
    real = b < batch
    if FROM_MASK:
        rows_real = b < tl.load(args_ptr + 6)  # ARG_B
        L = tl.load(args_ptr + 7).to(tl.int32)  # ARG_L
        mask_ptr = tl.load(args_ptr + 8).to(tl.pointer_type(tl.int8))  # ARG_MASK
        rows = mask_ptr + b.to(tl.int64)[:, None] * tl.load(args_ptr + 9)  # ARG_MASK_SB
        stride_ml = tl.load(args_ptr + 10)  # ARG_MASK_SL
        lens = tl.zeros([BLOCK_B], dtype=tl.int32)
        for s in range(0, L, BLOCK_L):
            t = s + tl.arange(0, BLOCK_L)[None, :]
            pad = tl.load(rows + t * stride_ml, mask=rows_real[:, None] & (t < L), other=1)
            lens += tl.sum((pad == 0).to(tl.int32), 1)
        if FIRST_COL:
            keys = lens
            first = tl.load(mask_ptr + b.to(tl.int64) * tl.load(args_ptr + 9), mask=rows_real & (b * 0 < L), other=0)
            lens += ((first != 0) & (keys > 0)).to(tl.int32)
    else:
        lens = tl.load(args_ptr + HEAD + b, mask=real, other=0).to(tl.int32)
    ext = (lens + ALIGN - 1) // ALIGN * ALIGN
    counts = (lens + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(counts, 0)  # the program after each component's last one
    total = tl.sum(counts, 0)
    # program p belongs to the component whose blocks span it: the count of components ending at or before p
    p = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    comp = tl.sum((ends[None, :] <= p[:, None]).to(tl.int32), 1)
    comp = tl.where(p < total, comp, -1)
    tl.store(meta_ptr + at_grid + p, comp, mask=p < programs)
    if pid == 0:
        tl.store(meta_ptr, 0)
        tl.store(meta_ptr + 1 + b, tl.cumsum(ext, 0), mask=real)
        tl.store(meta_ptr + at_lengths + b, lens, mask=real)
        block_offsets = meta_ptr + at_blocks
        tl.store(block_offsets, 0)
        tl.store(block_offsets + 1 + b, ends, mask=real)
        if FIRST_COL:
            tl.store(meta_ptr + at_keys + b, keys, mask=real)


def layout(
    args: torch.Tensor,
    meta: torch.Tensor,
    batch: int,
    programs: int,
    block_m: int,
    align: int,
    from_mask: bool = False,
    first_column: bool = False,
) -> None:
    """Write the layout of the lengths in `args` into `meta` (see the module docstring). With `from_mask`
    the lengths are counted from the mask `args` points at instead (kernels/masked_pack.py's args), and
    with `first_column` a left-padded row's column 0 is one more row, query-only."""
    if from_mask and align != 1:
        raise ValueError(f"a layout counted from a mask packs components back to back (align 1), got align {align}")
    if first_column and not from_mask:
        raise ValueError("first_column needs a layout counted from a mask (from_mask=True)")
    if meta.numel() != meta_size(batch, programs, first_column) or meta.dtype != torch.int32:
        size = meta_size(batch, programs, first_column)
        raise ValueError(f"meta must be int32 of {size} elements, got {meta.dtype} of {meta.numel()}")
    need = MASK_ARGS if from_mask else ARGS_HEAD + batch
    if args.numel() < need or args.dtype != torch.int64:
        raise ValueError(f"args must be int64 of at least {need} elements")
    block_b = next_pow2(max(batch, 1))
    block_p = max(16, min(1024, 8192 // block_b))  # the (BLOCK_P, BLOCK_B) comparison stays small
    kernel_args = (args, meta, batch, programs, *starts(batch, programs))
    sizes = dict(HEAD=ARGS_HEAD, BLOCK_B=block_b, BLOCK_P=block_p, BLOCK_L=max(16, 4096 // block_b), num_warps=4,
                 **launch_kwargs(args.device))  # fmt: skip
    if ahead.first_sight(("layout", args.device, block_b), args):
        _compile_siblings(kernel_args, sizes, (block_m, align, from_mask, first_column))
    _layout_kernel[(triton.cdiv(programs, block_p),)](
        *kernel_args, **sizes, BLOCK_M=block_m, ALIGN=align, FROM_MASK=from_mask, FIRST_COL=first_column,
    )  # fmt: skip


def _compile_siblings(kernel_args: tuple, sizes: dict, mine: tuple) -> None:
    """The first layout of a batch size bucket (outside a capture) compiles, in the background, the variants
    the other graphs of that bucket may launch (kernels/ahead.py): the attention tiles' row blocks (32 or
    64 rows: the longest component at or under 32, or over) for a graph fed lengths (align 1) and one fed a
    mask (with and without the first-column row): a variant compiled inside a capture stalls the stream (HF
    bert-base, CoLA B=128 on an H100, benchmarks/stream_table.py)."""
    variants = {(m, 1, False, False) for m in (32, 64)} | {(m, 1, True, f) for m in (32, 64) for f in (False, True)}
    jobs = [
        functools.partial(
            _layout_kernel.warmup, *kernel_args, **sizes, BLOCK_M=m, ALIGN=a, FROM_MASK=fm, FIRST_COL=fc, grid=(1,)
        )  # fmt: skip
        for m, a, fm, fc in sorted(variants - {mine})
    ]
    ahead.submit(kernel_args[0].device, jobs, "layout")


def layout_ref(
    lengths: Sequence[int], align: int, block_m: int, batch: int, programs: int, meta: np.ndarray | None = None
) -> tuple[np.ndarray, int, int]:
    """Numpy reference: (the int32 meta of `lengths`, written into `meta` if given; rows used; largest
    extent). Lengths past len(lengths), up to `batch`, are spare components of length 0."""
    B = len(lengths)
    lens = np.fromiter(lengths, dtype=np.int64, count=B)
    ext = lens if align == 1 else (lens + align - 1) // align * align
    counts = (lens + block_m - 1) // block_m
    if meta is None:
        meta = np.zeros(meta_size(batch, programs), dtype=np.int32)  # (the padding between sections stays 0)
    offsets, lengths_out, grid, block_offsets = sections(meta, batch, programs)
    offsets[0] = 0
    np.cumsum(ext, out=offsets[1 : B + 1])
    offsets[B + 1 :] = offsets[B]
    lengths_out[:B] = lens
    lengths_out[B:] = 0
    used = int(counts.sum())
    if used > programs:
        raise ValueError(f"{used} row blocks of {block_m} do not fit {programs} programs")
    grid[:used] = np.repeat(np.arange(B, dtype=np.int32), counts)
    grid[used:] = -1
    block_offsets[0] = 0
    np.cumsum(counts, out=block_offsets[1 : B + 1])
    block_offsets[B + 1 :] = block_offsets[B]
    return meta, int(offsets[B]), int(ext.max(initial=0))
