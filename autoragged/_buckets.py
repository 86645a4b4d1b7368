"""Shape buckets of the CUDA-graph arms (pure arithmetic, shared by the runtime and the cost model).

A graph replays fixed shapes, so each batch runs in the smallest bucket that holds it and the rest of
the bucket is real work: rows the linears compute and nothing reads. Ladders grow geometrically (8
steps per octave for the ragged rows and the padded length) so a handful of graphs covers a workload.
"""

from __future__ import annotations

import functools
import math

from .kernels._config import next_pow2  # (kernels._config imports neither torch nor triton)

__all__ = [
    "ladder", "ragged_bucket", "padded_bucket", "mask_width", "mask_rungs", "mask_rungs_fit", "mask_tokens",
    "widen_mask", "cublas_rows", "LADDER_VERSION",
]  # fmt: skip

# Bumped whenever a bucket function changes: graph-arm measurements taken under another ladder describe
# other work, and the cost model's fit leaves them out (recorded as Measurement.extra["ladder"]).
# 3: the cuBLAS ragged graph runs its rung's rows or one more, whichever replays faster (_graphs._ROW_CHOICE).
LADDER_VERSION = 3


def ladder(n: int, *, floor: int, multiple: int, steps: int = 4) -> int:
    """The smallest rung >= n of 2**(k / steps), rounded up to `multiple`, and at least `floor`."""
    if n <= floor:
        return floor
    rung = 2 ** (math.ceil(math.log2(n) * steps - 1e-9) / steps)
    return max(floor, -(-math.ceil(rung) // multiple) * multiple)


@functools.lru_cache(maxsize=4096)  # on every graph call: the cache hit costs a fraction of the arithmetic
def ragged_bucket(rows: int, batch: int, max_len: int) -> tuple[int, int, int]:
    """(rows, components, max_len) of the ragged graph that runs a batch of `rows` values rows (alignment
    included), `batch` components and longest component `max_len`; spare components have length 0.
    Rows climb 8 rungs per octave (at most ~9% spare rows): with 4, the spare rows of big batches cost
    more than the replay saved (H100, 2026-11-22: RACE B=64 and SQuAD B=128, +7-16%). A graph with cuBLAS
    linears may run one row more than the rung (`_graphs._ROW_CHOICE`)."""
    return ladder(rows, floor=256, multiple=128, steps=8), next_pow2(max(batch, 1)), next_pow2(max(max_len, 1))


@functools.lru_cache(maxsize=4096)
def padded_bucket(batch: int, seq_len: int) -> tuple[int, int]:
    """(batch, padded length) of the padded graph: the batch as it is, the length on a ladder."""
    return batch, ladder(seq_len, floor=16, multiple=16, steps=8)


@functools.lru_cache(maxsize=4096)
def mask_width(seq_len: int) -> int:
    """The padded length of the ragged graph fed the mask (`GraphCache.ragged_mask`): 2 rungs per octave. Its
    linears and attention stop at the rows and lengths the device counts, so a wider bucket costs memory and
    the embedding step over the spare columns, not the layers' work; and each bucket a stream meets is a
    capture (bert-base: 20-30 ms). On the padded graph's 8 rungs per octave, a 64-batch stream of new batches
    (MNLI B=32, after 24 warm-up batches) still met two new buckets: 53 ms of captures in 112 ms (H200,
    2026-11-25, `benchmarks/stream_table.py --quick --models bert-base`)."""
    return ladder(seq_len, floor=16, multiple=16, steps=2)


def widen_mask(top: list[int] | None, width: int, narrowest: int, batch: int) -> int:
    """The width of a new mask graph of `batch` rows (`GraphCache.ragged_mask`): `width`, or the next
    `mask_width` rung where the widest padded length this batch size has brought (`top`: [that length, the
    batches that had it, the batches]) fills the top quarter of `width` and is no cap (fewer than max(2, a
    quarter) of the batches reach it: a tokenizer's max_length pads every batch to it, and none comes wider);
    at most 2x `narrowest` (the batch's own width: a graph serves batches up to 2x narrower) and _RUNG_CAPACITY
    rows (the short rows, where a read costs a large share of a batch, fit; a long row's graph holds GBs).
    The widest of n batches is passed by the next with probability near 1/(n+1), so a stream soon brings a
    batch past a graph whose width its longest batch fills. A graph of the next width serves that batch, where
    the narrower one's shape reads its lengths and runs its read path eagerly, at first sight of its bucket:
    CoRa, CoLA B=32, widths reached 20-32 in the warm-up, and the stream's first L of 33 took 6.9 ms of GPU
    time against 0.24 a batch (H100, 2026-11-26, `vt2_cora_short_h100.json`). The graph is made at a shape's
    third batch, so the bound is a quarter, not less: an eighth missed that stream's first batches. The spare
    columns cost the graph's embedding step and memory, not the layers' work."""
    if top is None:
        return width
    longest, at_top, seen = top
    if longest > width or 4 * longest < 3 * width or at_top >= max(2, seen / 4):
        return width
    wider = mask_width(width + 1)
    return wider if wider <= 2 * narrowest and batch * wider <= _RUNG_CAPACITY else width


# mask_rungs: the batches of one mask graph (B, mask_width) fill rows around the judged batch's; the fine rungs
# cover these shares of it (4 rungs of 8 per octave span 1.41x). A batch's tokens are a sum of B lengths: over 400
# draws of each CoRa row, grouped by mask width, 90% fell within 0.87-1.15x of their group's median at B=32
# (MNLI, the widest), 0.93-1.08x at B=128. Other batches share the graph too (another source of the same B and
# width: in one process the HF table's B=128 rows of MRPC, XNLI and Wiki128 met one graph, captured for the first
# one's tokens, and ran its Triton branch; H200, 2026-11-26): coarser rungs, 4 per octave, cover the rest of the
# capacity above and down to 0.6x, as many as fit in _MAX_RUNGS.
_RUNG_LOW, _RUNG_HIGH, _FINE_RUNGS, _MAX_RUNGS, _COARSE_LOW = 0.85, 1.2, 4, 7, 0.6
# no rungs for a graph of more rows than this: the branches' graphs share little memory, and HF bert-base's
# RACE B=128 mask graph (65,536 rows) held 11.2 GB, after which its stream read its lengths and captured the read
# path's graph mid-stream (cold after `warmup()` 1.39x the warm stream; H200, 2026-11-26). Its batches' work
# dwarfs what the branches save there; the short rows, where they pay, fit in 16,384 rows up to B=128
_RUNG_CAPACITY = 16384
# below this share of the lowest rung the Triton branch does less work than cuBLAS on the whole rung (the
# analytic prior's Triton linear runs at 0.7x cuBLAS's rate)
_RUNG_FLOOR = 0.7


def mask_rungs_fit(capacity: int) -> bool:
    """Whether a ragged graph fed the mask of `capacity` rows (batch x mask width) gets cuBLAS branches."""
    return capacity <= _RUNG_CAPACITY


@functools.lru_cache(maxsize=4096)
def mask_rungs(tokens: int, capacity: int) -> tuple[tuple[int, int], ...]:
    """The cuBLAS branches of a ragged graph fed the mask whose batches are expected to fill about `tokens`
    rows of its `capacity` (batch x mask width): (lowest, rows) per branch, a batch of T counted rows taking
    the branch with lowest < T <= rows. Fine rungs, the ragged graph's (`ragged_bucket`, 8 per octave), from
    0.85x to 1.2x `tokens` (at most 4), then coarse ones (4 per octave) up to the capacity and down to 0.6x
    `tokens`, alternately, at most 7 in all; none past the capacity (the capacity itself where the rungs would
    pass it). The lowest rung also takes batches down to 0.7x its rows (all of them at the ladder's floor).
    Empty where no rung fits (`tokens` <= 0 or past the capacity) or the capacity passes 16,384 rows: the graph
    has its Triton branch alone."""
    if tokens <= 0 or tokens > capacity or not mask_rungs_fit(capacity):
        return ()
    fine = functools.partial(ladder, floor=256, multiple=128, steps=8)
    coarse = functools.partial(ladder, floor=256, multiple=128, steps=4)
    r, top = fine(max(1, int(tokens * _RUNG_LOW))), fine(max(1, int(tokens * _RUNG_HIGH)))
    rows: list[int] = []
    while r <= min(top, capacity) and len(rows) < _FINE_RUNGS:
        rows.append(r)
        r = fine(r + 1)
    if not rows:  # the first fine rung passes the capacity: the capacity itself
        rows.append(capacity)
    below = int(tokens * _COARSE_LOW)
    while len(rows) < _MAX_RUNGS:
        grew = False
        if rows[-1] < capacity:
            rows.append(min(capacity, coarse(rows[-1] + 1)))
            grew = True
        if len(rows) < _MAX_RUNGS and int(rows[0] * _RUNG_FLOOR) > below:
            lower = coarse(int(rows[0] * _RUNG_FLOOR))  # (takes what the rung above it leaves)
            if lower < rows[0]:
                rows.insert(0, lower)
                grew = True
        if not grew:
            break
    # (the ladder's floor, 256 rows, is launch-bound: any fewer rows take it)
    lows = [0 if rows[0] <= 256 else int(rows[0] * _RUNG_FLOOR), *rows[:-1]]
    return tuple(zip(lows, rows))


@functools.lru_cache(maxsize=4096)
def mask_tokens(tokens: int) -> int:
    """The tokens bucket of a ragged graph fed the mask with cuBLAS branches (2 per octave; part of its key): its
    rungs center on the tokens of the batch it was captured for, so batches of one (B, mask width) but other
    token counts (another source of the same widths) get a graph of their own rather than its Triton branch."""
    return ladder(max(tokens, 1), floor=256, multiple=128, steps=2)


_CUBLAS_LADDER_ROWS = 8192  # cublas_rows: the ladder up to here, whole blocks of _CUBLAS_BLOCK rows beyond
_CUBLAS_BLOCK = 1024


@functools.lru_cache(maxsize=4096)
def cublas_rows(rows: int) -> int:
    """The rows the eager ragged arm gives its cuBLAS linears for a batch of `rows` packed rows; the spare rows
    belong to no sequence and nothing reads them. cuBLAS pays a first call per problem shape (its heuristic
    query): on the H200 host (CUDA 13.0, 2026-11-26) an fp16 `F.linear` on a row count never seen before took
    0.14-0.30 ms of host time (median over 40 new counts per weight shape, 3-5 ms at worst) against 19-33 us
    on one seen before (`benchmarks/cublas_rows.py`). A stream of new batches brings a new token count every
    batch, so every eager run paid it per weight shape. Up to 8,192 rows: the ragged graph's rung (8 per
    octave, at most ~9% spare; the graph captures of a rung pay its first calls too). Beyond, where the
    linears' time grows with the rows and the graph's rung cost the latency table's eager rows 7-9% (bert-base,
    RACE B=64/128 and Wiki512 B=64), whole blocks of 1,024 rows: at most 12.5% spare at 8K rows, 2.5% at 40K."""
    if rows <= _CUBLAS_LADDER_ROWS:
        return ladder(rows, floor=256, multiple=128, steps=8)
    return -(-rows // _CUBLAS_BLOCK) * _CUBLAS_BLOCK
