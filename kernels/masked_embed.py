"""Token embeddings computed straight into packed rows, driven by a key padding mask on the device.

A mask graph fed token ids (autoragged/graphs/capture.py, "mask" with inputs "ids") ran the model's own embedding
module over its whole (batch, width) buffer and then packed the real rows: a graph 4x wider than its batch spent
that much more on the embedding step (MNLI B=128 on the bert-base shape: 112 us a replay at width 128, 416 us at
width 512; H200, benchmarks/diagnostics/graph_width.py). Here each real token's row is computed where pack would put
it, and nothing else:

    values[offsets[b] + r] = LayerNorm(word[ids[b, t]] + type[types[b, t]] + position[pos(b, t)])

for the r-th real token t of row b (ranks as kernels/masked_pack.py counts them, any padding pattern), with the
sums rounded to the tables' dtype after each add as the BERT family's `nn.Embedding` sums are, and the norm in
fp32. Positions are the column (`pos(b, t) = t`: BERT, ELECTRA, DistilBERT) or, with `pad_position` (RoBERTa's
`padding_idx`), counted from the ids as transformers does: `pad_position + (number of ids != pad_position in
row b's columns 0..t)` for a token that is not the pad id, `pad_position` for one that is. first_column: as in
kernels/masked_pack.py, a row whose column 0 is a pad and which has real tokens gets that column's embedding as
its component's last row.

Shape contracts
    args:       (>= MASK_ARGS,) int64, kernels/masked_pack.py's layout: ARG_B, ARG_L and the mask's pointer and
                strides are read (the padded input's pointer is not)
    ids, types: (>= ARG_B, >= ARG_L) int64, stride 1 on columns; types None: type 0 for every token (the
                embeddings' default where the call gives none)
    tables:     `Tables`: word (V, D), position (P, D), token_type (T, D) or None, the norm's weight (D,) and
                bias (D,) or None, all of the values' dtype, stride 1 on D
    offsets:    (>= batch [+ 1 with first_column],) int32, counted from the same mask (kernels/graph_layout.py)
    values:     (rows, D), stride 1 on D; rows of real tokens written, others untouched
A token whose id, type or position falls outside its table (the module would raise; a graph replays without
host reads) gets a row of NaN.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .config import next_pow2
from .masked_pack import MASK_ARGS, batch_row, real_before
from .pdl import launch_kwargs, wait_prior
from .triton_compat import tl, triton

__all__ = ["Tables", "embed_masked", "embed_masked_ref", "positions_ref"]

# tokens of one row per program: a program's steps are serial gathers, so short rows need many programs (16 for
# 64: 0.65x the kernel's time, geomean over bert-base's 24 CoRa rows, MNLI B=64 11.6 us against 25.0; H100)
_SPAN = 16
_TILE = 4096  # elements of one step's (tokens x D) tile


class Tables(NamedTuple):
    """What an embedding step of the BERT family reads: the three tables, the LayerNorm's parameters and eps, and
    the pad id positions are counted from (None: positions are columns)."""

    word: torch.Tensor
    position: torch.Tensor
    token_type: torch.Tensor | None
    weight: torch.Tensor
    bias: torch.Tensor | None
    eps: float
    pad_position: int | None = None


@triton.jit
def _kept_before(ids_row, t0, pad_id, BLOCK: tl.constexpr):
    """Ids other than `pad_id` in columns [0, t0) of a row."""
    count = 0
    for s in range(0, t0, BLOCK):
        t = s + tl.arange(0, BLOCK)
        v = tl.load(ids_row + t, mask=t < t0, other=pad_id)
        count += tl.sum((v != pad_id).to(tl.int32), 0)
    return count


@triton.jit
def _masked_embed_kernel(
    args_ptr, ids_ptr, types_ptr, stride_ib, stride_tb,
    word_ptr, pos_ptr, type_ptr, weight_ptr, bias_ptr, stride_w, stride_p, stride_ty,
    values_ptr, offsets_ptr, D, stride_vt, eps, pad_id, n_words, n_positions, n_types,
    HAS_TYPES: tl.constexpr, TYPES_GIVEN: tl.constexpr, HAS_BIAS: tl.constexpr, POS_FROM_IDS: tl.constexpr,
    FIRST_COL: tl.constexpr,
    SPAN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_prior(PDL)
    b = tl.program_id(0)
    t_start = tl.program_id(1) * SPAN
    n_rows, L, mask_row, stride_ml = batch_row(args_ptr, b)
    if (b < n_rows) & (t_start < L):
        ids_row = ids_ptr + b.to(tl.int64) * stride_ib
        dtype = values_ptr.dtype.element_ty
        cols = tl.arange(0, BLOCK_D)
        in_d = cols < D
        w = tl.load(weight_ptr + cols, mask=in_d, other=0.0).to(tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + cols, mask=in_d, other=0.0).to(tl.float32)
        start = tl.load(offsets_ptr + b).to(tl.int64)
        if FIRST_COL:
            n = tl.load(offsets_ptr + b + 1).to(tl.int64) - start
        done = real_before(mask_row, stride_ml, t_start, 64)  # real tokens before this span
        if POS_FROM_IDS:
            kept_before = _kept_before(ids_row, t_start, pad_id, 64)
        for s in range(t_start, tl.minimum(t_start + SPAN, L), BLOCK_T):
            t = s + tl.arange(0, BLOCK_T)
            inside = t < L
            pad = tl.load(mask_row + t * stride_ml, mask=inside, other=1)
            real = (pad == 0) & inside
            rank = done + tl.cumsum(real.to(tl.int32), 0) - 1
            done += tl.sum(real.to(tl.int32), 0)
            if FIRST_COL:  # a left-padded row's column 0 is its component's last row (query only)
                first = (t == 0) & (pad != 0) & (t * 0 < n)
                rank = tl.where(first, n - 1, rank)
                real = real | first
            ids = tl.load(ids_row + t, mask=inside, other=0)
            if POS_FROM_IDS:  # transformers' create_position_ids_from_input_ids
                kept = (ids != pad_id) & inside
                position = tl.where(kept, kept_before + tl.cumsum(kept.to(tl.int32), 0), 0) + pad_id
                kept_before += tl.sum(kept.to(tl.int32), 0)
            else:
                position = t
            bad = (ids < 0) | (ids >= n_words) | (position >= n_positions)
            tt = t * 0  # no types given: type 0 for every token, the embeddings' default
            if HAS_TYPES and TYPES_GIVEN:
                tt = tl.load(types_ptr + b.to(tl.int64) * stride_tb + t, mask=real, other=0)
                bad = bad | (tt < 0) | (tt >= n_types)
            m2 = (real & ~bad)[:, None] & in_d[None, :]
            e = tl.load(word_ptr + ids[:, None] * stride_w + cols[None, :], mask=m2, other=0.0)
            if HAS_TYPES:
                e = (e + tl.load(type_ptr + tt[:, None] * stride_ty + cols[None, :], mask=m2, other=0.0)).to(dtype)
            e = (e + tl.load(pos_ptr + position.to(tl.int64)[:, None] * stride_p + cols[None, :], mask=m2,
                             other=0.0)).to(dtype)  # fmt: skip
            x = e.to(tl.float32)
            mean = tl.sum(x, 1) / D
            xc = tl.where(in_d[None, :], x - mean[:, None], 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 1) / D + eps)
            y = xc * rstd[:, None] * w[None, :]
            if HAS_BIAS:
                y += bias[None, :]
            y = tl.where(bad[:, None], float("nan"), y)  # an id out of its table: NaN rows, never another's row
            tl.store(values_ptr + (start + rank)[:, None] * stride_vt + cols[None, :], y.to(dtype),
                     mask=real[:, None] & in_d[None, :])  # fmt: skip


def _check(args, ids, types, tables: Tables, values, offsets, batch: int, first_column: bool) -> None:
    if args.numel() < MASK_ARGS or args.dtype != torch.int64:
        raise ValueError(f"args must be int64 of at least {MASK_ARGS} elements")
    D = values.shape[1]
    for name, t in (("word", tables.word), ("position", tables.position), ("token_type", tables.token_type)):
        if t is not None and (t.dim() != 2 or t.shape[1] != D or t.stride(1) != 1 or t.dtype != values.dtype):
            raise ValueError(f"the {name} table must be (rows, {D}) {values.dtype}, stride 1 on D; got "
                             f"{tuple(t.shape)} {t.dtype}")  # fmt: skip
    for name, t in (("ids", ids), ("types", types)):
        if t is not None and (t.dim() != 2 or t.dtype != torch.int64 or t.stride(1) != 1):
            raise ValueError(f"{name} must be int64 (B, L) with stride 1 on L, got {t.dtype} {tuple(t.shape)}")
    need = batch + 1 if first_column else batch
    if offsets.numel() < need or offsets.dtype != torch.int32 or values.stride(1) != 1:
        raise ValueError(f"offsets must be int32 of at least {need} elements, values of stride 1 on D")


def embed_masked(args, ids, types, tables: Tables, values, offsets, batch: int, width: int, first_column=False):
    """Write the embeddings of the batch's real tokens into their packed rows of `values` (module docstring); the
    grid covers `batch` rows of up to `width` columns."""
    _check(args, ids, types, tables, values, offsets, batch, first_column)
    D = values.shape[1]
    if batch == 0 or width == 0 or D == 0:
        return values
    block_d = next_pow2(D)
    block_t = max(1, min(_SPAN, _TILE // block_d))
    types_arg = types if types is not None else ids
    type_table = tables.token_type if tables.token_type is not None else tables.word
    pad_id = tables.pad_position if tables.pad_position is not None else 0
    _masked_embed_kernel[(batch, triton.cdiv(width, _SPAN))](
        args, ids, types_arg, ids.stride(0), types_arg.stride(0),
        tables.word, tables.position, type_table, tables.weight,
        tables.bias if tables.bias is not None else tables.weight,
        tables.word.stride(0), tables.position.stride(0), type_table.stride(0),
        values, offsets, D, values.stride(0), float(tables.eps), pad_id,
        tables.word.shape[0], tables.position.shape[0], type_table.shape[0],
        HAS_TYPES=tables.token_type is not None, TYPES_GIVEN=types is not None, HAS_BIAS=tables.bias is not None,
        POS_FROM_IDS=tables.pad_position is not None, FIRST_COL=first_column,
        SPAN=_SPAN, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4, **launch_kwargs(values.device),
    )  # fmt: skip
    return values


def positions_ref(ids: torch.Tensor, pad_position: int | None) -> torch.Tensor:
    """Each column's position id: the column, or (pad_position given) counted from the ids as transformers'
    RoBERTa does."""
    if pad_position is None:
        return torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    kept = ids.ne(pad_position).int()
    return (torch.cumsum(kept, dim=1) * kept).long() + pad_position


def embed_masked_ref(ids, types, mask, tables: Tables, values, offsets, first_column=False):
    """PyTorch reference of `embed_masked`: ids, types (B, L) (types None: zeros), mask (B, L) True = pad; the
    embeddings as the BERT family's modules compute them, packed as kernels/masked_pack.py's reference packs."""
    from .masked_pack import pack_masked_ref

    e = F.embedding(ids, tables.word)
    if tables.token_type is not None:
        e = e + F.embedding(types if types is not None else torch.zeros_like(ids), tables.token_type)
    e = e + F.embedding(positions_ref(ids, tables.pad_position), tables.position)
    x = F.layer_norm(e, (e.shape[-1],), tables.weight, tables.bias, tables.eps)
    return pack_masked_ref(x, mask, values, offsets, first_column)
