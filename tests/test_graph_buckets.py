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

from autoragged.planning.buckets import ladder, mask_width, padded_bucket, ragged_bucket
from autoragged.ragged.layout import Layout

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


def test_mask_width_picks_the_rung_before_rounding():  # as `ladder` says: 90.5 -> 96 holds up to 90, not 96
    assert [mask_width(n) for n in (16, 17, 32, 33, 45, 46, 64, 65, 90, 91, 96, 128, 129, 181, 182)] == [
        16, 32, 32, 48, 48, 64, 64, 96, 96, 128, 128, 128, 192, 192, 256,
    ]  # fmt: skip


@pytest.mark.parametrize("n", [257, 1000, 4097, 46913, 10**6])
def test_ragged_graph_rows_waste_at_most_a_ninth(n):
    rows = ragged_bucket(n, 8, 64)[0]
    assert rows >= n and rows % 128 == 0 and rows <= n * 1.095 + 128


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
    pads = torch.full((batch + 2,), -1, dtype=torch.int32)  # where the graph stores each row's pads: host memory
    pads = pads.pin_memory() if torch.device(device).type == "cuda" else pads
    args = torch.tensor(
        [x.data_ptr(), out.data_ptr(), *x.stride()[:2], *out.stride()[:2], B, L, mask.data_ptr(), *mask.stride(),
         pads.data_ptr()], dtype=torch.int64, device=device,
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
    # each row's pads over the width, from its real tokens (a query-only column 0 is no real token), into host
    # memory; the grid's spare rows and what follows untouched; with no destination (0) nothing is written
    lengths = (graph_layout.key_lengths if first else lambda *a: graph_layout.sections(*a)[1])(meta, batch, programs)
    masked_pack.post_pads(args, lengths, width, batch)
    torch.cuda.synchronize() if torch.device(device).type == "cuda" else None
    assert pads.tolist() == [width - n for n in keys] + [-1] * (batch + 2 - B)
    assert masked_pack.post_pads_ref(lengths.cpu(), width, B, torch.full_like(pads, -1)).tolist() == pads.tolist()
    pads.fill_(-1)
    args[masked_pack.ARG_PADS] = 0
    masked_pack.post_pads(args, lengths, width, batch)
    torch.cuda.synchronize() if torch.device(device).type == "cuda" else None
    assert (pads == -1).all()


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("batch,n_rows", [(1, 1), (3, 2), (5, 5)])
def test_post_pads_stores_each_rows_pads_in_host_memory(device, batch, n_rows):
    """A mask graph's pad counts go straight into (pinned) host memory: width - length for the batch's rows, nothing
    for the grid's spare rows or past them, and nothing at all without a destination."""
    from autoragged.kernels import masked_pack

    cuda = torch.device(device).type == "cuda"
    pads = torch.full((batch + 1,), -1, dtype=torch.int32)
    pads = pads.pin_memory() if cuda else pads
    lengths = torch.tensor([7, 0, 30, 2, 16][:batch], dtype=torch.int32, device=device)
    args = torch.zeros(masked_pack.MASK_ARGS, dtype=torch.int64)
    args[6], args[masked_pack.ARG_PADS] = n_rows, pads.data_ptr()  # ARG_B
    masked_pack.post_pads(args.to(device), lengths, 32, batch)
    torch.cuda.synchronize() if cuda else None
    want = masked_pack.post_pads_ref(lengths.cpu(), 32, n_rows, torch.full_like(pads, -1))
    assert pads.tolist() == want.tolist() == [32 - n for n in lengths.tolist()[:n_rows]] + [-1] * (batch + 1 - n_rows)
    with pytest.raises(ValueError, match="lengths must be int32"):
        masked_pack.post_pads(args.to(device), lengths.long(), 32, batch)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize(
    "B,L,batch,width,D,first,pad_position,with_types,dtype",
    [(5, 37, 8, 48, 24, False, None, True, torch.float32), (5, 70, 6, 80, 40, True, 1, True, torch.float32),
     (6, 130, 6, 144, 24, True, None, False, torch.float32), (4, 16, 4, 16, 48, False, 1, False, torch.float16)],
)  # fmt: skip
def test_masked_embedding_writes_each_real_token_where_pack_puts_it(
    device, B, L, batch, width, D, first, pad_position, with_types, dtype
):
    """The mask graph's embedding step: word + type + position tables and the LayerNorm, computed for the real
    tokens only, each into the packed row the mask's layout gives it, whatever the padding pattern; positions
    from the columns or counted from the ids (RoBERTa), column 0 of left-padded rows as one more row with
    first_column, spans of several programs per row (L > 16); nothing else written."""
    from autoragged.kernels import masked_embed

    g = torch.Generator().manual_seed(2)
    mask = _awkward_mask(B, L, device)
    ids = torch.randint(0, 50, (B, L), generator=g)
    if pad_position is not None:  # pad ids at the pads and at a few real tokens, as transformers counts them
        ids = ids.masked_fill(mask.cpu() | (torch.rand(B, L, generator=g) < 0.1), pad_position)
    ids = ids.to(device)
    types = torch.randint(0, 2, (B, L), generator=g).to(device) if with_types else None
    table = lambda n: torch.randn(n, D, generator=g).to(dtype).to(device)  # noqa: E731
    tables = masked_embed.Tables(table(50), table(L + 3), table(2), table(1)[0] + 1, table(1)[0], 1e-5, pad_position)
    out = torch.empty(B, L, D, dtype=dtype, device=device)
    args = torch.tensor([ids.data_ptr(), out.data_ptr(), 0, 0, *out.stride()[:2], B, L, mask.data_ptr(),
                         *mask.stride(), 0], dtype=torch.int64, device=device)  # fmt: skip
    programs = batch * width // 16 + batch
    meta = torch.zeros((meta_size(batch, programs, first),), dtype=torch.int32, device=device)
    graph_layout.layout(args, meta, batch, programs, 16, 1, from_mask=True, first_column=first)
    offsets = meta[: batch + 1]
    total = int(offsets[B])
    values = torch.full((batch * width, D), float("nan"), dtype=dtype, device=device)
    masked_embed.embed_masked(args, ids, types, tables, values, offsets, batch, width, first)
    want = masked_embed.embed_masked_ref(ids, types, mask, tables, torch.full_like(values, float("nan")),
                                         offsets.cpu().tolist(), first)  # fmt: skip
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(values[:total], want[:total], rtol=tol, atol=tol)
    assert values[total:].isnan().all()  # nothing past the batch's tokens
    assert total == int((~mask).sum()) + (sum(int(mask[b, 0] and not mask[b].all()) for b in range(B)) if first else 0)
    if pad_position is None:  # an id past its table: that token's row is NaN, the others as before
        real = (~mask).nonzero()
        b, t = real[len(real) // 2].tolist()
        ids[b, t] = 50
        masked_embed.embed_masked(args, ids, types, tables, values, offsets, batch, width, first)
        bad = values[:total].isnan().all(1)
        assert int(bad.sum()) == 1
        torch.testing.assert_close(values[:total][~bad], want[:total][~bad], rtol=tol, atol=tol)


def test_masked_embedding_positions_follow_transformers():
    """Column positions; RoBERTa's counted from the ids (pads keep padding_idx) match transformers' own."""
    from autoragged.kernels.masked_embed import positions_ref
    from transformers.models.roberta.modeling_roberta import RobertaEmbeddings

    ids = torch.tensor([[5, 6, 1, 7, 1], [1, 1, 8, 9, 4]])
    assert positions_ref(ids, None).tolist() == [[0, 1, 2, 3, 4]] * 2
    assert torch.equal(positions_ref(ids, 1), RobertaEmbeddings.create_position_ids_from_input_ids(ids, 1))


def test_a_layout_from_a_mask_is_packed():
    args = torch.zeros(11, dtype=torch.int64)
    meta = torch.zeros(meta_size(2, 4), dtype=torch.int32)
    with pytest.raises(ValueError, match="back to back"):
        graph_layout.layout(args, meta, 2, 4, 16, 8, from_mask=True)
    with pytest.raises(ValueError, match="from_mask"):
        graph_layout.layout(args, meta, 2, 4, 16, 1, first_column=True)
    with pytest.raises(ValueError, match=f"meta must be int32 of {meta_size(2, 4, True)}"):  # room for the key lengths
        graph_layout.layout(args, meta, 2, 4, 16, 1, from_mask=True, first_column=True)


class _Graph:
    def __init__(self, key):
        self.key, self.recorded_on = key, None

    def record(self, pool, stream):
        import threading

        self.recorded_on = threading.current_thread()


def _cache(monkeypatch, cap=None):
    """A GraphCache whose pool and streams are stand-ins (no GPU here); the worker thread is the real one."""
    from autoragged.graphs import cache as _cache_module
    from autoragged.graphs.worker import worker

    monkeypatch.setattr(_cache_module.torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(worker, "stream", lambda device, purpose="warm": purpose)
    cache = _cache_module.GraphCache(cap=cap)
    cache.budget_bytes = 1 << 30
    return cache, worker


def test_a_requested_graph_warms_up_on_the_worker_thread_and_is_recorded_on_the_callers(monkeypatch):
    """The warm-up (compiles, handles) runs in the background; the capture, which forbids device-wide syncs in
    every thread, is recorded on the caller's thread when the runtime says a batch is queued (`record_ready`)."""
    import threading

    from autoragged.graphs.capture import GraphKey

    cache, worker = _cache(monkeypatch)
    key = GraphKey(8, 64, "mask", "x", False)
    threads = []

    def make(pool, stream):
        threads.append(threading.current_thread())
        return _Graph(key)

    assert cache.request(key, make, "cuda", 1 << 20)
    assert not cache.request(key, make, "cuda", 1 << 20)  # pending: asked once
    worker.drain()
    assert threads and threads[0] is not threading.current_thread()
    assert key in cache.pending and cache.lookup(key) is None  # warmed, not recorded yet
    cache.record_ready()
    graph = cache.lookup(key)
    assert graph.key == key and graph.recorded_on is threading.current_thread()
    assert not cache.pending and cache.stats().captures == 1


def test_a_batch_replays_a_kept_graph_up_to_four_times_as_wide_the_narrowest_first(monkeypatch):
    from autoragged.graphs.capture import GraphKey

    cache, _ = _cache(monkeypatch)
    for width in (128, 96, 256):
        key = GraphKey(8, width, "mask", "ids", False)
        cache.capture_now(key, lambda pool, stream, key=key: _Graph(key), "cuda", 1)
    assert cache.lookup(GraphKey(8, 64, "mask", "ids", False)).key.width == 96
    assert cache.lookup(GraphKey(8, 128, "mask", "ids", False)).key.width == 128
    assert cache.lookup(GraphKey(8, 32, "mask", "ids", False)).key.width == 96
    assert cache.lookup(GraphKey(8, 24, "mask", "ids", False)).key.width == 96  # four times as wide at most
    assert cache.lookup(GraphKey(8, 16, "mask", "ids", False)) is None
    assert cache.lookup(GraphKey(8, 64, "mask", "x", False)) is None  # other inputs
    assert cache.lookup(GraphKey(16, 64, "mask", "ids", False)) is None  # another batch size


def test_the_graph_serving_a_key_follows_every_change_of_the_kept_graphs(monkeypatch):
    """`lookup` remembers which graph serves each key; a graph kept, evicted or dropped makes it look again."""
    from autoragged.graphs.capture import GraphKey

    cache, _ = _cache(monkeypatch, cap=2)
    narrow = GraphKey(8, 48, "mask", "ids", False)

    def capture(width):
        key = GraphKey(8, width, "mask", "ids", False)
        return cache.capture_now(key, lambda pool, stream: _Graph(key), "cuda", 1)

    assert cache.lookup(narrow) is None and cache.lookup(narrow) is None
    capture(192)
    assert cache.lookup(narrow).key.width == 192
    capture(96)  # narrower: it serves now
    assert cache.lookup(narrow).key.width == 96
    capture(1024)  # the cap is 2: the least recently used (192) goes, 96 still serves
    assert cache.lookup(narrow).key.width == 96 and {k.width for k in cache.graphs} == {96, 1024}
    assert cache.lookup(GraphKey(8, 1024, "mask", "ids", False)).key.width == 1024  # used after 96
    capture(2048)  # 96 is the least recently used now: it goes, and nothing serves
    assert {k.width for k in cache.graphs} == {1024, 2048} and cache.lookup(narrow) is None
    capture(64)
    assert cache.lookup(narrow).key.width == 64
    cache.clear()
    assert cache.lookup(narrow) is None


def test_dropping_the_graphs_gives_their_memory_back(monkeypatch):
    """A pool whose graphs were all freed stays reserved until `empty_cache`: `clear` (parameters moved) calls it
    where it dropped graphs (tests/test_graphs_cuda.py measures the memory)."""
    from autoragged.graphs import cache as _cache_module
    from autoragged.graphs.capture import GraphKey

    cache, _ = _cache(monkeypatch)
    emptied = []
    monkeypatch.setattr(_cache_module.torch.cuda, "empty_cache", lambda: emptied.append(True))
    cache.clear()
    assert emptied == []  # nothing was dropped
    key = GraphKey(8, 64, "mask", "ids", False)
    cache.capture_now(key, lambda pool, stream: _Graph(key), "cuda", 1)
    cache.clear()
    assert emptied == [True] and cache.pool is None and cache.lookup(key) is None


def test_a_failed_capture_is_remembered_and_the_cap_evicts_the_least_recently_used(monkeypatch, caplog):
    from autoragged.graphs.capture import GraphKey

    cache, worker = _cache(monkeypatch, cap=2)
    bad = GraphKey(4, 32, "lengths", "x", False)

    def fail(pool, stream):
        raise RuntimeError("out of memory")

    cache.request(bad, fail, "cuda", 1)
    worker.drain()
    with caplog.at_level("WARNING", logger="autoragged"):
        cache.record_ready()
        assert cache.lookup(bad) is None
    assert "out of memory" in cache.unavailable(bad) and "capture failed" in caplog.text
    assert not cache.request(bad, fail, "cuda", 1)  # not asked again
    keys = [GraphKey(4, w, "lengths", "x", False) for w in (16, 64, 256)]
    for key in keys:
        cache.capture_now(key, lambda pool, stream, key=key: _Graph(key), "cuda", 1)
    assert list(cache.graphs) == keys[1:] and cache.stats().evictions == 1


def test_a_graph_too_big_for_the_budget_is_not_asked_for(monkeypatch):
    from autoragged.graphs.capture import GraphKey

    cache, _ = _cache(monkeypatch)
    key = GraphKey(128, 512, "mask", "x", False)
    assert not cache.request(key, lambda pool, stream: _Graph(key), "cuda", 2 << 30)
    assert "does not fit the graph memory budget" in cache.unavailable(key)


def _bare_graph(key, d_model: int):
    """A RaggedGraph's host side alone (no capture): its args are assembled on the CPU, its replay is recorded."""
    from autoragged.graphs.capture import RaggedGraph

    graph = object.__new__(RaggedGraph)
    graph.key, graph.d_model, graph.dtype, graph.device, graph.index = key, d_model, torch.float32, "cpu", -1
    graph.batch_first, graph.replayed = True, []
    graph.replay = graph.replayed.append
    return graph


def test_a_mask_graph_points_its_args_at_the_batch_or_at_its_static_embeddings():
    """The args' head (input and output pointers and strides, B, L), then the mask's pointer, strides and the pads'
    address: for a caller's hidden states ("x"), and for token ids the graph embeds itself ("ids_tt": the ids
    copied into the static ones, the head pointing at the static embeddings)."""
    from autoragged.graphs.capture import GraphKey

    mask = torch.zeros(3, 10, dtype=torch.bool)
    graph = _bare_graph(GraphKey(3, 16, "mask", "x", False), 8)
    x = torch.randn(3, 10, 8)
    out = graph.run_mask(x, mask, pads_to=1234)
    assert out.shape == x.shape and out.data_ptr() != x.data_ptr()
    head = (x.data_ptr(), out.data_ptr(), 80, 8, 80, 8, 3, 10)
    assert graph.replayed == [(*head, mask.data_ptr(), 10, 1, 1234)]
    with pytest.raises(ValueError, match="batches of 3 rows up to 16 long"):
        graph.run_mask(torch.randn(3, 17, 8), torch.zeros(3, 17, dtype=torch.bool))

    graph = _bare_graph(GraphKey(3, 16, "mask", "ids_tt", False), 8)
    graph.ids, graph.x = torch.zeros(3, 16, dtype=torch.long), torch.zeros(3, 16, 8)
    graph.types, graph.types_zero = torch.ones(3, 16, dtype=torch.long), False
    ids = torch.randint(1, 100, (3, 10))
    out = graph.run_mask(None, mask, ids, None)
    assert out.shape == (3, 10, 8) and torch.equal(graph.ids[:, :10], ids)
    assert not graph.types.any() and graph.types_zero  # no types given: zeros, the embeddings' default
    head = (graph.x.data_ptr(), out.data_ptr(), 128, 8, 80, 8, 3, 10)
    assert graph.replayed == [(*head, mask.data_ptr(), 10, 1, 0)]


def test_a_pads_ring_slot_taken_again_gives_its_unread_counts_to_their_record(monkeypatch):
    """A slot is taken again a round later: the take checks that slot's own event only (no wait for the batch just
    queued), the record still waiting for the slot's counts takes a copy of them, and the slot reads -1 (not landed)
    again; every record still reads its own batch's lengths."""
    from autoragged.planning.costmodel import PADDED
    from autoragged.runtime import records

    waited = []
    monkeypatch.setattr(records, "event_done", waited.append)
    ring = object.__new__(records.PadsRing)
    ring.device, ring.slots, ring.width, ring.i, ring.views, ring.retired = torch.device("cpu"), 4, 3, 0, {}, []
    ring.host, ring.owners = torch.full((4, 3), -1, dtype=torch.int32), [None] * 4
    ring.events = [f"event {i}" for i in range(4)]
    made = []
    for pads in ([1, 0], [2, 5], [0, 0], [3, 3], [4, 1]):
        slot = ring.take(2)
        record = records.Record(None, PADDED, {}, "unread", None, "sig")
        record.defer(slot, 8, 8, ring)
        assert record.peek() is None  # -1: not landed
        slot.host.copy_(torch.tensor(pads, dtype=torch.int32))
        made.append(record)
    assert waited == ["event 1", "event 2", "event 3", "event 0", "event 1"]  # each take: its own slot's event
    assert made[1].peek().total == 9
    assert made[0]._pending.event is None and made[1]._pending.event == "event 2"  # slot 1 reused: a copy
    ring.take(2)  # slot 2 again
    assert (ring.host[2] == -1).all() and ring.owners[2] is None
    assert [r.stats.total for r in made] == [15, 9, 16, 10, 11]
