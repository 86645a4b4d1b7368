"""Ragged attention's backward kernels against float64 autograd of the PyTorch reference.

The yardstick (the training issue's): each gradient of our kernels in a dtype may be off float64 by at most twice
what PyTorch's own reference in that dtype is off, plus a floor of a few units in the last place of the gradient's
scale, at least 1 (two errors of 1 ulp can differ 2x by chance; inputs and upstream gradients are randn). Lengths are awkward on purpose: 1-row components, lengths
just past a block, a component longer than two blocks.
"""

from __future__ import annotations

import pytest
import torch
from autoragged.kernels import ragged_attention as k_attn
from autoragged.kernels import ragged_attention_backward as k_bwd
from autoragged.kernels.triton_compat import tl, triton
from conftest import triton_available

from autoragged.ops import attention_values
from autoragged.ragged.layout import Layout

pytestmark = pytest.mark.skipif(not triton_available("cpu"), reason="needs Triton (the interpreter on CPU)")

_EPS = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _problem(layout: Layout, *, causal=False, window=(-1, -1), keys=None, head_dim=32):
    offsets, lengths = layout.device_meta(torch.device("cpu"))
    key_lengths = None if keys is None else torch.tensor(keys, dtype=torch.int32)
    config = k_attn.default_config(head_dim, layout.max_len)
    prelude = lambda block: layout.prelude(block, torch.device("cpu"))  # noqa: E731
    return k_bwd.AttentionProblem(offsets, lengths, prelude, key_lengths, causal, None, window, config, layout.max_len)


def _grads(fn, inputs, upstream):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    (out.double() * upstream).sum().backward()
    return out.detach(), [t.grad.double() for t in leaves]


def _assert_gradients_match_fp64(
    lens, *, heads=4, kv_heads=2, head_dim=32, causal=False, window=(-1, -1), keys=None, dtype=torch.float32
):
    layout = Layout.make(tuple(lens))
    T = layout.rows
    q = torch.randn(T, heads, head_dim, dtype=torch.float64)
    k, v = (torch.randn(T, kv_heads, head_dim, dtype=torch.float64) for _ in range(2))
    upstream = torch.randn(T, heads, head_dim, dtype=torch.float64)
    problem = _problem(layout, causal=causal, window=window, keys=keys, head_dim=head_dim)

    def ref(upcast):
        return lambda q, k, v: k_attn.ragged_attention_ref(
            q, k, v, layout.offsets, layout.lengths, causal=causal, window=window, key_lengths=keys, upcast=upcast
        )

    low = [t.to(dtype) for t in (q, k, v)]
    out, ours = _grads(lambda q, k, v: k_bwd.ragged_attention_train(q, k, v, problem), low, upstream)
    _, same_dtype = _grads(ref(False), low, upstream)
    exact_out, exact = _grads(ref(True), [t.to(dtype).double() for t in (q, k, v)], upstream)
    for name, g, s, e in zip("qkv", ours, same_dtype, exact):
        floor = 4 * _EPS[dtype] * max(e.abs().max().item(), 1.0)  # (1.0: a window of one key has dq = 0)
        ours_err, torch_err = (g - e).abs().max().item(), (s - e).abs().max().item()
        assert ours_err <= 2 * torch_err + floor, f"d{name}: ours {ours_err:.3g}, PyTorch {dtype} {torch_err:.3g}"
    # gradients of rows that are no component's (and of query-only rows for k and v) are exactly zero
    real = torch.zeros(T, dtype=torch.bool)
    key_rows = torch.zeros(T, dtype=torch.bool)
    for start, n, nk in zip(layout.offsets, layout.lengths, keys or layout.lengths):
        real[start : start + n] = True
        key_rows[start : start + nk] = True
    assert not ours[0][~real].any() and not ours[1][~key_rows].any() and not ours[2][~key_rows].any()
    assert (out.double() - exact_out)[real].abs().max() <= 2 * _EPS[dtype] * 64 * exact_out.abs().max()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_backward_matches_fp64(causal, dtype):
    _assert_gradients_match_fp64([5, 17, 1, 70, 33], causal=causal, dtype=dtype)


@pytest.mark.parametrize("window,causal", [((3, 5), False), ((6, -1), True), ((0, 2), False), ((40, -1), False)])
def test_attention_backward_windows(window, causal):
    _assert_gradients_match_fp64([5, 17, 1, 70], window=window, causal=causal, kv_heads=4)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_attention_backward_grouped_query(kv_heads):
    """k and v of fewer heads: their gradients sum over each group's query heads, with no repeated copy."""
    _assert_gradients_match_fp64([9, 33, 2], kv_heads=kv_heads, causal=True)


def test_attention_backward_query_only_rows():
    """Rows past a component's keys (a first-token pooler's column 0 of a left-padded row) are queries only."""
    _assert_gradients_match_fp64([5, 17, 2, 40], keys=[4, 17, 1, 39])


@pytest.mark.parametrize("head_dim", [80, 128])
def test_attention_backward_head_dims(head_dim):
    _assert_gradients_match_fp64([3, 20], head_dim=head_dim, heads=2, kv_heads=1, causal=True)


def test_attention_backward_aligned_layout_and_views():
    """q, k, v as strided views of one fused product, a layout with alignment gaps: gradients land in the
    product's gradient, zero on every gap row."""
    layout = Layout.make((5, 17, 1), align=8)
    T, H, D = layout.rows, 2, 32
    qkv = torch.randn(T, 3 * H * D, requires_grad=True)
    q, k, v = qkv.view(T, 3, H, D).unbind(1)
    out = attention_values(q, k, v, layout)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    qkv64 = qkv.detach().double().requires_grad_()
    q64, k64, v64 = qkv64.view(T, 3, H, D).unbind(1)
    ref = k_attn.ragged_attention_ref(q64, k64, v64, layout.offsets, layout.lengths)
    (ref * g.double()).sum().backward()
    torch.testing.assert_close(qkv.grad.double(), qkv64.grad, atol=1e-5, rtol=1e-5)
    gaps = torch.ones(T, dtype=torch.bool)
    for start, n in zip(layout.offsets, layout.lengths):
        gaps[start : start + n] = False
    assert not qkv.grad[gaps].any()


def test_attention_under_autograd_zeroes_spare_rows_past_every_component(monkeypatch):
    """Spare rows after the last component (the rows an encoder's cuBLAS rung adds on the GPU) come out zero, not
    whatever freed memory held: the o-projection's weight gradient sums every row, and there 0 x NaN is NaN (a
    compiled BERT step on an H100 got NaN weight gradients from it). The forward's buffer is poisoned with NaN here,
    as freed device memory may be."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(k_attn.torch, "empty", poisoned)
    base = Layout.make((5, 17, 1), align=1)
    layout = Layout(base.lengths, 1, base.offsets, base.rows + 9, canonical=False)
    T, H, D = layout.rows, 2, 32
    q, k, v = (torch.randn(T, H, D, requires_grad=True) for _ in range(3))
    out = attention_values(q, k, v, layout)
    assert torch.equal(out[base.rows :], torch.zeros_like(out[base.rows :]))
    w = torch.randn(H * D, 8, requires_grad=True)
    (out.reshape(T, -1) @ w)[: base.rows].sum().backward()
    assert torch.isfinite(w.grad).all() and torch.isfinite(q.grad).all()


def test_attention_values_without_grad_takes_the_inference_kernel():
    """No autograd recording: no lse is stored and the result equals the training forward's."""
    layout = Layout.make((5, 17))
    q, k, v = (torch.randn(layout.rows, 2, 32) for _ in range(3))
    with torch.no_grad():
        plain = attention_values(q, k, v, layout)
    trained = attention_values(q.requires_grad_(), k, v, layout)
    assert trained.requires_grad and not plain.requires_grad
    torch.testing.assert_close(trained.detach(), plain, atol=0, rtol=0)


@triton.jit
def _keep_kernel(Out, Seed, p, heads, comp, BLOCK: tl.constexpr):
    """The keep mask the kernels draw for one component, (heads, BLOCK, BLOCK) int8."""
    head = tl.program_id(0)
    rows = tl.arange(0, BLOCK)
    keep = k_attn.keep_mask(tl.load(Seed) + comp * heads + head, p, rows, 0, BLOCK)
    tl.store(Out + head * BLOCK * BLOCK + rows[:, None] * BLOCK + rows[None, :], keep.to(tl.int8))


def _keep_masks(layout: Layout, heads: int, dropout: k_attn.Dropout) -> list[torch.Tensor]:
    block = max(16, 1 << (layout.max_len - 1).bit_length())
    masks = []
    for comp, n in enumerate(layout.lengths):
        out = torch.empty(heads, block, block, dtype=torch.int8)
        _keep_kernel[(heads,)](out, dropout.seed, dropout.p, heads, comp, BLOCK=block)
        masks.append(out[:, :n, :n].bool())
    return masks


def test_keep_mask_drops_p_in_every_lane_of_a_draw_independently():
    """One Philox draw serves 8 neighbouring keys (16 bits each): each of the 8 lanes drops about p, lanes of one
    draw are uncorrelated, and another head's stream draws another mask."""
    dropout = k_attn.Dropout.draw(0.1, "cpu")
    assert dropout.p == 6553 / 65536
    (mask,) = _keep_masks(Layout.make((256,)), 2, dropout)
    drop = (~mask).float()
    lanes = drop.reshape(2, 256, 32, 8).mean(dim=(0, 1, 2))  # 16,384 draws a lane
    assert (lanes - dropout.p).abs().max() < 0.015, lanes
    pairs = drop.reshape(-1, 8)
    centred = pairs - pairs.mean(0)
    corr = (centred.T @ centred) / (centred.norm(dim=0)[:, None] * centred.norm(dim=0)[None, :])
    assert (corr - torch.eye(8)).abs().max() < 0.05
    assert (mask[0] != mask[1]).float().mean() > 0.1


def test_dropout_p_off_the_kernels_steps_is_refused():
    layout = Layout.make((5, 17))
    q = torch.randn(layout.rows, 2, 32)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="multiple of 2"):
        k_attn.ragged_attention(
            q, q, q, *layout.device_meta(cpu), *layout.prelude(32, cpu), dropout=k_attn.Dropout(0.1, torch.zeros(1))
        )


@pytest.mark.parametrize("causal", [False, True])
def test_attention_dropout_forward_and_backward_match_fp64_with_the_same_mask(causal):
    """Dropout on the probabilities: the forward and both backward kernels draw one mask (a Philox stream per
    component and head, counters (row, key)); with that mask the fp64 reference gives the same output and gradients.
    About p of the probabilities are dropped."""
    layout = Layout.make((5, 40, 1, 33))
    T, H, Hkv, D = layout.rows, 4, 2, 32
    q = torch.randn(T, H, D, dtype=torch.float64)
    k, v = (torch.randn(T, Hkv, D, dtype=torch.float64) for _ in range(2))
    upstream = torch.randn(T, H, D, dtype=torch.float64)
    dropout = k_attn.Dropout(19660 / 65536, torch.tensor([1234]))  # 0.3 in the kernels' 2^-16 steps
    problem = _problem(layout, causal=causal)._replace(dropout=dropout)
    keep = _keep_masks(layout, H, dropout)
    visible = sum(m.sum().item() for m in keep) / sum(m.numel() for m in keep)
    assert abs(visible - 0.7) < 0.03

    def ref(q, k, v):
        return k_attn.ragged_attention_ref(
            q, k, v, layout.offsets, layout.lengths, causal=causal, dropout=dropout.p, keep=keep
        )

    low = [t.float() for t in (q, k, v)]
    out, ours = _grads(lambda q, k, v: k_bwd.ragged_attention_train(q, k, v, problem), low, upstream)
    _, same = _grads(lambda q, k, v: ref(q, k, v), low, upstream)
    exact_out, exact = _grads(ref, [t.double() for t in low], upstream)
    torch.testing.assert_close(out.double(), exact_out, atol=1e-5, rtol=1e-5)
    for name, g, s, e in zip("qkv", ours, same, exact):
        floor = 4 * _EPS[torch.float32] * max(e.abs().max().item(), 1.0)
        ours_err, torch_err = (g - e).abs().max().item(), (s - e).abs().max().item()
        assert ours_err <= 2 * torch_err + floor, f"d{name}: ours {ours_err:.3g}, PyTorch {torch_err:.3g}"
