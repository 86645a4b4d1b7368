"""autoragged.wrap(): equivalence of original, padded arm and ragged arm for every module option;
routing of unsupported cases with their reasons; unwrap; the decision record."""

import copy
import itertools

import pytest
import torch
from _tolerance import assert_within_torch_error
from torch import nn

import autoragged
from autoragged import RaggedTensor


def make_encoder(*, d=64, heads=2, ff=96, layers=2, norm_first=False, activation="relu", batch_first=True,
                 bias=True, eps=1e-5, final_norm=False, dropout=0.0):  # fmt: skip
    layer = nn.TransformerEncoderLayer(
        d, heads, ff, dropout=dropout, activation=activation, batch_first=batch_first, norm_first=norm_first,
        bias=bias, layer_norm_eps=eps,
    )  # fmt: skip
    norm = nn.LayerNorm(d, eps=eps, bias=bias) if final_norm else None
    enc = nn.TransformerEncoder(layer, layers, norm=norm, enable_nested_tensor=False)
    with torch.no_grad():  # non-trivial norms so a wrong norm would show
        for m in enc.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                if m.bias is not None:
                    m.bias.uniform_(-0.5, 0.5)
    return enc.eval()


def batch(lengths, d, device, dtype=torch.float32, batch_first=True):
    L = max(lengths) + 3
    x = torch.randn(len(lengths), L, d, dtype=torch.float64).to(dtype).to(device)
    mask = (torch.arange(L)[None, :] >= torch.tensor(lengths)[:, None]).to(device)
    return (x if batch_first else x.transpose(0, 1).contiguous()), mask


def real_tokens(y, lengths, batch_first=True):
    y = y if batch_first else y.transpose(0, 1)
    return torch.cat([y[i, :n] for i, n in enumerate(lengths)])


def pads(y, lengths, batch_first=True):
    y = y if batch_first else y.transpose(0, 1)
    return torch.cat([y[i, n:].reshape(-1) for i, n in enumerate(lengths)])


LENGTHS = [17, 1, 0, 9, 33]
OPTIONS = list(itertools.product([False, True], ["relu", "gelu"], [True, False], [True, False], [False, True]))


@pytest.mark.parametrize("norm_first, activation, batch_first, bias, final_norm", OPTIONS, ids=lambda v: str(v))
def test_arms_agree_with_the_original(backend, norm_first, activation, batch_first, bias, final_norm):
    torch.manual_seed(1)
    opts = dict(norm_first=norm_first, activation=activation, batch_first=batch_first, bias=bias, final_norm=final_norm)
    enc = make_encoder(**opts, eps=1e-4).to(backend)
    ref64 = copy.deepcopy(enc).double()
    x, mask = batch(LENGTHS, 64, backend, batch_first=batch_first)
    with torch.no_grad():
        # (reference in float64, PyTorch's own float32 result) with PyTorch's fast path as built, which the
        # padded arm runs, and without it: on CUDA the fast path computes gelu with the tanh approximation
        # (its fused addmm epilogue, pytorch#104061) although the module says exact gelu, as the ragged arm does
        refs = {"padded": (ref64(x.double(), src_key_padding_mask=mask), enc(x, src_key_padding_mask=mask))}
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            refs["ragged"] = (ref64(x.double(), src_key_padding_mask=mask), enc(x, src_key_padding_mask=mask))
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
        wrapped = autoragged.wrap(enc, db=False)
        for policy in ("padded", "ragged", "auto"):
            wrapped._autoragged.policy = policy
            y = wrapped(x, src_key_padding_mask=mask)
            decision = autoragged.recent_decisions(wrapped, 1)[0]
            # the CPU prior picks ragged here; on a GPU the graph arms compete, and any arm must agree
            want = policy if policy != "auto" else ("ragged" if backend.type == "cpu" else None)
            assert want is None or decision.arm == want, decision.reason
            assert y.shape == x.shape and y.dtype == x.dtype
            expect, original = refs["padded" if decision.arm.startswith("padded") else "ragged"]
            assert_within_torch_error(
                real_tokens(y, LENGTHS, batch_first), real_tokens(original, LENGTHS, batch_first),
                real_tokens(expect, LENGTHS, batch_first), f"{policy} {opts}",
            )  # fmt: skip
            assert (pads(y, LENGTHS, batch_first) == 0).all(), "padded positions must be zero on every arm"


def test_a_lone_encoder_layer_inside_a_model(backend):
    torch.manual_seed(2)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 64)
            self.block = make_encoder(layers=1, norm_first=True).layers[0]

        def forward(self, x, mask):
            return self.block(self.proj(x), src_key_padding_mask=mask)

    model = Model().eval().to(backend)
    x, mask = batch(LENGTHS, 64, backend)
    with torch.no_grad():
        ref = model(x, mask)
        autoragged.wrap(model, db=False, policy="ragged")
        assert type(model.block).__name__ == "DispatchingTransformerEncoderLayer"
        y = model(x, mask)
    assert autoragged.recent_decisions(model, 1)[0].arm == "ragged"
    torch.testing.assert_close(real_tokens(y, LENGTHS), real_tokens(ref, LENGTHS), rtol=1e-4, atol=1e-4)


def test_lengths_and_ragged_inputs(backend):
    enc = make_encoder().to(backend)
    x, mask = batch(LENGTHS, 64, backend)
    with torch.no_grad():
        ref = enc(x, src_key_padding_mask=mask)
        autoragged.wrap(enc, db=False, policy="ragged")
        by_lengths = enc(x, lengths=LENGTHS)  # no mask at all: lengths are the truth
        both = enc(x, src_key_padding_mask=mask, lengths=LENGTHS)
        rt = RaggedTensor.from_padded(x, LENGTHS, align=16)
        out = enc(rt)
        # a RaggedTensor runs on its own layout, and the record says so
        assert autoragged.recent_decisions(enc, 1)[0].config["align"] == 16
        enc._autoragged.policy = "padded"
        out_padded_arm = enc(rt)
    for y in (by_lengths, both):
        torch.testing.assert_close(real_tokens(y, LENGTHS), real_tokens(ref, LENGTHS), rtol=1e-4, atol=1e-4)
        assert (pads(y, LENGTHS) == 0).all()
    for r in (out, out_padded_arm):
        assert isinstance(r, RaggedTensor) and r.lengths == tuple(LENGTHS) and r.align == 16
        torch.testing.assert_close(
            r.to_padded(max_len=x.shape[1]), ref.masked_fill(mask[..., None], 0), rtol=1e-4, atol=1e-4
        )


def test_no_mask_means_all_tokens_are_real():
    enc = make_encoder()
    x = torch.randn(2, 7, 64)
    with torch.no_grad():
        ref = enc(x)
        autoragged.wrap(enc, db=False, policy="ragged")
        y = enc(x)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    assert autoragged.recent_decisions(enc, 1)[0].stats.pad_fraction == 0.0


def test_causal_mask_with_the_hint_runs_ragged():
    enc = make_encoder()
    x, mask = batch([6, 11], 64, "cpu")
    causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
    with torch.no_grad():
        ref = enc(x, mask=causal, src_key_padding_mask=mask, is_causal=True)
        autoragged.wrap(enc, db=False, policy="ragged")
        y = enc(x, mask=causal, src_key_padding_mask=mask, is_causal=True)
    assert autoragged.recent_decisions(enc, 1)[0].arm == "ragged"
    torch.testing.assert_close(real_tokens(y, [6, 11]), real_tokens(ref, [6, 11]), rtol=1e-4, atol=1e-4)


# -- unsupported cases: padded, with the reason, never an error or a wrong answer ----------------
@pytest.mark.parametrize(
    "setup, call, words",
    [
        (None, lambda e, x, m: e(x, mask=torch.zeros(x.shape[1], x.shape[1]), src_key_padding_mask=m), "attn_mask"),
        (None, lambda e, x, m: e(x, src_key_padding_mask=m.float().masked_fill(m, float("-inf"))), "not bool"),
        (None, lambda e, x, m: e(x, src_key_padding_mask=m.flip(1)), "not right-padded"),
        (lambda e: e.layers[0].linear1.register_forward_hook(lambda *a: None), None, "forward hooks"),
    ],
)
def test_unsupported_batches_go_padded_with_their_reason(setup, call, words):
    enc = make_encoder(dropout=0.1)
    x, mask = batch(LENGTHS, 64, "cpu")
    if setup is not None:
        setup(enc)
    with torch.no_grad():
        ref = enc(x, src_key_padding_mask=mask)
        autoragged.wrap(enc, db=False, policy="ragged")
        y = (call or (lambda e, x, m: e(x, src_key_padding_mask=m)))(enc, x, mask)
    d = autoragged.recent_decisions(enc, 1)[0]
    assert d.arm == "padded" and words in d.reason, d.reason
    assert y.shape == x.shape
    if ref is not None and words in ("forward hooks",):
        torch.testing.assert_close(y, ref.masked_fill(mask[..., None], 0))


def test_input_that_differs_from_the_parameters_gets_pytorchs_own_error():
    enc = make_encoder()
    x, mask = batch([4, 2], 64, "cpu")
    with torch.no_grad(), pytest.raises(RuntimeError) as original:
        enc(x.double(), src_key_padding_mask=mask)
    autoragged.wrap(enc, db=False, policy="ragged")
    with torch.no_grad(), pytest.raises(RuntimeError) as wrapped:
        enc(x.double(), src_key_padding_mask=mask)
    assert str(wrapped.value) == str(original.value)


def test_autograd_runs_ragged_and_gradients_flow():
    """A PyTorch encoder in train mode under autograd runs the ragged arm (its kernels' backward) and every parameter
    gets its gradient (their values against fp64: tests/test_training.py)."""
    enc = make_encoder().train()
    autoragged.wrap(enc, db=False, policy="ragged")
    x, mask = batch(LENGTHS, 64, "cpu")
    y = enc(x, src_key_padding_mask=mask)
    y[~mask].sum().backward()
    d = autoragged.recent_decisions(enc, 1)[0]
    assert d.arm == "ragged", d.reason
    assert all(p.grad is not None for p in enc.parameters())


def test_unsupported_activation_is_a_static_reason():
    enc = make_encoder(activation=nn.GELU(approximate="tanh"))
    autoragged.wrap(enc, db=False, policy="ragged")
    x, mask = batch([5, 3], 64, "cpu")
    with torch.no_grad():
        enc(x, src_key_padding_mask=mask)
    assert "activation gelu(approximate='tanh')" in autoragged.recent_decisions(enc, 1)[0].reason


def test_unbatched_input_is_passed_through():
    layer = make_encoder(layers=1).layers[0]
    autoragged.wrap(layer, db=False, policy="ragged")
    x = torch.randn(5, 64)
    with torch.no_grad():
        y = layer(x)
    assert y.shape == (5, 64) and "not a batched" in autoragged.recent_decisions(layer, 1)[0].reason


# -- wrap / unwrap --------------------------------------------------------------------------------
def test_wrap_keeps_identity_state_dict_and_unwrap_restores():
    enc = make_encoder()
    keys = list(enc.state_dict())
    x, mask = batch(LENGTHS, 64, "cpu")
    with torch.no_grad():
        before = enc(x, src_key_padding_mask=mask)
    same = autoragged.wrap(enc, db=False, policy="ragged")
    assert same is enc and isinstance(enc, nn.TransformerEncoder)
    assert list(enc.state_dict()) == keys
    assert type(enc).__name__ == "DispatchingTransformerEncoder"
    autoragged.unwrap(enc)
    assert type(enc) is nn.TransformerEncoder and not hasattr(enc, "_autoragged")
    with torch.no_grad():
        after = enc(x, src_key_padding_mask=mask)
    torch.testing.assert_close(after, before, rtol=0, atol=0, equal_nan=True)  # a zero-length row is NaN in PyTorch


def test_parameters_are_shared_not_copied():
    """An in-place update must be seen by the next ragged batch. The update is not a constant shift: the
    post-norm layer's LayerNorm would cancel one (the old form of this test could not fail)."""
    enc = make_encoder()
    plain = copy.deepcopy(enc)
    autoragged.wrap(enc, db=False, policy="ragged")
    x, mask = batch([8, 4], 64, "cpu")
    with torch.no_grad():
        y1 = enc(x, src_key_padding_mask=mask)
        for m in (enc, plain):
            m.layers[1].linear2.bias.add_(torch.linspace(-1.0, 1.0, 64))
        y2 = enc(x, src_key_padding_mask=mask)
        want = plain(x, src_key_padding_mask=mask).masked_fill(mask[..., None], 0.0)
    assert (y2 - y1).abs().max() > 0.1
    torch.testing.assert_close(y2, want, rtol=1e-4, atol=1e-4)


def test_deepcopy_and_rewrap():
    enc = autoragged.wrap(make_encoder(), db=False, policy="ragged")
    x, mask = batch([8, 4], 64, "cpu")
    with torch.no_grad():
        enc(x, src_key_padding_mask=mask)
    twin = copy.deepcopy(enc)
    assert type(twin).__name__ == "DispatchingTransformerEncoder" and twin._autoragged.policy == "ragged"
    assert enc._autoragged.shapes and not twin._autoragged.shapes  # (a copy starts anew)
    learnt = ("ring", "timers", "count")
    assert all(getattr(enc._autoragged, k) for k in learnt) and not any(getattr(twin._autoragged, k) for k in learnt)
    # the copy runs its own parameters: changed in the twin only, the twin's output follows
    with torch.no_grad():
        twin.layers[0].linear1.bias.add_(1.0)
        want = nn.TransformerEncoder.forward(twin, x, src_key_padding_mask=mask).masked_fill(mask[..., None], 0.0)
        torch.testing.assert_close(twin(x, src_key_padding_mask=mask), want, rtol=1e-4, atol=1e-4)
        assert (enc(x, src_key_padding_mask=mask) - want).abs().max() > 1e-2
    autoragged.wrap(twin, db=False, policy="padded")
    assert twin._autoragged.policy == "padded" and enc._autoragged.policy == "ragged"


def test_wrap_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="policy must be one of"):
        autoragged.wrap(make_encoder(), policy="fast")
    with pytest.raises(ValueError, match="found nothing it can run"):
        autoragged.wrap(nn.Linear(3, 3))
    with pytest.raises(TypeError, match="expects an nn.Module"):
        autoragged.wrap("model")
    (tmp_path / "dir").mkdir()
    from autoragged.tuning_db import DatabaseError

    with pytest.raises(DatabaseError, match="dir"):
        autoragged.wrap(make_encoder(), db=tmp_path / "dir")


def test_lengths_that_disagree_with_the_mask_are_an_error():
    enc = autoragged.wrap(make_encoder(), db=False)
    x, mask = batch([5, 3], 64, "cpu")
    with torch.no_grad(), pytest.raises(ValueError, match="lengths\\[1\\] = 4 but the padding mask's row 1 has 3"):
        enc(x, src_key_padding_mask=mask, lengths=[5, 4])
    with torch.no_grad(), pytest.raises(ValueError, match="exceeds the padded length"):
        enc(x, lengths=[5, 99])


def test_decisions_reach_the_database(tmp_path):
    from autoragged.tuning_db import TuningDB

    path = tmp_path / "t.sqlite"
    enc = autoragged.wrap(make_encoder(), db=path)
    x, mask = batch([5, 3], 64, "cpu")
    with torch.no_grad():
        for _ in range(3):
            enc(x, src_key_padding_mask=mask)
    autoragged.flush()  # (what the recorder's thread has not written already: its interval may have passed)
    with TuningDB.open(path) as db:
        rows = db.decisions()
    assert len(rows) == 3 and rows[0].signature == "encoder:2x64/2h/ff96:relu:post:float32"
    assert rows[0].stats.total == 8 and rows[0].arm in ("padded", "ragged") and rows[0].predicted_ms


def test_decisions_are_logged(caplog):
    import logging

    from autoragged.runtime import core as _dispatch

    enc = autoragged.wrap(make_encoder(), db=False)
    x, mask = batch([5, 3], 64, "cpu")
    with caplog.at_level(logging.DEBUG, logger="autoragged"), torch.no_grad():
        enc(x, src_key_padding_mask=mask)
        enc._autoragged.count = _dispatch._SUMMARY_EVERY - 1
        enc(x, src_key_padding_mask=mask)
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG and "B=2 max_len=5 total=8" in r.getMessage()]
    info = [r for r in caplog.records if r.levelno == logging.INFO and "batches so far" in r.getMessage()]
    assert len(debug) == 2 and len(info) == 1


def test_deferred_stats_wait_on_the_pinned_slot_not_on_a_cuda_call():
    """The recorder's thread resolves unread batches' stats by polling the slot (pre-filled with -1), never
    by an event sync: a CUDA call from another thread invalidates any graph capture in global mode."""
    import threading

    from autoragged.planning.costmodel import PADDED
    from autoragged.runtime.records import Pending, Record

    class NoSync:
        def synchronize(self):
            raise AssertionError("a CUDA call while the copy could simply be waited for")

    host = torch.full((3,), -1, dtype=torch.int32)
    record = Record(None, PADDED, {}, "unread", None, "sig")
    record._pending = Pending(host, NoSync(), 10, 10)
    lands = threading.Timer(0.05, lambda: host.copy_(torch.tensor([2, 0, 5], dtype=torch.int32)))
    lands.start()
    try:
        stats = record.stats
    finally:
        lands.join()
    assert (stats.batch, stats.total, stats.max_len) == (3, 8 + 10 + 5, 10)


def test_grad_mode_follows_the_parameters_flags_every_batch():
    """Grad mode on: a batch runs the training path (its output takes gradients) exactly when a parameter needs grad.
    The flags are read every batch (the parameter list is kept), so unfreezing one parameter, or registering a new
    one that needs grad, makes the next batch's output differentiable."""
    enc = make_encoder().requires_grad_(False)
    autoragged.wrap(enc, db=False, policy="ragged")
    x, mask = batch(LENGTHS, 64, "cpu")

    def arm():
        y = enc(x, src_key_padding_mask=mask)
        d = autoragged.recent_decisions(enc, 1)[0]
        return d.arm, y.requires_grad

    assert arm() == ("ragged", False)
    enc.layers[1].linear2.bias.requires_grad_(True)  # a flag flipped in place: no re-registration
    assert arm() == ("ragged", True)
    enc.layers[1].linear2.bias.requires_grad_(False)
    assert arm() == ("ragged", False)
    enc.layers[0].norm1.weight = nn.Parameter(torch.ones(64))  # re-registered, needs grad
    assert arm() == ("ragged", True)


CHANGES = ["replace", "delete", "insert", "append", "reassign", "norm", "sublayer", "none"]


@pytest.mark.parametrize("change", CHANGES)
def test_a_structure_change_after_wrap_is_what_the_ragged_arm_runs(change):
    """Layers replaced, removed, inserted or appended, the layer list or the norm reassigned, a sublayer swapped
    after wrap(): the next batch's ragged arm runs the module as it is now (it is bound anew, keeping its
    decision history), as PyTorch's own forward does. A module made elsewhere changes nothing."""
    torch.manual_seed(0)
    enc = make_encoder(layers=3, final_norm=True)
    autoragged.wrap(enc, db=False, policy="ragged")
    x, mask = batch(LENGTHS, 64, "cpu")
    runtime = enc._autoragged
    with torch.no_grad():
        enc(x, src_key_padding_mask=mask)
        new = make_encoder(layers=1).layers[0]  # other weights
        if change == "replace":
            enc.layers[1] = new
        elif change == "delete":
            del enc.layers[1]
        elif change == "insert":
            enc.layers.insert(1, new)
        elif change == "append":
            enc.layers.append(new)
        elif change == "reassign":
            enc.layers = nn.ModuleList([enc.layers[2], enc.layers[0]])
        elif change == "norm":
            enc.norm = None
        elif change == "sublayer":
            enc.layers[0].linear2 = nn.Linear(96, 64)
        enc.num_layers = len(enc.layers)
        y = enc(x, src_key_padding_mask=mask)
        want = nn.TransformerEncoder.forward(enc, x, src_key_padding_mask=mask)
        want64 = nn.TransformerEncoder.forward(copy.deepcopy(enc).double(), x.double(), src_key_padding_mask=mask)
    assert (enc._autoragged is runtime) == (change == "none")
    decisions = autoragged.recent_decisions(enc, 10)
    assert [d.arm for d in decisions] == ["ragged", "ragged"]  # the history kept, the new structure run ragged
    assert_within_torch_error(real_tokens(y, LENGTHS), real_tokens(want, LENGTHS), real_tokens(want64, LENGTHS), change)


@pytest.mark.parametrize("policy", ["ragged", "auto"])
def test_a_cast_after_wrap_binds_the_module_anew(policy):
    """Casting a wrapped module (`.double()`, `.to(dtype)`: the same parameter objects, a new dtype) binds it anew
    at its next batch, as a structure change does: in float64, which no kernel takes, it runs padded with the
    dtype as its reason, under policy="ragged" too (whose ragged arm raised a TypeError before); its signature
    names the new dtype; cast back, the ragged arm may run again. Every output is PyTorch's own."""
    torch.manual_seed(0)
    enc = make_encoder()
    autoragged.wrap(enc, db=False, policy=policy)
    x, mask = batch(LENGTHS, 64, "cpu")
    runtime = enc._autoragged
    assert runtime.sig_key.endswith("float32")
    for dtype in (torch.float64, torch.float32):
        enc.to(dtype)
        with torch.no_grad():
            y = enc(x.to(dtype), src_key_padding_mask=mask)
            want = nn.TransformerEncoder.forward(enc, x.to(dtype), src_key_padding_mask=mask)
            want64 = nn.TransformerEncoder.forward(copy.deepcopy(enc).double(), x.double(), src_key_padding_mask=mask)
        decision = autoragged.recent_decisions(enc, 1)[0]
        assert enc._autoragged is not runtime and enc._autoragged.sig_key.endswith(str(dtype)[6:])
        dtype_reason = "parameters of dtype torch.float64 (supported: float16, bfloat16, float32)"
        if dtype == torch.float64:
            assert decision.arm == "padded" and decision.reason.endswith(dtype_reason), decision.reason
        else:
            assert "dtype" not in decision.reason, decision.reason
            assert decision.arm == "ragged" or policy == "auto"  # (auto: the prior's pick on a CPU)
        assert_within_torch_error(real_tokens(y, LENGTHS), real_tokens(want, LENGTHS), real_tokens(want64, LENGTHS),
                                  str(dtype))  # fmt: skip
        runtime = enc._autoragged
    assert len(autoragged.recent_decisions(enc, 10)) == 2  # the history kept


# -- bad input: a clear error or a correct result, never a silently wrong one ---------------------------
@pytest.mark.parametrize("policy", ["padded", "ragged", "auto"])
def test_lengths_with_a_left_padded_mask_are_an_error(policy):
    enc = autoragged.wrap(make_encoder(), db=False, policy=policy)
    x, _ = batch([6, 4, 4], 64, "cpu")
    L = x.shape[1]
    left = torch.arange(L)[None, :] < (L - torch.tensor([6, 4, 4]))[:, None]  # real tokens at the end
    with torch.no_grad(), pytest.raises(ValueError, match="row 0 is not right-padded"):
        enc(x, src_key_padding_mask=left, lengths=[6, 4, 4])
    with torch.no_grad():  # the mask alone: any padding is fine (the padded arm, with the reason)
        y = enc(x, src_key_padding_mask=left)
        want = nn.TransformerEncoder.forward(enc, x, src_key_padding_mask=left)
    torch.testing.assert_close(y[~left], want[~left], rtol=1e-4, atol=1e-5)


def test_a_ragged_input_without_a_feature_dimension_is_an_error():
    enc = autoragged.wrap(make_encoder(), db=False, policy="ragged")
    for bad in (RaggedTensor.from_list([torch.randn(5), torch.randn(3)]),
                autoragged.strip_padding(torch.randn(2, 6), torch.ones(2, 6, dtype=torch.bool))):  # fmt: skip
        with torch.no_grad(), pytest.raises(ValueError, match=r"must have values \(T, 64\)"):
            enc(bad)


def test_lengths_with_an_unbatched_input_are_an_error():
    enc = autoragged.wrap(make_encoder(), db=False, policy="ragged")
    with torch.no_grad(), pytest.raises(ValueError, match=r"lengths= needs a batched \(B, L, D\) input"):
        enc(torch.randn(7, 64), lengths=[5])
    x = torch.randn(7, 64)
    with torch.no_grad():  # without lengths, PyTorch's own unbatched forward runs, recorded as such
        torch.testing.assert_close(enc(x), nn.TransformerEncoder.forward(enc, x))
    assert "not a batched" in autoragged.recent_decisions(enc, 1)[0].reason


@pytest.mark.parametrize("policy", ["padded", "ragged", "auto"])
def test_a_batch_of_only_empty_sequences_is_a_clear_error_on_every_arm(policy):
    enc = autoragged.wrap(make_encoder(), db=False, policy=policy)
    x = torch.randn(3, 8, 64)
    with torch.no_grad():
        with pytest.raises(ValueError, match="every sequence of this batch of 3 is empty"):
            enc(x, src_key_padding_mask=torch.ones(3, 8, dtype=torch.bool))
        with pytest.raises(ValueError, match="every sequence of this batch of 3 is empty"):
            enc(x, lengths=[0, 0, 0])


def test_subclasses_and_float_hf_masks_are_warned_about(caplog):
    class MyEncoder(nn.TransformerEncoder):
        pass

    layer = nn.TransformerEncoderLayer(64, 2, 96, batch_first=True)
    model = nn.Sequential(MyEncoder(layer, 2, enable_nested_tensor=False)).eval()
    with caplog.at_level("WARNING", logger="autoragged"):
        autoragged.wrap(model, db=False)
    assert "MyEncoder, a subclass of nn.TransformerEncoder" in caplog.text
    enc = autoragged.wrap(make_encoder(), db=False)
    x, mask = batch([6, 4], 64, "cpu")
    hf_style = (~mask).float()  # 1.0 = keep: PyTorch adds it to the scores, it pads nothing
    caplog.clear()
    with caplog.at_level("WARNING", logger="autoragged"), torch.no_grad():
        enc(x, src_key_padding_mask=hf_style)
        enc(x, src_key_padding_mask=hf_style)
    assert caplog.text.count("values other than 0 and -inf") == 1


@pytest.mark.parametrize("policy", ["padded", "ragged", "auto"])
def test_an_empty_batch_does_what_the_original_does(policy):
    """B = 0 (no sequences at all) goes to the original module, whatever it does with it, under every policy."""
    enc = autoragged.wrap(make_encoder(), db=False, policy=policy)
    x = torch.randn(0, 8, 64)
    with torch.no_grad():
        y = enc(x, src_key_padding_mask=torch.zeros(0, 8, dtype=torch.bool))
        want = nn.TransformerEncoder.forward(enc, x, src_key_padding_mask=torch.zeros(0, 8, dtype=torch.bool))
    assert y.shape == want.shape == (0, 8, 64)
    assert "an empty batch" in autoragged.recent_decisions(enc, 1)[0].reason


def test_the_wrap_warning_names_the_users_class_not_ours(caplog):
    """A module that always runs padded is named in one WARNING, under the class the user passed in (the
    encoder's own class is swapped for a dispatching one when it is wrapped)."""
    enc = make_encoder(activation=lambda x: x * 2)  # an activation the ragged arm cannot run
    with caplog.at_level("WARNING", logger="autoragged"):
        autoragged.wrap(enc, db=False)
    assert "autoragged.wrap(TransformerEncoder)" in caplog.text, caplog.text
    assert "Dispatching" not in caplog.text
