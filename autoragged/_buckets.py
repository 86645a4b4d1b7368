"""Shape buckets of the CUDA-graph arms (pure arithmetic, shared by the runtime and the cost model).

A graph replays fixed shapes, so each batch runs in the smallest bucket that holds it and the rest of
the bucket is real work: rows the linears compute and nothing reads. Ladders grow geometrically (4
steps per octave: at most ~19% spare rows, ~9% on average) so a handful of graphs covers a workload.
"""

from __future__ import annotations

import math

__all__ = ["ladder", "ragged_bucket", "padded_bucket", "next_pow2"]


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def ladder(n: int, *, floor: int, multiple: int, steps: int = 4) -> int:
    """The smallest rung >= n of 2**(k / steps), rounded up to `multiple`, and at least `floor`."""
    if n <= floor:
        return floor
    rung = 2 ** (math.ceil(math.log2(n) * steps - 1e-9) / steps)
    return max(floor, -(-math.ceil(rung) // multiple) * multiple)


def ragged_bucket(rows: int, batch: int, max_len: int) -> tuple[int, int, int]:
    """(rows, components, max_len) of the ragged graph that runs a batch of `rows` values rows (alignment
    included), `batch` components and longest component `max_len`; spare components have length 0."""
    return ladder(rows, floor=256, multiple=128), next_pow2(max(batch, 1)), next_pow2(max(max_len, 1))


def padded_bucket(batch: int, seq_len: int) -> tuple[int, int]:
    """(batch, padded length) of the padded graph: the batch as it is, the length on a ladder."""
    return batch, ladder(seq_len, floor=16, multiple=16, steps=8)
