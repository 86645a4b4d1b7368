"""CUDA-graph arms (GPU only): replay equals eager, eviction, capture failure, parameter updates, no syncs."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from autoragged.tuning_db import BatchStats  # noqa: E402

import autoragged  # noqa: E402
from autoragged._costmodel import PADDED, PADDED_GRAPH, Arm  # noqa: E402
from autoragged._planner import default_ragged_config, graph_config  # noqa: E402
from autoragged.adapters.torch_encoder import _BASE, TorchCall  # noqa: E402
from autoragged.runtime import capture as _capture  # noqa: E402
from autoragged.runtime import graphs as _graphs  # noqa: E402

D, H = 256, 4


def encoder(norm_first=False, batch_first=True):
    layer = torch.nn.TransformerEncoderLayer(D, H, 512, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
    return torch.nn.TransformerEncoder(layer, 2).to("cuda", torch.float16).eval()


def run(enc, arm, lengths, L=None, batch_first=True, seed=0):
    torch.manual_seed(seed)
    L = L or max(lengths)
    x = torch.randn(len(lengths), L, D, device="cuda", dtype=torch.float16)
    if not batch_first:
        x = x.transpose(0, 1).contiguous()
    mask = torch.arange(L, device="cuda")[None, :] >= torch.tensor(lengths, device="cuda")[:, None]
    stats = BatchStats.from_lengths(tuple(lengths), padded_len=L)
    rt = enc._autoragged
    with torch.inference_mode():
        return rt._execute(enc, TorchCall(rt.body, x, None, mask, None, None), arm, tuple(lengths), stats, None)


def call_mask(enc, x, mask, no_sync: bool):
    """enc(x, src_key_padding_mask=mask); with no_sync, any device synchronisation in it is an error."""
    if no_sync:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        return enc(x, src_key_padding_mask=mask)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def real(y, lengths, batch_first=True):
    y = y if batch_first else y.transpose(0, 1)
    return torch.cat([y[i, :n] for i, n in enumerate(lengths)]).float()


BATCHES = [[37, 5, 100, 1], [64, 64, 3], [17] * 9, [200, 1, 1, 1, 1, 90]]


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
def test_replay_equals_eager_across_buckets(norm_first, batch_first):
    enc = autoragged.wrap(encoder(norm_first, batch_first), db=False)
    enc._autoragged.graph_min_seen = 1
    cfg = default_ragged_config(D // H, 128)
    for i, lengths in enumerate(BATCHES * 2):  # the second pass replays graphs holding the first pass's data
        eager_r, _ = run(enc, Arm("ragged", cfg), lengths, batch_first=batch_first, seed=i)
        graph_r, note_r = run(enc, Arm("ragged_graph", cfg), lengths, batch_first=batch_first, seed=i)
        # Triton linears and norms that stop at the rows the batch fills (the bucket's spare rows skipped)
        triton_arm = Arm("ragged_graph", cfg.replace(backend="triton"))
        graph_t, note_t = run(enc, triton_arm, lengths, batch_first=batch_first, seed=i)
        assert note_t is None, note_t
        torch.testing.assert_close(
            real(graph_t, lengths, batch_first), real(eager_r, lengths, batch_first), rtol=2e-3, atol=2e-3
        )
        eager_p, _ = run(enc, PADDED, lengths, batch_first=batch_first, seed=i)
        graph_p, note_p = run(enc, PADDED_GRAPH, lengths, batch_first=batch_first, seed=i)
        assert note_r is None and note_p is None, (note_r, note_p)
        torch.testing.assert_close(
            real(graph_r, lengths, batch_first), real(eager_r, lengths, batch_first), rtol=2e-3, atol=2e-3
        )
        # eager padded may take the nested-tensor path, the padded graph cannot: fp16-level differences
        torch.testing.assert_close(
            real(graph_p, lengths, batch_first), real(eager_p, lengths, batch_first), rtol=1e-2, atol=1e-2
        )
        torch.testing.assert_close(
            real(graph_r, lengths, batch_first), real(eager_p, lengths, batch_first), rtol=2e-2, atol=2e-2
        )
        for y in (graph_r, graph_t, graph_p):
            yb = y if batch_first else y.transpose(0, 1)
            assert all((yb[j, n:] == 0).all() for j, n in enumerate(lengths)), "pads must be zero"
    assert len(enc._autoragged.graphs.graphs) >= 4


@pytest.mark.parametrize("extra_row", [False, True])
def test_a_cublas_graph_of_either_row_count_replays_like_eager(monkeypatch, extra_row):
    # the row count is chosen by timing both graphs (_graphs._ROW_CHOICE); force each outcome
    monkeypatch.setattr(_graphs, "_ROW_CHOICE", {})
    timed = []

    def replay_ms(graphs):
        timed.append(_graphs.replay_ms.__wrapped__(graphs))
        return [1.0, 0.5] if extra_row else [0.5, 1.0]

    replay_ms.__wrapped__ = _graphs.replay_ms
    monkeypatch.setattr(_graphs, "replay_ms", replay_ms)
    enc = autoragged.wrap(encoder(), db=False)
    enc._autoragged.graph_min_seen = 1
    cfg = default_ragged_config(D // H, 128)
    for i, lengths in enumerate(BATCHES * 2):
        eager, _ = run(enc, Arm("ragged", cfg), lengths, seed=i)
        graph, note = run(enc, Arm("ragged_graph", cfg), lengths, seed=i)
        assert note is None, note
        torch.testing.assert_close(real(graph, lengths), real(eager, lengths), rtol=2e-3, atol=2e-3)
    graphs = enc._autoragged.graphs.graphs
    # timed once per row count (the memo is keyed by rows and dims, not by the bucket's batch or length)
    assert len(graphs) >= 3 and len(timed) == len({key[1] for key in graphs}) >= 2
    assert all(0 < t < 1e3 for ms in timed for t in ms)
    assert all(g.rows == key[1] + extra_row for key, g in graphs.items())


def test_bucket_is_captured_when_it_recurs_and_eviction_keeps_the_cap():
    enc = autoragged.wrap(encoder(), db=False, graph_cap=2)
    cfg = default_ragged_config(D // H, 128)
    _, note = run(enc, Arm("ragged_graph", cfg), [40, 3])
    assert "first time" in note
    _, note = run(enc, Arm("ragged_graph", cfg), [40, 3])
    assert note is None
    cache = enc._autoragged.graphs
    for lengths in ([300, 2], [300, 2], [900, 800, 700], [900, 800, 700]):
        run(enc, Arm("ragged_graph", cfg), lengths)
    assert len(cache.graphs) == 2
    first_key = ("ragged", 256, 2, 64, cfg, False, "padded")
    assert first_key not in cache.graphs  # the least recently used went out
    y, note = run(enc, Arm("ragged_graph", cfg), [40, 3])  # seen before: recaptured at once
    eager, _ = run(enc, Arm("ragged", cfg), [40, 3])
    assert note is None
    torch.testing.assert_close(real(y, [40, 3]), real(eager, [40, 3]), rtol=2e-3, atol=2e-3)


def test_evicted_graphs_are_freed_at_once_and_collections_never_break_a_capture():
    """An evicted graph must not wait for the garbage collector (no reference cycle through its capture
    closure): a collection that ran mid-capture destroyed such a graph and failed the capture (H100,
    2026-11-22). With a collection on every allocation, every bucket still captures and replays right."""
    import gc
    import weakref

    enc = autoragged.wrap(encoder(), db=False, graph_cap=1)
    enc._autoragged.graph_min_seen = 1
    cfg = default_ragged_config(D // H, 128)
    threshold = gc.get_threshold()
    gc.set_threshold(1)  # the collector runs all the time, so also during any capture it is not kept out of
    try:
        refs = []
        for i, lengths in enumerate([[40, 3], [300, 2], [900, 800, 700]] * 2):
            for arm in (Arm("ragged_graph", cfg), PADDED_GRAPH):
                y, note = run(enc, arm, lengths, seed=i)
                assert note is None, note
                refs += [weakref.ref(g) for g in enc._autoragged.graphs.graphs.values()]
                eager, _ = run(enc, Arm("ragged", cfg), lengths, seed=i)
                torch.testing.assert_close(real(y, lengths), real(eager, lengths), rtol=1e-2, atol=1e-2)
    finally:
        gc.set_threshold(*threshold)
    gc.disable()
    try:
        enc._autoragged.graphs.clear()
        assert all(r() is None for r in refs), "a graph outlived its eviction (a reference cycle holds it)"
    finally:
        gc.enable()


def test_capture_failure_runs_eagerly_with_the_reason(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(_capture, "_warm_and_capture", broken)
    enc = autoragged.wrap(encoder(), db=False, policy="auto")
    enc._autoragged.graph_min_seen = 1
    cfg = default_ragged_config(D // H, 128)
    y, note = run(enc, Arm("ragged_graph", cfg), [50, 7])
    eager, _ = run(enc, Arm("ragged", cfg), [50, 7])
    assert "graph capture failed: RuntimeError: operation not permitted" in note
    torch.testing.assert_close(real(y, [50, 7]), real(eager, [50, 7]), rtol=0, atol=0)
    _, again = run(enc, Arm("ragged_graph", cfg), [50, 7])
    assert "failed earlier" in again  # not retried every batch


def test_parameter_updates_reach_the_replay():
    enc = autoragged.wrap(encoder(), db=False)
    enc._autoragged.graph_min_seen = 1
    cfg = default_ragged_config(D // H, 128)
    arm = Arm("ragged_graph", cfg)
    before, _ = run(enc, arm, [30, 12])
    with torch.no_grad():
        enc.layers[1].linear2.bias.add_(0.5)  # in place: same storage, the graph reads it
    after, note = run(enc, arm, [30, 12])
    eager, _ = run(enc, Arm("ragged", cfg), [30, 12])
    assert note is None and not torch.allclose(before, after)
    torch.testing.assert_close(real(after, [30, 12]), real(eager, [30, 12]), rtol=2e-3, atol=2e-3)
    with torch.no_grad():
        enc.layers[0].linear1.weight = torch.nn.Parameter(enc.layers[0].linear1.weight * 2)  # new storage
    replaced, _ = run(enc, arm, [30, 12])
    eager, _ = run(enc, Arm("ragged", cfg), [30, 12])
    torch.testing.assert_close(real(replaced, [30, 12]), real(eager, [30, 12]), rtol=2e-3, atol=2e-3)
    # one parameter's storage swapped under the same Parameter (no re-registration): only the storage check
    # sees it, whichever way it runs (PyTorch's C++ check where the build has it)
    run(enc, arm, [30, 12])
    generation = enc._autoragged.graphs.generation
    with torch.no_grad():
        enc.layers[1].norm2.bias.data = enc.layers[1].norm2.bias.data + 0.25
    swapped, _ = run(enc, arm, [30, 12])
    eager, _ = run(enc, Arm("ragged", cfg), [30, 12])
    assert enc._autoragged.graphs.generation == generation + 1  # the graphs were dropped
    torch.testing.assert_close(real(swapped, [30, 12]), real(eager, [30, 12]), rtol=2e-3, atol=2e-3)
    assert not torch.allclose(real(swapped, [30, 12]), real(replaced, [30, 12]))


def test_replay_with_host_lengths_never_syncs():
    enc = autoragged.wrap(encoder(), db=False, policy="auto", sample_every=0)
    enc._autoragged.graph_min_seen = 1
    cfg = default_ragged_config(D // H, 128)
    x = torch.randn(3, 80, D, device="cuda", dtype=torch.float16)
    for arm in (Arm("ragged_graph", cfg), PADDED_GRAPH):
        stats = BatchStats.from_lengths((80, 9, 33))
        call = TorchCall(enc._autoragged.body, x, None, None, None, None)
        with torch.inference_mode():
            enc._autoragged._execute(enc, call, arm, (80, 9, 33), stats, None)  # capture
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.inference_mode():
                out, note = enc._autoragged._execute(enc, call, arm, (80, 9, 33), stats, None)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert note is None and out.shape == x.shape


def test_wrapped_auto_model_uses_graphs_and_stays_right():
    enc = encoder()
    x = torch.randn(8, 64, D, device="cuda", dtype=torch.float16)
    lengths = [64, 3, 17, 40, 9, 1, 33, 20]
    mask = torch.arange(64, device="cuda")[None, :] >= torch.tensor(lengths, device="cuda")[:, None]
    with torch.inference_mode():
        ref = enc(x, src_key_padding_mask=mask)
        autoragged.wrap(enc, db=False, policy="auto", sample_every=0)
        outs = [enc(x, lengths=lengths) for _ in range(4)]
    arms = {d.arm for d in autoragged.recent_decisions(enc, 4)}
    for y in outs:
        torch.testing.assert_close(real(y, lengths), real(ref, lengths), rtol=2e-2, atol=2e-2)
    assert arms  # which arm won is the planner's business; every one of them must be right


@pytest.mark.parametrize("align", [1, 16])
def test_ragged_input_replays_a_graph_of_its_own_alignment(align):
    """FFD bins come as align-16 RaggedTensors: the graph arm runs on their layout instead of refusing."""
    enc = autoragged.wrap(encoder(), db=False, policy="auto", sample_every=0)
    rt_ = enc._autoragged
    rt_.graph_min_seen = 1
    lengths = [50, 7, 33, 1, 64]
    torch.manual_seed(0)
    x = torch.randn(len(lengths), 64, D, device="cuda", dtype=torch.float16)
    src = autoragged.RaggedTensor.from_padded(x, lengths, align=align)
    stats = BatchStats.from_lengths(tuple(lengths))
    cfg = default_ragged_config(D // H, 64).replace(align=align)
    outs = []
    for arm in (Arm("ragged_graph", cfg), Arm("ragged", cfg)):
        for _ in range(2):  # the second graph call replays what the first captured
            with torch.inference_mode():
                y, note = rt_._execute(enc, TorchCall(rt_.body, src, None, None, None, None), arm, tuple(lengths), stats,
                                       None)  # fmt: skip
            assert note is None, note
        outs.append(y.to_padded())
    torch.testing.assert_close(real(outs[0], lengths), real(outs[1], lengths), rtol=2e-3, atol=2e-3)
    with torch.inference_mode():  # through the wrapped call: the recorded arm carries the input's alignment
        enc(src)
    (decision,) = autoragged.recent_decisions(enc, 1)
    assert decision.arm.startswith("padded") or decision.config["align"] == align


def test_padded_graph_fed_the_mask_replays_right_and_never_syncs():
    """The unread mask path: a shape the padded side wins runs the padded graph on the mask itself; batches
    of several lengths share its bucket (columns a longer batch wrote must read as pad again)."""
    from autoragged.runtime import core as dispatch

    enc = encoder()
    autoragged.wrap(enc, db=False, policy="auto", sample_every=0)
    rt_ = enc._autoragged
    rt_.graph_min_seen = 1
    B = 4
    for i, L in enumerate([100, 100, 100, 100, 97, 100, 90]):  # one bucket, trusted per (B, L)
        lengths = [L, L // 2, 3, 1 + i]
        torch.manual_seed(i)
        x = torch.randn(B, L, D, device="cuda", dtype=torch.float16)
        mask = torch.arange(L, device="cuda")[None, :] >= torch.tensor(lengths, device="cuda")[:, None]
        # as if judged _TRUST times already
        rt_.mask_shapes[rt_._shape_key(B, L)] = dispatch._shape_entry(
            dispatch._TRUST, PADDED_GRAPH, {"padded_graph": 1.0}
        )
        with torch.inference_mode():
            y = call_mask(enc, x, mask, no_sync=i >= 1)  # captured by now: a replay must not synchronise
            want, _ = run(enc, PADDED, lengths, L=L, seed=i)
        d = autoragged.recent_decisions(enc, 1)[0]  # the wrapped call's record (run() adds none)
        assert "not read" in d.reason and d.arm == "padded_graph", d.reason
        assert d.stats.total == sum(lengths)
        torch.testing.assert_close(real(y, lengths), real(want, lengths), rtol=1e-2, atol=1e-2)
        assert all((y[j, n:] == 0).all() for j, n in enumerate(lengths))


def test_unread_records_keep_their_stats_when_the_pads_ring_wraps():
    from autoragged.runtime import core as dispatch

    enc = autoragged.wrap(encoder(), db=False, policy="auto", sample_every=0)
    rt_ = enc._autoragged
    L = 40
    want = []
    with torch.inference_mode():
        # 150 batches of 3 (more than the ring's 64 slots: it wraps twice), then 70 of 5 (wider rows: the ring
        # is reallocated mid-round, and records of the old buffer keep their counts); every 16th batch of a
        # shape reads its lengths instead
        for B, n in ((3, 150), (5, 70)):
            rt_.mask_shapes[rt_._shape_key(B, L)] = dispatch._shape_entry(
                dispatch._TRUST, PADDED_GRAPH, {"padded_graph": 1.0}
            )
            x = torch.randn(B, L, D, device="cuda", dtype=torch.float16)
            for i in range(n):
                lengths = [L, *(1 + (j * 7 + 1) * i % L for j in range(B - 1))]
                mask = torch.arange(L, device="cuda")[None, :] >= torch.tensor(lengths, device="cuda")[:, None]
                enc(x, src_key_padding_mask=mask)
                want.append(sum(lengths))
    got = [d.stats.total for d in autoragged.recent_decisions(enc, 220)]
    assert got == want


def test_a_trusted_shape_that_measures_slower_fed_the_mask_reads_its_lengths_again():
    """The first replays of a trusted shape fed the mask are timed (a capture is not); measured slower
    than the shape's read path (here a made-up 1 ns), the shape goes back to reading its lengths."""
    from autoragged.runtime import core as dispatch

    enc = autoragged.wrap(encoder(), db=False, policy="auto", sample_every=1000)
    rt_ = enc._autoragged
    B, L = 3, 40
    entry = dispatch._shape_entry(dispatch._TRUST, PADDED_GRAPH, {"padded_graph": 1.0})
    entry[5]["read"].append(1e-6)
    rt_.mask_shapes[rt_._shape_key(B, L)] = entry
    x = torch.randn(B, L, D, device="cuda", dtype=torch.float16)
    mask = torch.arange(L, device="cuda")[None, :] >= torch.tensor([L, 7, 20], device="cuda")[:, None]
    reasons = []
    with torch.inference_mode():
        for _ in range(6):
            enc(x, src_key_padding_mask=mask)
            rt_._harvest(wait=True)
            reasons.append(autoragged.recent_decisions(enc, 1)[0].reason)
    assert len(entry[5]["unread"]) == 2 and entry[5]["lost"] and entry[0] == 0
    assert all(u > 0 for u in entry[5]["unread"])
    # seen once, captured, then two timed replays; from there on the lengths are read
    assert ["not read" in r for r in reasons] == [True] * 4 + [False] * 2


@pytest.mark.parametrize("batch_first", [True, False])
def test_ragged_graph_fed_the_mask_is_right_for_any_padding_and_never_syncs(batch_first):
    """The unread mask path on the ragged side: the graph counts and packs each row's real tokens from
    the mask itself (left padding, holes, an all-pad row), so nothing reads lengths or synchronises, and
    the record's stats still arrive."""
    from autoragged.runtime import core as dispatch

    enc = encoder(batch_first=batch_first)
    autoragged.wrap(enc, db=False, policy="auto", sample_every=0)
    rt_ = enc._autoragged
    rt_.graph_min_seen = 1
    B, L = 5, 70
    arm = Arm("ragged_graph", graph_config(D // H, L, "triton"))
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        mask = torch.rand(B, L, generator=g) < 0.3 + 0.1 * i
        mask[0], mask[1] = True, False  # an all-pad row, a full row
        mask[2, :20], mask[2, 20:] = True, False  # left padding
        mask = mask.cuda()
        x = torch.randn(B, L, D, generator=g).to("cuda", torch.float16)
        if not batch_first:
            x = x.transpose(0, 1).contiguous()
        entry = dispatch._shape_entry(dispatch._TRUST, arm, {arm.label: 1.0}, 200)  # judged
        rt_.mask_shapes[rt_._shape_key(B, L)] = entry
        with torch.inference_mode():
            y = call_mask(enc, x, mask, no_sync=i >= 1)  # captured by now: a replay must not synchronise
            want = rt_.body.base.forward(enc, x, None, mask, None)
        d = autoragged.recent_decisions(enc, 1)[0]
        assert "not read" in d.reason and d.arm == "ragged_graph", d.reason
        assert d.stats.total == int((~mask).sum()) and d.stats.batch == B
        yb, wb = (y, want) if batch_first else (y.transpose(0, 1), want.transpose(0, 1))
        keep = ~mask
        keep[0] = False  # PyTorch's output on an all-pad row is undefined (NaN); ours is zeros
        torch.testing.assert_close(yb[keep].float(), wb[keep].float(), rtol=2e-2, atol=2e-2)
        assert (yb[mask] == 0).all()
        (graph,) = [g_ for k, g_ in rt_.graphs.graphs.items() if k[0] == "ragged" and k[6] == "mask"]
        assert graph.layout.live.item() == int((~mask).sum())  # the rows the linears and norms stopped at
        assert graph.layout.tile_rows == 200  # the linears' tiles were picked for the judged batch's tokens


def test_a_trusted_mask_shape_replays_its_kept_graph_and_notices_what_changed():
    """The hot path of a trusted mask-only shape (`_replay_unread`) replays the graph the shape kept, with no
    lookup; a graph gone from the cache (evicted, cleared, parameters moved to new storage) sends the batch
    to the general path, which captures again; in-place parameter updates are seen by the next replay."""
    from autoragged.runtime import core as dispatch

    enc = encoder()
    autoragged.wrap(enc, db=False, policy="auto", sample_every=0)
    rt_ = enc._autoragged
    rt_.graph_min_seen = 1
    L = 50
    arm = Arm("ragged_graph", graph_config(D // H, L, "triton"))
    entries = {B: dispatch._shape_entry(dispatch._TRUST, arm, {arm.label: 1.0}, 100) for B in (4, 6)}
    rt_.mask_shapes.update({rt_._shape_key(B, L): e for B, e in entries.items()})
    fast = []
    replay_unread = rt_._replay_unread
    g = torch.Generator().manual_seed(0)

    def spy(*a):
        out = replay_unread(*a)
        fast.append(out is not None)
        return out

    rt_._replay_unread = spy

    def check(B, hot):
        """One batch of B rows through the wrapped call against PyTorch on the same mask: it took the hot
        path (and then never synchronised) if and only if `hot`."""
        n = len(fast)
        lengths = torch.randint(1, L + 1, (B,), generator=g)
        mask = (torch.arange(L)[None, :] >= lengths[:, None]).cuda()
        x = torch.randn(B, L, D, generator=g).to("cuda", torch.float16)
        with torch.inference_mode():
            y = call_mask(enc, x, mask, no_sync=hot)
            want = rt_.body.base.forward(enc, x, None, mask, None)
        keep = ~mask
        torch.testing.assert_close(y[keep].float(), want[keep].float(), rtol=2e-2, atol=2e-2)
        assert (y[mask] == 0).all()
        d = autoragged.recent_decisions(enc, 1)[0]
        assert "not read" in d.reason and d.arm == "ragged_graph" and d.stats.total == int(lengths.sum()), d
        assert (fast[n:] == [True]) == hot, (B, fast[n:])

    check(4, hot=False)  # captured through the general path, which keeps the graph for the shape
    assert entries[4][6] is not None
    for _ in range(3):
        check(4, hot=True)
    with torch.no_grad():  # in place: the same storage, seen by the next replay
        enc.layers[0].linear1.weight.mul_(1.5)
    check(4, hot=True)
    for p in enc.parameters():  # new storage (as `.to()` or ZeRO-style partitioning do): the graphs are dropped
        p.data = p.data.clone()
    with torch.no_grad():
        enc.layers[1].linear2.weight.mul_(0.5)  # on the new storage only
    check(4, hot=False)
    check(4, hot=True)
    rt_.graphs.cap = 1
    check(6, hot=False)  # its capture evicts the B=4 graph
    check(4, hot=False)  # and this one the B=6 graph
    check(6, hot=False)
    check(6, hot=True)
    rt_.graphs.clear()
    check(6, hot=False)
    check(6, hot=True)


@pytest.mark.parametrize("padded", [False, True])
def test_queued_replays_each_fetch_their_own_args_from_the_pinned_ring(padded):
    """The host runs a whole ring of replays ahead of a busy GPU (slots are reused only once their replay
    completed): each replay still reads its own batch (the ragged graph its pointers and lengths, the padded
    graph its lengths). A bare replay that runs before the next post fetches nothing and is counted, and
    the next posted batch still matches."""
    enc = autoragged.wrap(encoder(), db=False)
    enc._autoragged.graph_min_seen = 1
    cfg = default_ragged_config(D // H, 128)
    arm, eager_arm = (PADDED_GRAPH, PADDED) if padded else (Arm("ragged_graph", cfg), Arm("ragged", cfg))
    batches = [[40 - i, 3 + i, 25] for i in range(20)]  # 20 batches > 8 slots, all within the graph
    run(enc, arm, batches[0], L=40)  # capture
    graph = next(iter(enc._autoragged.graphs.graphs.values()))
    replay = graph.run if padded else graph.run_padded
    xs = [torch.randn(3, 40, D, device="cuda", dtype=torch.float16) for _ in batches]
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU: the replays below queue behind it
    with torch.inference_mode():
        outs = [replay(x, lengths) for x, lengths in zip(xs, batches)]
    graph.graph.replay()  # no batch posted: zero args, counted
    torch.cuda.synchronize()  # (a bare replay still queued when the next batch is posted would take it)
    with torch.inference_mode():
        again = replay(xs[0], batches[0])
    assert graph.mailbox.state.tolist() == [graph.mailbox.stamp, 1]
    for x, lengths, out in zip(xs, batches, outs):
        stats = BatchStats.from_lengths(tuple(lengths), padded_len=40)
        with torch.inference_mode():
            rt_ = enc._autoragged
            eager, _ = rt_._execute(enc, TorchCall(rt_.body, x, None, None, None, None), eager_arm, tuple(lengths), stats,
                                    None)  # fmt: skip
        tol = 1e-2 if padded else 2e-3  # the padded graph runs PyTorch's plain path, eager its nested one
        torch.testing.assert_close(real(out, lengths), real(eager, lengths), rtol=tol, atol=tol)
    torch.testing.assert_close(again, outs[0], rtol=0, atol=0)


@pytest.mark.parametrize("ragged", [False, True])
def test_the_mask_paths_take_calls_in_any_grad_mode(ragged):
    """Calls alternate inference_mode, no_grad and plain grad mode (a frozen model: no parameter needs grad)
    over more batches than the pads ring has slots: state made by a call in one mode (the pinned pads ring,
    the static buffers, the args ring) is written by calls in another, on the general path and on a trusted
    shape's hot path."""
    from autoragged.runtime import core as dispatch

    enc = encoder().requires_grad_(False)
    autoragged.wrap(enc, db=False, policy="auto", sample_every=0)
    rt_ = enc._autoragged
    rt_.graph_min_seen = 1
    B, L = 4, 48
    arm = Arm("ragged_graph", graph_config(D // H, L, "triton")) if ragged else PADDED_GRAPH
    rt_.mask_shapes[rt_._shape_key(B, L)] = dispatch._shape_entry(dispatch._TRUST, arm, {arm.label: 1.0}, 120)
    modes = [torch.inference_mode, torch.no_grad, torch.enable_grad]
    g = torch.Generator().manual_seed(0)
    totals = []
    for i in range(70):
        lengths = torch.randint(1, L + 1, (B,), generator=g)
        mask = (torch.arange(L)[None, :] >= lengths[:, None]).cuda()
        x = torch.randn(B, L, D, generator=g).to("cuda", torch.float16)
        with modes[i % 3]():
            y = enc(x, src_key_padding_mask=mask)
            assert not y.requires_grad
        totals.append(int(lengths.sum()))
        # an output as eager PyTorch's would be: an inference tensor only under inference_mode, and one the caller
        # may write in place
        assert y.is_inference() == (i % 3 == 0)
        if i % 3:
            y.add_(0)
        if i % 10 == 0:
            with torch.inference_mode():
                want = rt_.body.base.forward(enc, x, None, mask, None)
            keep = ~mask
            torch.testing.assert_close(y[keep].float(), want[keep].float(), rtol=2e-2, atol=2e-2)
            assert (y[mask] == 0).all()
    decisions = autoragged.recent_decisions(enc, 70)
    assert [d.stats.total for d in decisions] == totals  # every record kept its stats (the pads ring's copies)
    assert sum("not read" in d.reason for d in decisions) >= 60  # every 16th call reads its lengths again
    # the shape kept its graph: the later calls took the hot path
    assert rt_.mask_shapes[rt_._shape_key(B, L)][6] is not None


def test_a_layer_replaced_after_capture_is_what_the_next_replay_runs():
    """A trusted mask shape replays its graph on the hot path; a layer replaced in the encoder (new module,
    new weights) re-binds the module, so the next batch runs the new layer, not the captured old one."""
    from autoragged.runtime import core as dispatch

    enc = encoder()
    autoragged.wrap(enc, db=False, policy="auto", sample_every=0)
    B, L = 4, 50
    arm = Arm("ragged_graph", graph_config(D // H, L, "triton"))
    x = torch.randn(B, L, D, device="cuda", dtype=torch.float16)
    mask = torch.arange(L, device="cuda")[None, :] >= torch.tensor([50, 20, 7, 33], device="cuda")[:, None]
    keep = ~mask

    def trusted_calls(n):
        rt_ = enc._autoragged
        rt_.graph_min_seen = 1
        if rt_._shape_key(B, L) not in rt_.mask_shapes:
            rt_.mask_shapes[rt_._shape_key(B, L)] = dispatch._shape_entry(dispatch._TRUST, arm, {arm.label: 1.0}, 100)
        with torch.inference_mode():
            ys = [enc(x, src_key_padding_mask=mask) for _ in range(n)]
            want = _BASE[type(enc)].forward(enc, x, src_key_padding_mask=mask)
        for y in ys:
            torch.testing.assert_close(y[keep].float(), want[keep].float(), rtol=2e-2, atol=2e-2)
        return ys[-1]

    before = trusted_calls(4)
    assert enc._autoragged.mask_shapes[enc._autoragged._shape_key(B, L)][6] is not None  # the hot path's graph is kept
    enc.layers[1] = encoder().layers[0]  # other weights, a new module
    after = trusted_calls(4)
    assert not torch.allclose(before[keep].float(), after[keep].float(), atol=1e-2)
