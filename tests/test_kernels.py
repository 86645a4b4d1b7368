"""Ragged kernels against fp64 references, on awkward layouts, with NaN-poisoned outputs.

Runs the Triton kernels compiled on CUDA or in the interpreter on CPU (conftest sets TRITON_INTERPRET=1
without a GPU), and the PyTorch reference path of `autoragged.ops` on every device.
"""

import itertools
import math

import pytest
import torch
from _tolerance import assert_within_torch_error
from autoragged.kernels import gated_act as k_act
from autoragged.kernels import ragged_add_layer_norm as k_ln
from autoragged.kernels import ragged_attention as k_attn
from autoragged.kernels import ragged_bmm as k_bmm
from autoragged.kernels import ragged_linear as k_lin
from autoragged.kernels import rms_norm as k_rms
from autoragged.kernels import rotary as k_rope
from autoragged.kernels.config import interpreting
from conftest import DEVICES, triton_available

import autoragged.ops as ops
from autoragged import KernelConfig, RaggedTensor

TRITON_DEVICES = [d for d in DEVICES if triton_available(d)]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]

# lengths 1, 63, 64, 65, 129, 257, zero-length and length-1 components, one long outlier among short ones
LAYOUTS = {
    "edges": [1, 0, 63, 64, 65],
    "outlier": [3, 1, 129, 2, 0, 5],
    "long": [257, 17],
    "single": [33],
}


def _real_rows(rt: RaggedTensor) -> torch.Tensor:
    mask = torch.zeros(rt.values.shape[0], dtype=torch.bool)
    for start, n in zip(rt.layout.offsets, rt.lengths):
        mask[start : start + n] = True
    return mask.to(rt.device)


def _ragged(lengths, features, dtype, device, align=1, scale=1.0):
    x = torch.randn(len(lengths), max(lengths), *features, dtype=torch.float64) * scale
    return RaggedTensor.from_padded(x.to(dtype).to(device), lengths, align=align)


# -- attention ------------------------------------------------------------------------------------
ATTN_CONFIGS = [
    KernelConfig(block_m=16, block_n=16, num_warps=2, num_stages=1),
    KernelConfig(block_m=32, block_n=16, num_warps=4, num_stages=2),
    KernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=3),
]


def check_attention_case(
    device, dtype, lengths, head_dim, causal, config, align, heads=2, kv_heads=None, window=(-1, -1)
):
    kv_heads = kv_heads or heads
    rt = _ragged(lengths, (heads + 2 * kv_heads, head_dim), dtype, device, align)
    # strided views, as a fused qkv projection gives them (GQA: q's heads, then k's and v's fewer heads)
    q, k, v = rt.values.split([heads, kv_heads, kv_heads], dim=1)
    offsets, dev_lengths = rt.layout.device_meta(rt.device)
    grid_mapping, block_offsets = rt.prelude(config.block_m)
    out = torch.full_like(q, float("nan"))  # poison: every real row must be written
    k_attn.ragged_attention(
        q, k, v, offsets, dev_lengths, grid_mapping, block_offsets, causal=causal, config=config, out=out, window=window
    )
    real = _real_rows(rt)
    args = dict(causal=causal, window=window)
    ref64 = k_attn.ragged_attention_ref(q.double(), k.double(), v.double(), rt.layout.offsets, lengths, **args)
    same = k_attn.ragged_attention_ref(q, k, v, rt.layout.offsets, lengths, upcast=False, **args)
    what = f"attention {dtype} {lengths} {config.short()} heads {heads}/{kv_heads} window {window} causal {causal}"
    assert_within_torch_error(out[real], same[real], ref64[real], what)
    # gap rows inside a component's last query block are zeros; any past it (align > block_m) untouched
    bm = config.block_m
    for start, end, n in zip(rt.layout.offsets, rt.layout.offsets[1:], lengths):
        covered = start + min(end - start, -(-n // bm) * bm)
        assert (out[start + n : covered] == 0).all(), "alignment gap rows must be written as zeros"
        assert torch.isnan(out[covered:end]).all(), "the kernel wrote rows no program owns"


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["edges", "outlier", "long"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_layouts(device, dtype, layout, causal):
    config = ATTN_CONFIGS[hash((layout, causal)) % 2 + 1]
    check_attention_case(device, dtype, LAYOUTS[layout], 32, causal, config, align=8)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("head_dim", k_attn.HEAD_DIMS)
def test_attention_head_dims(device, head_dim):
    check_attention_case(device, torch.float16, [1, 40, 17], head_dim, False, ATTN_CONFIGS[1], align=1, heads=1)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("config", ATTN_CONFIGS, ids=lambda c: c.short())
@pytest.mark.parametrize("align", [1, 8, 16, 64])
def test_attention_configs_and_aligns(device, config, align):
    check_attention_case(device, torch.float16, [5, 0, 47, 16], 64, True, config, align=align, heads=1)


def test_attention_scale_argument():
    rt = _ragged([9, 4], (3, 1, 32), torch.float32, "cpu")
    q, k, v = (RaggedTensor(t, rt.layout) for t in rt.values.unbind(1))
    a = ops.ragged_attention(q, k, v, scale=0.5)
    b = ops.ragged_attention(RaggedTensor(q.values * (0.5 * 32**0.5), q.layout), k, v)
    torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)


# -- attention variants: grouped-query heads, sliding windows, head dim 256 -----------------------
# lengths 0, 1, 65, 129 and an outlier (129) among short ones; the windows are narrower than, as wide as and
# wider than the components
VARIANT_LENGTHS = [1, 0, 65, 3, 129, 2]


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize(
    "heads, kv_heads, dtype, causal",
    [
        (4, 2, torch.float16, False),
        (8, 2, torch.bfloat16, True),
        (8, 1, torch.float16, True),
        (3, 1, torch.float32, False),
    ],
    ids=["group2", "group4", "group8-mqa", "mqa-3-heads"],
)
def test_attention_grouped_query_heads(device, heads, kv_heads, dtype, causal):
    """Query head h reads kv head h // (H / Hkv); k and v are strided views with fewer heads than q."""
    config = ATTN_CONFIGS[1 + causal]
    check_attention_case(device, dtype, VARIANT_LENGTHS, 32, causal, config, align=8, heads=heads, kv_heads=kv_heads)


WINDOWS = [
    ((4, 4), False),  # symmetric, far narrower than the tiles
    ((16, 3), False),  # asymmetric
    ((-1, 5), False),  # right bound only
    ((40, -1), False),  # left bound only
    ((7, 0), True),  # causal sliding (Mistral's W = 8)
    ((20, 20), True),  # causal: the right bound is the diagonal
    ((300, 300), False),  # longer than every component: plain attention
    ((0, 0), False),  # each row sees itself only
    ((0, -1), True),  # causal with a zero left bound: the diagonal only
]


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("window, causal", WINDOWS, ids=[f"{w[0]}_{w[1]}{'-causal' if c else ''}" for w, c in WINDOWS])
def test_attention_sliding_windows(device, window, causal):
    for config in (ATTN_CONFIGS[1], KernelConfig(block_m=16, block_n=32, num_warps=2, num_stages=1)):
        check_attention_case(device, torch.float16, VARIANT_LENGTHS, 32, causal, config, 1, heads=1, window=window)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("config", [ATTN_CONFIGS[1], ATTN_CONFIGS[0]], ids=lambda c: c.short())
def test_attention_window_edges_at_tile_boundaries(device, config):
    """Window sides one short of, at and one past a 16-key tile: the bounds of the skipped, masked and unmasked
    key tiles are off by one somewhere unless every one of these matches the reference."""
    windows = [(1, 14), (14, 30), (15, 17), (17, 15), (16, 30), (31, 16), (15, 0), (17, 0)]
    for window in windows:
        causal = window[1] == 0
        check_attention_case(device, torch.float32, [100, 37], 32, causal, config, 1, heads=1, window=window)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_grouped_query_heads_with_a_causal_window(device, dtype):
    """Qwen2-style sliding layers: GQA, causal, a window of W = 24 (left 23), alignment gaps."""
    check_attention_case(
        device, dtype, VARIANT_LENGTHS, 64, True, ATTN_CONFIGS[2], align=16, heads=4, kv_heads=2, window=(23, 0)
    )


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_attention_head_dim_256_with_groups_and_window(device):
    config = k_attn.default_config(256, 40)
    check_attention_case(device, torch.bfloat16, [1, 40, 17], 256, False, config, 1, heads=2, kv_heads=1, window=(8, 8))


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("window, causal", [((8, 8), False), ((8, 0), True)], ids=["bidirectional", "causal"])
def test_attention_window_skips_key_tiles_outside_it(device, window, causal):
    """Key tiles wholly outside a query block's window are never read, not just masked: v is NaN outside
    rows [96, 160) of a 256-row component, so a visited tile there would turn an output row NaN (p = 0 times
    NaN); the rows whose blocks' windows stay inside [96, 160) (112..143 with 16-row tiles) must be finite and
    right. The plain kernel, which reads every tile, fails this test."""
    n, config = 256, KernelConfig(block_m=16, block_n=16, num_warps=2, num_stages=1)
    rt = _ragged([n], (3, 1, 32), torch.float32, device)
    q, k, v = (t.contiguous() for t in rt.values.unbind(1))
    v_poisoned = v.clone()
    v_poisoned[:96] = float("nan")
    v_poisoned[160:] = float("nan")
    offsets, lengths = rt.layout.device_meta(rt.device)
    gm, bo = rt.prelude(config.block_m)
    out = k_attn.ragged_attention(
        q, k, v_poisoned, offsets, lengths, gm, bo, causal=causal, config=config, window=window
    )
    ref = k_attn.ragged_attention_ref(q.double(), k.double(), v.double(), [0], [n], causal=causal, window=window)
    rows = slice(112, 144)
    assert torch.isfinite(out[rows]).all(), "a key tile outside every window of the block was read"
    torch.testing.assert_close(out[rows].double(), ref[rows], rtol=1e-5, atol=1e-5)
    assert torch.isnan(out[:16]).all(), "the poison must reach rows whose windows hold it (else the test is void)"


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("config", ATTN_CONFIGS[:2], ids=lambda c: c.short())
def test_attention_query_only_rows_see_the_keys_and_are_never_keys(device, config):
    """key_lengths: a component's rows past its keys are queries only (a first-token pooler's column 0 of a
    left-padded row, kernels/masked_pack.py). Their k and v are NaN, so a kernel that read them as keys would
    turn every row of the component NaN; every row, query-only ones included, must match the reference."""
    lengths, keys = [5, 1, 48, 17, 16, 33], [4, 1, 47, 16, 16, 32]
    rt = _ragged(lengths, (6, 64), torch.float16, device)
    q, k, v = (t.contiguous() for t in rt.values.split([2, 2, 2], dim=1))
    for start, n, nk in zip(rt.layout.offsets, lengths, keys):
        k[start + nk : start + n] = float("nan")
        v[start + nk : start + n] = float("nan")
    offsets, dev_lengths = rt.layout.device_meta(rt.device)
    gm, bo = rt.prelude(config.block_m)
    key_lengths = torch.tensor(keys, dtype=torch.int32, device=device)
    out = k_attn.ragged_attention(q, k, v, offsets, dev_lengths, gm, bo, config=config, key_lengths=key_lengths)
    real = _real_rows(rt)
    args = dict(key_lengths=keys)
    ref64 = k_attn.ragged_attention_ref(q.double(), k.double(), v.double(), rt.layout.offsets, lengths, **args)
    same = k_attn.ragged_attention_ref(q, k, v, rt.layout.offsets, lengths, upcast=False, **args)
    assert torch.isfinite(out[real]).all(), "a query-only row was read as a key"
    assert_within_torch_error(out[real], same[real], ref64[real], f"query-only rows {config.short()}")
    with pytest.raises(ValueError, match="neither causal nor windowed"):
        k_attn.ragged_attention(q, k, v, offsets, dev_lengths, gm, bo, causal=True, key_lengths=key_lengths)


def test_attention_supports_names_what_it_cannot_do():
    assert k_attn.supports(64) is None
    assert k_attn.supports(256, heads=28, kv_heads=4, window=(4095, 0), dtype=torch.bfloat16) is None
    assert "head dim 48" in k_attn.supports(48)
    assert "softcapping" in k_attn.supports(256, softcap=50.0)
    assert "do not divide" in k_attn.supports(64, heads=8, kv_heads=3)
    assert "float64" in k_attn.supports(64, dtype=torch.float64)
    assert "-1 for unbounded" in k_attn.supports(64, window=(-2, 0))
    assert 256 in k_attn.HEAD_DIMS


@pytest.mark.parametrize(
    "shapes, window, exc, words",
    [
        (((10, 8, 64), (10, 3, 64), (10, 3, 64)), (-1, -1), ValueError, "3 heads, which must divide q's 8"),
        (((10, 8, 64), (9, 2, 64), (9, 2, 64)), (-1, -1), ValueError, "must have q's rows and head dim"),
        (((10, 8, 64), (10, 2, 64), (10, 4, 64)), (-1, -1), ValueError, "one (T, Hkv, Dh) shape"),
        (((10, 2, 64),) * 3, (-5, 0), ValueError, "window sides must be >= 0"),
        (((10, 2, 64),) * 3, (3,), TypeError, "(left, right) pair"),
        (((10, 2, 64),) * 3, (1.5, 2), TypeError, "(left, right) pair"),
    ],
)
def test_attention_shape_and_window_errors_are_named(shapes, window, exc, words):
    q, k, v = (torch.randn(s) for s in shapes)
    offsets, lengths = torch.tensor([0, 10], dtype=torch.int32), torch.tensor([10], dtype=torch.int32)
    layout = RaggedTensor.from_padded(torch.randn(1, 10, 1), [10]).layout
    with pytest.raises(exc) as info:
        k_attn.ragged_attention(q, k, v, offsets, lengths, torch.zeros(1, dtype=torch.int32), offsets, window=window)
    assert words in str(info.value)
    with pytest.raises(exc):  # the value-level op validates before choosing a backend
        ops.attention_values(q, k, v, layout, window=window)


def test_attention_default_configs_fit_their_budgets():
    """Every head dim's default tiles pass the pruning predicate for 2- and 4-byte elements; head dim 256 takes
    its own tiles (fp32 ones for 4 bytes), and the accumulator rule keeps 128-row tiles off 4 warps there. (Below
    17 rows the 32-row default is longer than the predicate allows, as it was before head dim 256.)"""
    for head_dim, max_len, size in itertools.product(k_attn.HEAD_DIMS, (20, 100, 4096), (2, 4)):
        config = k_attn.default_config(head_dim, max_len, size)
        assert k_attn.prune(config, head_dim=head_dim, max_len=max_len, element_size=size), (head_dim, max_len, size)
    assert k_attn.default_config(256, 4096, 4) != k_attn.default_config(256, 4096, 2) != k_attn.DEFAULT_CONFIG
    assert k_attn.default_config(128, 4096) == k_attn.DEFAULT_CONFIG == k_attn.default_config(64, 4096, 4)
    big = KernelConfig(block_m=128, block_n=32, num_warps=4, num_stages=1)
    assert k_attn.prune(big, head_dim=128, max_len=4096) and not k_attn.prune(big, head_dim=256, max_len=4096)
    # a bounded window lifts the causal rule that the query block be a multiple of the key tile
    odd = KernelConfig(block_m=32, block_n=64, num_warps=4, num_stages=2)
    assert not k_attn.prune(odd, head_dim=64, max_len=512, causal=True)
    assert k_attn.prune(odd, head_dim=64, max_len=512, causal=True, window=(127, 0))


def test_ops_attention_with_groups_and_window(backend):
    """The public op on RaggedTensors, Triton and reference backends alike, against per-sequence SDPA with
    torch's own GQA and an explicit window mask."""
    lengths, heads, kv_heads, window = [5, 0, 19, 1, 33], 4, 2, (6, 2)
    q = _ragged(lengths, (heads, 32), torch.float32, backend, align=8)
    k, v = (RaggedTensor(_ragged(lengths, (kv_heads, 32), torch.float32, backend, 8).values, q.layout) for _ in "kv")
    a = ops.ragged_attention(q, k, v, window=window)
    assert (a.values[~_real_rows(q)] == 0).all()
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        keep = k_attn.window_mask(n, window, device=backend)
        qi, ki, vi = (t.select(i).transpose(0, 1) for t in (q, k, v))
        dense = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=keep, enable_gqa=True)
        torch.testing.assert_close(a.select(i), dense.transpose(0, 1), rtol=2e-4, atol=2e-4)


# -- linear ---------------------------------------------------------------------------------------
LINEAR_CONFIGS = [
    KernelConfig(block_m=32, block_n=32, block_k=16, num_warps=4, num_stages=2),
    KernelConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3, group_m=2),
    KernelConfig(block_m=32, block_n=128, block_k=32, num_warps=4, num_stages=2),  # (gelu's epilogue in halves)
]


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", k_lin.ACTIVATIONS)
@pytest.mark.parametrize("shape", [(1, 48, 40), (130, 96, 64), (65, 16, 16), (0, 8, 16), (33, 24, 12)], ids=str)
@pytest.mark.parametrize("tma", [None, False], ids=["tma-if-usable", "pointer"])
def test_linear(device, dtype, activation, shape, tma):
    """Both kernels (TMA descriptors where they can address the tensors, else and when asked the pointer
    kernel; K = 12 has rows TMA cannot address), NaN-poisoned outputs, against fp64."""
    M, N, K = shape
    x = torch.randn(M, K, dtype=torch.float64).to(dtype).to(device)
    w = (torch.randn(N, K, dtype=torch.float64) / K**0.5).to(dtype).to(device)
    b = torch.randn(N, dtype=torch.float64).to(dtype).to(device)
    for config in LINEAR_CONFIGS:
        for bias in (b, None):
            y = _poisoned_linear(x, w, bias, activation, config, tma=tma)
            ref64 = k_lin.ragged_linear_ref(x.double(), w.double(), None if bias is None else bias.double(), activation)
            same = k_lin.ragged_linear_ref(x, w, bias, activation)
            assert y.shape == (M, N) and y.dtype == dtype
            assert_within_torch_error(y, same, ref64, f"linear {dtype} {shape} {activation} {config.short()} {tma}")


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("tma", [None, False], ids=["tma-if-usable", "pointer"])
def test_linear_gelu_keeps_its_relative_accuracy_in_the_tails(device, tma):
    """gelu(x) through the identity, x from -12 to 12 in fp32: each value to a relative error of 5e-5, also where
    it is tiny (x = -10: -7.6e-23) and 1 + erf(x / sqrt 2), the textbook form, cancels to nothing. (Not to a few
    ulps there: x / sqrt 2 and its square are rounded to fp32 before the exp, 1.4e-5 at x = -11.4.) +-inf and NaN
    come out as F.gelu's fp16 path gives them."""
    x = torch.linspace(-12, 12, 160 * 16, dtype=torch.float64).reshape(160, 16)
    config = KernelConfig(block_m=32, block_n=128, block_k=16, num_warps=4, num_stages=2)
    eye = torch.eye(16, device=device)
    y = k_lin.ragged_linear(x.float().to(device), eye, None, "gelu", config, tma=tma).cpu().double()
    ref = 0.5 * x * torch.erfc(-x / math.sqrt(2))  # (F.gelu's 1 + erf cancels even in fp64)
    assert ((y - ref).abs() <= 5e-5 * ref.abs()).all(), (y - ref).abs().div(ref.abs()).max()
    edges = torch.zeros(3, 16)
    edges[:, 0] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    y = k_lin.ragged_linear(edges.to(device), eye, None, "gelu", config, tma=tma)[:, 0].tolist()
    assert y[0] == float("inf") and math.isnan(y[1]) and math.isnan(y[2])


def _poisoned_linear(x, w, bias, activation, config, **kwargs):
    """ragged_linear into an output filled with NaN first, so an unwritten element shows."""
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    y = k_lin.ragged_linear(x, w, bias, activation, config, out=out, **kwargs)
    assert y is out
    return y


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_linear_tma_is_used_only_where_it_can_address_the_tensors(device):
    """TMA needs 16-byte aligned bases and row strides: a view one element in, or rows of 12 fp16 (24
    bytes), cannot be described, and asking for TMA there is an error that says why."""
    x = torch.randn(40, 65, dtype=torch.float16, device=device)
    w = torch.randn(24, 64, dtype=torch.float16, device=device)
    if interpreting() or (device == "cuda" and torch.cuda.get_device_capability()[0] >= 9):
        assert k_lin.tma_usable(x[:, :64].contiguous(), w)
    assert not k_lin.tma_usable(x[:, 1:], w)  # base 2 bytes in, rows 130 bytes apart
    assert not k_lin.tma_usable(torch.randn(8, 12, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match="TMA cannot address"):
        k_lin.ragged_linear(x[:, 1:], w, None, None, LINEAR_CONFIGS[0], tma=True)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        k_lin.ragged_linear(x[:, :64], w, out=torch.empty(24, 40, dtype=torch.float16, device=device))
    y = k_lin.ragged_linear(x[:, 1:], w, None, None, LINEAR_CONFIGS[0])  # falls back to the pointer kernel
    torch.testing.assert_close(y.float(), torch.nn.functional.linear(x[:, 1:].float(), w.float()), rtol=2e-2, atol=2e-2)


def test_linear_strided_input_and_cublas_backend(device):
    x = torch.randn(40, 64, device=device)[:, :32]  # row stride 64
    w = torch.randn(24, 32, device=device)
    ref = torch.nn.functional.linear(x.double(), w.double())
    for config in (LINEAR_CONFIGS[0], KernelConfig(backend="cublas")):
        torch.testing.assert_close(ops.linear_values(x, w, None, None, config).double(), ref, rtol=1e-4, atol=1e-4)


def test_linear_default_tiles_follow_the_rows():
    """Few rows get small tiles, a few thousand the mid ones, more the large ones, whatever the weight; a gelu
    linear the next larger ones."""
    small, mid, large = k_lin._SMALL, k_lin._MID, k_lin._LARGE
    assert k_lin.default_config(512, 2048, 400) == small == k_lin.default_config(1536, 512, 1024)
    assert k_lin.default_config(1536, 512, 1025) == mid == k_lin.default_config(512, 2048, 3072)
    for n, k in ((384, 1536), (512, 2048), (768, 3072), (3072, 768)):
        assert k_lin.default_config(n, k, 3073) == large == k_lin.default_config(n, k, 40000)
    assert large.block_m * large.block_n > mid.block_m * mid.block_n > small.block_m * small.block_n
    assert all(k_lin.prune(c, n=512, k=2048) for c in (small, mid, large))
    # gelu's epilogue takes each bucket's next larger tiles
    assert k_lin.default_config(3072, 768, 400, "gelu") == mid == k_lin.default_config(1536, 384, 1024, "gelu")
    assert k_lin.default_config(3072, 768, 1025, "gelu") == large == k_lin.default_config(3072, 768, 40000, "gelu")
    assert k_lin.default_config(2048, 512, 1025, "relu") == mid


def test_linear_tiles_fit_shared_memory():
    """The default tiles are picked for 2-byte elements; fp32 gets fewer stages, then shorter K tiles, until
    its buffers fit, and 2-byte tiles that fit are left alone."""

    def need(c, size):
        return (c.num_stages * (c.block_m + c.block_n) * c.block_k + c.block_m * c.block_n) * size

    for config in (k_lin._SMALL, k_lin._MID, k_lin._LARGE):
        assert k_lin.fit_shared_memory(config, 2) == config
        fp32 = k_lin.fit_shared_memory(config, 4)
        assert need(fp32, 4) <= 227 * 1024 and (fp32.block_m, fp32.num_warps) == (config.block_m, config.num_warps)
    assert k_lin.fit_shared_memory(k_lin._LARGE, 4) != k_lin._LARGE


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("rows", [400, 2000, 9000])
@pytest.mark.parametrize("activation", k_lin.ACTIVATIONS)
def test_linear_default_tiles_are_right_on_awkward_shapes(device, rows, activation):
    """Each default tiling (picked for `rows`) on a shape that fills none of its tiles, with and without a
    live count: within PyTorch's own error of the float64 reference. N = 104 ends in the second half of a
    128-wide tile, which the TMA kernel stores apart."""
    M, N, K = 70, 104, 136  # K > N: the deep-reduction tiles on few rows; rows of 16 bytes, as TMA needs
    config = k_lin.default_config(N, K, rows)
    x = torch.randn(M, K, dtype=torch.float64).to(torch.float16).to(device)
    w = (torch.randn(N, K, dtype=torch.float64) / K**0.5).to(torch.float16).to(device)
    b = torch.randn(N, dtype=torch.float64).to(torch.float16).to(device)
    ref64 = k_lin.ragged_linear_ref(x.double(), w.double(), b.double(), activation)
    same = k_lin.ragged_linear_ref(x, w, b, activation)
    y = k_lin.ragged_linear(x, w, b, activation, config)
    assert_within_torch_error(y, same, ref64, f"linear default tiles {config.short()} {activation}")
    live = torch.tensor([53], dtype=torch.int32, device=device)
    y_live = k_lin.ragged_linear(x, w, b, activation, config, live=live)
    assert torch.equal(y_live[:53], y[:53])


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("live", [0, 1, 31, 64, 97, 130, 500])
def test_linear_and_norm_stop_at_the_live_rows(device, live):
    """With `live` (a device count, as a CUDA graph's layout holds it) a fixed grid walks the tiles of the
    first live rows only (in the interpreter 3 programs, so each loops); those rows equal the reference.
    A count past the rows is clamped to them."""
    M, N, K = 130, 48, 40
    x = torch.randn(M, K, dtype=torch.float64).to(torch.float16).to(device)
    w = (torch.randn(N, K, dtype=torch.float64) / K**0.5).to(torch.float16).to(device)
    b = torch.randn(N, dtype=torch.float64).to(torch.float16).to(device)
    count = torch.tensor([live, 999], dtype=torch.int32, device=device)  # only element 0 is read
    n = min(live, M)
    for config, tma in itertools.product(LINEAR_CONFIGS, (None, False)):
        y = _poisoned_linear(x, w, b, "relu", config, live=count, tma=tma)
        want = k_lin.ragged_linear(x, w, b, "relu", config, tma=tma)  # the kernel computes rows alike either way
        assert torch.equal(y[:n], want[:n]), (config.short(), tma)
    r = torch.randn(M, N, dtype=torch.float64).to(torch.float16).to(device)
    for config in (k_ln.default_config(N), KernelConfig(block_m=4, num_warps=2, num_stages=1)):
        out, total = k_ln.add_layer_norm(y, r, None, b, 1e-5, store_sum=True, config=config, live=count)
        want_out, want_total = k_ln.add_layer_norm(y, r, None, b, 1e-5, store_sum=True, config=config)
        assert torch.equal(out[:n], want_out[:n]) and torch.equal(total[:n], want_total[:n])
    with pytest.raises(ValueError, match="live must be an int32/int64 tensor"):
        k_lin.ragged_linear(x, w, b, None, LINEAR_CONFIGS[0], live=count.float())


# -- bmm ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["edges", "outlier"])
@pytest.mark.parametrize("align", [1, 16])
def test_bmm(device, dtype, layout, align):
    lengths = LAYOUTS[layout]
    rt = _ragged(lengths, (40,), dtype, device, align)
    weights = (torch.randn(len(lengths), 40, 24, dtype=torch.float64) / 40**0.5).to(dtype).to(device)
    config = KernelConfig(block_m=32, block_n=16, block_k=16, num_warps=4, num_stages=2)
    offsets, dev_lengths = rt.layout.device_meta(rt.device)
    grid_mapping, block_offsets = rt.prelude(config.block_m)
    out = torch.full((rt.values.shape[0], 24), float("nan"), dtype=dtype, device=device)
    k_bmm.ragged_bmm(rt.values, weights, offsets, dev_lengths, grid_mapping, block_offsets, config=config, out=out)
    real = _real_rows(rt)
    ref64 = k_bmm.ragged_bmm_ref(rt.values.double(), weights.double(), rt.layout.offsets, lengths)
    same = k_bmm.ragged_bmm_ref(rt.values, weights, rt.layout.offsets, lengths, upcast=False)
    assert_within_torch_error(out[real], same[real], ref64[real], f"bmm {dtype} {lengths}")
    assert torch.isnan(out[~real]).all()


# -- add + layer norm -----------------------------------------------------------------------------
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [32, 48, 512])
def test_add_layer_norm(device, dtype, n):
    x = (torch.randn(37, n, dtype=torch.float64) * 3 + 1).to(dtype).to(device)
    r = torch.randn(37, n, dtype=torch.float64).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(n, dtype=torch.float64)).to(dtype).to(device)
    b = (0.1 * torch.randn(n, dtype=torch.float64)).to(dtype).to(device)
    for config in (k_ln.default_config(n), KernelConfig(block_m=4, num_warps=2, num_stages=1)):
        for residual, weight, bias in ((r, w, b), (None, w, b), (r, None, None)):
            out, total = k_ln.add_layer_norm(x, residual, weight, bias, 1e-5, store_sum=True, config=config)
            args64 = [None if t is None else t.double() for t in (x, residual, weight, bias)]
            ref64, _ = k_ln.add_layer_norm_ref(*args64, 1e-5)
            same, _ = k_ln.add_layer_norm_ref(x, residual, weight, bias, 1e-5)
            assert_within_torch_error(out, same, ref64, f"add_layer_norm {dtype} n={n}")
            expected_sum = x if residual is None else (x.double() + residual.double()).to(dtype)
            # exact, except that the interpreter truncates to bf16 (one ulp; see tests/_tolerance.py)
            ulp = torch.finfo(dtype).eps * 2 if dtype == torch.bfloat16 and interpreting() else 0.0
            torch.testing.assert_close(total, expected_sum, rtol=ulp, atol=0)


# -- the Llama-style layer's elementwise kernels: HF's rounding ------------------------------------
def _ulps(dtype) -> float:
    """Relative rounding differences allowed against HF's own (reference) computation in `dtype`: two ulps of a
    half dtype (the order of an fp32 sum moves a rounding), four of fp32 (whose chained roundings and rsqrt
    show), four of bf16 under the interpreter's truncating casts (tests/_tolerance.py)."""
    ulp = torch.finfo(dtype).eps
    return ulp * (4 if dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting()) else 2)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [32, 100, 640])
def test_add_rms_norm_rounds_as_hf(device, dtype, n):
    x = (torch.randn(37, n, dtype=torch.float64) * 3 + 1).to(dtype).to(device)
    r = torch.randn(37, n, dtype=torch.float64).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(n, dtype=torch.float64)).to(dtype).to(device)
    strided = torch.randn(37, 2 * n, dtype=dtype, device=device)[:, ::2]  # stride 2 on N: copied
    for residual in (r, None, strided):
        out, total = k_rms.add_rms_norm(x, residual, w, 1e-6, store_sum=True)
        want, want_total = k_rms.add_rms_norm_ref(x, residual, w, 1e-6, store_sum=True)
        want64, _ = k_rms.add_rms_norm_ref(*(None if t is None else t.double() for t in (x, residual, w)), 1e-6)
        assert_within_torch_error(out, want, want64, f"add_rms_norm {dtype} n={n}")
        # within an ulp or two of HF's own result in the same dtype
        torch.testing.assert_close(out, want, rtol=_ulps(dtype), atol=0)
        if residual is None:
            assert total is None
        else:
            torch.testing.assert_close(total, want_total, rtol=_ulps(dtype), atol=0)
    for config in (
        KernelConfig(block_m=4, num_warps=2, num_stages=1),
        KernelConfig(block_m=1, num_warps=1, num_stages=1),
    ):
        out, _ = k_rms.add_rms_norm(x[:5], r[:5], w, 1e-6, config=config)
        torch.testing.assert_close(out, k_rms.add_rms_norm_ref(x[:5], r[:5], w, 1e-6)[0], rtol=_ulps(dtype), atol=0)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, heads, dim", [(1, 1, 64), (7, 3, 32), (13, 5, 128), (6, 2, 80)])
def test_rotary_is_hfs_to_the_bit(device, dtype, rows, heads, dim):
    """One product and one sum, each rounded as HF's separate kernels round them: the same bits as HF (but for
    the interpreter's truncating bf16 casts). A strided view (a projection's output) and odd head counts."""
    proj = torch.randn(rows, heads * dim + 3, dtype=dtype, device=device)[:, 3:]  # (rows, H * D), row stride H*D+3
    x = proj.view(rows, heads, dim) if proj.is_contiguous() else proj.unflatten(1, (heads, dim))
    angle = torch.arange(rows, dtype=torch.float32, device=device)[:, None] * torch.rand(dim // 2, device=device)
    angle = torch.cat((angle, angle), dim=-1)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    out = k_rope.rotary(x, cos, sin)
    want = k_rope.rotary_ref(x, cos, sin)
    assert out.is_contiguous() and out.shape == x.shape
    tol = 0.0 if not (dtype == torch.bfloat16 and interpreting()) else _ulps(dtype)
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (3, 700), (5, 2048 + 17)])
def test_silu_mul_rounds_as_hf_and_overwrites_the_gate(device, dtype, shape):
    gate = (torch.randn(shape, dtype=torch.float64) * 4).to(dtype).to(device)
    up = torch.randn(shape, dtype=torch.float64).to(dtype).to(device)
    want = k_act.silu_mul_ref(gate, up)
    kept = k_act.silu_mul(gate, up, inplace=False)
    torch.testing.assert_close(kept, want, rtol=_ulps(dtype), atol=_ulps(dtype))
    out = k_act.silu_mul(gate, up)
    assert out.data_ptr() == gate.data_ptr()
    torch.testing.assert_close(out, want, rtol=_ulps(dtype), atol=_ulps(dtype))


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: k_rms.add_rms_norm(torch.randn(3, 8), None, torch.ones(7), 1e-6), "weight must be (8,)"),
        (lambda: k_rms.add_rms_norm(torch.randn(3, 8), torch.randn(3, 8).half(), torch.ones(8), 1e-6), "residual"),
        (lambda: k_rope.rotary(torch.randn(3, 2, 7), torch.randn(3, 7), torch.randn(3, 7)), "D even"),
        (lambda: k_rope.rotary(torch.randn(3, 2, 8), torch.randn(2, 8), torch.randn(3, 8)), "cos must be (3, 8)"),
        (lambda: k_act.silu_mul(torch.randn(3, 8), torch.randn(3, 9)), "gate and up must be"),
    ],
)
def test_layer_kernel_errors_are_named(call, words):
    with pytest.raises(ValueError) as info:
        call()
    assert words in str(info.value)


# -- the public ops on RaggedTensors: one suite, both backends -----------------------------------


def test_ops_keep_layout_and_zero_gaps(backend):
    lengths = [5, 0, 19, 1]
    qkv = _ragged(lengths, (3, 2, 32), torch.float32, backend, align=16)
    q, k, v = (RaggedTensor(t, qkv.layout) for t in qkv.values.unbind(1))
    a = ops.ragged_attention(q, k, v, causal=True)
    x = RaggedTensor(a.values.reshape(a.values.shape[0], 64), a.layout)
    w, bias = torch.randn(48, 64, device=backend), torch.randn(48, device=backend)
    h = ops.ragged_linear(x, w, bias, "gelu")
    ln_w, ln_b = torch.randn(48, device=backend), torch.randn(48, device=backend)
    normed, total = ops.ragged_add_layer_norm(h, h, ln_w, ln_b, 1e-5, return_sum=True)
    y = ops.ragged_bmm(normed, torch.randn(4, 48, 8, device=backend))
    gaps = ~_real_rows(qkv)
    for out in (a, h, normed, total, y):
        assert out.layout is qkv.layout
        assert (out.values[gaps] == 0).all(), "gap rows must be zero after a public op"
    # compare each component with a dense computation on that component alone
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        qi, ki, vi = (t.select(i).transpose(0, 1) for t in (q, k, v))
        dense = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, is_causal=True).transpose(0, 1)
        torch.testing.assert_close(a.select(i), dense, rtol=2e-4, atol=2e-4)
        hi = torch.nn.functional.gelu(x.select(i) @ w.T + bias)
        torch.testing.assert_close(h.select(i), hi, rtol=2e-4, atol=2e-4)
        ni = torch.nn.functional.layer_norm(2 * hi, (48,), ln_w, ln_b)
        torch.testing.assert_close(normed.select(i), ni, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda q: ops.ragged_attention(q, q, q.values), TypeError, "not a RaggedTensor"),
        (
            lambda q: ops.ragged_attention(q, q, RaggedTensor.from_padded(torch.randn(2, 9, 1, 32), [9, 3])),
            ValueError,
            "another layout",
        ),
        (lambda q: ops.ragged_attention(q, q, q.to(torch.float64)), ValueError, "float64"),
        (lambda q: ops.ragged_linear(q, torch.randn(8, 32)), ValueError, "values must be (T, K)"),
        (lambda q: ops.linear_values(q.values[:, 0], torch.randn(8, 31)), ValueError, "disagree"),
        (lambda q: ops.linear_values(q.values[:, 0], torch.randn(8, 32), activation="tanh"), ValueError, "activation"),
        (
            lambda q: ops.ragged_bmm(RaggedTensor(q.values[:, 0], q.layout), torch.randn(3, 32, 4)),
            ValueError,
            "weights must be (B, K, N) = (2",
        ),
    ],
)
def test_op_errors_are_named(call, exc, words):
    q = RaggedTensor.from_padded(torch.randn(2, 9, 1, 32), [9, 4])
    with pytest.raises(exc) as info:
        call(q)
    assert words in str(info.value)


def test_attention_rejects_unsupported_head_dim():
    x = torch.randn(5, 1, 48)
    offsets, lengths = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match="head dim 48 is not supported"):
        k_attn.ragged_attention(x, x, x, offsets, lengths, torch.zeros(1, dtype=torch.int32), offsets)


# -- config spaces --------------------------------------------------------------------------------
def test_config_spaces_are_pruned_and_defaults_pass_their_predicates():
    kept = [c for c in k_attn.CONFIGS if k_attn.prune(c, head_dim=64, max_len=512, causal=True)]
    assert 0 < len(kept) < len(k_attn.CONFIGS)
    assert all(c.block_m % c.block_n == 0 for c in kept)
    assert k_attn.prune(k_attn.DEFAULT_CONFIG, head_dim=64, max_len=512)
    short = [c for c in k_attn.CONFIGS if k_attn.prune(c, head_dim=64, max_len=13)]
    assert all(c.block_m <= 16 for c in short)
    assert k_lin.prune(k_lin.DEFAULT_CONFIG, n=1536, k=512)
    assert any(c.backend == "cublas" for c in k_lin.CONFIGS)
    assert k_ln.prune(k_ln.default_config(512), n=512)
    assert k_bmm.prune(k_bmm.DEFAULT_CONFIG, max_len=100, n=64, k=64)


def test_kernel_config_validation():
    with pytest.raises(ValueError, match="block_m must be a positive power of two"):
        KernelConfig(block_m=48)
    with pytest.raises(ValueError, match="backend"):
        KernelConfig(backend="cudnn")
    c = KernelConfig(block_m=32, align=16)
    assert KernelConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="unknown KernelConfig fields"):
        KernelConfig.from_dict({"block_q": 3})


# -- torch.library registration -------------------------------------------------------------------
def test_registered_ops_propagate_shapes_with_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(100, 8, 64, dtype=torch.float16)
        meta = torch.empty(5, dtype=torch.int32)
        out = torch.ops.autoragged.ragged_attention(q, q, q, meta, meta[:4], meta, meta, False, 0.125, 64, 64, 4, 2)
        assert out.shape == (100, 8, 64) and out.dtype == torch.float16
        kv = torch.empty(100, 2, 64, dtype=torch.float16)  # GQA: the output has q's heads
        out = torch.ops.autoragged.ragged_attention(
            q, kv, kv, meta, meta[:4], meta, meta, True, 0.125, 64, 64, 4, 2, 63, 0
        )
        assert out.shape == (100, 8, 64)
        y = torch.ops.autoragged.ragged_linear(
            torch.empty(100, 512), torch.empty(2048, 512), None, 1, 64, 64, 32, 4, 2, 8
        )
        assert y.shape == (100, 2048)
        n, s = torch.ops.autoragged.add_layer_norm(torch.empty(100, 512), None, None, None, 1e-5, True, 8, 4)
        assert n.shape == s.shape == (100, 512)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_registered_op_runs_eagerly(device):
    rt = _ragged([7, 3], (3, 2, 32), torch.float32, device)
    q, k, v = rt.values.unbind(1)
    offsets, lengths = rt.layout.device_meta(rt.device)
    gm, bo = rt.prelude(16)
    out = torch.ops.autoragged.ragged_attention(q, k, v, offsets, lengths, gm, bo, False, 32**-0.5, 16, 16, 2, 1)
    ref = k_attn.ragged_attention_ref(q, k, v, rt.layout.offsets, rt.lengths)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_registered_op_carries_groups_and_window(device):
    rt = _ragged([7, 30], (4, 32), torch.float32, device)
    q, k, v = rt.values.split([2, 1, 1], dim=1)
    offsets, lengths = rt.layout.device_meta(rt.device)
    gm, bo = rt.prelude(16)
    out = torch.ops.autoragged.ragged_attention(q, k, v, offsets, lengths, gm, bo, True, 32**-0.5, 16, 16, 2, 1, 4, 0)
    ref = k_attn.ragged_attention_ref(q, k, v, rt.layout.offsets, rt.lengths, causal=True, window=(4, 0))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(ref, k_attn.ragged_attention_ref(q, k, v, rt.layout.offsets, rt.lengths, causal=True))


def test_sibling_tiles_are_the_other_row_buckets():
    """The tiles compiled ahead for a TMA linear variant: the row buckets' defaults other than the one used,
    fitted to shared memory (fp32 halves what fits); in the interpreter nothing is compiled ahead."""
    small, mid, large = (k_lin.default_config(512, 512, rows) for rows in (64, 3000, 20000))
    assert len({small, mid, large}) == 3
    assert k_lin.sibling_tiles(small, 2) == [mid, large]
    assert k_lin.sibling_tiles(large, 2) == [small, mid]
    assert k_lin.sibling_tiles(large, 2, gelu=True) == [mid]  # a gelu linear never takes the small tiles
    assert {k_lin.default_config(512, 512, rows, "gelu") for rows in (64, 3000, 20000)} == {mid, large}
    assert all(k_lin.fit_shared_memory(t, 4) == t for t in k_lin.sibling_tiles(small, 4))
    from autoragged.kernels import ahead

    before = set(ahead._seen)
    x = torch.randn(8, 32)
    flags = {"HAS_BIAS": False, "ACTIVATION": 0, "HAS_LIVE": False, "PRECISION": "tf32", "UPCAST": False, "PDL": False}
    key = k_lin._sibling_key(x.dtype, x.device, 16, 32, flags)
    k_lin.compile_sibling_tiles(x, torch.randn(16, 32), None, None, 16, 32, flags, small, key)
    assert ahead._seen == before  # nothing compiled ahead off the GPU


# -- programmatic dependent launch (kernels/pdl.py) --------------------------------------------------------------
def _jit_kernels():
    """(file, function) for every @triton.jit function of the kernel files."""
    import ast
    from pathlib import Path

    import autoragged.kernels as kernels

    for path in sorted(Path(kernels.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                yield path.name, node


def test_every_kernel_that_chains_waits_before_anything_else():
    """A kernel launched with PDL may start while the kernel before it still runs, so each of its programs must wait
    before it reads or writes memory (kernels/pdl.py): a kernel that takes the PDL flag waits at its first statement.
    The encoder and decoder forward kernels take it."""
    import ast

    chained = set()
    for name, fn in _jit_kernels():
        if "PDL" not in [a.arg for a in fn.args.args] or fn.name == "wait_prior":
            continue
        body = (
            fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
        )
        assert ast.unparse(body[0]) == "wait_prior(PDL)", f"{name}:{fn.name} does not wait first"
        chained.add(fn.name)
    assert {"_linear_kernel", "_linear_tma_kernel", "_ragged_attn_fwd_kernel", "_add_layer_norm_kernel",
            "_layout_kernel", "_masked_kernel", "_masked_embed_kernel", "_post_pads_kernel", "_pack_kernel",
            "_unpack_kernel", "_add_rms_norm_kernel", "_silu_mul_kernel", "_rotary_kernel"} <= chained  # fmt: skip


def test_pdl_is_off_where_nothing_can_chain():
    """No PDL off CUDA, in the interpreter, or through torch.compile's launcher (wrap_triton)."""
    from autoragged.kernels import pdl

    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch_kwargs(torch.device("cpu")) == {"PDL": False}
    assert pdl.launch_kwargs(torch.device("cuda", 0), wrap=lambda kernel: kernel) == {"PDL": False}
    if interpreting():
        assert not pdl.enabled(torch.device("cuda", 0))


def test_pdl_turned_off_at_run_time_stays_off_until_turned_on(monkeypatch):
    """`set_enabled` (the diagnostic's A/B) overrides what the device can do, for the launches after it."""
    from autoragged.kernels import pdl

    monkeypatch.setattr(pdl, "_ON", True)
    monkeypatch.setitem(pdl._BY_DEVICE, 0, True)  # (a device that can chain, as an H100 reports)
    monkeypatch.setattr(pdl, "interpreting", lambda: False)
    monkeypatch.setattr(pdl, "gdc_wait", pdl.gdc_wait or (lambda: None))
    cuda = torch.device("cuda", 0)
    if torch.version.hip is not None:
        pytest.skip("ROCm never chains")
    assert pdl.launch_kwargs(cuda) == {"PDL": True, "launch_pdl": True}
    pdl.set_enabled(False)
    assert pdl.launch_kwargs(cuda) == {"PDL": False} and not pdl.enabled(cuda)
    pdl.set_enabled(True)
    assert pdl.enabled(cuda)


def test_pdl_can_be_turned_off_before_import():
    import os
    import subprocess
    import sys

    code = "from autoragged.kernels import pdl; print(pdl._ON)"
    env = {**os.environ, "AUTORAGGED_PDL": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
