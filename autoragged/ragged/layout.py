"""The host-side shape of a ragged batch, its device copies and the CoRa prelude.

A `Layout` is immutable host metadata (lengths, alignment, offsets) plus lazily made device copies of
what kernels read (offsets, lengths, prelude, gap rows), cached per device. Layouts made from
(lengths, align) are themselves cached, so q, k, v and every intermediate of one batch share one
layout and one set of device copies.
"""

from __future__ import annotations

import operator
import threading
from collections import OrderedDict
from collections.abc import Sequence
from itertools import accumulate

import numpy as np
import torch

from ..kernels.config import aligned
from .backend import host_to_device

_CACHE_SIZE = 1024
_cache: OrderedDict[tuple[tuple[int, ...], int], Layout] = OrderedDict()
_cache_lock = threading.Lock()
_INT_ONLY = {int}


def as_lengths(lengths: object, *, name: str = "lengths") -> tuple[int, ...]:
    """Host lengths as a tuple of non-negative ints; a clear error for anything else.

    Accepts a sequence of ints, a numpy integer array or a CPU integer tensor. A CUDA tensor is refused:
    reading it would be a hidden device->host sync.
    """
    if type(lengths) in (tuple, list, HostLengths) and (not lengths or set(map(type, lengths)) == _INT_ONLY):
        out = tuple(lengths)  # the hot path: a host sequence of plain ints
    else:
        if isinstance(lengths, torch.Tensor):
            if lengths.device.type != "cpu":
                raise TypeError(
                    f"{name} must be on the host, got a tensor on {lengths.device}; pass lengths.tolist() "
                    "(one device->host copy) or build the batch from a key padding mask"
                )
            if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
                raise TypeError(f"{name} must hold integers, got a tensor of {lengths.dtype}")
            lengths = lengths.reshape(-1).tolist()
        elif isinstance(lengths, np.ndarray):
            if lengths.dtype.kind not in "iu":
                raise TypeError(f"{name} must hold integers, got a numpy array of {lengths.dtype}")
            lengths = lengths.reshape(-1).tolist()
        elif not isinstance(lengths, Sequence) or isinstance(lengths, (str, bytes)):
            raise TypeError(f"{name} must be a sequence of ints, got {type(lengths).__name__}")
        try:
            out = tuple(map(operator.index, lengths))
        except TypeError:
            bad = next(v for v in lengths if not _is_index(v))
            raise TypeError(f"{name} must hold ints, got {bad!r} ({type(bad).__name__})") from None
    if out and min(out) < 0:
        i = next(i for i, v in enumerate(out) if v < 0)
        raise ValueError(f"{name}[{i}] = {out[i]} is negative; lengths must be >= 0")
    return out


class HostLengths(tuple):
    """Host lengths read from the very padding mask of the call they come with, before that mask moved to the
    device (sentence-transformers' tokenizer output, models/sentence.py): the runtime takes them as given,
    without reading the mask back to check them (a device->host sync)."""

    __slots__ = ()


def _is_index(v: object) -> bool:
    try:
        operator.index(v)
    except TypeError:
        return False
    return True


def check_align(align: object) -> int:
    if type(align) is not int or align < 1 or align & (align - 1):
        raise ValueError(f"align must be a positive power of two (1 = packed), got {align!r}")
    return align


class Layout:
    """Host metadata of B components stored back to back.

    lengths:  (B,) host ints, the real rows of each component
    offsets:  (B + 1,) host ints, start of each component in values; offsets[-1] <= rows
    align:    every start is a multiple of align and offsets[i+1] - offsets[i] = ceil(lengths[i] / align) * align
              (only for canonical layouts; a view over arbitrary offsets has align 1 and canonical False)
    rows:     rows of values (= offsets[-1] for canonical layouts)
    """

    __slots__ = (
        "lengths",
        "align",
        "offsets",
        "rows",
        "canonical",
        "max_len",
        "total",
        "max_extent",
        "_device",
        "_prelude",
        "_gaps",
        "__weakref__",
    )
    key_lengths = None  # every row is a key (a CUDA graph's static layout may have query-only rows)
    # The rows a batch fills, as a (1,) device tensor, where only the device knows them: a CUDA graph's
    # layout built in the graph (autoragged/graphs/capture.py). Row-wise kernels stop there. A host layout: None.
    live = None
    # The rows the linears' default Triton tiles are picked for where x's rows would mislead: a graph's values
    # have room for every row at full width, and a batch fills a fraction. None: x's rows.
    tile_rows = None

    def __init__(self, lengths: tuple[int, ...], align: int, offsets: tuple[int, ...], rows: int, canonical: bool):
        self.lengths = lengths
        self.align = align
        self.offsets = offsets
        self.rows = rows
        self.canonical = canonical
        self.max_len = max(lengths, default=0)
        self.total = sum(lengths)
        if canonical:
            self.max_extent = -(-self.max_len // align) * align
        else:
            self.max_extent = max((b - a for a, b in zip(offsets, offsets[1:])), default=0)
        self._device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._prelude: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self._gaps: dict[torch.device, torch.Tensor] = {}

    # -- construction -----------------------------------------------------------------------
    @staticmethod
    def make(lengths: tuple[int, ...], align: int = 1) -> Layout:
        """The canonical layout of `lengths` (already validated) with `align`; cached."""
        key = (lengths, align)
        with _cache_lock:
            hit = _cache.get(key)
            if hit is not None:
                _cache.move_to_end(key)
                return hit
        if align == 1:
            offsets = tuple(accumulate(lengths, initial=0))
        else:
            offsets = tuple(accumulate(((n + align - 1) // align * align for n in lengths), initial=0))
        layout = Layout(lengths, align, offsets, offsets[-1], canonical=True)
        with _cache_lock:
            _cache[key] = layout
            if len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
        return layout

    @staticmethod
    def from_offsets(offsets: tuple[int, ...], lengths: tuple[int, ...] | None, rows: int) -> Layout:
        """A layout over given host offsets (validated here); `lengths` default to the offsets' differences."""
        if len(offsets) == 0:
            raise ValueError("offsets must have B + 1 >= 1 entries, got an empty offsets")
        if offsets[0] < 0:
            raise ValueError(f"offsets[0] = {offsets[0]} is negative")
        for i in range(len(offsets) - 1):
            if offsets[i + 1] < offsets[i]:
                raise ValueError(
                    f"offsets decrease at {i}: offsets[{i}] = {offsets[i]} > offsets[{i + 1}] = {offsets[i + 1]}"
                )
        if offsets[-1] > rows:
            raise ValueError(f"offsets[-1] = {offsets[-1]} but values has only {rows} rows")
        extents = [b - a for a, b in zip(offsets, offsets[1:])]
        if lengths is None:
            lengths = tuple(extents)
        elif len(lengths) != len(extents):
            raise ValueError(
                f"{len(lengths)} lengths for {len(extents)} components (offsets has {len(offsets)} entries)"
            )
        for i, (n, e) in enumerate(zip(lengths, extents)):
            if n > e:
                raise ValueError(f"lengths[{i}] = {n} exceeds its extent offsets[{i + 1}] - offsets[{i}] = {e}")
        canonical = offsets[0] == 0 and offsets[-1] == rows and tuple(extents) == tuple(lengths)
        return Layout(lengths, 1, offsets, rows, canonical)

    @staticmethod
    def with_query_rows(keys: tuple[int, ...], device: torch.device) -> QueryRowsLayout:
        """The packed layout of `keys` where each non-empty component ends in one more row, a query only: the
        attention reads its first keys[b] rows as keys (a left-padded row's column 0, a pad the original
        computes and a task head reads, runs as that query row). Not cached: its device keys are its own."""
        lengths = tuple(n + 1 if n else 0 for n in keys)
        offsets = tuple(accumulate(lengths, initial=0))
        layout = QueryRowsLayout(lengths, 1, offsets, offsets[-1], canonical=True)
        layout.keys = keys
        layout.key_lengths = host_to_device(np.asarray(keys, dtype=np.int32), device)
        return layout

    # -- properties -------------------------------------------------------------------------
    @property
    def packed(self) -> bool:
        """Whether the components lie back to back from row 0, each as long as its length (align 1; rows past
        them, if any, are spare: `ragged_from_padded(rows=)`)."""
        return self.align == 1 and self.offsets[0] == 0 and self.offsets[-1] == self.total

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def has_gaps(self) -> bool:
        return self.total != self.rows

    def same_as(self, other: Layout) -> bool:
        return self is other or (
            self.lengths == other.lengths and self.offsets == other.offsets and self.rows == other.rows
        )

    # -- device copies ----------------------------------------------------------------------
    def device_meta(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(offsets (B+1,), lengths (B,)) as int32 on `device`, from one host->device copy; cached."""
        hit = self._device.get(device)
        if hit is None:
            b1, at = len(self.offsets), aligned(len(self.offsets))
            host = np.zeros(at + len(self.lengths), dtype=np.int32)
            host[:b1], host[at:] = self.offsets, self.lengths
            both = host_to_device(host, device)
            hit = (both[:b1], both[at:])  # each view 64-byte aligned (`aligned`): one kernel variant
            self._device[device] = hit
        return hit

    def set_device_offsets(self, offsets: torch.Tensor) -> None:
        """Use a caller's int32 offsets tensor as this layout's device offsets (the view constructors)."""
        lengths = host_to_device(np.asarray(self.lengths, dtype=np.int32), offsets.device)
        self._device[offsets.device] = (offsets, lengths)

    def prelude(self, block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """CoRa prelude for a 1-D grid over the real row blocks of size `block_m`.

        grid_mapping:  (P,) int32, grid_mapping[p] = component of program p; P = sum ceil(lengths / block_m)
        block_offsets: (B + 1,) int32, prefix sum of blocks per component; block p of component b is
                       block p - block_offsets[b] of that component
        Built on the host from `lengths`, copied without blocking, cached per (block_m, device).
        """
        if type(block_m) is not int or block_m < 1:
            raise ValueError(f"block_m must be a positive int, got {block_m!r}")
        key = (block_m, device)
        hit = self._prelude.get(key)
        if hit is None:
            lens = np.asarray(self.lengths, dtype=np.int64)
            counts = (lens + block_m - 1) // block_m
            block_offsets = np.zeros(len(lens) + 1, dtype=np.int32)
            np.cumsum(counts, out=block_offsets[1:])
            grid_mapping = np.repeat(np.arange(len(lens), dtype=np.int32), counts)
            P, at = len(grid_mapping), aligned(len(grid_mapping))
            host = np.zeros(at + len(block_offsets), dtype=np.int32)
            host[:P], host[at:] = grid_mapping, block_offsets
            both = host_to_device(host, device)
            hit = (both[:P], both[at:])
            self._prelude[key] = hit
        return hit

    def gap_rows(self, device: torch.device) -> torch.Tensor | None:
        """int64 indices of the rows of values that belong to no component (None when there are none)."""
        if not self.has_gaps:
            return None
        hit = self._gaps.get(device)
        if hit is None:
            covered = np.zeros(self.rows, dtype=bool)
            lens = np.asarray(self.lengths, dtype=np.int64)
            starts = np.asarray(self.offsets[:-1], dtype=np.int64)
            first = np.repeat(np.cumsum(lens) - lens, lens)
            covered[np.repeat(starts, lens) + np.arange(self.total) - first] = True
            hit = host_to_device(np.flatnonzero(~covered).astype(np.int64), device)
            self._gaps[device] = hit
        return hit

    def __repr__(self) -> str:
        return (
            f"Layout(B={self.batch_size}, total={self.total}, rows={self.rows}, align={self.align}, "
            f"max_len={self.max_len})"
        )


class QueryRowsLayout(Layout):
    """A `Layout` whose non-empty components end in a query-only row (`Layout.with_query_rows`).

    keys:         (B,) host ints, each component's key rows (its real tokens)
    key_lengths:  (B,) int32 on the device, the same (what the attention kernel reads)
    """

    __slots__ = ("keys", "key_lengths")
