"""autoragged.wrap(): equivalence of original, padded arm and ragged arm for every module option;
routing of unsupported cases with their reasons; unwrap; the decision record."""

import copy
import itertools

import pytest
import torch
from _fakes import Prefers
from _tolerance import assert_within_torch_error
from torch import nn

import autoragged
import autoragged.runtime.core as dispatch
from autoragged import RaggedTensor
from autoragged.runtime import unread as _unread


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
        (lambda e: e.train(), None, "training mode with dropout"),
    ],
)
def test_unsupported_batches_go_padded_with_their_reason(setup, call, words):
    enc = make_encoder(dropout=0.1)
    x, mask = batch(LENGTHS, 64, "cpu")
    if setup is not None:
        setup(enc)
    with torch.no_grad():
        ref = enc(x, src_key_padding_mask=mask) if words != "training mode with dropout" else None
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


def test_autograd_goes_padded_and_gradients_flow():
    enc = make_encoder().train()
    for m in enc.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    autoragged.wrap(enc, db=False, policy="ragged")
    x, mask = batch(LENGTHS, 64, "cpu")
    y = enc(x, src_key_padding_mask=mask)
    y[~mask].sum().backward()
    d = autoragged.recent_decisions(enc, 1)[0]
    assert d.arm == "padded" and "autograd" in d.reason
    assert enc.layers[0].linear1.weight.grad is not None


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
    assert list(enc._autoragged.mask_tops) == [2] and twin._autoragged.mask_tops == {}  # (a copy starts anew)
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
    assert autoragged.flush() >= 3
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


def _with_model(enc, model):
    from autoragged._planner import Planner

    rt = enc._autoragged
    rt.planners[torch.device("cpu")] = Planner(rt.sig, model)


def test_an_arm_chosen_on_other_arms_timings_is_timed_until_it_has_its_own():
    """Every 32nd batch is timed, except that an arm the planner chose for a bucket where other arms are timed
    and it is not (its prediction scaled by theirs) is timed on each of its batches until it has min_samples
    timings (`Planner.unproven`); then the rate is back to every 32nd."""
    from autoragged.tuning_db import BatchStats

    from autoragged._costmodel import PADDED
    from autoragged._planner import bucket_key

    enc = autoragged.wrap(make_encoder(), db=False, policy="auto", sample_every=32, explore=False)
    _with_model(enc, Prefers(padded=False))
    rt, cpu = enc._autoragged, torch.device("cpu")
    x, _ = batch(LENGTHS, 64, "cpu")
    stats = BatchStats.from_lengths(tuple(LENGTHS), padded_len=x.shape[1])
    planner = rt.planners[cpu]
    for _ in range(3):
        planner.observe(stats, PADDED, 2.0)
    chosen = planner.plan(stats).arm
    assert chosen.kind == "ragged" and planner.unproven(stats, chosen)
    with torch.no_grad():
        for _ in range(planner.min_samples):
            enc(x, lengths=LENGTHS)
    assert len(planner._measured[bucket_key(stats)][chosen.label]) == planner.min_samples
    assert not planner.unproven(stats, chosen)
    with torch.no_grad():
        for _ in range(5):  # (calls 4-8: none is a 32nd)
            enc(x, lengths=LENGTHS)
    assert len(planner._measured[bucket_key(stats)][chosen.label]) == planner.min_samples


@pytest.mark.parametrize("mask_reads", ["one_behind", "recheck"])
@pytest.mark.parametrize("padded_wins", [True, False])
def test_mask_only_batches_of_a_padded_shape_skip_reading_lengths(monkeypatch, padded_wins, mask_reads):
    enc = make_encoder()
    x, mask = batch(LENGTHS, 64, "cpu")
    with torch.no_grad():
        ref = enc(x, src_key_padding_mask=mask)
    autoragged.wrap(enc, db=False, policy="auto", sample_every=0)
    enc._autoragged.mask_reads = mask_reads
    _with_model(enc, Prefers(padded=padded_wins))
    reads = []
    real = dispatch.mask_lengths
    monkeypatch.setattr(dispatch, "mask_lengths", lambda *a, **k: reads.append(1) or real(*a, **k))
    n = enc._autoragged.trust + 2 * dispatch._RECHECK
    with torch.no_grad():
        outs = [enc(x, src_key_padding_mask=mask) for _ in range(n)]
    for y in outs:
        torch.testing.assert_close(real_tokens(y, LENGTHS), real_tokens(ref, LENGTHS), rtol=1e-4, atol=1e-4)
        assert (pads(y, LENGTHS) == 0).all()
    decisions = autoragged.recent_decisions(enc, n)
    if padded_wins and mask_reads == "recheck":  # read until trusted, then once every _RECHECK batches of the shape
        assert len(reads) == dispatch._TRUST_RECHECK + 2
    elif padded_wins:  # read until trusted; then judged one batch behind from the unread batches' stats, no read
        assert len(reads) == dispatch._TRUST
        unread = [d for d in decisions if "not read" in d.reason]
        assert len(unread) == n - len(reads) and all(d.arm == "padded" for d in unread)
        assert all(d.predicted_ms for d in unread)  # the shape's last judged predictions: not a fallback
    else:
        assert len(reads) == n and not any("not read" in d.reason for d in decisions)
    # stats of every record are the batch's, whether its lengths were read on the hot path or later
    assert all(d.stats.total == sum(LENGTHS) and d.stats.max_len == max(LENGTHS) for d in decisions)


def test_an_unread_batch_with_left_padding_is_still_right():
    """Only right-padded batches make a shape trusted, but a trusted shape may then see any mask: the
    padded arm takes every mask as it is."""
    enc = make_encoder()
    x, mask = batch(LENGTHS, 64, "cpu")
    autoragged.wrap(enc, db=False, policy="auto", sample_every=0)
    _with_model(enc, Prefers(padded=True))
    with torch.no_grad():
        for _ in range(dispatch._TRUST):
            enc(x, src_key_padding_mask=mask)
        left = mask.flip(1)
        got = enc(x, src_key_padding_mask=left)
        assert "not read" in autoragged.recent_decisions(enc, 1)[0].reason
        autoragged.unwrap(enc)
        want = enc(x, src_key_padding_mask=left).masked_fill(left[..., None], 0.0)
    keep = ~left
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-4, atol=1e-4)
    assert (got[left] == 0).all()


def test_the_first_read_on_a_gpu_counts_for_nothing():
    """Its one-time costs (kernels' first launches, compiles queued before it) are not the read's: until a
    read's event pair is timed, a read on a GPU costs the prior, and the first read never marks the host
    as running ahead."""
    rt = autoragged.wrap(make_encoder(), db=False, policy="auto")._autoragged
    rt.read_events = ["start", "end", "cuda", False]  # as `_read_begin` left it for a read on a GPU
    rt._read_timed(21.0, True, rt.read_events)  # the module's first read
    assert not rt.sync_samples and rt.sync_ms == _unread._READ_PRIOR_MS and not rt.pipelined
    assert rt.read_events[3] is False  # its pair is not taken as a sample either
    cpu = autoragged.wrap(make_encoder(), db=False, policy="auto")._autoragged
    cpu._read_timed(0.3, False, None)
    assert cpu.sync_ms == 0.3  # on a CPU nothing is queued: the read's host time is its own


def test_a_shape_is_judged_with_the_mask_read_counted_against_the_ragged_arms():
    enc = autoragged.wrap(make_encoder(), db=False, policy="auto")
    rt = enc._autoragged
    rt.sync_samples.extend([0.1, 40.0])  # a read that waited for queued work does not count
    rt._judge_shape(8, 40, {"padded": 1.0, "padded_graph": 0.7, "ragged:a": 0.65})  # 0.7 <= 0.65 + 0.1
    rt._judge_shape(8, 40, {"padded": 1.0, "padded_graph": 0.7, "ragged:a": 0.65})
    key = rt._shape_key(8, 40)
    assert key == (8, 48) == rt._shape_key(8, 33) == rt._shape_key(8, 45) != rt._shape_key(8, 46)  # L's bucket
    streak, arm, _, predicted, _, _, _, _, capacity, bucket = rt.mask_shapes[key]
    assert streak == 2 and arm.kind == "padded_graph" and predicted["ragged:a"] == 0.65
    assert capacity == 8 * 48 and bucket == (8, 48)  # the rows of its mask graph: B x mask width; (B, mask width)
    rt._judge_shape(8, 40, {"padded": 1.0, "padded_graph": 0.9, "ragged:a": 0.65})  # ragged wins by more
    assert rt.mask_shapes[key][0] == 0
    rt._judge_shape(8, 45, {"padded": 0.5, "padded_graph": 0.9, "ragged:a": 0.65})
    assert rt.mask_shapes[key][:2] == [1, autoragged._costmodel.PADDED]


def test_a_shape_may_be_judged_for_the_ragged_graph_fed_the_mask():
    """Where graphs run, the ragged graph with Triton linears, fed the mask (no lengths needed; it does
    the same work either way, so the batch's own prediction for it holds), competes with the padded arms
    for the unread path; the read's cost counts against the arms that need lengths."""
    from autoragged._costmodel import Arm
    from autoragged._planner import graph_config

    enc = autoragged.wrap(make_encoder(), db=False, policy="auto")
    rt = enc._autoragged
    rt.sync_samples.extend([0.1, 40.0])  # a read that waited for queued work does not count
    mask_arm = Arm("ragged_graph", graph_config(16, 40, "triton"))
    cublas = Arm("ragged_graph", graph_config(16, 40, "cublas"))
    predicted = {"padded": 1.0, "padded_graph": 0.9, cublas.label: 0.4, mask_arm.label: 0.45}
    rt._judge_shape(8, 40, predicted, mask_arm, 123)  # 0.45 <= 0.4 + 0.1: worth not reading
    streak, chosen, _, recorded, tokens, _, _, _, _, _ = rt.mask_shapes[rt._shape_key(8, 40)]
    assert streak == 1 and chosen == mask_arm and recorded == predicted
    assert tokens == 123  # the mask graph's linears pick their tiles for the judged batch's tokens
    rt._judge_shape(8, 40, {**predicted, mask_arm.label: 0.6}, mask_arm)  # the read is cheaper
    assert rt.mask_shapes[rt._shape_key(8, 40)][0] == 0
    rt._judge_shape(8, 40, {**predicted, "padded_graph": 0.3}, mask_arm)  # the padded graph wins outright
    assert rt.mask_shapes[rt._shape_key(8, 40)][:2] == [1, autoragged._costmodel.PADDED_GRAPH]
    del predicted[mask_arm.label]  # no prediction for it (graphs off): the padded arms alone
    rt._judge_shape(9, 40, predicted, mask_arm)
    assert rt.mask_shapes[rt._shape_key(9, 40)][0] == 0


def test_a_mask_graph_with_cublas_rungs_is_judged_as_the_cublas_graph():
    """Where the mask graph holds cuBLAS branches on rungs of rows (runtime/capture.py, `_Rungs`; CUDA 12.4+),
    it does the cuBLAS graph's work without the read: the verdict weighs the lesser of its Triton prediction
    and the cuBLAS graph's, so a shape whose read path is the cuBLAS graph skips the read. Without rungs the
    Triton prediction alone, as before."""
    from autoragged._costmodel import Arm
    from autoragged._planner import graph_config

    enc = autoragged.wrap(make_encoder(), db=False, policy="auto")
    rt = enc._autoragged
    rt.sync_samples.append(0.05)
    mask_arm = Arm("ragged_graph", graph_config(16, 40, "triton"))
    cublas = Arm("ragged_graph", graph_config(16, 40, "cublas"))
    predicted = {"padded": 1.0, "padded_graph": 0.9, cublas.label: 0.4, mask_arm.label: 0.6}
    rt.mask_rungs = False
    assert rt._judge_shape(8, 40, predicted, mask_arm, 123)[0] == 0  # 0.6 > 0.4 + 0.05: read
    rt.mask_rungs = True
    assert rt._mask_graph_ms(predicted, mask_arm) == 0.4
    assert rt._judge_shape(8, 40, predicted, mask_arm, 123)[:2] == [1, mask_arm]  # 0.4 <= 0.45: not read
    assert rt._mask_graph_ms({**predicted, mask_arm.label: 0.3}, mask_arm) == 0.3  # the lesser
    assert rt._mask_graph_ms(predicted, mask_arm, 128 * 256) == 0.6  # a graph of more rows has no branches
    assert rt._mask_graph_ms(predicted, mask_arm, 128 * 128) == 0.4
    del predicted[cublas.label]
    assert rt._mask_graph_ms(predicted, mask_arm) == 0.6  # no cuBLAS graph predicted: its own


def test_a_close_verdict_from_the_prior_is_left_to_the_probes():
    """Where the prior predicts (no calibration) and probes run, a mask graph predicted to lose by less than
    _EXPLORE wins its verdicts, once the shape's reads have cost _EXPLORE_AFTER_MS (in a stream at its first close
    verdict there, and only then; never where the read costs less than _EXPLORE_SHARE of the batch), until the
    shape's probes
    timed it: then the timings decide, and a shape they found slower is not explored again. Further off, or
    with a calibrated model, the prediction decides. An explored shape runs unread once its read path was
    timed (the probes compare against it)."""
    from autoragged._costmodel import Arm
    from autoragged._planner import graph_config
    from autoragged.runtime import unread

    enc = autoragged.wrap(make_encoder(), db=False, policy="auto")
    rt = enc._autoragged
    rt.sync_samples.append(0.1)
    mask_arm = Arm("ragged_graph", graph_config(16, 40, "triton"))
    cublas = Arm("ragged_graph", graph_config(16, 40, "cublas"))
    close = {"padded": 2.0, cublas.label: 0.4, mask_arm.label: 0.5 * unread._EXPLORE}  # read path: 0.4 + 0.1
    far = {**close, mask_arm.label: 0.5 * unread._EXPLORE + 0.01}
    reads = round(unread._EXPLORE_AFTER_MS / 0.1)
    for _ in range(reads - 1):  # the reads have not cost enough yet
        assert rt._judge_shape(8, 40, close, mask_arm, explore=True)[0] == 0
    assert rt._judge_shape(8, 40, close, mask_arm)[0] == 0  # not exploring: the prediction decides
    assert rt._judge_shape(8, 40, far, mask_arm, explore=True)[0] == 0
    entry = rt._judge_shape(8, 40, close, mask_arm, explore=True)
    assert entry[:2] == [rt.trust, mask_arm] and entry[5]["explored"]  # trusted at once, for the probes

    class _CudaMask:
        is_cuda = True

    assert not rt._read_known(entry, _CudaMask())  # its read path is not timed yet
    entry[5]["unread"].append(0.55)  # one timing is not a verdict yet
    assert rt._judge_shape(8, 40, close, mask_arm, explore=True)[0] == rt.trust + 1
    entry[5]["unread"].append(0.6)
    assert rt._judge_shape(8, 40, close, mask_arm, explore=True)[0] == 0  # timed: no more exploring
    rt._probe_result(entry[5], 8, 40, "read", 0.4)  # 0.55 > 0.4 + 0.1: lost
    assert entry[5]["lost"] and rt._judge_shape(8, 40, close, mask_arm, explore=True)[0] == 0
    # in a stream (the host ahead of the GPU) a close shape explores at once; where the read costs less than
    # _EXPLORE_SHARE of the batch, never (what exploring can win is the read)
    rt.pipelined = True
    assert rt.read_cost_ms == 0.1
    assert rt._judge_shape(4, 40, close, mask_arm, explore=True)[:2] == [rt.trust, mask_arm]  # (not lost: B=4)
    # weighed once, yet on trial until timed: its next close verdicts keep it trusted (a stream's explored shape
    # fell back at its next verdict before, and never ran the mask graph to be timed)
    assert rt._judge_shape(4, 40, close, mask_arm, explore=True)[:2] == [rt.trust + 1, mask_arm]
    trial = rt.mask_shapes[rt._shape_key(4, 40)][5]
    trial["unread"] += [0.45, 0.5]
    rt._probe_result(trial, 4, 40, "read", 0.4)  # 0.45 <= 0.4 + 0.1: confirmed, kept whatever predicted
    assert trial["confirmed"] and rt._judge_shape(4, 40, far, mask_arm, explore=True)[0] == rt.trust + 2
    long = {"padded": 9.0, cublas.label: 3.0, mask_arm.label: 3.3}  # close, but 0.1 is 3% of 3.0: not explored
    for _ in range(reads + 1):
        assert rt._judge_shape(2, 40, long, mask_arm, explore=True)[0] == 0
    rt.pipelined = False
    assert rt.mask_shapes[rt._shape_key(2, 40)][5]["paid"] >= unread._EXPLORE_AFTER_MS
    assert rt._judge_shape(2, 40, long, mask_arm, explore=True)[0] == 0
    # a stream weighs a close shape once, at its first close verdict there: a read cost that rises past the share
    # later (a slow host, a long wait) explores neither then nor, with calls synchronised, once the rent is paid
    rt.pipelined = True
    assert rt._judge_shape(1, 40, long, mask_arm, explore=True)[0] == 0
    rt.sync_samples.clear()
    rt.sync_samples.append(0.25)  # now 8% of the batch (and 3.0 + 0.25 still under the mask graph's 3.3)
    assert rt.read_cost_ms == 0.25
    assert rt._judge_shape(1, 40, long, mask_arm, explore=True)[0] == 0
    rt.pipelined = False
    for _ in range(round(unread._EXPLORE_AFTER_MS / 0.25) + 1):
        assert rt._judge_shape(1, 40, long, mask_arm, explore=True)[0] == 0
    assert not rt.mask_shapes[rt._shape_key(1, 40)][5]["explored"]
    rt.pipelined = True
    assert rt._judge_shape(3, 40, long, mask_arm, explore=True)[:2] == [rt.trust, mask_arm]  # weighed anew
    cpu = torch.device("cpu")
    rt._plan(cpu, autoragged.tuning_db.BatchStats.from_lengths((40, 20)), None)
    assert rt.planners[cpu].model.name == "prior" and not rt._explores(cpu)  # no probes on a CPU


def test_a_mask_graph_timed_slower_on_one_shape_loses_its_buckets_other_shapes():
    """The probes that find a shape's mask graph slower than its read path (plus the read) take the mask graph
    from every shape of its (B, mask width) bucket (the same graph, batches of like sizes), present and to come;
    the shapes of other buckets keep their verdicts."""
    from autoragged._buckets import mask_width
    from autoragged._costmodel import Arm
    from autoragged._planner import graph_config

    rt = autoragged.wrap(make_encoder(), db=False, policy="auto")._autoragged
    rt.sync_samples.append(0.1)
    mask_arm = Arm("ragged_graph", graph_config(16, 170, "triton"))
    cublas = Arm("ragged_graph", graph_config(16, 170, "cublas"))
    wins = {"padded": 2.0, cublas.label: 0.4, mask_arm.label: 0.3}  # the read path: 0.4 + a 0.1 read
    assert mask_width(140) == mask_width(160) == mask_width(180) == 192 and mask_width(100) == 128
    assert len({rt._shape_key(8, L) for L in (140, 160, 180)}) == 3  # three shapes of one bucket
    first, sibling, other = (rt._judge_shape(8, L, wins, mask_arm) for L in (140, 160, 100))
    assert [e[:2] for e in (first, sibling, other)] == [[1, mask_arm]] * 3
    first[5]["unread"] += [0.6, 0.55]
    rt._probe_result(first[5], 8, 140, "read", 0.4)  # 0.55 > 0.4 + 0.1
    assert first[5]["lost"] and rt.mask_lost == {(8, 192)} and not sibling[5]["lost"]
    assert rt._judge_shape(8, 160, wins, mask_arm)[0] == 0  # its sibling reads from its next verdict on
    assert rt._judge_shape(8, 180, wins, mask_arm)[0] == 0  # and so does a shape of the bucket seen later
    assert rt._judge_shape(8, 100, wins, mask_arm)[:2] == [2, mask_arm]  # another bucket: as it was
    close = {**wins, mask_arm.label: 0.55}  # would be explored (within 1.35x of 0.5) once the reads paid 30 ms
    late = rt._judge_shape(8, 170, close, mask_arm, explore=True)
    late[5]["paid"] = 100.0
    assert rt._judge_shape(8, 170, close, mask_arm, explore=True)[0] == 0  # lost: not explored either
    assert not late[5]["explored"]
    old = autoragged.wrap(make_encoder(), db=False, policy="auto", mask_reads="recheck")._autoragged
    old.sync_samples.append(0.1)
    first, sibling = (old._judge_shape(8, L, wins, mask_arm) for L in (140, 160))
    first[5]["unread"] += [0.6, 0.55]
    old._probe_result(first[5], 8, 140, "read", 0.4)
    assert first[5]["lost"] and not old.mask_lost and old._judge_shape(8, 160, wins, mask_arm)[0] == 2  # (each alone)


def test_a_mask_graph_timed_faster_on_one_shape_wins_its_buckets_other_shapes_at_their_next_verdict():
    """Where a trusted shape's probes timed the mask graph faster than its read path plus the read, the other
    shapes of its bucket, and of buckets up to 2x narrower (its graph serves their batches), take the mask graph
    at their next verdict, trusted at once and whatever their predictions, as the timed shape does; further off
    they go by their own verdicts, and once a shape of the bucket is timed slower, so do its shapes again."""
    from autoragged._buckets import mask_width
    from autoragged._costmodel import Arm
    from autoragged._planner import graph_config

    rt = autoragged.wrap(make_encoder(), db=False, policy="auto")._autoragged
    rt.sync_samples.append(0.1)
    mask_arm = Arm("ragged_graph", graph_config(16, 170, "triton"))
    cublas = Arm("ragged_graph", graph_config(16, 170, "cublas"))
    wins = {"padded": 2.0, cublas.label: 0.4, mask_arm.label: 0.3}
    lose = {**wins, mask_arm.label: 0.6}  # predicted slower than the read path plus the read
    assert (mask_width(140), mask_width(160), mask_width(100), mask_width(60)) == (192, 192, 128, 64)
    rt._judge_shape(8, 140, wins, mask_arm)
    first = rt._judge_shape(8, 140, wins, mask_arm)
    assert first[0] == rt.trust and rt._judge_shape(8, 160, lose, mask_arm)[0] == 0  # trusted, not timed yet
    first[5]["unread"] += [0.3, 0.32]
    rt._probe_result(first[5], 8, 140, "read", 0.4)  # 0.3 <= 0.4 + 0.1
    assert first[5]["confirmed"] and rt.mask_won == {(8, 192)}
    assert rt._judge_shape(8, 160, lose, mask_arm)[:2] == [rt.trust, mask_arm]  # its sibling, whatever predicted
    assert rt._judge_shape(8, 180, wins, mask_arm)[0] == rt.trust  # a new shape of the bucket: trusted at once
    assert rt._judge_shape(8, 100, lose, mask_arm)[0] == rt.trust  # width 128: the 192 graph serves it
    assert rt._judge_shape(8, 60, wins, mask_arm)[0] == 1  # width 64: past 2x, its own verdicts
    assert rt._judge_shape(4, 140, lose, mask_arm)[0] == 0  # another batch size
    sibling = rt.mask_shapes[rt._shape_key(8, 160)]
    sibling[5]["unread"] += [0.7, 0.8]
    rt._probe_result(sibling[5], 8, 160, "read", 0.4)  # 0.7 > 0.4 + 0.1: the bucket lost
    assert (8, 192) in rt.mask_lost and rt._judge_shape(8, 180, lose, mask_arm)[0] == 0
    assert rt._judge_shape(8, 140, lose, mask_arm)[0] == rt.trust + 1  # the timed shape keeps its own timing


def test_a_new_shape_served_by_a_trusted_shapes_kept_mask_graph_starts_on_its_verdict():
    """A mask shape's first batch in a stream (the host ahead), where a trusted shape of its batch size keeps a mask
    graph that serves this batch's width (up to 2x wider) and was not timed slower nor is on trial, enters trusted
    on that verdict (`_adopt`): it runs unread, no read. Without such a graph, another batch size, a lost bucket, a shape on
    trial or a graph gone from the cache: no adoption, the shape is judged as before."""
    import weakref

    from autoragged._costmodel import Arm
    from autoragged._planner import graph_config
    from autoragged.runtime import graphs as _graphs

    rt = autoragged.wrap(make_encoder(), db=False, policy="auto")._autoragged
    rt.sync_samples.append(0.1)
    rt.graphs = _graphs.GraphCache()
    rt.pipelined = True  # a stream: the host ahead of the GPU
    mask_arm = Arm("ragged_graph", graph_config(32, 40, "triton"))
    wins = {"padded": 2.0, "ragged_graph:x": 0.4, mask_arm.label: 0.3}
    for _ in range(rt.trust):
        trusted = rt._judge_shape(8, 30, wins, mask_arm, 200)

    class _Graph:
        width = 48

    graph = _Graph()
    trusted[6] = (weakref.ref(graph), rt.graphs.generation, "why", None)
    key = rt._shape_key(8, 33)
    assert key != rt._shape_key(8, 30) and key not in rt.mask_shapes
    rt.pipelined = False
    assert rt._adopt(8, 33) is None  # calls synchronised: a read costs only itself, the shape is judged alone
    rt.pipelined = True
    new = rt._adopt(8, 33)  # width 48: the kept graph serves it
    assert new is rt.mask_shapes.pop(key) and new[:5] == [rt.trust, mask_arm, 0, wins, 200]
    assert new[9] == (8, 48) and new[6] is None and new[5]["left"] == 3  # its own graph reference and probes
    assert rt._adopt(8, 16) is None  # width 16: past 2x
    assert rt._adopt(4, 33) is None  # another batch size
    rt.mask_lost.add((8, 32))
    assert rt._adopt(8, 33) is None  # the trusted shape's bucket was timed slower
    rt.mask_lost.clear()
    trusted[5]["explored"] = True
    assert rt._adopt(8, 33) is None  # on trial: explored, not confirmed yet
    trusted[5]["confirmed"] = True
    assert rt._adopt(8, 33) is not None
    rt.mask_shapes.pop(key)
    del graph
    assert rt._adopt(8, 33) is None and key not in rt.mask_shapes  # the graph left the cache
    graph = _Graph()
    trusted[6] = (weakref.ref(graph), rt.graphs.generation - 1, "why", None)
    assert rt._adopt(8, 33) is None  # a graph of an older generation (the parameters moved since)
    old = autoragged.wrap(make_encoder(), db=False, policy="auto", mask_reads="recheck")._autoragged
    old.graphs = rt.graphs
    old.mask_shapes = rt.mask_shapes
    assert old._adopt(8, 33) is None  # the rule before: each (B, L) judged alone


def test_a_new_mask_graph_is_a_rung_wider_where_its_longest_batches_fill_its_width():
    """`widen_mask`: the next rung where the widest padded length seen fills the top quarter of the width and no
    cap holds it there (a quarter of the batches, and at least two, at it); never past 2x the batch's own width
    nor 16,384 rows."""
    from autoragged._buckets import mask_width, widen_mask

    assert (mask_width(32), mask_width(33), mask_width(128), mask_width(129)) == (32, 48, 128, 192)
    assert widen_mask(None, 32, 32, 32) == 32
    assert widen_mask([25, 1, 3], 32, 32, 32) == 48  # CoLA B=32: 25 of 32 at a shape's third batch
    assert widen_mask([23, 1, 3], 32, 32, 32) == 32  # under 3/4 of the width
    assert widen_mask([32, 2, 6], 32, 32, 32) == 32  # two of six batches at 32: a cap (max_length padding)
    assert widen_mask([32, 2, 24], 32, 32, 32) == 48  # two of 24: a tail
    assert widen_mask([128, 24, 24], 128, 128, 32) == 128  # every batch at 128: truncated there
    assert widen_mask([120, 1, 10], 128, 64, 32) == 128  # 192 is past 2x the batch's own 64
    assert widen_mask([127, 1, 10], 128, 96, 32) == 192
    assert widen_mask([127, 1, 10], 128, 96, 128) == 128  # 128 x 192 rows: past 16,384
    assert widen_mask([200, 1, 10], 128, 128, 32) == 128  # (a longest batch past the width: not this graph's)


def test_the_mask_graph_stays_one_arm_for_a_shape_whose_batches_straddle_an_attention_tile():
    """The mask graph's attention tiles follow the batch's max_len (32 x 32 up to 32 tokens), and a mask
    shape's batches have different ones: a verdict for the mask graph with the other tiles is a verdict
    for the arm the shape already has (its graph and timings kept), not a new arm."""
    from autoragged._costmodel import Arm
    from autoragged._planner import graph_config

    enc = autoragged.wrap(make_encoder(), db=False, policy="auto")
    rt = enc._autoragged
    rt.sync_samples.append(0.1)
    short, longer = (Arm("ragged_graph", graph_config(16, n, "triton")) for n in (30, 34))
    assert short != longer and short.mask_only and longer.mask_only
    entry = rt._judge_shape(8, 34, {"padded": 1.0, short.label: 0.45}, short)
    entry[5]["unread"].append(0.4)
    entry[6] = "the kept graph"
    rt._judge_shape(8, 34, {"padded": 1.0, longer.label: 0.45}, longer)
    assert entry[:2] == [2, short] and entry[5]["unread"] == [0.4] and entry[6] == "the kept graph"


def test_a_plan_names_its_mask_arm_whatever_the_batch_that_finds_it_cached():
    """Plans are cached per bucket of (B, max_len, tokens): a batch of 34 tokens may get the plan of one of
    32, whose arms carry 32 x 32 attention tiles. The mask arm a verdict weighs is the plan's (its label has
    a prediction), not one rebuilt from the batch's max_len (whose label the plan does not have)."""
    from autoragged.tuning_db import BatchStats

    from autoragged._costmodel import AnalyticPrior, Arm
    from autoragged._device import device_key
    from autoragged._planner import Planner, graph_config

    enc = autoragged.wrap(make_encoder(), db=False, policy="auto")
    rt = enc._autoragged
    head_dim = rt.body.head_dim
    arms = lambda s: [Arm("ragged_graph", graph_config(head_dim, s.max_len, b)) for b in ("cublas", "triton")]  # noqa: E731
    planner = Planner(rt.sig, AnalyticPrior(device_key(torch.device("cpu"))), arms)
    first = planner.plan(BatchStats.from_lengths((32, 20, 10)))
    again = planner.plan(BatchStats.from_lengths((34, 20, 8)))  # the same bucket: the cached plan
    assert again is first and first.mask_arm.mask_only and first.mask_arm.label in first.predicted_ms
    assert Arm("ragged_graph", graph_config(head_dim, 34, "triton")).label not in first.predicted_ms


class _DoneEvents:
    """A (start, end) pair of finished CUDA events that measured `ms`, for _harvest."""

    def __init__(self, ms):
        self.ms = ms

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return self.ms


def test_a_trusted_shape_whose_unread_arm_measures_slower_is_read_again():
    """The verdicts are predictions; timed runs overrule them: once two unread runs of a shape took longer
    than its timed read path plus the read, the shape reads its lengths and is not trusted again; where
    they took less, it stays trusted whatever later predictions say."""
    enc = autoragged.wrap(make_encoder(), db=False, policy="auto")
    rt = enc._autoragged
    rt.sync_samples.append(0.1)
    for B, read_ms, unread in [(8, 1.0, [1.05, 1.2]), (9, 1.0, [1.2, 1.3])]:
        for _ in range(dispatch._TRUST):
            rt._judge_shape(B, 40, {"padded": 1.0, "padded_graph": 0.7, "ragged:a": 0.65})
        entry = rt.mask_shapes[rt._shape_key(B, 40)]
        probe = entry[5]
        assert entry[0] == dispatch._TRUST and probe["left"] == dispatch._PROBES
        # as run() and _run_unread queue them; _harvest hands each to _probe_result
        for kind, ms in [("read", read_ms)] + [("unread", ms) for ms in unread]:
            ev = _DoneEvents(ms)
            rt.pending.append((ev, ev, 0.0, None, torch.device("cpu"), False, (probe, B, 40, kind)))
        rt._harvest()
        assert not rt.pending
    kept = rt.mask_shapes[rt._shape_key(8, 40)]
    assert kept[0] == dispatch._TRUST and kept[5]["confirmed"]  # 1.05 <= 1.0 + 0.1: it stays trusted
    rt._judge_shape(8, 40, {"padded": 1.0, "padded_graph": 0.9, "ragged:a": 0.5})  # predicted to lose now
    assert kept[0] == dispatch._TRUST + 1  # the timings stand
    lost = rt.mask_shapes[rt._shape_key(9, 40)]
    assert lost[5]["lost"] and lost[0] == 0  # 1.2 > 1.0 + 0.1
    rt._judge_shape(9, 40, {"padded": 1.0, "padded_graph": 0.7, "ragged:a": 0.65})
    assert lost[0] == 0  # the prediction still says the unread arm wins: the measurement stands


def test_a_trusted_shape_runs_unread_only_once_its_read_path_was_timed():
    """Where probes run (a CUDA mask, sampling on), trust alone does not send a shape to a padded unread arm:
    without a timed read path the probes could never revoke a wrong verdict."""
    enc = autoragged.wrap(make_encoder(), db=False, policy="auto")
    rt = enc._autoragged
    rt.sync_samples.append(0.1)
    for _ in range(dispatch._TRUST):
        rt._judge_shape(8, 40, {"padded": 1.0, "padded_graph": 0.7, "ragged:a": 0.65})
    entry = rt.mask_shapes[rt._shape_key(8, 40)]

    class _CudaMask:
        is_cuda = True

    assert entry[0] == dispatch._TRUST and not rt._read_known(entry, _CudaMask())
    assert rt._read_known(entry, torch.zeros(8, 40, dtype=torch.bool))  # a CPU mask: no probes to wait for
    entry[5]["read"].append(1.0)
    assert rt._read_known(entry, _CudaMask())
    rt.sample_every = 0
    entry[5]["read"].clear()
    assert rt._read_known(entry, _CudaMask())  # sampling off: no timing will come
    rt.sample_every = 1
    entry[1] = autoragged._costmodel.Arm("ragged_graph", entry[1].config)
    assert rt._read_known(entry, _CudaMask())  # the ragged graph fed the mask: the read path's work, no read


def test_causal_mask_batches_always_read_their_lengths():
    """The unread arms run the key padding mask alone, so a causal batch never takes them."""
    enc = make_encoder()
    x, mask = batch(LENGTHS, 64, "cpu")
    causal = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
    autoragged.wrap(enc, db=False, policy="auto", sample_every=0)
    _with_model(enc, Prefers(padded=True))
    with torch.no_grad():
        for _ in range(dispatch._TRUST + 3):
            got = enc(x, mask=causal, src_key_padding_mask=mask, is_causal=True)
        assert not enc._autoragged.mask_shapes
        assert all("not read" not in d.reason for d in autoragged.recent_decisions(enc, 10))
        autoragged.unwrap(enc)
        want = enc(x, mask=causal, src_key_padding_mask=mask, is_causal=True)
    keep = ~mask
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-4, atol=1e-4)


def test_deferred_stats_wait_on_the_pinned_slot_not_on_a_cuda_call():
    """The recorder's thread resolves unread batches' stats by polling the slot (pre-filled with -1), never
    by an event sync: a CUDA call from another thread invalidates any graph capture in global mode."""
    import threading

    from autoragged._costmodel import PADDED
    from autoragged.runtime.records import Record

    class NoSync:
        def synchronize(self):
            raise AssertionError("a CUDA call while the copy could simply be waited for")

    host = torch.full((3,), -1, dtype=torch.int32)
    record = Record(None, PADDED, {}, "unread", None, "sig")
    record._pending = (host, NoSync(), 10, 10)
    lands = threading.Timer(0.05, lambda: host.copy_(torch.tensor([2, 0, 5], dtype=torch.int32)))
    lands.start()
    try:
        stats = record.stats
    finally:
        lands.join()
    assert (stats.batch, stats.total, stats.max_len) == (3, 8 + 10 + 5, 10)


def test_a_frozen_model_under_grad_mode_runs_ragged_until_a_parameter_needs_grad():
    """Grad mode on with no parameter that needs grad (a frozen encoder, no torch.no_grad): nothing to
    differentiate, so the ragged arm may run. The flags are read every batch (the parameter list is kept), so
    unfreezing one parameter, or registering a new one that needs grad, sends the next batch padded."""
    enc = make_encoder().requires_grad_(False)
    autoragged.wrap(enc, db=False, policy="ragged")
    x, mask = batch(LENGTHS, 64, "cpu")

    def arm():
        y = enc(x, src_key_padding_mask=mask)
        d = autoragged.recent_decisions(enc, 1)[0]
        return d.arm, y.requires_grad

    assert arm() == ("ragged", False)
    enc.layers[1].linear2.bias.requires_grad_(True)  # a flag flipped in place: no re-registration
    assert arm() == ("padded", True)
    enc.layers[1].linear2.bias.requires_grad_(False)
    assert arm() == ("ragged", False)
    enc.layers[0].norm1.weight = nn.Parameter(torch.ones(64))  # re-registered, needs grad
    assert arm() == ("padded", True)
    d = autoragged.recent_decisions(enc, 1)[0]
    assert "autograd" in d.reason


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
