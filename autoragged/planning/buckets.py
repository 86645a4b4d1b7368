"""Shape arithmetic shared by the runtime and the cost model (no torch): the ragged graph's width rung, the eager
arm's cuBLAS row rungs, and the bucketed row counts the cost model's features describe a batch with. Ladders grow
geometrically, so a handful of rungs covers a workload.
"""

from __future__ import annotations

import functools
import math

from ..kernels.config import next_pow2  # (kernels.config imports neither torch nor triton)

__all__ = ["ladder", "ragged_bucket", "padded_bucket", "mask_width", "cublas_rows", "LADDER_VERSION"]

# Bumped whenever what a graph arm computes changes: the cost model's fit leaves out measurements of another
# version (Measurement.extra["ladder"]). 6: a graph per batch size and `mask_width`.
LADDER_VERSION = 6


def ladder(n: int, *, floor: int, multiple: int, steps: int = 4) -> int:
    """2**(k / steps) for the smallest k where that is >= n, rounded up to `multiple`, and at least `floor`. The
    rung is picked before rounding, so an n between a rung and its rounded value takes the next one (steps 2,
    multiple 16: 96 -> 128, the rung 90.5 rounding to 96); changing that re-keys graphs and cost-model features."""
    if n <= floor:
        return floor
    rung = 2 ** (math.ceil(math.log2(n) * steps - 1e-9) / steps)
    return max(floor, -(-math.ceil(rung) // multiple) * multiple)


@functools.lru_cache(maxsize=4096)
def ragged_bucket(rows: int, batch: int, max_len: int) -> tuple[int, int, int]:
    """(rows on a ladder of 8 rungs per octave, components and max_len to powers of two): how a cost-model feature
    describes the packed batch (`costmodel.features`)."""
    return ladder(rows, floor=256, multiple=128, steps=8), next_pow2(max(batch, 1)), next_pow2(max(max_len, 1))


@functools.lru_cache(maxsize=4096)
def padded_bucket(batch: int, seq_len: int) -> tuple[int, int]:
    """(batch, padded length on a ladder of 8 rungs per octave): how a cost-model feature describes the padded
    rectangle."""
    return batch, ladder(seq_len, floor=16, multiple=16, steps=8)


@functools.lru_cache(maxsize=4096)
def mask_width(seq_len: int) -> int:
    """The width of the ragged graph of a batch padded to `seq_len` (2 rungs per octave, floor 16). The layers stop
    at the rows the batch fills, so a wider graph costs memory and its programs that find no row, not the layers'
    work; a graph serves batches up to four times narrower (graphs/cache.py)."""
    return ladder(seq_len, floor=16, multiple=16, steps=2)


_CUBLAS_LADDER_ROWS = 8192  # cublas_rows: the ladder up to here, whole blocks of _CUBLAS_BLOCK rows beyond
_CUBLAS_BLOCK = 1024


@functools.lru_cache(maxsize=4096)
def cublas_rows(rows: int) -> int:
    """The rows the eager arm gives its cuBLAS linears for `rows` packed rows (the spare rows are read by nothing):
    cuBLAS's first call on a row count took up to 2.6 ms of host time for a bert-base linear (H200), and a stream
    brings a new token count every batch. A ladder of 8 rungs per octave up to 8,192 rows (at most ~9% spare), then
    whole blocks of 1,024."""
    if rows <= _CUBLAS_LADDER_ROWS:
        return ladder(rows, floor=256, multiple=128, steps=8)
    return -(-rows // _CUBLAS_BLOCK) * _CUBLAS_BLOCK
