"""Backward passes of the row-wise ops (add + LayerNorm, add + RMSNorm, rotary, silu * up) as autograd Functions.

Each train function's gradients of a random upstream sum(out * g) are held to the rule of tests/_tolerance.py:
err(ours, fp64 reference) <= 2 * err(PyTorch's autograd through the reference in the same dtype, fp64) + two ulps
of the fp64 gradient's scale. The floor is for gradients PyTorch gets exactly (a bias gradient of one row, an fp32
column sum that needs no rounding), which would otherwise hold ours to zero; two ulps because ours rounds once
from fp32 and the interpreter's bf16 casts truncate (one more ulp, added there). On CPU the kernels run in
Triton's interpreter (conftest), so the shapes are small: rows 1, 7, 33; feature dims 48 and 80.
"""

import pytest
import torch
from _tolerance import assert_within_torch_error
from autoragged.kernels import gated_act as k_act
from autoragged.kernels import ragged_add_layer_norm as k_ln
from autoragged.kernels import rms_norm as k_rms
from autoragged.kernels import rotary as k_rope
from conftest import DEVICES, triton_available

import autoragged.ops as ops

TRITON_DEVICES = [d for d in DEVICES if triton_available(d)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _grads(fn, inputs, upstream):
    """Gradients of sum_i (out_i * g_i).sum() through fn(*inputs), one per input (None for a None input)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((out * g).sum() for out, g in zip(outs, upstream) if out is not None)
    loss.backward()
    return [None if t is None else t.grad for t in leaves]


def check_backward(train, ref, ref64, inputs, names, what):
    """Gradients through train, ref (same dtype) and ref64 (fp64 copies) against the rule; returns each input's
    (name, err ours, err PyTorch same dtype) against the fp64 gradients."""
    with torch.no_grad():
        outs = ref(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    upstream = [None if o is None else torch.randn(o.shape, dtype=torch.float64).to(o.dtype).to(o.device) for o in outs]
    ours = _grads(train, inputs, upstream)
    same = _grads(ref, inputs, upstream)
    exact = _grads(
        ref64,
        [None if t is None else t.double() for t in inputs],
        [None if g is None else g.double() for g in upstream],
    )
    errors = []
    for name, t, a, b, c in zip(names, inputs, ours, same, exact):
        if t is None:
            continue
        assert a.shape == t.shape and a.dtype == t.dtype, f"{what} d{name}: {a.shape} {a.dtype}"
        errors.append((name, *assert_within_torch_error(a, b, c, f"{what} d{name}")))
    return errors


def _ln_inputs(rows, n, residual, weight, bias, dtype, device):
    x = torch.randn(rows, n, dtype=torch.float64) * 2 + 1  # an offset mean, so centring matters
    r = torch.randn(rows, n, dtype=torch.float64) if residual else None
    w = 1 + 0.1 * torch.randn(n, dtype=torch.float64) if weight else None
    b = 0.1 * torch.randn(n, dtype=torch.float64) if bias else None
    return [None if t is None else t.to(dtype).to(device) for t in (x, r, w, b)]


def _rms_ref64(x, residual, weight, eps, store_sum=False):
    """add_rms_norm_ref in fp64 throughout: the reference computes its statistics in fp32 (as HF), even on fp64."""
    total = x if residual is None else residual + x
    out = weight * total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps)
    return out, (total if store_sum and residual is not None else None)


def _rope_tables(rows, dim, equal_halves, dtype, device):
    """HF's tables (cat(freqs, freqs): both halves equal), or independent halves, which only a backward that
    swaps the halves of sin gets right."""
    angle = torch.arange(rows, dtype=torch.float64)[:, None] * torch.rand(dim // 2, dtype=torch.float64)
    angle = torch.cat((angle, angle if equal_halves else angle.flip(-1) + 0.5), dim=-1)
    return angle.cos().to(dtype).to(device), angle.sin().to(dtype).to(device)


# -- add + LayerNorm --------------------------------------------------------------------------------------------------
LN_CASES = [  # rows, n, residual, weight, bias, store_sum
    (1, 48, True, True, True, True),
    (7, 80, True, True, True, False),
    (33, 48, False, True, False, False),
    (7, 48, True, False, False, True),
    (33, 80, False, False, True, True),  # store_sum without a residual: the sum is x, its gradient joins dx
]


def check_layer_norm(device, dtype, rows, n, residual, weight, bias, store_sum):
    inputs = _ln_inputs(rows, n, residual, weight, bias, dtype, device)
    return check_backward(
        lambda *t: k_ln.add_layer_norm_train(*t, 1e-5, store_sum),
        lambda *t: k_ln.add_layer_norm_ref(*t, 1e-5, store_sum=store_sum),
        lambda *t: k_ln.add_layer_norm_ref(*t, 1e-5, store_sum=store_sum),
        inputs, ("x", "residual", "weight", "bias"), f"add_layer_norm {dtype} {rows}x{n}",
    )  # fmt: skip


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, n, residual, weight, bias, store_sum", LN_CASES)
def test_add_layer_norm_backward(device, dtype, rows, n, residual, weight, bias, store_sum):
    check_layer_norm(device, dtype, rows, n, residual, weight, bias, store_sum)


# -- add + RMSNorm ----------------------------------------------------------------------------------------------------
RMS_CASES = [  # rows, n, residual, store_sum
    (1, 48, True, True),
    (7, 80, True, False),
    (33, 48, False, False),
    (33, 80, True, True),
]


def check_rms_norm(device, dtype, rows, n, residual, store_sum):
    x, r, w, _ = _ln_inputs(rows, n, residual, True, False, dtype, device)
    return check_backward(
        lambda *t: k_rms.add_rms_norm_train(*t, 1e-6, store_sum),
        lambda *t: k_rms.add_rms_norm_ref(*t, 1e-6, store_sum=store_sum),
        lambda *t: _rms_ref64(*t, 1e-6, store_sum=store_sum),
        [x, r, w], ("x", "residual", "weight"), f"add_rms_norm {dtype} {rows}x{n}",
    )  # fmt: skip


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, n, residual, store_sum", RMS_CASES)
def test_add_rms_norm_backward(device, dtype, rows, n, residual, store_sum):
    check_rms_norm(device, dtype, rows, n, residual, store_sum)


# -- rotary -----------------------------------------------------------------------------------------------------------
ROPE_CASES = [(1, 1, 48, True), (7, 3, 80, False), (33, 2, 48, True)]  # rows, heads, dim, equal halves


def check_rotary(device, dtype, rows, heads, dim, equal_halves):
    proj = torch.randn(rows, heads * dim + 3, dtype=torch.float64).to(dtype).to(device)
    cos, sin = _rope_tables(rows, dim, equal_halves, dtype, device)
    as_heads = lambda t: t[:, 3:].unflatten(1, (heads, dim))  # noqa: E731  (a strided view, as a projection's)
    return check_backward(
        lambda t: k_rope.rotary_train(as_heads(t), cos, sin),
        lambda t: k_rope.rotary_ref(as_heads(t), cos, sin),
        lambda t: k_rope.rotary_ref(as_heads(t), cos.double(), sin.double()),
        [proj], ("x",), f"rotary {dtype} {rows}x{heads}x{dim}",
    )  # fmt: skip


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, heads, dim, equal_halves", ROPE_CASES)
def test_rotary_backward(device, dtype, rows, heads, dim, equal_halves):
    check_rotary(device, dtype, rows, heads, dim, equal_halves)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, heads, kv_heads", [(1, 1, 1), (7, 5, 2), (33, 2, 3)])
def test_rotary_pair_is_two_rotaries(device, dtype, rows, heads, kv_heads):
    """One launch over a layer's queries and keys (strided views of one projection, any head counts, more key
    heads than query heads too): each output the single-tensor kernel's to the bit, and their gradients within
    PyTorch's own error of fp64."""
    dim = 48
    proj = torch.randn(rows, (heads + kv_heads) * dim + 3, dtype=torch.float64).to(dtype).to(device)
    cos, sin = _rope_tables(rows, dim, False, dtype, device)

    def split(t):  # (q, k): strided views of one projection's output, as a fused q/k/v product gives them
        return t[:, 3 : 3 + heads * dim].unflatten(1, (heads, dim)), t[:, 3 + heads * dim :].unflatten(
            1, (kv_heads, dim)
        )

    q, k = split(proj)
    for got, want in zip(k_rope.rotary_pair(q, k, cos, sin), (k_rope.rotary(q, cos, sin), k_rope.rotary(k, cos, sin))):
        assert torch.equal(got, want)
    pair = ops.rotary_pair_values(*_leaves(q, k), cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(pair, k_rope.rotary_pair(q, k, cos, sin)))
    assert all(t.grad_fn is not None for t in pair), "under autograd the pair takes the Function"
    check_backward(
        lambda t: k_rope.rotary_pair_train(*split(t), cos, sin),
        lambda t: tuple(k_rope.rotary_ref(x, cos, sin) for x in split(t)),
        lambda t: tuple(k_rope.rotary_ref(x, cos.double(), sin.double()) for x in split(t)),
        [proj], ("q and k",), f"rotary pair {dtype} {rows}x{heads}+{kv_heads}",
    )  # fmt: skip


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_rotary_backward_has_pytorchs_bits(device):
    """fp32 in both (no truncating bf16 cast): the forward kernel run backwards rounds where autograd does."""
    x = torch.randn(7, 3, 80, device=device)
    cos, sin = _rope_tables(7, 80, False, torch.float32, device)
    g = torch.randn(7, 3, 80, device=device)
    ours = _grads(lambda t: k_rope.rotary_train(t, cos, sin), [x], [g])[0]
    torch.testing.assert_close(ours, _grads(lambda t: k_rope.rotary_ref(t, cos, sin), [x], [g])[0], rtol=0, atol=0)


# -- silu(gate) * up --------------------------------------------------------------------------------------------------
SILU_SHAPES = [(1, 48), (7, 80), (3, 1100)]  # 1100: past one 1024-column block


def check_silu_mul(device, dtype, shape):
    gate = (torch.randn(shape, dtype=torch.float64) * 4).to(dtype).to(device)  # both tails of the sigmoid
    up = torch.randn(shape, dtype=torch.float64).to(dtype).to(device)
    return check_backward(
        k_act.silu_mul_train, k_act.silu_mul_ref, k_act.silu_mul_ref, [gate, up], ("gate", "up"),
        f"silu_mul {dtype} {shape}",
    )  # fmt: skip


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SILU_SHAPES)
def test_silu_mul_backward(device, dtype, shape):
    check_silu_mul(device, dtype, shape)


# -- the train functions' forwards and the ops that call them ---------------------------------------------------------
def _leaves(*tensors):
    return [None if t is None else t.clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_train_forwards_equal_the_launchers(device, dtype):
    x, r, w, b = _ln_inputs(7, 80, True, True, True, dtype, device)
    for got, want in zip(
        k_ln.add_layer_norm_train(*_leaves(x, r, w, b), 1e-5, True), k_ln.add_layer_norm(x, r, w, b, store_sum=True)
    ):
        assert torch.equal(got, want)
    for got, want in zip(
        k_rms.add_rms_norm_train(*_leaves(x, r, w), 1e-6, True), k_rms.add_rms_norm(x, r, w, 1e-6, store_sum=True)
    ):
        assert torch.equal(got, want)
    cos, sin = _rope_tables(7, 40, True, dtype, device)
    q = x.view(7, 2, 40)
    assert torch.equal(k_rope.rotary_train(*_leaves(q), cos, sin), k_rope.rotary(q, cos, sin))
    gate, up = _leaves(x, r)
    before = gate.detach().clone()
    assert torch.equal(k_act.silu_mul_train(gate, up), k_act.silu_mul(x, r, inplace=False))
    assert torch.equal(gate.detach(), before), "silu_mul_train must leave the gate (its backward reads it)"


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_norm_sum_output_alone_carries_its_gradient(device):
    """Only the sum output used: its gradient is dx and dresidual as it is, the weight gets none."""
    x, r, w, b = _ln_inputs(7, 48, True, True, True, torch.float32, device)
    g = torch.randn(7, 48, device=device)
    for train in (
        lambda x, r, w, b: k_ln.add_layer_norm_train(x, r, w, b, 1e-5, True)[1],
        lambda x, r, w, b: k_rms.add_rms_norm_train(x, r, w, 1e-6, True)[1],
    ):
        leaves = _leaves(x, r, w, b)
        (train(*leaves) * g).sum().backward()
        assert torch.equal(leaves[0].grad, g) and torch.equal(leaves[1].grad, g)
        assert torch.equal(leaves[2].grad, torch.zeros_like(w))


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_ops_take_the_train_functions_when_autograd_records(device):
    """On the Triton path, inputs that require grad get the kernels' Functions (a norm's weight alone is enough),
    with the train functions' gradients; without grad the inference path stays (silu_mul overwrites its gate).
    add+LayerNorm under autograd is PyTorch's add and layer_norm (fewer host launches in a training step: see
    autoragged/ops.py), as exact as our Function."""
    x, r, w, b = _ln_inputs(7, 48, True, True, True, torch.float32, device)
    cos, sin = _rope_tables(7, 24, True, torch.float32, device)
    g = torch.randn(7, 48, device=device)
    cases = [  # (op, train function, its inputs, which of them alone makes autograd record)
        (lambda x, w: ops.add_rms_norm_values(x, r, w, 1e-6)[0], lambda x, w: k_rms.add_rms_norm_train(x, r, w, 1e-6)[0], [x, w], 1),
        (lambda x: ops.rotary_values(x, cos, sin), lambda x: k_rope.rotary_train(x, cos, sin), [x.view(7, 2, 24)], 0),
        (ops.silu_mul_values, k_act.silu_mul_train, [x, r], 1),
    ]  # fmt: skip
    for op, train, inputs, alone in cases:
        leaves = _leaves(*inputs)
        name = type(op(*leaves).grad_fn).__name__
        assert name.endswith("FunctionBackward"), f"{name}: not one of the kernels' autograd Functions"
        one = [t.clone().requires_grad_(i == alone) for i, t in enumerate(inputs)]
        assert type(op(*one).grad_fn).__name__ == name, "one input requiring grad must be enough"
        upstream = [g.view_as(inputs[0])]
        for got, want in zip(_grads(op, inputs, upstream), _grads(train, inputs, upstream)):
            assert torch.equal(got, want)
        with torch.no_grad():
            assert op(*_leaves(*inputs)).grad_fn is None
    layer_norm = lambda x, w: ops.add_layer_norm_values(x, r, w, b)[0]  # noqa: E731
    assert type(layer_norm(*_leaves(x, w)).grad_fn).__name__ == "NativeLayerNormBackward0"
    for got, want in zip(
        _grads(layer_norm, [x, w], [g]), _grads(lambda x, w: k_ln.add_layer_norm_train(x, r, w, b)[0], [x, w], [g])
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    gate = x.clone()
    ops.silu_mul_values(gate, r)
    assert not torch.equal(gate, x), "without autograd, silu_mul_values still writes over the gate"


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_training_errors_are_named(device):
    x = torch.randn(7, 48, device=device, requires_grad=True)
    live = torch.tensor([3], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="live rows are inference-only"):
        ops.add_layer_norm_values(x, None, None, None, live=live)
    cos, sin = _rope_tables(7, 24, True, torch.float32, device)
    for learned in (0, 1):
        tables = [t.clone().requires_grad_(i == learned) for i, t in enumerate((cos, sin))]
        with pytest.raises(ValueError, match="cos and sin require grad"):
            ops.rotary_values(x.detach().view(7, 2, 24), *tables)
