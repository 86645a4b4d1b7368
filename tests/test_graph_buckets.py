"""Pieces of the CUDA-graph arms that run anywhere: bucket ladders, the layout a ragged graph builds from
lengths (numpy reference and Triton kernel) and the pointer-addressed pack / unpack it replays with (the
kernels run compiled on CUDA, in the interpreter on CPU)."""

import numpy as np
import pytest
import torch
from autoragged.kernels import graph_args, graph_layout, ragged_pack
from autoragged.kernels.graph_layout import layout_ref as _host_meta
from autoragged.kernels.graph_layout import meta_size
from conftest import DEVICES, triton_available
from hypothesis import given, settings
from hypothesis import strategies as st

from autoragged._buckets import ladder, mask_rungs, mask_tokens, mask_width, padded_bucket, ragged_bucket
from autoragged._layout import Layout

TRITON_DEVICES = [d for d in DEVICES if triton_available(d)]


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
    offsets, lens, grid, block_offsets = graph_layout.sections(meta, batch, programs)
    assert [len(s) for s in (offsets, lens, grid, block_offsets)] == [batch + 1, batch, programs, batch + 1]
    assert offsets[: B + 1].tolist() == list(layout.offsets) and (offsets[B:] == layout.rows).all()
    assert lens[:B].tolist() == list(lengths) and (lens[B:] == 0).all()  # spare components are empty
    counts = [-(-n // block_m) for n in lengths]
    assert grid[: sum(counts)].tolist() == [b for b, c in enumerate(counts) for _ in range(c)]
    assert (grid[sum(counts) :] == -1).all()  # spare programs exit
    assert block_offsets[: B + 1].tolist() == [0, *np.cumsum(counts).tolist()]
    assert sum(counts) <= programs  # the bucket's grid always has room


def test_host_meta_writes_into_a_given_buffer():  # the numpy reference of kernels/graph_layout.py
    buf = np.full(meta_size(4, 10), 7, dtype=np.int32)
    meta, rows, _ = _host_meta([3, 1], 1, 16, 4, 10, buf)
    assert meta is buf and rows == 4 and buf[:5].tolist() == [0, 3, 4, 4, 4]


@pytest.mark.parametrize("n", [1, 100, 256, 257, 1000, 4097, 46913, 10**6])
def test_ladders_hold_the_batch_with_bounded_waste(n):
    r = ladder(n, floor=256, multiple=128)
    assert r >= n and r % 128 == 0 and (n < 256 or r <= n * 1.2 + 128)
    b, L = padded_bucket(32, n)
    assert b == 32 and L >= n and L % 16 == 0 and (n < 16 or L <= n * 1.1 + 16)
    w = mask_width(n)  # the mask graph's: 2 rungs an octave
    assert w >= L and w % 16 == 0 and (n < 16 or w <= n * 1.42 + 16)


@pytest.mark.parametrize("n", [257, 1000, 4097, 46913, 10**6])
def test_ragged_graph_rows_waste_at_most_a_ninth(n):
    rows = ragged_bucket(n, 8, 64)[0]
    assert rows >= n and rows % 128 == 0 and rows <= n * 1.095 + 128


@given(st.integers(1, 40_000), st.integers(1, 70_000))
def test_mask_rungs_rise_within_the_capacity_and_hold_the_tokens(tokens, capacity):
    """The cuBLAS branches of a mask graph (runtime/capture.py, `_Rungs`): rising rows, none past the capacity,
    at most 7, each branch taking the rows above the previous one's, whole multiples of 128 rows or the capacity;
    a batch of the expected tokens fits one where the capacity holds it."""
    rungs = mask_rungs(tokens, capacity)
    assert len(rungs) <= 7
    rows = [r for _, r in rungs]
    assert rows == sorted(set(rows)) and all(r <= capacity for r in rows)
    assert all(r % 128 == 0 or r == capacity for r in rows)
    assert all(low == prev for (low, _), prev in zip(rungs[1:], rows))
    if tokens <= capacity <= 16384:
        assert rungs and rungs[0][0] < rows[0] and any(low < tokens <= r for low, r in rungs)
    else:
        assert rungs == ()  # (past 16,384 rows the branches' memory outweighs what they save)


def test_mask_rungs_are_fine_around_the_tokens_and_coarse_beyond():
    # fine (8 per octave) from 0.85x to 1.2x of 7405, then 4 per octave above, one below
    assert mask_rungs(7405, 128 * 128) == (
        (3494, 4992), (4992, 6400), (6400, 6912), (6912, 7552), (7552, 8192), (8192, 9856), (9856, 11648)
    )  # fmt: skip
    assert mask_rungs(4096, 4096) == ((2060, 2944), (2944, 3840), (3840, 4096))  # the capacity: every column real
    assert mask_rungs(100, 512) == ((0, 256), (256, 384), (384, 512))  # the ladder's floor takes any fewer rows
    assert mask_rungs(0, 512) == () and mask_rungs(5000, 4096) == ()
    assert mask_rungs(20_000, 128 * 256) == ()  # past 16,384 rows: the Triton branch alone
    assert [mask_tokens(n) for n in (1, 256, 257, 329, 384, 385)] == [256, 256, 384, 384, 512, 512]  # 2 an octave


def test_the_switch_node_picks_the_first_bound_holding_the_count_else_the_last_branch():
    """runtime/_cuda_if.py: the device kernel's reference, and the driver's node-parameter layout (CUDA's
    CUgraphNodeParams: 256 bytes, the conditional parameters at byte 16)."""
    import ctypes

    from autoragged.runtime import _cuda_if

    bounds = ((0, 256), (256, 384), (384, 512))
    assert [_cuda_if.pick_branch_ref(n, bounds) for n in (0, 1, 256, 257, 384, 512, 513)] == [3, 0, 0, 1, 1, 2, 3]
    assert _cuda_if.pick_branch_ref(5, ()) == 0
    assert ctypes.sizeof(_cuda_if._NodeParams) == 256 and _cuda_if._NodeParams.conditional.offset == 16
    assert ctypes.sizeof(_cuda_if._ConditionalParams) == 32
    if not torch.cuda.is_available():
        assert _cuda_if.why_not(0) is not None  # says why, raises nothing


def test_layout_reference_refuses_a_grid_too_small():
    with pytest.raises(ValueError, match="do not fit 2 programs"):
        _host_meta([40], 1, 16, 1, 2)


def _args(lengths, batch, B=None, L=0, x=None, out=None):
    """The per-batch args of a ragged graph (kernels/ragged_pack.py), on x's device."""
    head = [0] * ragged_pack.ARGS_HEAD
    if x is not None:
        head[:6] = [x.data_ptr(), out.data_ptr(), *x.stride()[:2], *out.stride()[:2]]
    head[ragged_pack.ARG_B], head[ragged_pack.ARG_L] = len(lengths) if B is None else B, L
    device = x.device if x is not None else "cpu"
    return torch.tensor(head + list(lengths) + [0] * (batch - len(lengths)), dtype=torch.int64, device=device)


# spare components, empty ones, a component longer than a row block, one whose rows fill the bucket
LAYOUT_CASES = [([5, 0, 13, 2], 8, 4, 4), ([1], 1, 1, 16), ([0, 0], 4, 8, 16), ([33, 7, 64, 1, 0], 8, 16, 16),
                ([300, 2, 17], 4, 1, 64)]  # fmt: skip


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("lengths,batch,align,block_m", LAYOUT_CASES)
def test_layout_kernel_matches_the_reference(device, lengths, batch, align, block_m):
    rows = ragged_bucket(Layout.make(tuple(lengths), align).rows, batch, max(lengths, default=1))[0]
    programs = rows // block_m + batch
    meta = torch.full((meta_size(batch, programs),), 12345, dtype=torch.int32, device=device)  # poison
    graph_layout.layout(_args(lengths, batch).to(device), meta, batch, programs, block_m, align)
    want, _, _ = _host_meta(lengths, align, block_m, batch, programs)
    got = meta.cpu().numpy()
    for section, expected in zip(
        graph_layout.sections(got, batch, programs), graph_layout.sections(want, batch, programs)
    ):
        assert section.tolist() == expected.tolist()
    written = np.zeros(got.size, dtype=bool)
    for section in graph_layout.sections(written, batch, programs):
        section[:] = True
    assert (got[~written] == 12345).all()  # the padding between sections is never written


@pytest.mark.parametrize("batch", [1, 3, 16, 100, 128])
@pytest.mark.parametrize("programs", [1, 17, 64, 301])
def test_every_layout_view_is_64_byte_aligned(batch, programs):
    """Triton compiles a variant per pointer alignment: the views a graph's and an eager batch's kernels read
    start at multiples of 16 int32 elements, whatever the batch and program count (one variant for all)."""
    meta = torch.zeros(meta_size(batch, programs, True), dtype=torch.int32)
    views = [*graph_layout.sections(meta, batch, programs), graph_layout.key_lengths(meta, batch, programs)]
    assert all(v.storage_offset() % 16 == 0 for v in views)
    lengths = tuple(range(batch))
    layout = Layout.make(lengths, 1)
    eager = [*layout.device_meta(torch.device("cpu")), *layout.prelude(16, torch.device("cpu"))]
    assert all(v.storage_offset() % 16 == 0 for v in eager)
    assert eager[1].tolist() == list(lengths) and eager[3].tolist()[-1] == sum(-(-n // 16) for n in lengths)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("n_args,slots,spare", [(1, 1, 0), (11, 3, 2), (45, 8, 0)])
def test_graph_args_fetch_follows_the_stamps(device, n_args, slots, spare):
    """The graph's first kernel takes the slot of the next stamp, over several laps of the ring; a replay
    with no batch posted gets zero args and a counted miss, and the next posted batch still matches."""
    ring = torch.zeros(slots, n_args + 1 + spare, dtype=torch.int64)
    ring = ring.pin_memory() if device == "cuda" else ring
    args = torch.full((n_args,), -5, dtype=torch.int64, device=device)
    state = torch.zeros(2, dtype=torch.int64, device=device)
    ref_args, ref_state = np.full(n_args, -5, dtype=np.int64), np.zeros(2, dtype=np.int64)
    rng = np.random.default_rng(n_args)
    stamp = 0
    for step in range(3 * slots + 4):
        if step % 4 != 3:  # every fourth replay finds nothing posted (a stale stamp from the previous lap)
            stamp += 1
            ring[stamp % slots] = torch.from_numpy(rng.integers(-(2**62), 2**62, ring.shape[1]))
            ring[stamp % slots, 0] = stamp
        graph_args.fetch(ring, args, state)
        graph_args.fetch_ref(ring.numpy(), ref_args, ref_state)
        assert args.cpu().tolist() == ref_args.tolist() and state.cpu().tolist() == ref_state.tolist()
        if step % 4 == 3:
            assert not ref_args.any()
        else:
            assert ref_args.tolist() == ring[stamp % slots, 1 : 1 + n_args].tolist()
    assert ref_state.tolist() == [stamp, (3 * slots + 4) // 4]


def test_graph_args_fetch_checks_its_buffers():
    ring, state = torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="at most 3 elements"):
        graph_args.fetch(ring, torch.zeros(4, dtype=torch.int64), state)
    with pytest.raises(ValueError, match="ring must be a contiguous 2-D int64"):
        graph_args.fetch(ring.t(), torch.zeros(1, dtype=torch.int64), state)
    with pytest.raises(ValueError, match="state must be 2 int64"):
        graph_args.fetch(ring, torch.zeros(3, dtype=torch.int64), state.int())


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("align", [1, 8])
def test_pack_from_and_unpack_to_follow_the_pointers(device, align):
    """The graph's pack reads a strided input it was not captured with, and its unpack writes a fresh
    strided output: real rows equal the references, pads are zeros, spare components write nothing."""
    lengths, batch, L, D = [5, 0, 13, 2], 8, 14, 24  # L > max(lengths): the tail columns are pads
    g = torch.Generator().manual_seed(0)
    x = torch.randn(L, len(lengths), D, generator=g).to(torch.float16).to(device).transpose(0, 1)  # (B, L, D)
    whole = torch.full((L + 2, len(lengths), D), 7.0, dtype=torch.float16, device=device)
    out = whole.transpose(0, 1)[:, :L]
    args = _args(lengths, batch, L=L, x=x, out=out)
    meta, used, extent = _host_meta(lengths, align, 4, batch, 64 + batch)
    meta = torch.from_numpy(meta).to(device)
    offsets, lens = graph_layout.sections(meta, batch, 64 + batch)[:2]
    values = torch.full((64, D), float("nan"), dtype=torch.float16, device=device)
    ragged_pack.pack_from(args, values, offsets, lens, extent)
    want = ragged_pack.pack_ref(x, meta[: len(lengths) + 1].tolist(), lengths, used)
    assert torch.equal(values[:used], want)  # gap rows included: zeros
    assert values[used:].isnan().all()  # nothing past the components
    ragged_pack.unpack_to(args, values, offsets, lens, 16)
    want_out = ragged_pack.unpack_ref(values, meta[: len(lengths) + 1].tolist(), lengths, torch.empty_like(x), 0.0)
    assert torch.equal(out, want_out)
    assert (whole[L:] == 7).all()  # past ARG_L: untouched


def _awkward_mask(B, L, device, seed=0):
    """Random holes, an all-pad row, a full row, left padding, right padding."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, L, generator=g) < 0.4
    mask[0], mask[1] = True, False
    mask[2, : L // 3], mask[2, L // 3 :] = True, False
    mask[3, : L - 5], mask[3, L - 5 :] = False, True
    return mask.to(device)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize(
    "B,L,batch,width,batch_first,first",
    [(5, 37, 8, 48, True, False), (4, 70, 4, 80, False, False), (6, 16, 6, 16, True, False),
     (5, 37, 8, 48, True, True), (6, 16, 6, 16, False, True)],
)  # fmt: skip
def test_masked_pack_and_layout_follow_any_padding_pattern(device, B, L, batch, width, batch_first, first):
    """The ragged graph fed a mask: its layout counts each row's real tokens and lays the rows back to
    back, pack fills them in order, unpack puts them back and zeros the pads, whatever the pattern; the
    grid's spare rows (batch > B) are empty, and nothing past the batch's tokens is written. With
    first_column, a row whose column 0 is a pad and which has real tokens gets that column as one more
    row after them (a query-only row), and unpack writes it back to column 0; all-pad rows get none, and
    unpack writes NaN over them (the original computes their pads; the graph cannot)."""
    from autoragged.kernels import masked_pack

    D = 24
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, L, D, generator=g).to(torch.float16).to(device)
    if not batch_first:  # (L, B, D) storage, read through its batch-major view
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    mask = _awkward_mask(B, L, device)
    whole = torch.full((B, L + 3, D), 7.0, dtype=torch.float16, device=device)
    out = whole[:, :L]
    args = torch.tensor(
        [x.data_ptr(), out.data_ptr(), *x.stride()[:2], *out.stride()[:2], B, L, mask.data_ptr(), *mask.stride()],
        dtype=torch.int64, device=device,
    )  # fmt: skip
    assert args.numel() == masked_pack.MASK_ARGS
    programs = batch * width // 16 + batch
    meta = torch.full((meta_size(batch, programs, first),), 12345, dtype=torch.int32, device=device)
    graph_layout.layout(args, meta, batch, programs, 16, 1, from_mask=True, first_column=first)
    keys = (~mask).sum(1).tolist()
    lens = [n + int(first and n > 0 and bool(mask[b, 0])) for b, n in enumerate(keys)]
    if first:  # the awkward mask has left-padded rows: some rows gain a query-only row
        assert lens != keys
        assert graph_layout.key_lengths(meta, batch, programs).cpu().tolist() == keys + [0] * (batch - B)
    want_meta, total, _ = _host_meta(lens, 1, 16, batch, programs)
    got = graph_layout.sections(meta.cpu(), batch, programs)  # offsets, lengths, grid, blocks
    assert [s.tolist() for s in got] == [s.tolist() for s in graph_layout.sections(want_meta, batch, programs)]
    offsets = meta[: batch + 1]
    values = torch.full((batch * width, D), float("nan"), dtype=torch.float16, device=device)
    masked_pack.pack_masked(args, values, offsets, batch, width, first)
    want = masked_pack.pack_masked_ref(x, mask, torch.full_like(values, float("nan")), want_meta[:B], first)
    assert torch.equal(values[:total], want[:total])
    assert values[total:].isnan().all()  # nothing past the batch's tokens
    masked_pack.unpack_masked(args, values, offsets, batch, width, first)
    want_out = masked_pack.unpack_masked_ref(values, mask, torch.empty_like(x), want_meta[:B], first)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0, equal_nan=True)
    # row 0 has no real token: with first_column (the original computes its pads) NaN, never a quiet zero
    assert out[0].isnan().all() if first else (out[0] == 0).all()
    assert not out[1:].isnan().any()
    left = [b for b in range(B) if bool(mask[b, 0]) and keys[b] > 0]
    assert left and (out[left, 0] != 0).any() == first  # column 0 of left-padded rows: written back, or zeros
    assert (whole[:, L:] == 7).all()


def test_a_layout_from_a_mask_is_packed():
    args = torch.zeros(11, dtype=torch.int64)
    meta = torch.zeros(meta_size(2, 4), dtype=torch.int32)
    with pytest.raises(ValueError, match="back to back"):
        graph_layout.layout(args, meta, 2, 4, 16, 8, from_mask=True)
    with pytest.raises(ValueError, match="from_mask"):
        graph_layout.layout(args, meta, 2, 4, 16, 1, first_column=True)
    with pytest.raises(ValueError, match=f"meta must be int32 of {meta_size(2, 4, True)}"):  # room for the key lengths
        graph_layout.layout(args, meta, 2, 4, 16, 1, from_mask=True, first_column=True)


class _FakeGraph:
    def __init__(self, runtime, module, config, causal, key, dtype, device, pool):
        self.rows, self.config = key[0], config


@pytest.mark.parametrize(
    ("backend", "times", "rows", "made"),
    [
        ("triton", None, 1024, 1),  # Triton linears stop at the batch's rows: nothing to choose
        ("cublas", [2.0, 1.8], 1025, 2),  # one row more replays faster: kept
        ("cublas", [2.0, 1.99], 1024, 2),  # within _ROW_MARGIN: the rung
        ("cublas", [1.8, 2.0], 1024, 2),
    ],
)
def test_a_cublas_ragged_graph_keeps_the_faster_of_its_rung_and_one_row_more(monkeypatch, backend, times, rows, made):
    from torch import nn

    from autoragged._planner import graph_config
    from autoragged.adapters.torch_encoder import TorchEncoderBody
    from autoragged.runtime import graphs as _graphs

    made_rows, timed = [], []
    monkeypatch.setattr(_graphs, "_RaggedGraph", lambda *a: made_rows.append(a[4][0]) or _FakeGraph(*a))
    monkeypatch.setattr(_graphs, "replay_ms", lambda graphs: timed.append([g.rows for g in graphs]) or times)
    monkeypatch.setattr(_graphs, "_ROW_CHOICE", {})
    runtime = type("R", (), {"body": TorchEncoderBody(nn.TransformerEncoderLayer(64, 4, 128))})()
    cache = _graphs.GraphCache()
    key = (1024, 8, 64, graph_config(16, 64, backend), False, "padded")
    graph = cache._ragged_rows(runtime, None, key[3], False, key, torch.float16, "cuda")
    assert graph.rows == rows and len(made_rows) == made
    assert timed == ([[1024, 1025]] if backend == "cublas" else [])
    # the choice is remembered: the same bucket captured again (after an eviction, say) is not timed again
    made_rows.clear()
    assert cache._ragged_rows(runtime, None, key[3], False, key, torch.float16, "cuda").rows == rows
    assert made_rows == [rows] and len(timed) == (1 if backend == "cublas" else 0)


def test_a_failed_second_capture_keeps_the_rung_graph(monkeypatch):
    from torch import nn

    from autoragged._planner import graph_config
    from autoragged.adapters.torch_encoder import TorchEncoderBody
    from autoragged.runtime import graphs as _graphs

    def make(*a):
        if a[4][0] == 1025:
            raise RuntimeError("CUDA out of memory")
        return _FakeGraph(*a)

    monkeypatch.setattr(_graphs, "_RaggedGraph", make)
    monkeypatch.setattr(_graphs, "replay_ms", lambda graphs: pytest.fail("nothing to compare"))
    monkeypatch.setattr(_graphs, "_ROW_CHOICE", {})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    runtime = type("R", (), {"body": TorchEncoderBody(nn.TransformerEncoderLayer(64, 4, 128))})()
    key = (1024, 8, 64, graph_config(16, 64, "cublas"), False, "padded")
    assert _graphs.GraphCache()._ragged_rows(runtime, None, key[3], False, key, torch.float16, "cuda").rows == 1024
    assert list(_graphs._ROW_CHOICE.values()) == [1024]
