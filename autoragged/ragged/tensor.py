"""`RaggedTensor`: B components of shape [length_i, *features] stored back to back, lengths on the host."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..kernels import ragged_pack
from .backend import host_to_device, use_triton
from .layout import Layout, as_lengths, check_align

__all__ = [
    "RaggedTensor", "lengths_from_mask", "mask_lengths", "strip_padding", "restore_padding", "pad_mask", "mask_rows",
    "pack_by_mask", "unpack_by_mask", "ragged_from_padded", "padded_from_ragged", "zero_pads", "zero_gaps",
]  # fmt: skip


class RaggedTensor:
    """A batch of B variable-length components `[length_i, *features]`, stored back to back.

    values:   (T, *features); component i occupies rows offsets[i] : offsets[i] + lengths[i]. With
              alignment A, offsets[i+1] - offsets[i] = ceil(lengths[i] / A) * A and the gap rows are zero.
    offsets:  (B + 1,), int32, on the values' device (copied from the host once per layout and device)
    lengths:  host tuple of B ints: the truth about the shape, so no op needs a device->host sync
    align:    int, 1 = packed

    Build one with a constructor (`from_padded`, `from_mask`, `from_list`, `from_values_offsets`,
    `from_nested`); `RaggedTensor(values, layout)` is internal.
    """

    __slots__ = ("values", "layout")

    def __init__(self, values: torch.Tensor, layout: Layout):
        if values.dim() < 1 or values.shape[0] != layout.rows:
            raise ValueError(
                f"values has {values.shape[0] if values.dim() else 0} rows but the layout has {layout.rows}"
            )
        self.values = values
        self.layout = layout

    # -- metadata ---------------------------------------------------------------------------
    @property
    def lengths(self) -> tuple[int, ...]:
        return self.layout.lengths

    @property
    def offsets(self) -> torch.Tensor:
        return self.layout.device_meta(self.values.device)[0]

    @property
    def align(self) -> int:
        return self.layout.align

    @property
    def batch_size(self) -> int:
        return len(self.layout.lengths)

    @property
    def max_len(self) -> int:
        return self.layout.max_len

    @property
    def total(self) -> int:
        """Sum of lengths: the real rows (values may hold more: alignment gaps)."""
        return self.layout.total

    @property
    def feature_shape(self) -> torch.Size:
        return self.values.shape[1:]

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    def __len__(self) -> int:
        return self.batch_size

    def __repr__(self) -> str:
        return (
            f"RaggedTensor(batch_size={self.batch_size}, total={self.total}, max_len={self.max_len}, "
            f"features={tuple(self.feature_shape)}, align={self.align}, dtype={self.dtype}, device={self.device})"
        )

    def prelude(self, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """CoRa prelude `(grid_mapping, block_offsets)` for a 1-D grid over real blocks of `block_m` rows
        (see `Layout.prelude`); built on the host, cached, copied without blocking."""
        return self.layout.prelude(block_m, self.values.device)

    # -- constructors -----------------------------------------------------------------------
    @classmethod
    def from_padded(cls, x: torch.Tensor, lengths: Sequence[int], align: int = 1) -> RaggedTensor:
        """From a batch-first padded tensor `x` (B, L, *features) and host `lengths` (B ints, each <= L)."""
        return ragged_from_padded(x, lengths, align, seq_axis=1)

    @classmethod
    def from_mask(cls, x: torch.Tensor, key_padding_mask: torch.Tensor, align: int = 1) -> RaggedTensor:
        """From `x` (B, L, *features) and `key_padding_mask` (B, L), True = pad (PyTorch's convention).

        Each row's real tokens must be a prefix. A mask on the GPU costs exactly one small device->host
        copy (the lengths and the prefix check travel together)."""
        _check_padded(x, 1)
        lengths = lengths_from_mask(key_padding_mask, key_padding=True, batch=x.shape[0], seq_len=x.shape[1])
        return ragged_from_padded(x, lengths, align, seq_axis=1)

    @classmethod
    def from_list(cls, tensors: Sequence[torch.Tensor], align: int = 1) -> RaggedTensor:
        """From B tensors `[length_i, *features]` with equal features, dtype and device (copied)."""
        align = check_align(align)
        tensors = list(tensors)
        if not tensors:
            raise ValueError(
                "from_list needs at least one tensor to know features, dtype and device; "
                "for an empty batch use from_padded(torch.empty(0, 0, *features), [])"
            )
        first = tensors[0]
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensors[{i}] is a {type(t).__name__}, not a torch.Tensor")
            if t.dim() < 1:
                raise ValueError(f"tensors[{i}] is 0-d; each component needs a length dim [length, *features]")
            if t.shape[1:] != first.shape[1:] or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(
                    f"tensors[{i}] has features {tuple(t.shape[1:])}, {t.dtype} on {t.device}; "
                    f"tensors[0] has {tuple(first.shape[1:])}, {first.dtype} on {first.device}"
                )
        layout = Layout.make(tuple(t.shape[0] for t in tensors), align)
        if layout.has_gaps:
            parts = []
            for t, n, start, end in zip(tensors, layout.lengths, layout.offsets, layout.offsets[1:]):
                parts.append(t)
                if end - start > n:
                    parts.append(t.new_zeros((end - start - n, *t.shape[1:])))
            values = torch.cat(parts)
        else:
            values = torch.cat(tensors)
        return cls(values, layout)

    @classmethod
    def from_values_offsets(
        cls, values: torch.Tensor, offsets: torch.Tensor | Sequence[int], lengths: Sequence[int] | None = None
    ) -> RaggedTensor:
        """A view over existing `values` (T, *features): no copy, the semantics of
        `torch.nested.nested_tensor_from_jagged`. Component i is rows offsets[i] : offsets[i] + lengths[i]
        (lengths default to the offsets' differences; shorter lengths leave holes, which are not touched).

        The offsets are validated on the host: an offsets tensor on the GPU costs one device->host copy
        of B + 1 ints here (never later).
        """
        if not isinstance(values, torch.Tensor) or values.dim() < 1:
            raise ValueError("values must be a tensor of at least 1 dim (T, *features)")
        if isinstance(offsets, torch.Tensor):
            if offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"offsets must be a 1-D int32/int64 tensor, got {offsets.dim()}-D {offsets.dtype}")
            host_offsets = tuple(offsets.tolist())
        else:
            host_offsets = as_lengths(offsets, name="offsets")
        lengths = None if lengths is None else as_lengths(lengths)
        layout = Layout.from_offsets(host_offsets, lengths, values.shape[0])
        if isinstance(offsets, torch.Tensor) and offsets.device == values.device:
            layout.set_device_offsets(offsets.to(torch.int32))
        return cls(values, layout)

    @classmethod
    def from_nested(cls, nt: torch.Tensor) -> RaggedTensor:
        """From a nested tensor: jagged layout as a view (one device->host copy of its offsets when they
        live on the GPU); strided layout by copying its components."""
        if not isinstance(nt, torch.Tensor) or not nt.is_nested:
            raise TypeError(f"from_nested expects a nested tensor, got {type(nt).__name__}")
        if nt.layout == torch.jagged:
            if nt._ragged_idx != 1:
                raise ValueError(f"the ragged dim of the nested tensor must be dim 1, got dim {nt._ragged_idx}")
            lengths = nt.lengths()
            return cls.from_values_offsets(nt.values(), nt.offsets(), None if lengths is None else lengths.tolist())
        return cls.from_list(nt.unbind())

    # -- out --------------------------------------------------------------------------------
    def to_padded(self, pad_value: float = 0.0, max_len: int | None = None) -> torch.Tensor:
        """(B, max_len, *features); real rows from values, every other element `pad_value`."""
        return padded_from_ragged(self, pad_value, max_len, seq_axis=1)

    def to_nested(self) -> torch.Tensor:
        """A jagged-layout nested tensor viewing the same values (holes become NJT lengths)."""
        offsets = self.offsets.to(torch.int64)
        lengths = None
        if not self.layout.canonical or self.layout.has_gaps:
            lengths = self.layout.device_meta(self.device)[1].to(torch.int64)
        return torch.nested.nested_tensor_from_jagged(self.values, offsets=offsets, lengths=lengths)

    def select(self, i: int) -> torch.Tensor:
        """Component i as a view `[length_i, *features]`."""
        i = operator.index(i)
        B = self.batch_size
        if not -B <= i < B:
            raise IndexError(f"component {i} out of range for a batch of {B}")
        i %= B
        start = self.layout.offsets[i]
        return self.values[start : start + self.layout.lengths[i]]

    def unbind(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.select(i) for i in range(self.batch_size))

    # -- structure-keeping ops --------------------------------------------------------------
    def with_values(self, values: torch.Tensor) -> RaggedTensor:
        """Same layout, new values (same rows)."""
        return RaggedTensor(values, self.layout)

    def map_values(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> RaggedTensor:
        """Apply a row-wise `fn` to values, keeping the layout; gap rows are zeroed again afterwards."""
        return self.with_values(zero_gaps(fn(self.values), self.layout))

    def to(self, *args: Any, **kwargs: Any) -> RaggedTensor:
        return self.with_values(self.values.to(*args, **kwargs))

    def contiguous(self) -> RaggedTensor:
        return self.with_values(self.values.contiguous())

    def clone(self) -> RaggedTensor:
        return self.with_values(self.values.clone())

    def detach(self) -> RaggedTensor:
        return self.with_values(self.values.detach())

    def _binary(self, other: Any, op: Callable[[Any, Any], torch.Tensor], name: str) -> RaggedTensor:
        if isinstance(other, RaggedTensor):
            if not self.layout.same_as(other.layout):
                raise ValueError(
                    f"{name}: layouts differ (lengths {_short(self.lengths)} align {self.align} vs "
                    f"{_short(other.lengths)} align {other.align})"
                )
            rhs = other.values
        elif isinstance(other, torch.Tensor):
            if other.dim() > len(self.feature_shape):
                raise ValueError(
                    f"{name}: a dense operand broadcasts over one component's features {tuple(self.feature_shape)}; "
                    f"got shape {tuple(other.shape)} (use a RaggedTensor of the same layout for per-token values)"
                )
            rhs = other
        elif isinstance(other, numbers.Number):
            rhs = other
        else:
            return NotImplemented
        return self.with_values(zero_gaps(op(self.values, rhs), self.layout))

    def __add__(self, o):
        return self._binary(o, operator.add, "+")

    def __radd__(self, o):
        return self._binary(o, lambda a, b: b + a, "+")

    def __sub__(self, o):
        return self._binary(o, operator.sub, "-")

    def __rsub__(self, o):
        return self._binary(o, lambda a, b: b - a, "-")

    def __mul__(self, o):
        return self._binary(o, operator.mul, "*")

    def __rmul__(self, o):
        return self._binary(o, lambda a, b: b * a, "*")

    def __truediv__(self, o):
        return self._binary(o, operator.truediv, "/")

    def __rtruediv__(self, o):
        return self._binary(o, lambda a, b: b / a, "/")

    def __pow__(self, o):
        return self._binary(o, operator.pow, "**")

    def __neg__(self):
        return self.with_values(-self.values)

    def __abs__(self):
        return self.with_values(self.values.abs())


def _short(lengths: tuple[int, ...]) -> str:
    return str(lengths) if len(lengths) <= 8 else f"({', '.join(map(str, lengths[:8]))}, ... {len(lengths)} in all)"


def zero_gaps(values: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Zero the rows of `values` that belong to no component (one small index_fill; none when packed)."""
    gaps = layout.gap_rows(values.device) if layout.has_gaps and layout.canonical else None
    if gaps is not None:
        values.index_fill_(0, gaps, 0)
    return values


# -- padded <-> ragged ------------------------------------------------------------------------
def _check_padded(x: object, seq_axis: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"a padded batch needs at least 2 dims (batch and sequence), got shape {tuple(x.shape)}")
    if x.is_nested:
        raise TypeError("got a nested tensor; use RaggedTensor.from_nested")


def zero_pads(out: torch.Tensor, mask: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """out (B, L, D), or (L, B, D) when not batch_first, with the positions of `mask` (B, L) set to 0."""
    return out.masked_fill(mask[..., None] if batch_first else mask.t()[..., None], 0.0)


def _batch_major(x: torch.Tensor, seq_axis: int) -> torch.Tensor:
    """View x as (B, L, D) with the features flattened (a copy only if the features are not contiguous)."""
    if seq_axis == 0:
        x = x.transpose(0, 1)
    B, L = x.shape[:2]
    if x.dim() != 3:
        x = x.reshape(B, L, math.prod(x.shape[2:]))  # a view for freshly allocated outputs; inputs may be copied
    return x if x.stride(-1) == 1 else x.contiguous()


def ragged_from_padded(
    x: torch.Tensor, lengths: Sequence[int], align: int, seq_axis: int, rows: int | None = None
) -> RaggedTensor:
    """Pack x (padded; sequence axis `seq_axis`: 1 for (B, L, ...), 0 for (L, B, ...)) by host `lengths`.
    rows: values rows to allocate where more than the layout needs (packed layouts, align 1): the spare rows
    follow the last component, zeros, in no component (`cublas_rows`)."""
    _check_padded(x, seq_axis)
    align = check_align(align)
    lengths = as_lengths(lengths)
    B, L = (x.shape[1], x.shape[0]) if seq_axis == 0 else (x.shape[0], x.shape[1])
    if len(lengths) != B:
        raise ValueError(f"got {len(lengths)} lengths for a batch of {B} (x has shape {tuple(x.shape)})")
    layout = Layout.make(lengths, align)
    if layout.max_len > L:
        i = lengths.index(layout.max_len)
        raise ValueError(f"lengths[{i}] = {layout.max_len} exceeds the padded length {L} of x {tuple(x.shape)}")
    used = layout.rows
    if rows is not None and rows > used and align == 1:
        layout = Layout(lengths, 1, layout.offsets, rows, canonical=False)
    features = x.shape[2:]
    src = _batch_major(x, seq_axis)
    if use_triton(x) and not (x.requires_grad and torch.is_grad_enabled()):
        offsets, dev_lengths = layout.device_meta(x.device)
        flat = ragged_pack.pack(src, offsets, dev_lengths, layout.rows, layout.max_extent)
        if layout.rows > used:
            flat[used:].zero_()
    else:  # reference path; also the differentiable one
        flat = ragged_pack.pack_ref(src, layout.offsets, lengths, layout.rows)
    return RaggedTensor(flat.view(layout.rows, *features), layout)


def padded_from_ragged(rt: RaggedTensor, pad_value: float, max_len: int | None, seq_axis: int) -> torch.Tensor:
    """Unpack rt to a padded tensor of `max_len` (None: rt's longest) positions on sequence axis `seq_axis`
    (1: (B, L, ...), 0: (L, B, ...)); pads are `pad_value`."""
    if not isinstance(pad_value, numbers.Number):
        raise TypeError(f"pad_value must be a number, got {type(pad_value).__name__}")
    L = rt.max_len if max_len is None else operator.index(max_len)
    if L < rt.max_len:
        raise ValueError(f"max_len = {L} is shorter than the longest component ({rt.max_len})")
    B, features, values = rt.batch_size, rt.feature_shape, rt.values
    shape = (L, B, *features) if seq_axis == 0 else (B, L, *features)
    out = values.new_empty(shape)
    dst = _batch_major(out, seq_axis)
    flat = values.reshape(values.shape[0], math.prod(features))
    if use_triton(values) and not (values.requires_grad and torch.is_grad_enabled()):
        offsets, dev_lengths = rt.layout.device_meta(values.device)
        ragged_pack.unpack(flat, offsets, dev_lengths, dst, pad_value)
    else:
        ragged_pack.unpack_ref(flat, rt.layout.offsets, rt.lengths, dst, pad_value)
    return out


# -- masks ------------------------------------------------------------------------------------
def lengths_from_mask(
    mask: torch.Tensor, *, key_padding: bool = True, batch: int | None = None, seq_len: int | None = None
) -> tuple[int, ...]:
    """Host lengths of a (B, L) mask, with at most one device->host copy.

    key_padding=True:  PyTorch's convention, True = pad. The real tokens of each row must be a prefix;
                       a row where they are not is an error naming the row.
    key_padding=False: Cerebras VTS's convention, True/1 = real; each sequence ends at the row's first
                       False/0 and whatever follows it is ignored.
    """
    lengths, bad_row = mask_lengths(mask, key_padding=key_padding, batch=batch, seq_len=seq_len)
    if bad_row is not None:
        raise ValueError(
            f"key_padding_mask row {bad_row}: the real (False) tokens are not a prefix; ragged execution needs "
            "right padding (sequence first, then pads)"
        )
    return lengths


def mask_lengths(
    mask: torch.Tensor, *, key_padding: bool = True, batch: int | None = None, seq_len: int | None = None
) -> tuple[tuple[int, ...], int | None]:
    """(lengths, first row whose real tokens are not a prefix or None): `lengths_from_mask` without the
    error, for callers that route such batches elsewhere. One device->host copy at most."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D (batch, seq), got shape {tuple(mask.shape)}")
    if (batch is not None and mask.shape[0] != batch) or (seq_len is not None and mask.shape[1] != seq_len):
        raise ValueError(f"mask has shape {tuple(mask.shape)} but the batch is (B={batch}, L={seq_len})")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(f"mask must be bool or integer, got {mask.dtype}")
    B, L = mask.shape
    if B == 0:
        return (), None
    if not key_padding:
        return tuple(mask.bool().to(torch.int32).cumprod(1).sum(1, dtype=torch.int32).tolist()), None
    # One weighted sum gives, per row, the count n of real tokens and the sum of their positions: real token c
    # adds 1 + K c (K = L + 1 > n, exact in int64), so n = s mod K and the position sum is s div K. The real
    # tokens are a prefix exactly when that sum is n (n - 1) / 2 (n distinct positions sum to at least that,
    # with equality only for 0..n-1). Two small kernels and one copy: 44-60 us of host time in all on an H100
    # host, time a synchronised call waits with the GPU idle (benchmarks/diagnostics/mask_read.py).
    sums = torch.where(mask.bool(), 0, _moment_weights(L, mask.device)).sum(1).cpu().numpy()  # the one copy
    counts = sums % (L + 1)
    lengths = tuple(counts.tolist())
    bad = np.flatnonzero(sums // (L + 1) != counts * (counts - 1) // 2)
    return lengths, (int(bad[0]) if bad.size else None)


_MOMENTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _moment_weights(L: int, device: torch.device) -> torch.Tensor:
    """(L,) int64: 1 + (L + 1) c for columns c = 0..L-1 (cached per L and device)."""
    key = (L, device)
    w = _MOMENTS.get(key)
    if w is None:
        w = host_to_device((1 + (L + 1) * np.arange(L, dtype=np.int64)), device)
        if len(_MOMENTS) > 256:
            _MOMENTS.clear()
        _MOMENTS[key] = w
    return w


def strip_padding(
    x: torch.Tensor, mask: torch.Tensor, axis: int = 1, *, key_padding: bool = False, align: int = 1
) -> RaggedTensor:
    """Remove padding: the Cerebras VTS `strip_padding` as plain PyTorch.

    x:     the padded batch; `axis` is its sequence axis (1: (B, L, *features); 0: (L, B, *features))
    mask:  (B, L). Default (VTS): True/1 = real token, each sequence ends at its first False/0.
           key_padding=True: PyTorch's convention, True = pad, real tokens must be a prefix.
    Returns a RaggedTensor; `restore_padding` is the inverse.
    """
    if axis not in (0, 1):
        raise ValueError(f"axis must be 0 (sequence-first) or 1 (batch-first), got {axis}")
    _check_padded(x, axis)
    B, L = (x.shape[1], x.shape[0]) if axis == 0 else (x.shape[0], x.shape[1])
    lengths = lengths_from_mask(mask, key_padding=key_padding, batch=B, seq_len=L)
    return ragged_from_padded(x, lengths, align, seq_axis=axis)


def restore_padding(r: RaggedTensor, axis: int = 1, pad_value: float = 0.0, max_len: int | None = None) -> torch.Tensor:
    """Put padding back: (B, L, *features) for axis=1, (L, B, *features) for axis=0; pads are `pad_value`."""
    if not isinstance(r, RaggedTensor):
        raise TypeError(f"restore_padding expects a RaggedTensor, got {type(r).__name__}")
    if axis not in (0, 1):
        raise ValueError(f"axis must be 0 (sequence-first) or 1 (batch-first), got {axis}")
    return padded_from_ragged(r, pad_value, max_len, seq_axis=axis)


# -- padded <-> packed by a key padding mask (any pattern), on the device -------------------------------------
def pad_mask(lens: tuple[int, ...], L: int, device: torch.device) -> torch.Tensor:
    """(B, L) bool, True = pad, built on the device from host lengths (no sync)."""
    dev_lengths = Layout.make(lens, 1).device_meta(device)[1]
    return torch.arange(L, device=device, dtype=torch.int32)[None, :] >= dev_lengths[:, None]


def mask_rows(kpm: torch.Tensor, layout: Layout) -> torch.Tensor:
    """(B * L,) int64: the values row of each padded position (real tokens in order from their component's
    offset; pads point at the spare row `layout.rows`). A layout with query rows (`Layout.with_query_rows`)
    also maps a non-empty row's column 0, where it is a pad, to its component's query row."""
    real = ~kpm
    offsets = layout.device_meta(kpm.device)[0][:-1].to(torch.int64)
    rank = real.to(torch.int64).cumsum(1) - 1 + offsets[:, None]
    rows = torch.where(real, rank, layout.rows)
    keys = layout.key_lengths
    if keys is not None:
        query_row = torch.where(kpm[:, 0] & (keys > 0), offsets + keys, rows[:, 0])
        rows = torch.cat([query_row[:, None], rows[:, 1:]], 1)
    return rows.reshape(-1)


def pack_by_mask(x: torch.Tensor, kpm: torch.Tensor, lens: tuple[int, ...], seq_axis: int, first_column: bool):
    """x's real tokens (kpm False, any pattern) packed back to back, align 1, as a RaggedTensor; no device
    sync. first_column: each non-empty row also packs column 0 as a query-only row (where column 0 is real,
    that row is zeros and unread)."""
    layout = Layout.with_query_rows(lens, x.device) if first_column else Layout.make(lens, 1)
    src = x if seq_axis == 1 else x.transpose(0, 1)
    B, L = kpm.shape
    flat = src.reshape(B * L, *src.shape[2:])
    make = flat.new_zeros if first_column else flat.new_empty
    values = make((layout.rows + 1, *src.shape[2:]))
    values.index_copy_(0, mask_rows(kpm, layout), flat)  # pads all land on the spare row
    return RaggedTensor(values[: layout.rows], layout)


def unpack_by_mask(values: torch.Tensor, rt: RaggedTensor, kpm: torch.Tensor, seq_axis: int) -> torch.Tensor:
    """The inverse of `pack_by_mask`: values back at their padded positions (a query row's at column 0),
    zeros at the other pads."""
    B, L = kpm.shape
    spare = torch.cat([values[: rt.layout.rows], values.new_zeros((1, *values.shape[1:]))])
    out = spare.index_select(0, mask_rows(kpm, rt.layout)).view(B, L, *values.shape[1:])
    return out if seq_axis == 1 else out.transpose(0, 1)
