"""Streams of new batches, on CPU: the capture policy (graphs faked: no GPU here), the graph cache's memory
budget and its evictions (counted, recorded, reported), the mask-only shapes judged one batch behind and the
read's cost, `autoragged.warmup`, and the stream benchmark's smoke run."""

import json
import re
import time
import types

import pytest
import torch
from _fakes import Fixed, Prefers
from autoragged.tuning_db import BatchStats, Decision, Measurement, TuningDB
from torch import nn

import autoragged
import autoragged.runtime.core as dispatch
from autoragged import report
from autoragged._costmodel import PADDED, Arm
from autoragged._planner import Planner, default_ragged_config, graph_config
from autoragged.runtime import graphs as _graphs
from autoragged.runtime import unread as _unread
from autoragged.runtime.records import Record


@pytest.fixture
def reference_ops(monkeypatch):
    """The PyTorch reference ops on CPU (the interpreter is for the kernel tests: too slow for streams)."""
    from autoragged import _ragged, ops

    monkeypatch.setattr(ops, "use_triton", lambda t: False)
    monkeypatch.setattr(_ragged, "use_triton", lambda t: False)


def make_encoder(d=64, layers=2):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d, 2, 2 * d, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()


def batch(lengths, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    x = torch.randn(len(lengths), L, d, generator=g)
    mask = torch.arange(L)[None, :] >= torch.tensor(lengths)[:, None]
    return x, mask


# -- the capture policy, on GraphCache with fake graphs -------------------------------------------------------
_NO_LINEARS = types.SimpleNamespace(memo=(), layer_linears=lambda: [])  # a body: no rows timed (`branch_rows`)


class _Fake:
    """A captured graph's stand-in: what `make` returns."""

    def __init__(self, key=None):
        self.key = key


@pytest.fixture
def fake_device(monkeypatch):
    """GraphCache's device calls answered on the host: allocator growth per capture from `state`, a fixed budget."""
    state = {"allocated": 0, "budget": 10**12, "clock": 0.0}
    monkeypatch.setattr(_graphs, "_memory", lambda device: (state["allocated"], 0))
    monkeypatch.setattr(_graphs, "_budget_bytes", lambda device, fraction: state["budget"])
    monkeypatch.setattr(_graphs, "_new_pool", lambda: object())
    monkeypatch.setattr(_graphs, "_clock", lambda: state["clock"])
    return state


def _make(state, nbytes=0, ms=0.0):
    def make():
        state["allocated"] += nbytes
        state["clock"] += ms / 1e3
        return _Fake()

    return make


def test_a_bucket_is_captured_once_its_recurrence_repays_the_capture(fake_device):
    """Ski rental: a bucket that saves 0.01 ms a replay, against a capture of 4 ms (the prior: 4x an eager arm
    of 1 ms), is captured once about 400 lookups promise 400 replays; one that saves 0.5 ms at its second sight
    (a stream is assumed to go on for 256 lookups more)."""
    cache = _graphs.GraphCache()
    notes = [cache._get("slow", _make(fake_device), "cuda", "single", (1.0, 0.99))[1] for _ in range(500)]
    assert notes[0] == _graphs.FIRST_SIGHT and notes[1] == _graphs.NOT_WORTH
    first = notes.index(_graphs.CAPTURE_NEXT)
    assert 399 <= first <= 402, first
    assert cache.deferred is not None and cache.declined == first - 1
    assert cache.capture_deferred() == "" and "slow" in cache.graphs and cache.deferred is None
    fast = _graphs.GraphCache()
    notes = [fast._get("fast", _make(fake_device), "cuda", "single", (1.0, 0.5))[1] for _ in range(2)]
    assert notes == [_graphs.FIRST_SIGHT, _graphs.CAPTURE_NEXT]
    # no saving, no capture, however often the bucket comes; without costs (the tuner, forced arms): at once
    assert all(fast._get("same", _make(fake_device), "cuda", "single", (1.0, 1.0))[1] != _graphs.CAPTURE_NEXT
               for _ in range(3000))  # fmt: skip
    graph, note = fast._get("forced", _make(fake_device), "cuda", "single", None)
    assert graph is None and note == _graphs.FIRST_SIGHT
    graph, note = fast._get("forced", _make(fake_device), "cuda", "single", None)
    assert isinstance(graph, _Fake) and note is None and graph.key == "forced"


def test_a_capture_with_a_stand_in_pays_out_of_what_it_saves_over_the_stand_in(fake_device):
    """With a third cost (the ms of a kept graph that runs the batch otherwise), the saving is over it, not over
    the eager arm: a graph 0.01 ms faster than its stand-in is declined at its second sight (256 replays promised
    x 0.01 ms < a 4 ms capture, the prior's 4x the eager arm's 1 ms), where against the eager arm (0.5 ms saved) it
    is captured; a stand-in slower than the eager arm makes the capture pay sooner, never later."""
    cache = _graphs.GraphCache()
    notes = [cache._get("b", _make(fake_device), "cuda", "single", (1.0, 0.5, 0.51))[1] for _ in range(3)]
    assert notes == [_graphs.FIRST_SIGHT, _graphs.NOT_WORTH, _graphs.NOT_WORTH] and cache.declined == 2
    eager = _graphs.GraphCache()
    notes = [eager._get("b", _make(fake_device), "cuda", "single", (1.0, 0.5))[1] for _ in range(2)]
    assert notes == [_graphs.FIRST_SIGHT, _graphs.CAPTURE_NEXT]
    notes = [cache._get("c", _make(fake_device), "cuda", "single", (1.0, 0.5, 1.5))[1] for _ in range(2)]
    assert notes == [_graphs.FIRST_SIGHT, _graphs.CAPTURE_NEXT]
    assert cache.deferred[4] == 1.0  # the capture's cost sample is taken against the eager arm's ms


def test_a_trusted_shapes_mask_graph_is_captured_at_its_first_sight(fake_device, monkeypatch):
    """A shape trusted to run the ragged graph fed the mask (judged twice, runtime/unread.py) has recurred
    already: its graph is captured at the key's first lookup, where an untrusted lookup waits for a second."""
    from autoragged.kernels import KernelConfig

    monkeypatch.setattr(_graphs, "_RaggedGraph", lambda *args: _Fake())
    runtime = types.SimpleNamespace(_parameters=lambda module: [], mask_rungs=False)
    config = KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2, backend="triton")
    cache = _graphs.GraphCache()
    args = (runtime, None, config, False, 32, 50, torch.float16, "cuda")
    assert cache.ragged_mask(*args)[1] == _graphs.FIRST_SIGHT
    graph, note = cache.ragged_mask(*args[:5], 120, *args[6:], trusted=True)  # another length bucket: a new key
    assert isinstance(graph, _Fake) and note is None and len(cache.graphs) == 1 and len(cache.seen) == 2


def test_mask_graphs_with_branches_are_found_by_the_tokens_their_rungs_hold(fake_device, monkeypatch):
    """With cuBLAS branches (runtime/capture.py, `_Rungs`), a mask graph of (B, width) serves the batches whose
    expected tokens its rungs hold; others get a graph for their tokens bucket (`mask_tokens`), as another source
    of the same shapes would. Past 16,384 rows, or where the device cannot take the SWITCH node (`why_not`), the
    graph has its Triton linears alone, keyed as before."""
    from autoragged.kernels import KernelConfig

    from autoragged import _buckets
    from autoragged.runtime import _cuda_if
    from autoragged.runtime.capture import _Rungs

    made = []

    def fake_graph(runtime, module, config, causal, key, dtype, device, pool, tile_rows=None, rungs=(), rows=None):
        made.append(rungs)
        graph = _Fake()
        graph.rungs = _Rungs(rungs, "cpu") if rungs else None
        return graph

    monkeypatch.setattr(_graphs, "_RaggedGraph", fake_graph)
    monkeypatch.setattr(_cuda_if, "why_not", lambda device: None)
    runtime = types.SimpleNamespace(_parameters=lambda module: [], mask_rungs=True, body=_NO_LINEARS)
    config = KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2, backend="triton")
    cache = _graphs.GraphCache()

    def lookup(B, L, tokens):
        return cache.ragged_mask(runtime, None, config, False, B, L, torch.float16, "cuda", tokens, trusted=True)[0]

    first = lookup(32, 109, 1339)  # 32 x 128 rows, tokens bucket 1,536
    assert first.rungs.holds(1339) and first.key[8] == _buckets.mask_tokens(1339) == 1536
    assert made[0] == _buckets.mask_rungs(int(1536 / 2**0.25), 32 * 128)
    assert lookup(32, 120, 1700) is first and first.rungs.holds(1700)  # another bucket's tokens, held: the same graph
    other = lookup(32, 128, 3600)  # Wiki128's: none of its rungs holds them
    assert other is not first and other.key[8] == _buckets.mask_tokens(3600) and len(cache.graphs) == 2
    assert lookup(32, 128, 3500) is other
    wide = lookup(128, 300, 20_000)  # 128 x 384 rows: past 16,384, the Triton branch alone
    assert wide.rungs is None and wide.key[8] is None
    # a narrower batch runs on a kept graph up to 2x its width (the layers stop at the counted rows): no capture
    width = _buckets.mask_width
    assert width(80) == 96 and lookup(32, 80, 1339) is first and width(60) == 64 and lookup(32, 60, 1339) is first
    narrow = lookup(32, 80, 600)  # its tokens in no rung of the wider graphs: a graph of its own width
    assert narrow not in (first, other) and narrow.key[3] == 96 and narrow.rungs.holds(600)
    assert lookup(32, 70, 600) is narrow  # the narrowest graph that serves
    assert width(30) == 32 and lookup(32, 30, 900).key[3] == 32  # 96 columns for a 32-wide bucket: past 2x
    assert lookup(128, 250, 20_000) is wide and len(cache.graphs) == 5  # (256 columns' bucket, no branches wanted)
    monkeypatch.setattr(_cuda_if, "why_not", lambda device: "RuntimeError: no SWITCH nodes here")
    plain = lookup(64, 30, 861)
    assert plain.rungs is None and plain.key[8] is None and runtime.mask_rungs is False


def test_a_mask_graphs_cublas_branch_runs_its_rung_or_one_row_more_whichever_its_linears_run_faster(monkeypatch):
    """`branch_rows`: a ragged graph of the rung timed already decides (`_ROW_CHOICE`); else one layer's linears are
    timed on the rung's rows and one more, once per (rows, body dims, dtype, device), and the extra row must win by
    the margin; the rung itself where the graph has no room for one more row or the body names no linears."""
    timed = []
    ms = {896: [1.0, 0.8], 960: [1.0, 0.995], 1024: [1.0, 0.5]}

    def fake_ms(linears, rows, dtype, device):
        timed.append(rows)
        return ms[rows[0]]

    monkeypatch.setattr(_graphs, "linears_ms", fake_ms)
    monkeypatch.setattr(
        _graphs, "_ROW_CHOICE", {(r, 8, 16, 2, "fp16", "gpu"): c for r, c in ((1024, 1024), (1152, 1153))}
    )
    monkeypatch.setattr(_graphs, "_BRANCH_ROWS", {})
    body = types.SimpleNamespace(memo=(8, 16, 2), layer_linears=lambda: ["a linear"])
    runtime = types.SimpleNamespace(body=body)

    def rows(n, capacity=4096):
        return _graphs.branch_rows(runtime, n, capacity, "fp16", "gpu")

    assert rows(896) == 897 and rows(896) == 897 and timed == [(896, 897)]  # timed once
    assert rows(960) == 960  # 0.5% faster: within the margin
    assert rows(1024) == 1024 and len(timed) == 2  # a ragged graph of 1,024 rows was timed: its choice
    assert rows(1152, capacity=1152) == 1152 and len(timed) == 2  # no room for one more (whatever was timed)
    assert rows(1152) == 1153
    runtime.body = _NO_LINEARS
    assert rows(1280) == 1280 and len(timed) == 2


def test_a_new_mask_graph_is_as_wide_as_its_batch_sizes_shapes_reach(fake_device, monkeypatch):
    """A new mask graph takes the widest length bucket the batch size's mask-only shapes have reached (up to 2x
    its own, and within the rows that keep cuBLAS branches): those batches then replay it, no capture mid-stream."""
    from autoragged.kernels import KernelConfig

    from autoragged import _buckets
    from autoragged.runtime import _cuda_if
    from autoragged.runtime.capture import _Rungs

    def fake_graph(runtime, module, config, causal, key, dtype, device, pool, tile_rows=None, rungs=(), rows=None):
        graph = _Fake()
        graph.rungs = _Rungs(rungs, "cpu") if rungs else None
        return graph

    monkeypatch.setattr(_graphs, "_RaggedGraph", fake_graph)
    monkeypatch.setattr(_cuda_if, "why_not", lambda device: None)
    shapes = {(32, 480): None, (32, 336): None, (40, 512): None, (32, 1024): None}  # (B, the padded bucket's L)
    runtime = types.SimpleNamespace(
        _parameters=lambda module: [], mask_rungs=True, mask_shapes=shapes, body=_NO_LINEARS
    )
    config = KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2, backend="triton")
    cache = _graphs.GraphCache()

    def lookup(B, L, tokens):
        return cache.ragged_mask(runtime, None, config, False, B, L, torch.float16, "cuda", tokens, trusted=True)[0]

    width = _buckets.mask_width
    assert (width(300), width(480), width(1024)) == (368, 512, 1024)
    graph = lookup(32, 300, 9000)
    assert graph.key[3] == 512 and graph.rungs.holds(9000)  # 1,024 is past 2x 368
    assert lookup(32, 500, 9500) is graph and len(cache.graphs) == 1
    assert lookup(16, 300, 3000).key[3] == 368  # no shapes of B=16: its own width
    assert lookup(40, 300, 12000).key[3] == 368  # 40 x 512 rows would lose the branches (40 x 368 keep them)


def test_a_rare_bucket_waits_while_a_frequent_one_is_captured_at_once(fake_device):
    cache = _graphs.GraphCache()
    seen = {"often": [], "rare": []}
    for t in range(1, 801):
        key = "rare" if t % 50 == 0 else "often"
        graph, note = cache._get(key, _make(fake_device, ms=4.0), "cuda", "single", (1.0, 0.5))  # 4x eager
        seen[key].append(note if graph is None else "replay")
        if cache.deferred is not None:
            cache.capture_deferred()
    assert seen["often"][:3] == [_graphs.FIRST_SIGHT, _graphs.CAPTURE_NEXT, "replay"]
    # one lookup in 50: 0.02 x 256 lookups x 0.5 ms = 2.56 ms < a 4 ms capture, until the stream's own length
    # has grown past 400 lookups (0.02 x 400 x 0.5 = 4)
    assert seen["rare"][:8] == [_graphs.FIRST_SIGHT] + [_graphs.NOT_WORTH] * 7
    assert _graphs.CAPTURE_NEXT in seen["rare"][8:11] and seen["rare"][-1] == "replay"


def test_the_capture_cost_is_the_least_measured_and_replaces_the_prior(fake_device):
    """A kind's first capture (it compiles, mostly) is no sample; of the others, the least is the estimate."""
    cache = _graphs.GraphCache(min_seen=1)
    assert cache.capture_cost_ms("ragged/padded/cublas+rows", 2.0) == 24.0  # the prior for a row choice
    assert cache.capture_cost_ms("padded/mask", 2.0) == 8.0
    cache._get("first", _make(fake_device, ms=1.0), "cuda", "padded/mask", (2.0, 1.0))
    cache.capture_deferred()
    assert cache.capture_cost_ms("padded/mask", 2.0) == 8.0  # still the prior
    for key, ms in (("b", 100.0), ("c", 10.0), ("d", 12.0)):
        cache._get(key, _make(fake_device, ms=ms), "cuda", "padded/mask", (2.0, 1.0))
        cache.capture_deferred()
    assert cache.capture_cost_ms("padded/mask", 3.0) == pytest.approx(15.0)  # 10 ms / 2 ms x 3 ms
    stats = cache.stats()
    assert stats.captures == 4 and stats.capture_ms == pytest.approx(123.0)
    assert stats.capture_cost == {"padded/mask": pytest.approx(5.0)}


def test_the_memory_budget_keeps_what_fits_least_recently_used_out(fake_device):
    fake_device["budget"] = 100
    cache = _graphs.GraphCache(min_seen=1)
    for key in ("k1", "k2"):
        cache._get(key, _make(fake_device, nbytes=40), "cuda")
    assert cache.kept_bytes == 80 and cache.evictions == 0
    generation = cache.generation
    cache._get("k3", _make(fake_device, nbytes=40), "cuda")  # 120 bytes > 100: k1, least recently used, goes
    assert list(cache.graphs) == ["k2", "k3"] and cache.kept_bytes == 80 and cache.evictions == 1
    assert cache.generation == generation + 1
    cache._get("k2", _make(fake_device), "cuda")  # a replay: k2 is the most recently used now
    cache._get("k4", _make(fake_device, nbytes=40), "cuda", "single", (2.0, 1.0))
    assert cache.capture_deferred() == "; 1 graph evicted (memory budget)"
    assert list(cache.graphs) == ["k2", "k4"] and cache.stats().evictions == 2 and cache.stats().budget_bytes == 100
    cache._get("huge", _make(fake_device, nbytes=1000), "cuda")  # over the budget alone: two graphs stay
    assert list(cache.graphs) == ["k4", "huge"]
    counted = _graphs.GraphCache(cap=2, min_seen=1)  # an explicit count: bytes do not matter
    for key in ("a", "b", "c"):
        counted._get(key, _make(fake_device, nbytes=10**9), "cuda")
    assert list(counted.graphs) == ["b", "c"] and counted.evictions == 1 and counted.stats().budget_bytes is None
    counted.clear()
    assert not counted.graphs and counted.kept_bytes == 0 and counted.seen  # the recurrence stays


def test_a_failed_capture_is_remembered(fake_device, monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    cache = _graphs.GraphCache(min_seen=1)

    def broken():
        raise RuntimeError("CUDA out of memory")

    cache._get("k", broken, "cuda", "single", (2.0, 1.0))
    assert cache.capture_deferred() == "; graph capture failed: RuntimeError: CUDA out of memory"
    assert cache._get("k", broken, "cuda", "single", (2.0, 1.0)) == (None, "graph capture failed earlier: "
                                                                     "RuntimeError: CUDA out of memory")  # fmt: skip


# -- the runtime's use of it, on CPU with a fake graph arm ----------------------------------------------------
class _FakeRagged:
    def __init__(self, runtime, module, config, causal, key, dtype, device, pool, tile_rows=None):
        self.rows, self.config = key[0], config

    def run_padded(self, x, lengths):
        return torch.full_like(x, 7.0)  # a replay, recognisably


def _graph_runtime(enc, monkeypatch, ms):
    """enc's runtime with a graph arm on CPU: a real GraphCache whose ragged graphs are fakes, and a planner
    that offers eager ragged and the cuBLAS ragged graph at the given ms."""
    monkeypatch.setattr(_graphs, "_RaggedGraph", _FakeRagged)
    monkeypatch.setattr(_graphs, "replay_ms", lambda graphs: [1.0] * len(graphs))
    monkeypatch.setattr(_graphs, "_ROW_CHOICE", {})
    rt = enc._autoragged
    cache = rt.graphs = _graphs.GraphCache(cap=rt.graph_cap)
    rt._graph_cache = lambda device: cache
    head_dim = rt.body.head_dim

    def candidates(stats):
        return [Arm("ragged", default_ragged_config(head_dim, stats.max_len)),
                Arm("ragged_graph", graph_config(head_dim, stats.max_len, "cublas"))]  # fmt: skip

    rt.planners[torch.device("cpu")] = Planner(rt.sig, Fixed(ms), candidates)
    return rt, cache


def _same_batch(enc, n: int, lengths=(9, 3, 6)):
    """(n outputs of enc on one batch with lengths=, the original's output with zeros at pads, the pad mask)."""
    x, mask = batch(list(lengths))
    with torch.inference_mode():
        want = nn.TransformerEncoder.forward(enc, x, src_key_padding_mask=mask).masked_fill(mask[..., None], 0)
        return [enc(x, lengths=list(lengths)) for _ in range(n)], want, mask


def test_the_runtime_captures_after_the_eager_run_when_it_pays(fake_device, monkeypatch, reference_ops):
    enc = autoragged.wrap(make_encoder(), db=False, sample_every=0, capture="pays")
    rt, cache = _graph_runtime(enc, monkeypatch, {"padded": 10.0, "ragged": 5.0, "ragged_graph": 1.0})
    outs, want, mask = _same_batch(enc, 3)
    first, second, third = autoragged.recent_decisions(enc, 3)
    assert first.arm == "ragged" and _graphs.FIRST_SIGHT in first.reason
    assert second.arm == "ragged" and _graphs.CAPTURE_NEXT in second.reason  # ran eagerly, then captured
    assert third.arm == "ragged_graph" and "graph" not in third.reason
    for y in outs[:2]:
        torch.testing.assert_close(y[~mask], want[~mask], rtol=1e-4, atol=1e-4)
    assert (outs[2] == 7).all()  # the third call replayed
    assert cache.captures == 1 and cache.lookups == 3


def test_a_capture_that_does_not_pay_runs_the_best_eager_arm(fake_device, monkeypatch, reference_ops):
    """The graph saves 0.01 ms a batch: not worth a capture; the batch runs the plan's best eager arm (padded
    here, not the graph's eager form), and the record says which and why."""
    enc = autoragged.wrap(make_encoder(), db=False, sample_every=0, capture="pays")
    rt, cache = _graph_runtime(enc, monkeypatch, {"padded": 3.0, "ragged": 5.0, "ragged_graph": 2.99})
    outs, want, mask = _same_batch(enc, 4)
    decisions = autoragged.recent_decisions(enc, 4)
    assert [d.arm for d in decisions] == ["padded"] * 4
    assert all(_graphs.NOT_WORTH in d.reason for d in decisions[1:]) and cache.declined == 3
    assert not cache.graphs and cache.captures == 0
    for y in outs:
        torch.testing.assert_close(y[~mask], want[~mask], rtol=1e-4, atol=1e-4)
    rt.capture_policy = False  # wrap(capture="second_sight"): captured at the second sight whatever it saves
    _same_batch(enc, 1)
    assert cache.captures == 1 and autoragged.recent_decisions(enc, 1)[0].arm == "ragged_graph"


def test_an_eviction_is_counted_and_noted_on_the_batch_that_caused_it(fake_device, monkeypatch, reference_ops):
    enc = autoragged.wrap(make_encoder(), db=False, sample_every=0, graph_cap=1)
    rt, cache = _graph_runtime(enc, monkeypatch, {"padded": 10.0, "ragged": 5.0, "ragged_graph": 1.0})
    with torch.inference_mode():
        for lengths in ([9, 3, 6], [9, 3, 6], [900, 3, 6], [900, 3, 6]):
            enc(*batch(lengths)[:1], lengths=lengths)
    last = autoragged.recent_decisions(enc, 1)[0]
    assert last.reason.endswith("; 1 graph evicted (graph cap)") and cache.evictions == 1
    stats = autoragged.graph_stats(enc)
    assert list(stats.values())[0].evictions == 1 and list(stats.values())[0].graphs == 1


def test_the_report_counts_captures_evictions_and_declines(tmp_path):
    path = tmp_path / "t.sqlite"
    stats = BatchStats.from_lengths((5, 3))
    reasons = [
        f"cost model (prior); {_graphs.CAPTURE_NEXT}",
        f"cost model (prior); {_graphs.CAPTURE_NEXT}; 2 graphs evicted (memory budget)",
        f"cost model (prior); {_graphs.NOT_WORTH}",
        f"cost model (prior); {_graphs.CAPTURE_NEXT}; graph capture failed: RuntimeError: out of memory",
        "cost model (prior); graph capture failed earlier: RuntimeError: out of memory",
        "cost model (prior)",
    ]
    with TuningDB.open(path) as db:
        db.add_decisions(Decision(time.time(), "dev", "sig", stats, "ragged", None, {"padded": 1.0}, r)
                         for r in reasons)  # fmt: skip
    s = report.summary(path)
    (module,) = s.devices[0].modules
    assert module.graphs == report.GraphEvents(captures=2, evictions=2, declined=1, failed=1)
    text = report.render_text(s)
    assert re.search(r"\| evicted \(the module's graph cap or memory budget\) +\| +2 \|", text), text


# -- wrap's options and the stats API -------------------------------------------------------------------------
def test_wrap_makes_the_planner_before_the_first_batch():
    """The database read and the cost model's decoding are paid at wrap, not by the stream's first batch."""
    enc = autoragged.wrap(make_encoder(), db=False)
    planner = enc._autoragged.planners[torch.device("cpu")]
    with torch.inference_mode():
        enc(*batch([5, 2])[:1], lengths=[5, 2])
    assert enc._autoragged.planners[torch.device("cpu")] is planner
    assert not autoragged.wrap(make_encoder(), db=False, policy="ragged")._autoragged.planners


def test_graph_cap_is_sized_from_memory_unless_given():
    enc = autoragged.wrap(make_encoder(), db=False)
    assert enc._autoragged.graph_cap is None
    assert autoragged.graph_stats(enc) == {"DispatchingTransformerEncoder": _graphs.GraphStats()}  # no graphs on CPU
    assert autoragged.wrap(make_encoder(), db=False, graph_cap=3)._autoragged.graph_cap == 3
    with pytest.raises(ValueError, match=r"graph_cap must be None \(sized from memory\) or an int >= 1, got 0"):
        autoragged.wrap(make_encoder(), graph_cap=0)


# -- mask-only shapes: judged one batch behind, the read's cost ----------------------------------------------
def test_a_trusted_shape_notices_a_change_one_batch_behind_without_reading(monkeypatch, reference_ops):
    enc = autoragged.wrap(make_encoder(), db=False, sample_every=0)
    rt = enc._autoragged
    cpu = torch.device("cpu")
    rt.planners[cpu] = Planner(rt.sig, Prefers(padded=True))
    reads = []
    real = dispatch.mask_lengths
    monkeypatch.setattr(dispatch, "mask_lengths", lambda *a, **k: reads.append(1) or real(*a, **k))
    streams = [[9, 3, 6 + i % 3] for i in range(40)]  # L 6..9: one shape (B=3, bucket 16)
    outs = []
    with torch.inference_mode():
        for i, lengths in enumerate(streams):
            if i == 20:  # the padded arm stops winning: the next verdict, from an earlier batch's stats, sees it
                rt.planners[cpu] = Planner(rt.sig, Prefers(padded=False))
                read_before = len(reads)
            x, mask = batch(lengths, seed=i)
            outs.append((enc(x, src_key_padding_mask=mask), x, mask))
    assert read_before == dispatch._TRUST  # trusted after two reads; judged again every 8 batches without one
    decisions = autoragged.recent_decisions(enc, 40)
    first_read = next(i for i in range(20, 40) if "not read" not in decisions[i].reason)
    assert first_read <= 20 + dispatch._REJUDGE + 1
    assert all("not read" not in d.reason for d in decisions[first_read:])  # from then on, read and ragged
    assert decisions[-1].arm == "ragged"
    for y, x, mask in outs:
        with torch.inference_mode():
            want = nn.TransformerEncoder.forward(enc, x, src_key_padding_mask=mask).masked_fill(mask[..., None], 0)
        torch.testing.assert_close(y[~mask], want[~mask], rtol=1e-4, atol=1e-4)
        assert (y[mask] == 0).all()


def test_the_read_costs_the_gpus_idle_time_only_when_the_host_runs_ahead():
    rt = autoragged.wrap(make_encoder(), db=False)._autoragged
    rt.sync_samples.extend([0.3, 0.1])
    rt.prelaunch.extend([0.3, 0.5, 0.4])
    predicted = {"padded": 1.0, "ragged:a": 0.8}
    assert rt.read_cost_ms == 0.1
    assert rt._judge_shape(4, 20, predicted)[0] == 0  # 1.0 > 0.8 + 0.1: the read path wins
    rt.pipelined = True
    assert rt.read_cost_ms == pytest.approx(0.4)  # + the least host time from a read to the next launch
    assert rt._judge_shape(4, 20, predicted)[0] == 1  # 1.0 <= 0.8 + 0.4: skip the read


def test_a_read_that_waits_for_queued_work_marks_the_host_ahead(monkeypatch, reference_ops):
    rt = autoragged.wrap(make_encoder(), db=False)._autoragged
    rt._read_timed(30.0, cuda=True)  # the first read on a GPU: its one-time costs are not the read's
    assert not rt.pipelined and not rt.sync_samples
    rt.sync_samples.append(0.1)  # as the next read's events time it
    rt._read_timed(5.0, cuda=True)  # it waited for the GPU to finish earlier batches
    assert rt.pipelined and rt.sync_ms == 0.1
    rt._read_timed(0.12, cuda=True)
    assert not rt.pipelined
    rt._read_timed(5.0, cuda=False)  # a CPU: the host's own noise
    assert not rt.pipelined
    # the calls themselves: every read is timed, and the host time from it to the arm's work queued
    enc = autoragged.wrap(make_encoder(), db=False, sample_every=0)
    rt = enc._autoragged
    rt.planners[torch.device("cpu")] = Planner(rt.sig, Prefers(padded=False))
    real = dispatch.mask_lengths
    monkeypatch.setattr(dispatch, "mask_lengths", lambda *a, **k: time.sleep(0.002) or real(*a, **k))
    x, mask = batch([9, 3, 6])
    with torch.inference_mode():
        for _ in range(3):
            enc(x, src_key_padding_mask=mask)
    assert len(rt.sync_samples) == len(rt.prelaunch) == 3 and rt.sync_ms >= 2.0 and not rt.pipelined


def test_a_gpu_reads_own_cost_is_timed_from_the_queued_works_end(monkeypatch):
    """On a GPU a read's host time includes its wait for the batches queued before it; its own cost is timed by
    events from their end, taken at the next read (no wait then). Fake events stand in for CUDA's here."""

    class Event:
        def __init__(self):
            self.at, self.done = None, True

        def record(self):
            self.at = clock[0]

        def query(self):
            return self.done

        def elapsed_time(self, other):
            return other.at - self.at

    clock = [0.0]
    monkeypatch.setattr(_unread, "timers", lambda device: (Event(), Event()))
    rt = autoragged.wrap(make_encoder(), db=False)._autoragged
    kpm = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))

    def read(host_ms, own_ms):  # the read waited host_ms - own_ms for queued work
        events = rt._read_begin(kpm)
        clock[0] += own_ms  # (the start fires at the queue's end: the host clock's wait is not on it)
        rt._read_timed(host_ms, True, events)
        clock[0] += 10.0  # the next batch

    read(25.0, 20.0)
    assert not rt.sync_samples and not rt.pipelined  # the first read, one-time costs and all: not a sample
    assert rt.sync_ms == _unread._READ_PRIOR_MS  # a GPU's read costs the prior until one is timed
    read(4.0, 0.06)
    assert not rt.sync_samples and rt.pipelined  # it waited: 4 ms against the prior's 0.2
    read(0.07, 0.05)
    assert rt.sync_ms == pytest.approx(0.06) and not rt.pipelined  # the last read's own time, harvested now
    read(0.3, 0.3)
    assert rt.sync_ms == pytest.approx(0.05) and rt.pipelined  # (0.3 > 0.05 + 0.05)
    rt.read_events[1].done = False  # a pair not fired yet is skipped, not waited for
    read(3.0, 0.02)
    assert rt.sync_ms == pytest.approx(0.05) and len(rt.sync_samples) == 2
    assert rt._read_begin(types.SimpleNamespace(is_cuda=False)) is None  # a CPU: host times only


def test_peek_never_waits_for_a_copy():
    host = torch.tensor([-1, 2, -1], dtype=torch.int32)
    record = Record(None, PADDED, {}, "unread", None, "sig")
    record._pending = (host, object(), 10, 8)  # an event no one may touch: peek makes no CUDA call
    assert record.peek() is None
    host.copy_(torch.tensor([4, 2, 3], dtype=torch.int32))
    stats = record.peek()
    assert (stats.batch, stats.total, stats.max_len) == (3, 6 + 8 + 7, 8)
    assert record._pending is not None  # peek changes nothing
    done = Record(BatchStats.from_lengths((2, 1)), PADDED, {}, "read", None, "sig")
    assert done.peek().total == 3


# -- warmup ---------------------------------------------------------------------------------------------------
def test_warmup_runs_a_workload_through_every_wrapped_module_on_cpu(tmp_path, reference_ops):
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = make_encoder(), make_encoder(layers=1)

    model = autoragged.wrap(Two(), db=tmp_path / "t.sqlite")
    s = autoragged.warmup(model, "CoLA", batch_sizes=[4, 8], batches=3, progress=False)
    assert s.modules == 2 and s.batches == 2 * 2 * 3 and not s.skipped and s.graphs == 0 and s.seconds > 0
    assert s.cublas_rows == 0  # (cuBLAS's first calls are a GPU's cost)
    rt = model.a._autoragged
    assert len(rt.ring) == 6 and rt.mask_shapes  # the shapes are judged (and trusted) ahead of traffic
    assert rt.recording  # on again after the warm-up
    assert autoragged.flush() == 0  # nothing synthetic reached the database
    with torch.inference_mode():
        model.a(*batch([5, 2])[:1], lengths=[5, 2])
    assert autoragged.flush() == 1
    # a sample of lengths, explicit batches, both kinds of input
    s = autoragged.warmup(model, [3, 7, 11, 30], batch_sizes=[2], batches=2, inputs="both", progress=False)
    assert s.batches == 2 * 2 * 2
    s = autoragged.warmup(model.b, [[5, 1], [7, 7, 2]], progress=False)
    assert s.batches == 2 and s.modules == 1


def test_warmup_adds_the_length_buckets_the_draws_missed_on_a_gpu():
    """`_tail`: for each batch size, a drawn batch cut and stretched to each mask-graph length bucket the draws
    missed, from one below the narrowest drawn up to the workload's longest sequence, 3 times each; nothing
    without graphs."""
    from types import SimpleNamespace

    from autoragged import _warmup
    from autoragged._buckets import mask_width

    assert _warmup._longest("CoLA") == 37 and _warmup._longest(["CoLA", "MNLI"]) == 128
    assert _warmup._longest([3, 9, 30]) == 30
    assert _warmup._longest([[5, 1]]) is None and _warmup._longest("calibration") is None
    gpu = SimpleNamespace(graphs_enabled=True, _param=lambda: SimpleNamespace(device=torch.device("cuda")))
    groups = [[5, 9], [7, 20], [3, 3, 3]]
    assert (mask_width(20), mask_width(3), mask_width(37)) == (32, 16, 48)
    tail = _warmup._tail(groups, 37, gpu)
    assert tail == [[7, 37]] * 3 + [[3, 3, 32]] * 3 + [[3, 3, 37]] * 3
    assert _warmup._tail(groups, 20, gpu) == [[3, 3, 20]] * 3  # the size-2 draws reached 20's bucket
    # the gaps between drawn buckets (32 from the batch under it, 64 and 96 from the longest drawn)
    assert _warmup._tail([[5, 40], [2, 3]], 100, gpu) == (
        [[2, 32]] * 3 + [[5, 64]] * 3 + [[5, 96]] * 3 + [[5, 100]] * 3
    )
    assert [mask_width(n) for n in (3, 40, 100)] == [16, 48, 128]
    # one bucket below the narrowest drawn: the shortest drawn batch cut to it
    assert _warmup._tail([[30, 40], [35, 44]], 44, gpu) == [[30, 32]] * 3
    cpu = SimpleNamespace(graphs_enabled=True, _param=lambda: SimpleNamespace(device=torch.device("cpu")))
    assert _warmup._tail(groups, 37, cpu) == []
    off = SimpleNamespace(graphs_enabled=False, _param=gpu._param)
    assert _warmup._tail(groups, 37, off) == []


def test_warmup_errors_say_what_to_do():
    enc = make_encoder()
    with pytest.raises(ValueError, match="no wrapped module in TransformerEncoder: call autoragged.wrap"):
        autoragged.warmup(enc, "CoLA")
    autoragged.wrap(enc, db=False)
    with pytest.raises(ValueError, match="unknown workload 'Cola'"):
        autoragged.warmup(enc, "Cola", progress=False)
    with pytest.raises(ValueError, match="inputs must be one of"):
        autoragged.warmup(enc, "CoLA", inputs="ids", progress=False)
    with pytest.raises(ValueError, match="needs the module's tuning database"):
        autoragged.warmup(enc, "calibration", progress=False)
    with pytest.raises(ValueError, match="non-empty lists of lengths"):
        autoragged.warmup(enc, [[3, 1], []], progress=False)


def test_warmup_from_the_calibrations_shapes(tmp_path, reference_ops):
    from autoragged._device import device_key

    path = tmp_path / "t.sqlite"
    enc = autoragged.wrap(make_encoder(), db=path)
    key = device_key("cpu").key
    shapes = [(3, 9, 20), (5, 12, 31)]
    with TuningDB.open(path) as db:
        db.add_measurements(
            Measurement(
                key,
                "other-signature",
                "padded",
                None,
                BatchStats.from_lengths((n, *[m] * (b - 1))),
                1.0,
                1.0,
                1.0,
                3,
                time.time(),
            )  # fmt: skip
            for b, n, m in ((3, 9, 5), (5, 12, 4))
        )
    s = autoragged.warmup(enc, "calibration", progress=False)
    assert s.batches == len(shapes)
    seen = sorted((d.stats.batch, d.stats.max_len, d.stats.total) for d in autoragged.recent_decisions(enc, 2))
    assert seen == [(3, 9, 19), (5, 12, 28)]


def test_warmup_of_a_huggingface_bert_clips_to_its_positions(reference_ops):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                     vocab_size=50, max_position_embeddings=16)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    autoragged.wrap(model, db=False)
    s = autoragged.warmup(model, [3, 9, 30], batch_sizes=[3], batches=3, inputs="both", progress=False)
    assert s.modules == 1 and s.batches == 6 and not s.skipped
    assert all(d.stats.max_len <= 16 for d in autoragged.recent_decisions(model, 6))


# -- the stream benchmark ---------------------------------------------------------------------------------------
def test_stream_table_runs_a_tiny_cpu_smoke(tmp_path, reference_ops):
    pytest.importorskip("transformers")
    from benchmarks import stream_table

    out = tmp_path / "stream.json"
    argv = ["--device", "cpu", "--tiny", "--models", "cora", "bert-base", "--datasets", "CoLA", "--batch-sizes", "3",
            "--warm", "1", "--batches", "2", "--before", "--ablate", "--warmup-call", "--warmup-batches", "2",
            "--out", str(out)]  # fmt: skip
    assert stream_table.main(argv) == 0
    results = json.loads(out.read_text())
    cora, bert = results["models"]["cora"]["rows"][0], results["models"]["bert-base"]["rows"][0]
    for row in (cora, bert):
        assert row["tokens"] > 0 and all(row[c] > 0 for c in ("auto", "auto_lengths", "auto_warmed", "auto_before",
                                                              "auto_recheck", "auto_pays"))  # fmt: skip
        assert row["before_over_auto"] > 0 and row["recheck_over_auto"] > 0
        assert set(row["failed"]) == {"varlen", "ragged_graph"}  # CUDA only
        assert row["auto_max_err"] < 1e-3 and row["diag"]["auto"]["mask_reads"] <= 2
    assert cora["pytorch_fast"] > 0 and cora["pytorch_nofast"] > 0 and bert["hf_sdpa"] > 0
    assert cora["diag"]["auto_warmed"]["warmup"]["batches"] == 2
    assert stream_table._strip(["--fresh-process", "--quick", "--columns", "auto", "x", "--out", "p", "--warm", "0"],
                               ("--fresh-process", "--out", "--columns")) == ["--quick", "--warm", "0"]  # fmt: skip


def test_verdict_trace_runs_a_tiny_cpu_smoke(tmp_path, reference_ops):
    """benchmarks/verdict_trace.py logs every timed batch's path and the verdicts, and puts the runtime back."""
    pytest.importorskip("transformers")
    from autoragged.runtime import core, unread
    from benchmarks import verdict_trace

    before = (core.Runtime._execute, unread.UnreadShapes._judge_entry, core.Runtime._run_unread)
    out = tmp_path / "trace.json"
    argv = ["--device", "cpu", "--tiny", "--rows", "CoLA:3", "--warm", "2", "--batches", "3", "--out", str(out)]
    assert verdict_trace.main(argv) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert [c["path"] for c in row["trace"]["calls"]] and len(row["trace"]["calls"]) == 3
    assert all(c["path"] in ("R", "U") or c["path"].startswith("read:") for c in row["trace"]["calls"])
    assert row["trace"]["verdicts"] and all(row[c]["ms"] > 0 for c in ("auto", "always_mask", "always_read"))
    # the timed stream itself is traced: each call says what its record ran; the warm-up's verdicts come first
    assert all(" | " in c["ran"] for c in row["trace"]["calls"])
    calls_at = [v["call"] for v in row["trace"]["verdicts"]]
    assert calls_at == sorted(calls_at) and -1 in calls_at
    verdict = row["trace"]["verdicts"][-1]  # what a verdict weighed: the read's parts, the rent, the bucket's timings
    assert verdict["sync_ms"] >= 0 and verdict["paid"] >= 0 and verdict["bucket"][0] == 3
    assert not verdict["explored_now"] and not verdict["bucket_won"] and not verdict["bucket_lost"]  # (a CPU)
    assert (core.Runtime._execute, unread.UnreadShapes._judge_entry, core.Runtime._run_unread) == before
    cora = tmp_path / "cora.json"  # the CoRa encoder's streams, called with src_key_padding_mask
    assert verdict_trace.main([*argv[:-1], str(cora), "--models", "cora"]) == 0
    calls = json.loads(cora.read_text())["rows"][0]["trace"]["calls"]
    assert len(calls) == 3 and all(c["path"] in ("R", "U") or c["path"].startswith("read:") for c in calls)
    with pytest.raises(SystemExit):
        verdict_trace.main(["--rows", "CoLA"])  # DATASET:B
