"""CUDA graphs (GPU only): every way a graph takes its batch replays what the eager arm computes; captures happen in
the background while the caller runs on; replays see in-place parameter updates; moved parameters drop the graphs;
nothing on the unread path synchronises."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from autoragged.tuning_db import BatchStats  # noqa: E402

import autoragged  # noqa: E402
from autoragged.graphs.worker import worker  # noqa: E402
from autoragged.models.torch_encoder import _BASE, TorchCall  # noqa: E402
from autoragged.planning.buckets import mask_width  # noqa: E402
from autoragged.planning.costmodel import Arm  # noqa: E402
from autoragged.planning.planner import default_ragged_config, graph_config  # noqa: E402

D, H = 256, 4


def encoder(norm_first=False, batch_first=True, layers=2):
    layer = torch.nn.TransformerEncoderLayer(D, H, 512, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
    return torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).to("cuda", torch.float16).eval()


def inputs(lengths, L=None, batch_first=True, seed=0, left=False):
    g = torch.Generator(device="cpu").manual_seed(seed)
    L = L or max(lengths)
    x = torch.randn(len(lengths), L, D, generator=g).to("cuda", torch.float16)
    cols = torch.arange(L)[None, :]
    n = torch.tensor(lengths)[:, None]
    mask = (cols < L - n) if left else (cols >= n)
    if not batch_first:
        x = x.transpose(0, 1).contiguous()
    return x, mask.cuda()


def execute(enc, arm, lengths, x, mask, from_mask=False):
    """`arm` through the runtime's execute path (a graph arm's graph captured now if not kept)."""
    rt = enc._autoragged
    stats = BatchStats.from_lengths(tuple(lengths), padded_len=mask.shape[1])
    call = TorchCall(rt.body, x, None, mask if from_mask else None, None, None)
    with torch.inference_mode():
        return rt.execute(enc, call, arm, tuple(lengths), stats)


def original(enc, x, mask):
    with torch.inference_mode():
        return (
            _BASE[type(enc)]
            .forward(enc, x, src_key_padding_mask=mask)
            .masked_fill((mask if enc._autoragged.body.batch_first else mask.T)[..., None], 0.0)
        )


def close(a, b, mask, batch_first=True):
    keep = ~mask if batch_first else ~mask.T
    torch.testing.assert_close(a[keep].float(), b[keep].float(), rtol=2e-2, atol=2e-2)


def unsynced(fn):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


BATCHES = [[37, 5, 100, 1], [64, 64, 3], [17] * 9, [200, 1, 1, 1, 1, 90]]


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("from_mask", [False, True])
def test_a_graph_replays_what_the_eager_arm_computes(norm_first, batch_first, from_mask):
    """Fed host lengths or the mask alone: replays of one graph on batches of other lengths (a graph serves every
    batch of its size that fits its width), against the eager arm and PyTorch's own forward."""
    enc = autoragged.wrap(encoder(norm_first, batch_first), db=False)
    for i, lengths in enumerate(BATCHES):
        L = max(lengths)
        graph = Arm("ragged_graph", graph_config(D // H, mask_width(L)))
        x, mask = inputs(lengths, batch_first=batch_first, seed=i)
        for _ in range(2):  # captured, then replayed
            got = execute(enc, graph, lengths, x, mask, from_mask)
        eager = execute(enc, Arm("ragged", default_ragged_config(D // H, L)), lengths, x, mask)
        close(got, eager, mask, batch_first)
        close(got, original(enc, x, mask), mask, batch_first)
        pads = ~(~mask if batch_first else ~mask.T)
        assert (got[pads] == 0).all()


def test_a_graph_fed_the_mask_takes_any_padding_and_never_syncs():
    enc = autoragged.wrap(encoder(), db=False)
    lengths = [50, 20, 7, 33]
    graph = Arm("ragged_graph", graph_config(D // H, 64))
    x, mask = inputs(lengths, L=50, left=True)
    execute(enc, graph, lengths, x, mask, from_mask=True)  # captured
    got = unsynced(lambda: execute(enc, graph, lengths, x, mask, from_mask=True))
    close(got, original(enc, x, mask), mask)
    assert (got[mask] == 0).all()


def test_in_place_updates_reach_the_replay_and_new_storage_drops_the_graphs():
    enc = autoragged.wrap(encoder(), db=False)
    lengths = [30, 12]
    x, mask = inputs(lengths)
    graph = Arm("ragged_graph", graph_config(D // H, 32))
    before = execute(enc, graph, lengths, x, mask)
    with torch.no_grad():
        enc.layers[1].linear2.bias.add_(0.5)  # in place: the graph reads it
    after = execute(enc, graph, lengths, x, mask)
    assert not torch.allclose(before, after)
    close(after, original(enc, x, mask), mask)
    cache = enc._autoragged.graphs
    with torch.no_grad():
        enc.layers[1].norm2.bias.data = enc.layers[1].norm2.bias.data + 0.25  # new storage, same Parameter
    assert cache.stats().graphs == 1
    enc._autoragged.graphs.check_params(enc._autoragged._parameters(enc))
    assert cache.stats().graphs == 0  # dropped: the graph read the old storage
    close(execute(enc, graph, lengths, x, mask), original(enc, x, mask), mask)


def test_graphs_dropped_for_moved_parameters_give_their_memory_back():
    """Each reload of the weights into new storage drops the graphs; their pool's memory must not stay reserved
    (without `empty_cache` it stayed until the process called it: 0.1-1.0 GiB a drop on bert-base)."""
    enc = autoragged.wrap(encoder(), db=False)
    lengths = [256] * 48  # a kept pool would show: 56 MiB a drop without the fix (H100)
    x, mask = inputs(lengths)
    rt, graph = enc._autoragged, Arm("ragged_graph", graph_config(D // H, 256))
    reserved = []
    for _ in range(4):
        execute(enc, graph, lengths, x, mask)
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
        with torch.no_grad():
            for p in enc.parameters():
                p.data = p.data.clone()  # a reload into new storage
        rt.graphs.check_params(rt._parameters(enc))
        assert rt.graphs.stats().graphs == 0
    assert reserved[-1] <= reserved[1] + (8 << 20), [r >> 20 for r in reserved]
    close(execute(enc, graph, lengths, x, mask), original(enc, x, mask), mask)


def test_a_ragged_input_replays_a_graph_of_its_own_alignment():
    enc = autoragged.wrap(encoder(), db=False)
    lengths = [50, 7, 33, 1, 64]
    x, mask = inputs(lengths)
    for align in (1, 16):
        src = autoragged.RaggedTensor.from_padded(x, lengths, align=align)
        arm = Arm("ragged_graph", graph_config(D // H, 64).replace(align=align))
        rt = enc._autoragged
        with torch.inference_mode():
            call = TorchCall(rt.body, src, None, None, None, None)
            got = rt.execute(enc, call, arm, tuple(lengths), BatchStats.from_lengths(tuple(lengths)))
        want = original(enc, x, mask)
        torch.testing.assert_close(got.to_padded(0.0, 64).float()[~mask], want[~mask].float(), rtol=2e-2, atol=2e-2)


def test_traffic_runs_eagerly_while_its_graph_is_captured_in_the_background_then_replays_without_a_sync():
    """A shape's first batches take a ready arm while the worker captures; once the capture is taken in, a mask
    alone runs on the graph: no read, no sync, the original's output."""
    enc = autoragged.wrap(encoder(layers=4), db=False, sample_every=0)
    lengths = [40, 17, 3, 29, 40, 8]
    x, mask = inputs(lengths)
    want = original(enc, x, mask)
    with torch.inference_mode():
        first = [enc(x, src_key_padding_mask=mask) for _ in range(3)]
        worker.drain()  # the warm-up run is done; the next call records the graph once its batch is queued
        first.append(enc(x, src_key_padding_mask=mask))
        later = [unsynced(lambda: enc(x, src_key_padding_mask=mask)) for _ in range(3)]
    for y in first + later:
        close(y, want, mask)
    decisions = autoragged.recent_decisions(enc, 7)
    assert [d.arm for d in decisions][-3:] == ["ragged_graph"] * 3, decisions
    assert "captured in the background" in decisions[0].reason
    (s,) = autoragged.graph_stats(enc).values()
    assert s.graphs == 1 and s.captures == 1 and s.pending == 0
    assert [d.stats.total for d in decisions] == [sum(lengths)] * 7


def test_a_warm_up_in_the_background_while_the_caller_keeps_the_gpu_busy_is_right():
    """The graph's warm-up run on the worker's thread and stream: the caller's eager batches on the default stream
    neither break it nor are broken by it, and the graph it leaves records and replays right, also where the zeroing
    of its buffers, queued behind the caller's work, would run after the warm-up (it reset the fetched stamp)."""
    enc = autoragged.wrap(encoder(), db=False)
    other = autoragged.wrap(encoder(), db=False, policy="ragged")
    lengths = [64, 9, 33]
    x, mask = inputs(lengths)
    graph = Arm("ragged_graph", graph_config(D // H, 64))
    rt = enc._autoragged
    key = rt._graph_key(TorchCall(rt.body, x, None, mask, None, None), rt_shape(x, mask))
    cache = rt.graph_cache()
    make, nbytes = rt._graph_make(enc, key, sum(lengths))
    torch.cuda._sleep(int(3e8))  # the graph's buffers are zeroed behind this on the default stream, its warm-up not
    cache.request(key, make, x.device, nbytes)
    with torch.inference_mode():
        busy = [other(x, src_key_padding_mask=mask) for _ in range(20)]  # while the worker warms the graph up
        worker.drain()
        cache.record_ready()
    for y in busy:
        close(y, original(other, x, mask), mask)
    close(execute(enc, graph, lengths, x, mask, from_mask=True), original(enc, x, mask), mask)
    assert rt.graphs.stats().captures == 1


def rt_shape(x, mask):
    from autoragged.runtime.policy import ShapeKey

    return ShapeKey(x.shape[0], mask_width(x.shape[1]), True)


def test_warmup_leaves_new_batches_of_its_shapes_on_their_graphs_without_a_capture():
    enc = autoragged.wrap(encoder(), db=False)
    summary = autoragged.warmup(enc, [20, 31, 7, 44, 12, 60, 3], batch_sizes=[8], batches=6, progress=False)
    assert summary.graphs >= 1 and summary.captured
    (s,) = autoragged.graph_stats(enc).values()
    captures = s.captures
    lengths = [44, 3, 20, 7, 31, 12, 60, 20]
    x, mask = inputs(lengths)
    with torch.inference_mode():
        for _ in range(4):
            y = unsynced(lambda: enc(x, src_key_padding_mask=mask))
    (s,) = autoragged.graph_stats(enc).values()
    assert s.captures == captures and s.pending == 0
    close(y, original(enc, x, mask), mask)


def test_a_layer_replaced_after_capture_is_what_the_next_replay_runs():
    enc = autoragged.wrap(encoder(), db=False, sample_every=0)
    lengths = [50, 20, 7, 33]
    x, mask = inputs(lengths)
    with torch.inference_mode():
        for _ in range(3):
            enc(x, src_key_padding_mask=mask)
        worker.drain()
        enc(x, src_key_padding_mask=mask)
        before = enc(x, src_key_padding_mask=mask)
    enc.layers[1] = encoder().layers[0]  # other weights, a new module: the module is bound anew
    with torch.no_grad():
        for p in enc.layers[1].parameters():
            p.add_(0.01)
    with torch.inference_mode():
        after = [enc(x, src_key_padding_mask=mask) for _ in range(3)]
        worker.drain()
        after.append(enc(x, src_key_padding_mask=mask))
    want = original(enc, x, mask)
    for y in after:
        close(y, want, mask)
    assert not torch.allclose(before[~mask].float(), after[-1][~mask].float(), atol=1e-2)


def test_unread_records_keep_their_stats_when_the_pads_ring_wraps():
    enc = autoragged.wrap(encoder(), db=False, sample_every=0)
    batches = [[i % 30 + 1, 5, 17] for i in range(80)]
    with torch.inference_mode():
        for i, lengths in enumerate(batches):
            x, mask = inputs(lengths, L=32, seed=i)
            enc(x, src_key_padding_mask=mask)
            if i == 2:
                worker.drain()
    decisions = autoragged.recent_decisions(enc, 80)
    assert [d.stats.total for d in decisions] == [sum(b) for b in batches]


def test_a_device_wide_sync_in_the_callers_code_is_safe_while_a_graph_is_being_made():
    """The background worker only warms graphs up; the capture, which forbids torch.cuda.synchronize() in every
    thread, is recorded inside the runtime's own calls."""
    enc = autoragged.wrap(encoder(layers=4), db=False, sample_every=0)
    with torch.inference_mode():
        for i in range(30):
            x, mask = inputs([40, 17, 3, 29 + i % 7], seed=i)
            enc(x, src_key_padding_mask=mask)
            torch.cuda.synchronize()
    worker.drain()
    (s,) = autoragged.graph_stats(enc).values()
    assert s.failed == 0 and s.captures + s.pending >= 1
