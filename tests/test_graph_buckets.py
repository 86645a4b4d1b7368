"""CPU-side pieces of the CUDA-graph arms: bucket ladders and the static layout metadata."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoragged._buckets import ladder, padded_bucket, ragged_bucket
from autoragged._graphs import _host_meta, meta_size
from autoragged._layout import Layout


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 300), min_size=0, max_size=40),
    align=st.sampled_from([1, 8, 16]),
    block_m=st.sampled_from([16, 32, 64]),
)
def test_host_meta_matches_the_layout_and_prelude(lengths, align, block_m):
    layout = Layout.make(tuple(lengths), align)
    rows, batch, max_len = ragged_bucket(layout.rows, len(lengths), layout.max_len)
    assert rows >= layout.rows and batch >= len(lengths) and max_len >= layout.max_len
    programs = rows // block_m + batch
    meta, used_rows, max_extent = _host_meta(lengths, align, block_m, batch, programs)
    assert meta.size == meta_size(batch, programs) and used_rows == layout.rows
    assert max_extent == layout.max_extent
    B = len(lengths)
    offsets, lens = meta[: batch + 1], meta[batch + 1 : 2 * batch + 1]
    grid, block_offsets = meta[2 * batch + 1 : 2 * batch + 1 + programs], meta[2 * batch + 1 + programs :]
    assert offsets[: B + 1].tolist() == list(layout.offsets) and (offsets[B:] == layout.rows).all()
    assert lens[:B].tolist() == list(lengths) and (lens[B:] == 0).all()  # spare components are empty
    counts = [-(-n // block_m) for n in lengths]
    assert grid[: sum(counts)].tolist() == [b for b, c in enumerate(counts) for _ in range(c)]
    assert (grid[sum(counts) :] == -1).all()  # spare programs exit
    assert block_offsets[: B + 1].tolist() == [0, *np.cumsum(counts).tolist()]
    assert sum(counts) <= programs  # the bucket's grid always has room


def test_host_meta_writes_into_a_given_buffer():
    buf = np.full(meta_size(4, 10), 7, dtype=np.int32)
    meta, rows, _ = _host_meta([3, 1], 1, 16, 4, 10, buf)
    assert meta is buf and rows == 4 and buf[:5].tolist() == [0, 3, 4, 4, 4]


@pytest.mark.parametrize("n", [1, 100, 256, 257, 1000, 4097, 46913, 10**6])
def test_ladders_hold_the_batch_with_bounded_waste(n):
    r = ladder(n, floor=256, multiple=128)
    assert r >= n and r % 128 == 0 and (n < 256 or r <= n * 1.2 + 128)
    b, L = padded_bucket(32, n)
    assert b == 32 and L >= n and L % 16 == 0 and (n < 16 or L <= n * 1.1 + 16)


@pytest.mark.parametrize("n", [257, 1000, 4097, 46913, 10**6])
def test_ragged_graph_rows_waste_at_most_a_ninth(n):
    rows = ragged_bucket(n, 8, 64)[0]
    assert rows >= n and rows % 128 == 0 and rows <= n * 1.095 + 128
