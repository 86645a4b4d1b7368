"""GPU-only checks: no hidden device syncs, and the registered ops under torch.compile."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from autoragged.kernels import ragged_attention as k_attn  # noqa: E402

import autoragged  # noqa: E402
import autoragged.ops as ops  # noqa: E402
from autoragged import KernelConfig, RaggedTensor  # noqa: E402


@pytest.fixture
def no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    yield
    torch.cuda.set_sync_debug_mode("default")


def test_from_padded_ops_to_padded_never_sync(no_sync):
    x = torch.randn(4, 70, 3 * 2 * 64, device="cuda", dtype=torch.float16)
    rt = RaggedTensor.from_padded(x, [70, 1, 0, 33], align=16)  # fresh layout: host->device copies only
    q, k, v = (RaggedTensor(t, rt.layout) for t in rt.values.view(-1, 3, 2, 64).unbind(1))
    a = ops.ragged_attention(q, k, v, causal=True)
    h = ops.ragged_linear(
        RaggedTensor(a.values.view(-1, 128), a.layout), torch.randn(64, 128, device="cuda", dtype=torch.float16)
    )
    y = h.to_padded()
    assert y.shape == (4, 70, 64)


def test_from_mask_syncs_exactly_once():
    x = torch.randn(3, 9, 8, device="cuda")
    mask = torch.arange(9, device="cuda")[None, :] >= torch.tensor([9, 2, 5], device="cuda")[:, None]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with pytest.warns(UserWarning, match="synchroniz") as record:
            rt = RaggedTensor.from_mask(x, mask)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in record if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    assert rt.lengths == (9, 2, 5)


def test_registered_ops_compile():
    lengths = [40, 7, 129]
    x = torch.randn(3, 129, 3, 4, 64, device="cuda", dtype=torch.float16)
    rt = RaggedTensor.from_padded(x, lengths)
    config = KernelConfig(block_m=64, block_n=32)
    offsets, dev_lengths = rt.layout.device_meta(rt.device)
    gm, bo = rt.prelude(config.block_m)
    w = torch.randn(256, 256, device="cuda", dtype=torch.float16) / 16

    def block(values, offsets, dev_lengths, gm, bo):
        q, k, v = values.unbind(1)
        a = torch.ops.autoragged.ragged_attention(q, k, v, offsets, dev_lengths, gm, bo, False, 0.125, 64, 32, 4, 2)
        h = torch.ops.autoragged.ragged_linear(a.reshape(-1, 256), w, None, 1, 64, 64, 32, 4, 2, 8)
        n, _ = torch.ops.autoragged.add_layer_norm(h, a.reshape(-1, 256), None, None, 1e-5, False, 8, 4)
        return n

    eager = block(rt.values, offsets, dev_lengths, gm, bo)
    compiled = torch.compile(block, fullgraph=True)(rt.values, offsets, dev_lengths, gm, bo)
    # inductor passes the scale as an fp64 scalar (the kernel casts back to fp32): equal to rounding
    torch.testing.assert_close(compiled, eager, rtol=2e-3, atol=2e-3)
    q, k, v = rt.values.unbind(1)
    ref = k_attn.ragged_attention_ref(q, k, v, rt.layout.offsets, lengths).reshape(-1, 256)
    ref = torch.nn.functional.layer_norm(torch.relu(ref @ w.T) + ref, (256,))
    torch.testing.assert_close(compiled, ref, rtol=2e-2, atol=2e-2)


def _compiled(*fns) -> int:
    """Kernels Triton has compiled (or loaded from its cache) for the JIT functions `fns`, in this process."""
    total = 0
    for fn in fns:
        caches = getattr(fn, "device_caches", None)
        if caches is None:
            pytest.skip("this Triton keeps no device_caches on its JIT functions")
        total += sum(len(entry[0]) for entry in caches.values())
    return total


def test_a_new_row_count_compiles_no_new_kernel():
    """Row counts and padded lengths change with every batch; the kernels that take them are not specialised
    on them (Triton compiles a kernel per value class: 1, a multiple of 16, any other), so rows 32, 17, 1 and
    1000 share the compiled kernels of the first call: a compile inside a stream costs 0.3-1 s."""
    from autoragged.kernels import ragged_add_layer_norm as k_ln
    from autoragged.kernels import ragged_linear as k_lin
    from autoragged.kernels import ragged_pack as k_pack

    fns = (k_lin._linear_kernel, k_lin._linear_tma_kernel, k_ln._add_layer_norm_kernel, k_pack._unpack_kernel)
    w = torch.randn(64, 128, device="cuda", dtype=torch.float16)
    config = k_lin.default_config(64, 128, 64)
    seen = None
    for rows in (32, 17, 1, 1000):
        x = torch.randn(rows, 128, device="cuda", dtype=torch.float16)
        y = ops.linear_values(x, w, config=config)
        ops.add_layer_norm_values(y, y, None, None, 1e-5)
        RaggedTensor.from_padded(torch.randn(2, rows, 64, device="cuda"), [rows, 1]).to_padded()
        torch.cuda.synchronize()
        seen = seen if seen is not None else _compiled(*fns)
        assert _compiled(*fns) == seen, f"rows={rows} compiled a new kernel"


def test_the_other_row_buckets_tiles_compile_in_the_background(monkeypatch):
    """The first launch of a TMA linear variant hands the other row buckets' tiles to a background compile and
    load: a later batch in another bucket launches without compiling or loading a module on the caller's thread
    (0.66 s inside a stream before), and computes the reference's result."""
    import threading

    from autoragged.kernels import ahead
    from autoragged.kernels import ragged_linear as k_lin
    from triton import knobs
    from triton.compiler.compiler import CompiledKernel

    on_caller: list[str] = []
    loads_on_caller: list[str] = []
    caller = threading.current_thread()

    def hook(**kw):
        if threading.current_thread() is caller:
            on_caller.append(kw["fn"].name)

    load = CompiledKernel._init_handles

    def counted_load(kernel):
        if getattr(kernel, "module", None) is None and threading.current_thread() is caller:
            loads_on_caller.append(kernel.name)
        return load(kernel)

    monkeypatch.setattr(CompiledKernel, "_init_handles", counted_load)
    k_lin._linear_tma_kernel.device_caches.clear()  # forget compiled variants (the disk cache still serves them)
    ahead.forget()
    before, knobs.runtime.jit_post_compile_hook = knobs.runtime.jit_post_compile_hook, hook
    try:
        N, K = 400, 208
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        first = torch.randn(64, K, device="cuda", dtype=torch.bfloat16)
        k_lin.ragged_linear(first, w, b, "relu", k_lin.default_config(N, K, 64))
        assert on_caller == ["_linear_tma_kernel"]  # the small tiles, compiled where they were needed
        ahead.drain()  # one worker: the sibling compiles have finished
        for rows in (3000, 20000):
            x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
            config = k_lin.default_config(N, K, rows)
            got = k_lin.ragged_linear(x, w, b, "relu", config)
            torch.testing.assert_close(got, k_lin.ragged_linear_ref(x, w, b, "relu"), atol=0.1, rtol=0.02)
        assert on_caller == ["_linear_tma_kernel"], on_caller
        assert loads_on_caller == ["_linear_tma_kernel"], loads_on_caller  # the first launch's own module
    finally:
        knobs.runtime.jit_post_compile_hook = before


def test_the_other_attention_tiles_and_layouts_compile_in_the_background():
    """The first attention launch of a variant and the first layout of a batch bucket hand their siblings (the
    32 x 32 tiles of a short batch, the other layouts of that bucket's graphs) to the background compiles: a later
    short batch and the other layouts launch without compiling on the caller's thread, and compute the
    references' results."""
    import threading

    from autoragged.kernels import ahead, graph_layout
    from autoragged.kernels.graph_layout import meta_size
    from triton import knobs

    from autoragged.ragged.layout import Layout

    on_caller: list[str] = []
    caller = threading.current_thread()

    def hook(**kw):
        if threading.current_thread() is caller:
            on_caller.append(kw["fn"].name)

    for kernel in (k_attn._ragged_attn_fwd_kernel, graph_layout._layout_kernel):
        kernel.device_caches.clear()  # forget compiled variants (the disk cache still serves them)
    ahead.forget()
    before, knobs.runtime.jit_post_compile_hook = knobs.runtime.jit_post_compile_hook, hook
    try:
        H, D = 4, 64
        for lengths in ((70, 3, 40), (20, 7, 31)):  # the longest over 32 (64 x 64 tiles), then at most 32
            layout = Layout.make(lengths, 1)
            q, k, v = (torch.randn(layout.rows, H, D, device="cuda", dtype=torch.float16) for _ in range(3))
            config = k_attn.default_config(D, max(lengths))
            offsets, lens = layout.device_meta(q.device)
            grid, blocks = layout.prelude(config.block_m, q.device)
            got = k_attn.ragged_attention(q, k, v, offsets, lens, grid, blocks, config=config)
            want = k_attn.ragged_attention_ref(q, k, v, layout.offsets, lengths)
            torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
            ahead.drain()  # one worker: the sibling compiles have finished
        assert on_caller == ["_ragged_attn_fwd_kernel"], on_caller  # the first tiles only
        batch, programs = 8, 40
        meta = torch.zeros(meta_size(batch, programs), dtype=torch.int32, device="cuda")
        args = torch.zeros(16 + batch, dtype=torch.int64, device="cuda")
        graph_layout.layout(args, meta, batch, programs, 64, 1)  # compiles itself, submits its siblings
        ahead.drain()
        for block_m in (32, 64):
            graph_layout.layout(args, meta, batch, programs, block_m, 1)
        assert on_caller == ["_ragged_attn_fwd_kernel", "_layout_kernel"], on_caller
    finally:
        knobs.runtime.jit_post_compile_hook = before


@pytest.mark.parametrize("given", ["attn_mask", "float mask"])
def test_unread_padded_batches_on_the_gpu_compute_the_call_as_given(given):
    """tests/test_runtime.py's check with real device masks: from a shape's second batch on, the mask is not read
    and the padded arm must still get the attention mask (or the float key padding mask) as given."""
    from torch import nn

    layer = nn.TransformerEncoderLayer(64, 2, 96, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).cuda().eval()
    seqs = [[9, 3, 5], [9, 9, 1], [9, 2, 2]]
    L = 12
    g = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(3, L, 64, generator=g).cuda(), torch.arange(L)[None, :] >= torch.tensor(s)[:, None])
              for s in seqs]  # fmt: skip
    attn = torch.rand(L, L, generator=g) > 0.7
    attn.fill_diagonal_(False)
    attn[:, 0] = False
    attn = attn.cuda()

    def call(module, x, mask):
        mask = mask.cuda()
        if given == "attn_mask":
            return module(x, mask=attn, src_key_padding_mask=mask)
        return module(x, src_key_padding_mask=torch.zeros(mask.shape, device="cuda").masked_fill(mask, float("-inf")))

    with torch.no_grad():
        wants = [call(enc, x, mask) for x, mask in inputs]
        autoragged.wrap(enc, db=False, sample_every=0)
        outs = [call(enc, x, mask) for x, mask in inputs]
    for y, want, (_, mask) in zip(outs, wants, inputs):
        keep = ~mask.cuda()
        torch.testing.assert_close(y[keep], want[keep], rtol=1e-4, atol=1e-4)
        assert (y[~keep] == 0).all()
    decisions = autoragged.recent_decisions(enc, 3)
    assert all(d.arm == "padded" for d in decisions)
    assert [d.stats.total for d in decisions] == [sum(s) for s in seqs]


def test_a_chain_of_pdl_kernels_replays_what_it_computes_eagerly():
    """With PDL each kernel is launched while the one before it runs and waits for it at its first step
    (kernels/pdl.py); a wait that did not hold would read rows not written yet. 30 dependent linear + add-norm
    pairs (the norm reads both kernels back), captured in a graph and replayed, against the same chain run eagerly
    with a synchronize after every kernel: equal bit for bit."""
    from autoragged.kernels import pdl

    assert pdl.enabled(torch.device("cuda")) == (torch.cuda.get_device_capability()[0] >= 9 and pdl._ON)
    torch.manual_seed(0)
    weights = [torch.randn(256, 256, device="cuda", dtype=torch.float16) / 16 for _ in range(4)]
    x0 = torch.randn(3000, 256, device="cuda", dtype=torch.float16)
    live = torch.tensor([2711], device="cuda", dtype=torch.int32)

    def chain(sync: bool):
        x = x0
        for i in range(30):
            y = ops.linear_values(x, weights[i % 4], live=live)
            if sync:
                torch.cuda.synchronize()
            x = ops.add_layer_norm_values(y, x, None, None, 1e-5, live=live)[0]
            if sync:
                torch.cuda.synchronize()
        return x

    expected = chain(sync=True)[:2711]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        chain(sync=False)  # (compiled already; a warm-up on the capture's stream)
        graph.capture_begin()
        out = chain(sync=False)
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(20):
        graph.replay()
        x0.add_(0)  # (an unchained PyTorch kernel between replays)
    torch.cuda.synchronize()
    assert torch.equal(out[:2711], expected)
