"""Streams on the GPU: captures with no device drain (the GPU still busy) replay right, the runtime captures
after a batch's eager run and then replays, graphs are sized against the device's memory, a trusted mask
shape judged one batch behind never synchronises, and `autoragged.warmup` runs on the GPU."""

import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from _fakes import Fixed, Prefers  # noqa: E402
from autoragged.tuning_db import BatchStats  # noqa: E402

import autoragged  # noqa: E402
from autoragged._costmodel import PADDED, PADDED_GRAPH, Arm  # noqa: E402
from autoragged._planner import Planner, default_ragged_config, graph_config  # noqa: E402
from autoragged.adapters.torch_encoder import TorchCall  # noqa: E402
from autoragged.runtime import capture as _capture  # noqa: E402
from autoragged.runtime import core as dispatch  # noqa: E402
from autoragged.runtime import graphs as _graphs  # noqa: E402
from autoragged.runtime import unread as _unread  # noqa: E402

D, H = 256, 4


def encoder():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(D, H, 512, dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 2).to("cuda", torch.float16).eval()


def batch(lengths, L=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    L = L or max(lengths)
    x = torch.randn(len(lengths), L, D, generator=g).to("cuda", torch.float16)
    mask = torch.arange(L, device="cuda")[None, :] >= torch.tensor(lengths, device="cuda")[:, None]
    return x, mask


def real(y, lengths):
    return torch.cat([y[i, :n] for i, n in enumerate(lengths)]).float()


def execute(enc, arm, lengths, seed=0):
    x, mask = batch(lengths, seed=seed)
    rt = enc._autoragged
    stats = BatchStats.from_lengths(tuple(lengths))
    with torch.inference_mode():
        return rt._execute(enc, TorchCall(rt.body, x, None, mask, None, None), arm, tuple(lengths), stats, None)


@pytest.mark.parametrize("drain", [False, True])
def test_graphs_captured_while_the_gpu_is_busy_replay_like_eager(monkeypatch, drain):
    """No device drain before a capture (the default): earlier batches may still be running; the graphs must
    replay exactly as captured with the drain (AUTORAGGED_CAPTURE_DRAIN=1) and as the eager arms compute."""
    monkeypatch.setattr(_capture, "_DRAIN", drain)
    enc = autoragged.wrap(encoder(), db=False)
    enc._autoragged.graph_min_seen = 1
    cfg = default_ragged_config(D // H, 128)
    arms = [(Arm("ragged_graph", cfg), Arm("ragged", cfg)), (Arm("ragged_graph", cfg.replace(backend="triton")),
            Arm("ragged", cfg)), (PADDED_GRAPH, PADDED)]  # fmt: skip
    for i, lengths in enumerate([[37, 5, 100, 1], [64, 64, 3], [200, 1, 90]] * 2):
        for graph_arm, eager_arm in arms:
            torch.cuda._sleep(50_000_000)  # ~25 ms of GPU work queued ahead of the capture
            y, note = execute(enc, graph_arm, lengths, seed=i)
            want, _ = execute(enc, eager_arm, lengths, seed=i)
            assert note is None, note
            tol = 1e-2 if graph_arm == PADDED_GRAPH else 2e-3
            torch.testing.assert_close(real(y, lengths), real(want, lengths), rtol=tol, atol=tol)
    cache = enc._autoragged.graphs
    # (a capture may take blocks the pool holds already and free others meanwhile: its own bytes can count 0)
    assert cache.budget_bytes > 0 and all(g.nbytes >= 0 for g in cache.graphs.values())
    assert any(g.nbytes > 0 for g in cache.graphs.values())
    assert cache.kept_bytes == sum(g.nbytes for g in cache.graphs.values())


def test_the_runtime_captures_after_the_eager_run_and_then_replays():
    enc = autoragged.wrap(encoder(), db=False, sample_every=0, capture="pays")
    rt = enc._autoragged
    head_dim = rt.body.head_dim

    def candidates(stats):
        return [Arm("ragged", default_ragged_config(head_dim, stats.max_len)),
                Arm("ragged_graph", graph_config(head_dim, stats.max_len, "cublas"))]  # fmt: skip

    rt.planners[torch.device("cuda", torch.cuda.current_device())] = Planner(
        rt.sig, Fixed({"padded": 10.0, "ragged": 5.0, "ragged_graph": 1.0}), candidates
    )
    rt.planners[torch.device("cuda")] = rt.planners[torch.device("cuda", torch.cuda.current_device())]
    lengths = [50, 7, 33, 20]
    outs = []
    with torch.inference_mode():
        for i in range(4):
            x, mask = batch(lengths, seed=i)
            want = rt.body.base.forward(enc, x, None, mask, None)
            outs.append((enc(x, lengths=lengths), want))
    arms = [(d.arm, d.reason) for d in autoragged.recent_decisions(enc, 4)]
    assert [a for a, _ in arms] == ["ragged", "ragged", "ragged_graph", "ragged_graph"], arms
    assert _graphs.CAPTURE_NEXT in arms[1][1]
    for y, want in outs:
        torch.testing.assert_close(real(y, lengths), real(want, lengths), rtol=2e-2, atol=2e-2)
    stats = autoragged.graph_stats(enc)["DispatchingTransformerEncoder"]
    assert stats.captures == 1 and stats.graphs == 1 and stats.capture_ms > 0 and stats.kept_bytes > 0


def test_a_read_behind_queued_work_costs_its_own_time_not_the_wait():
    """A mask read waits for the GPU work queued before it; the read's cost (`sync_ms`) is timed from that
    work's end, so the wait is not counted, and the wait marks the host as running ahead."""
    enc = autoragged.wrap(encoder(), db=False, sample_every=0, graphs=False)
    rt = enc._autoragged
    planner = Planner(rt.sig, Prefers(padded=False))  # the eager ragged arm: every batch reads its lengths
    rt.planners[torch.device("cuda")] = rt.planners[torch.device("cuda", torch.cuda.current_device())] = planner
    x, mask = batch([50, 17, 33, 8])
    host = []
    with torch.inference_mode():
        enc(x, src_key_padding_mask=mask)  # compiles and plans: not timed here
        torch.cuda.synchronize()
        rt.sync_samples.clear()
        for _ in range(2):
            torch.cuda._sleep(40_000_000)  # tens of ms of queued GPU work
            t0 = time.perf_counter()
            enc(x, src_key_padding_mask=mask)
            host.append((time.perf_counter() - t0) * 1e3)
        assert rt.pipelined
    torch.cuda.synchronize()
    rt._read_begin(mask)  # harvests the last read's events
    own = list(rt.sync_samples)  # (the module's first read, in the first call, is no sample: its one-time costs)
    assert min(host) > 10.0 and len(own) == 2 and max(own) < 2.0 and rt.sync_ms == min(own), (host, own)


def test_a_trusted_shape_judged_one_batch_behind_never_synchronises():
    """Mask-only batches of one shape run the padded graph fed the mask; every 8th is judged again from an
    earlier batch's stats, read from pinned memory: no batch reads lengths or synchronises."""
    enc = autoragged.wrap(encoder(), db=False, sample_every=0)
    rt = enc._autoragged
    rt.graph_min_seen = 1
    planner = Planner(rt.sig, Fixed({"padded": 2.0, "padded_graph": 1.0}), lambda stats: [PADDED_GRAPH])
    rt.planners[torch.device("cuda")] = rt.planners[torch.device("cuda", torch.cuda.current_device())] = planner
    B, L = 4, 60
    rt.mask_shapes[rt._shape_key(B, L)] = dispatch._shape_entry(dispatch._TRUST, PADDED_GRAPH, {"padded": 2.0,
                                                                "padded_graph": 1.0})  # fmt: skip
    rt.sync_samples.append(0.05)  # as if a read had been timed: verdicts one batch behind are allowed
    g = torch.Generator().manual_seed(0)
    totals = []
    with torch.inference_mode():
        for i in range(40):
            lengths = torch.randint(1, L + 1, (B,), generator=g)
            lengths[0] = L
            mask = (torch.arange(L)[None, :] >= lengths[:, None]).cuda()
            x = torch.randn(B, L, D, generator=g).to("cuda", torch.float16)
            if i >= 2:  # captured by now
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                y = enc(x, src_key_padding_mask=mask)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            totals.append(int(lengths.sum()))
            if i % 10 == 0:
                want = rt.body.base.forward(enc, x, None, mask, None)
                torch.testing.assert_close(y[~mask].float(), want[~mask].float(), rtol=1e-2, atol=1e-2)
    decisions = autoragged.recent_decisions(enc, 40)
    assert all("not read" in d.reason for d in decisions)
    assert [d.stats.total for d in decisions] == totals
    assert rt.mask_shapes[rt._shape_key(B, L)][0] > dispatch._TRUST  # judged again (and kept) along the way


class _Backends:
    """Predicts the cuBLAS ragged graph at 1 ms, the mask graph (Triton linears) at 50, anything else at 100."""

    name = "fake"

    def predict_ms(self, sig, stats, arms):
        return [1.0 if a.graph and a.ragged and not a.mask_only else 50.0 if a.mask_only else 100.0 for a in arms]


@pytest.mark.parametrize("stand_in_ms", [None, 1.005])
def test_a_read_batch_of_a_mask_graph_shape_replays_that_graph_until_its_own_bucket_recurs(stand_in_ms):
    """A mask shape whose mask graph is kept, whose batch read its lengths (its verdict flipped) and planned a
    cuBLAS graph not captured for its bucket: the kept mask graph runs it (the same function, no eager run, no
    capture) until the bucket's _STAND_IN_SIGHTS-th sight, which captures the cuBLAS graph; the records say
    which graph ran. Where the shape's verdict predicted the mask graph within 0.005 ms of the cuBLAS graph,
    the capture would not repay itself out of that saving: the mask graph goes on standing in."""
    enc = autoragged.wrap(encoder(), db=False, sample_every=0)
    rt = enc._autoragged
    rt.mask_rungs = False  # the mask graph of Triton linears alone, predicted at 50 ms: its shape reads
    head = D // H
    planner = Planner(rt.sig, _Backends(), lambda s: [Arm("ragged_graph", graph_config(head, s.max_len, b))
                                                      for b in ("cublas", "triton")])  # fmt: skip
    rt.planners[torch.device("cuda")] = rt.planners[torch.device("cuda", torch.cuda.current_device())] = planner
    lengths = [60, 17, 33, 1]
    x, mask = batch(lengths)
    mask_arm = Arm("ragged_graph", graph_config(head, 60, "triton"))
    entry = rt.mask_shapes[rt._shape_key(4, 60)] = dispatch._shape_entry(dispatch._TRUST, mask_arm, {})
    rt.sync_samples.append(0.05)
    with torch.inference_mode():
        enc(x, src_key_padding_mask=mask)  # trusted: the mask graph is captured (first sight) and kept
        assert entry[6] is not None and "not read" in autoragged.recent_decisions(enc, 1)[0].reason
        want = rt.body.base.forward(enc, x, None, mask, None)
        entry[0] = 0  # the verdict flipped: the next batches read their lengths
        if stand_in_ms is not None:
            entry[3] = {mask_arm.label: stand_in_ms}  # as the shape's last verdict predicted it
        n = dispatch._STAND_IN_SIGHTS
        for _ in range(n + 1):
            y = enc(x, src_key_padding_mask=mask)
            torch.testing.assert_close(y[~mask].float(), want[~mask].float(), rtol=1e-2, atol=1e-2)
            assert entry[0] == 0  # (50 ms against 1 + the read: every one of them reads)
    decisions = autoragged.recent_decisions(enc, n + 1)
    stood_in = [dispatch.STOOD_IN in d.reason for d in decisions]
    if stand_in_ms is not None:
        assert stood_in == [True] * (n + 1) and rt.graphs.stats().captures == 1
        assert all(d.config["backend"] == "triton" for d in decisions) and rt.graphs.stats().declined >= 2
        return
    assert stood_in == [True] * (n - 1) + [False] * 2
    assert all(d.arm == "ragged_graph" and d.config["backend"] == "triton" for d in decisions[: n - 1])
    assert all(d.arm == "ragged_graph" and d.config["backend"] == "cublas" for d in decisions[n - 1 :])
    assert rt.graphs.stats().captures == 2  # the mask graph, then the cuBLAS graph at the bucket's n-th sight


class _MaskWins:
    """Predicts the mask graph (Triton linears) at 0.5 ms, anything else at 2."""

    name = "fake"

    def predict_ms(self, sig, stats, arms):
        return [0.5 if a.mask_only else 2.0 for a in arms]


def test_a_stream_past_its_widest_batch_so_far_stays_on_the_mask_graph_without_a_read():
    """The mask graph a trusted shape captures is a rung wider where its batch size's longest batches fill its
    width (`widen_mask`: 48 for lengths up to 31), and in a stream (the host ahead of the GPU) the first batch past
    32, of a new shape that graph serves, takes the trusted shape's verdict (`_adopt`): it neither reads its
    lengths nor synchronises, and neither do the batches judged again one batch behind, which replay the kept
    graph; outputs stay right."""
    enc = autoragged.wrap(encoder(), db=False, sample_every=0)
    rt = enc._autoragged
    head = D // H
    planner = Planner(rt.sig, _MaskWins(), lambda s: [Arm("ragged_graph", graph_config(head, s.max_len, b))
                                                      for b in ("cublas", "triton")])  # fmt: skip
    rt.planners[torch.device("cuda")] = rt.planners[torch.device("cuda", torch.cuda.current_device())] = planner
    g = torch.Generator().manual_seed(0)
    widths = [29, 31, 30, 27, 31, 33, 30, 40, 29, 31, 30, 28, 27, 31, 29, 33, 30, 26, 31, 29, 28, 30]
    with torch.inference_mode():
        for i, L in enumerate(widths):
            lengths = torch.randint(1, L + 1, (8,), generator=g)
            lengths[0] = L
            x, mask = batch(lengths.tolist(), seed=i)
            torch.cuda.synchronize()
            torch.cuda._sleep(20_000_000)  # the GPU busy: the host runs ahead of it, as in a stream
            if i >= 3:  # trusted after two reads, its graph captured at the third batch
                torch.cuda.set_sync_debug_mode("error")
            try:
                y = enc(x, src_key_padding_mask=mask)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            want = rt.body.base.forward(enc, x, None, mask, None)
            torch.testing.assert_close(y[~mask].float(), want[~mask].float(), rtol=1e-2, atol=1e-2)
    decisions = autoragged.recent_decisions(enc, len(widths))
    assert all("not read" in d.reason for d in decisions[2:])
    assert [k[3] for k in rt.graphs.graphs] == [48]  # one mask graph, a rung wider than the first batches'
    assert rt.mask_shapes[rt._shape_key(8, 33)][0] >= dispatch._TRUST  # adopted at its first batch
    judged = [e for e in rt.mask_shapes.values() if e[0] > dispatch._TRUST]
    assert judged  # judged again (and kept) one batch behind along the way


def test_a_trusted_shapes_probe_runs_replay_on_the_hot_path_and_are_timed_there(monkeypatch):
    """Once a trusted shape's mask graph is captured, its first `_PROBES` runs (timed for the probes) replay by
    `_replay_unread`, with no graph lookup, and their timings reach the probe; outputs stay right."""
    enc = autoragged.wrap(encoder(), db=False)
    rt = enc._autoragged
    head = D // H
    planner = Planner(rt.sig, _MaskWins(), lambda s: [Arm("ragged_graph", graph_config(head, s.max_len, b))
                                                      for b in ("cublas", "triton")])  # fmt: skip
    rt.planners[torch.device("cuda")] = rt.planners[torch.device("cuda", torch.cuda.current_device())] = planner
    lookups = []
    real = _graphs.GraphCache.ragged_mask
    monkeypatch.setattr(_graphs.GraphCache, "ragged_mask", lambda *a, **k: lookups.append(1) or real(*a, **k))
    lengths = [40, 17, 33, 1]
    x, mask = batch(lengths)
    with torch.inference_mode():
        want = rt.body.base.forward(enc, x, None, mask, None)
        for _ in range(dispatch._TRUST + 1 + dispatch._PROBES):  # two reads, the capture, the probe runs
            y = enc(x, src_key_padding_mask=mask)
            torch.testing.assert_close(y[~mask].float(), want[~mask].float(), rtol=1e-2, atol=1e-2)
    torch.cuda.synchronize()
    rt._harvest(wait=True)
    entry = rt.mask_shapes[rt._shape_key(4, 40)]
    assert entry[0] >= dispatch._TRUST and entry[5]["left"] == 0
    assert len(entry[5]["unread"]) == dispatch._PROBES and all(ms > 0 for ms in entry[5]["unread"])
    assert len(lookups) == 1  # the capture's run alone took the general path


def test_warmup_captures_the_mask_graph_of_every_length_bucket_of_a_batch_size_that_has_one(monkeypatch):
    """`_warm_mask_graphs`: a batch size with a mask graph kept gets one for each other length bucket its warm
    batches reached that no kept graph serves (up to 2x wider), whatever the verdicts of their shapes; the
    shapes' verdicts and the batch counter are put back (a new shape is judged by traffic); the output stays
    the model's. (Graphs a rung wider, `widen_mask`, are the stream test's above: each graph here as wide as
    its batches.)"""
    from autoragged import _warmup
    from autoragged._buckets import mask_width

    monkeypatch.setattr(_graphs, "widen_mask", lambda top, width, own, batch: width)

    enc = autoragged.wrap(encoder(), db=False, sample_every=0)
    rt = enc._autoragged
    head = D // H
    x, mask = batch([60, 17, 33, 1])
    key = rt._shape_key(4, 60)
    rt.mask_shapes[key] = dispatch._shape_entry(dispatch._TRUST, Arm("ragged_graph", graph_config(head, 60, "triton")))
    rt.sync_samples.append(0.05)
    with torch.inference_mode():
        enc(x, src_key_padding_mask=mask)  # trusted: the mask graph of width 64 is captured
        widths = {k[3] for k in rt.graphs.graphs if k[6] == "mask"}
        assert widths == {mask_width(60)} == {64}
        count = rt.count
        groups = [[20, 5, 9, 3], [9, 9], [61, 2, 2, 2], [9, 5, 3, 2]]
        _warmup._warm_mask_graphs(enc, rt, groups, torch.device("cuda"))
        assert rt.count == count  # (the sampled batches are where they were)
        widths = {(k[2], k[3]) for k in rt.graphs.graphs if k[6] == "mask"}
        # not for batch size 2 (none kept), nor for widths 64 and 32 (the graph of 64 serves both)
        assert (mask_width(20), mask_width(9)) == (32, 16) and widths == {(4, 64), (4, 16)}
        assert rt._shape_key(4, 9) not in rt.mask_shapes and rt.mask_shapes[key][0] == dispatch._TRUST
        x, mask = batch([9, 5, 3, 2])
        y = enc(x, src_key_padding_mask=mask)
        want = rt.body.base.forward(enc, x, None, mask, None)
    torch.testing.assert_close(y[~mask].float(), want[~mask].float(), rtol=1e-2, atol=1e-2)


def test_warmup_on_the_gpu_leaves_the_model_right():
    enc = autoragged.wrap(encoder(), db=False)
    s = autoragged.warmup(enc, "MRPC", batch_sizes=[8], batches=12, progress=False)
    assert s.modules == 1 and s.batches >= 12 and (s.batches - 12) % 3 == 0 and s.seconds > 0  # (+ the tail's)
    assert s.graph_bytes == enc._autoragged.graphs.kept_bytes and len(s.captured) <= s.graphs + s.evictions
    # each eager arm ran once, forced, and the planner chooses again
    reasons = [d.reason for d in autoragged.recent_decisions(enc, 100)]
    assert "policy=padded" in reasons and "policy=ragged" in reasons and enc._autoragged.policy == "auto"
    lengths = [60, 21, 9, 33, 47, 58, 12, 30]
    x, mask = batch(lengths)
    with torch.inference_mode():
        y = enc(x, src_key_padding_mask=mask)
        want = enc._autoragged.body.base.forward(enc, x, None, mask, None)
    torch.testing.assert_close(real(y, lengths), real(want, lengths), rtol=2e-2, atol=2e-2)
    # the eager arm's cuBLAS rungs, every one up to 1.5x the batch's tokens (less than 3 x 300 here)
    from autoragged._buckets import cublas_rows

    s = autoragged.warmup(enc, [[300, 200, 7]], progress=False)
    rungs, r = [], cublas_rows(1)
    while r <= cublas_rows(507 * 3 // 2):
        rungs, r = rungs + [r], cublas_rows(r + 1)
    assert s.cublas_rows == len(rungs) > 1 and rungs[0] == 256 and rungs[-1] >= 760
    with torch.inference_mode():
        torch.testing.assert_close(real(enc(x, src_key_padding_mask=mask), lengths), real(want, lengths),
                                   rtol=2e-2, atol=2e-2)  # fmt: skip


class _ClosePrior:
    """The analytic prior's name, predicting the mask graph (Triton linears) 20% behind the cuBLAS graph."""

    name = "prior"

    def predict_ms(self, sig, stats, arms):
        return [1.0 if a.graph and a.ragged and not a.mask_only else 1.2 if a.mask_only else 100.0 for a in arms]


def test_a_close_mask_verdict_from_the_prior_is_settled_by_timing_the_mask_graph(monkeypatch):
    """Uncalibrated, a mask shape whose mask graph is predicted to lose by a little runs it (captured) until
    the probes have timed it against the read path; then the timings decide the shape, whichever way."""
    enc = autoragged.wrap(encoder(), db=False, sample_every=1, explore=False)
    rt = enc._autoragged
    rt.graph_min_seen = 1
    monkeypatch.setattr(_unread, "_EXPLORE_AFTER_MS", 0.0)  # explore at first sight
    head = D // H
    planner = Planner(rt.sig, _ClosePrior(), lambda s: [Arm("ragged_graph", graph_config(head, s.max_len, b))
                                                        for b in ("cublas", "triton")])  # fmt: skip
    rt.planners[torch.device("cuda")] = rt.planners[torch.device("cuda", torch.cuda.current_device())] = planner
    assert rt._explores(torch.device("cuda"))
    lengths = [60, 17, 33, 1]
    x, mask = batch(lengths)
    with torch.inference_mode():
        want = rt.body.base.forward(enc, x, None, mask, None)
        for _ in range(12):
            y = enc(x, src_key_padding_mask=mask)
            torch.testing.assert_close(y[~mask].float(), want[~mask].float(), rtol=1e-2, atol=1e-2)
        rt._harvest(wait=True)
    probe = rt.mask_shapes[rt._shape_key(4, 60)][5]
    assert len(probe["unread"]) >= 2 and probe["read"]  # both timed
    assert probe["confirmed"] != probe["lost"]  # and the timings decided
    ran = [d.reason for d in autoragged.recent_decisions(enc, 12)]
    assert any("not read" in r for r in ran) and any("not read" not in r for r in ran)
