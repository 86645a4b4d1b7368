"""The runtime's per-batch path (runtime/core.py) on a CPU: which arm runs, when a mask alone is read, what is
recorded and timed. A mask on the device is simulated (`core._on_device`): reading it is then what the runtime
avoids where it can. Cost models with known answers come from tests/_fakes.py."""

from __future__ import annotations

import pytest
import torch
from _fakes import Fixed
from test_wrap import LENGTHS, batch, make_encoder, pads, real_tokens

import autoragged
from autoragged.planning.planner import Planner
from autoragged.runtime import core
from autoragged.runtime.policy import MIN_SAMPLES, ShapeKey


def with_model(enc, model):
    rt = enc._autoragged
    rt.planners[torch.device("cpu")] = Planner(rt.sig, model)
    return rt


def test_a_mask_alone_is_read_once_then_only_where_the_running_arm_needs_lengths(device_masks):
    """A shape's first batch reads (nothing known of it yet); after that, with the padded arm cheapest, no batch
    reads, and each record still gets the batch's own stats (counted on the device, brought home later)."""
    enc = make_encoder()
    x, mask = batch(LENGTHS, 64, "cpu")
    with torch.no_grad():
        want = enc(x, src_key_padding_mask=mask)
    autoragged.wrap(enc, db=False, sample_every=0)
    with_model(enc, Fixed({"padded": 1.0, "ragged": 2.0}))
    with torch.no_grad():
        outs = [enc(x, src_key_padding_mask=mask) for _ in range(6)]
    assert len(device_masks) == 1
    for y in outs:
        torch.testing.assert_close(real_tokens(y, LENGTHS), real_tokens(want, LENGTHS), rtol=1e-4, atol=1e-4)
        assert (pads(y, LENGTHS) == 0).all()
    decisions = autoragged.recent_decisions(enc, 6)
    assert [d.arm for d in decisions] == ["padded"] * 6
    assert all(d.stats.total == sum(LENGTHS) and d.stats.max_len == max(LENGTHS) for d in decisions)


@pytest.mark.parametrize("why", ["policy", "reason"])
def test_a_batch_forced_padded_reads_its_mask_only_at_its_shapes_first_sight(device_masks, why):
    """policy="padded", or a reason the ragged arm cannot run (a static one here), needs no lengths: a read each
    batch would be a sync each (a wrap(policy="padded") BERT training step
    on MNLI B=32 took 34-37 ms against HF's own 29-31, H100). The records still get each batch's own stats."""
    enc = make_encoder()
    autoragged.wrap(enc, db=False, sample_every=0, policy="padded" if why == "policy" else "auto")
    if why == "reason":
        enc._autoragged.static_reason = "a reason the ragged arm cannot run"
    other = [33, 4, 4, 2, 8]  # the same padded length: the same shape
    with torch.no_grad():
        for lens in (LENGTHS, other, LENGTHS, other):
            x, mask = batch(lens, 64, "cpu")
            enc(x, src_key_padding_mask=mask)
    assert len(device_masks) == 1
    decisions = autoragged.recent_decisions(enc, 4)
    assert [d.arm for d in decisions] == ["padded"] * 4
    assert [d.stats.total for d in decisions] == [sum(LENGTHS), sum(other)] * 2


@pytest.mark.parametrize("given", ["attn_mask", "float mask"])
def test_batches_that_run_padded_unread_compute_what_the_module_does_on_the_call_as_given(device_masks, given):
    """A call the ragged arm cannot run (an attention mask beside the key padding mask; a float key padding mask,
    PyTorch's -inf = pad) runs padded, and after its shape's first batch its mask is not read: the padded arm must
    still get the call as given (it had dropped the attention mask, and zeroed pads with the float mask, which
    raised) and the records each batch's own stats."""
    enc = make_encoder()
    seqs = [[9, 3, 5], [9, 9, 1], [9, 2, 2]]  # one shape: B = 3, L = 12
    inputs = [batch(lens, 64, "cpu") for lens in seqs]
    L = inputs[0][0].shape[1]
    attn = torch.rand(L, L, generator=torch.Generator().manual_seed(0)) > 0.7
    attn.fill_diagonal_(False)
    attn[:, 0] = False  # every query sees a real key

    def call(module, x, mask):
        if given == "attn_mask":
            return module(x, mask=attn, src_key_padding_mask=mask)
        return module(x, src_key_padding_mask=torch.zeros(mask.shape).masked_fill(mask, float("-inf")))

    with torch.no_grad():
        wants = [call(enc, x, mask) for x, mask in inputs]
        autoragged.wrap(enc, db=False, sample_every=0)
        outs = [call(enc, x, mask) for x, mask in inputs]
    assert len(device_masks) == 1  # the shape's first batch only
    for y, want, lens in zip(outs, wants, seqs):
        torch.testing.assert_close(real_tokens(y, lens), real_tokens(want, lens), rtol=1e-4, atol=1e-4)
        assert (pads(y, lens) == 0).all()
    decisions = autoragged.recent_decisions(enc, 3)
    assert all(d.arm == "padded" for d in decisions)
    assert [d.stats.total for d in decisions] == [sum(lens) for lens in seqs]


def test_where_the_eager_arm_is_cheapest_every_batch_reads(device_masks):
    enc = autoragged.wrap(make_encoder(), db=False, sample_every=0)
    with_model(enc, Fixed({"padded": 3.0, "ragged": 1.0}))
    x, mask = batch(LENGTHS, 64, "cpu")
    with torch.no_grad():
        for _ in range(4):
            enc(x, src_key_padding_mask=mask)
    assert len(device_masks) == 4
    assert [d.arm for d in autoragged.recent_decisions(enc, 4)] == ["ragged"] * 4


def test_timings_overrule_the_prediction_and_a_read_counts_against_the_arm_that_needs_it(device_masks, monkeypatch):
    """Predicted, the eager arm wins; timed, its batches (read included) take longer than the padded arm's, which
    it tries (predicted within TRY_WITHIN), and the shape goes padded: from then on it reads no more."""
    enc = autoragged.wrap(make_encoder(), db=False, sample_every=32)
    rt = with_model(enc, Fixed({"padded": 1.2, "ragged": 1.0}))
    x, mask = batch(LENGTHS, 64, "cpu")
    times = {"padded": 1.0, "ragged": 5.0}

    def timed(self, timer, t0, record, kind, shape, backward):
        record.measured_ms = times[kind]
        core.policy.observe(shape, kind, times[kind], record.predicted_ms[kind])
        self.ring.append(record)

    monkeypatch.setattr(core.Runtime, "_time", timed)
    with torch.no_grad():
        arms = [(enc(x, src_key_padding_mask=mask), autoragged.recent_decisions(enc, 1)[0].arm)[1] for _ in range(9)]
    assert arms == ["ragged"] * MIN_SAMPLES + ["padded"] * (9 - MIN_SAMPLES)
    state = rt.shapes[ShapeKey(len(LENGTHS), core.mask_width(x.shape[1]), True)]
    # timed / predicted: 5 ms over a 1 ms prediction
    assert list(state.timed["ragged"]) == [5.0] * MIN_SAMPLES and len(state.timed["padded"]) >= MIN_SAMPLES
    reads = len(device_masks)
    with torch.no_grad():
        enc(x, src_key_padding_mask=mask)
    assert len(device_masks) == reads


def test_an_unread_batch_with_left_padding_is_still_right(device_masks):
    """A shape's later batches are not read; the arms that run without lengths take any mask as it is."""
    enc = make_encoder()
    x, mask = batch(LENGTHS, 64, "cpu")
    autoragged.wrap(enc, db=False, sample_every=0)
    with_model(enc, Fixed({"padded": 1.0, "ragged": 2.0}))
    left = mask.flip(1)
    with torch.no_grad():
        enc(x, src_key_padding_mask=mask)
        got = enc(x, src_key_padding_mask=left)
        assert len(device_masks) == 1
        autoragged.unwrap(enc)
        want = enc(x, src_key_padding_mask=left).masked_fill(left[..., None], 0.0)
    torch.testing.assert_close(got[~left], want[~left], rtol=1e-4, atol=1e-4)
    assert (got[left] == 0).all()


def test_causal_mask_batches_always_read_their_lengths(device_masks):
    """The arms that run without lengths take the key padding mask alone, never a causal one."""
    enc = make_encoder()
    x, mask = batch(LENGTHS, 64, "cpu")
    causal = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
    autoragged.wrap(enc, db=False, sample_every=0)
    with_model(enc, Fixed({"padded": 1.0, "ragged": 2.0}))
    with torch.no_grad():
        for _ in range(4):
            got = enc(x, mask=causal, src_key_padding_mask=mask, is_causal=True)
        assert len(device_masks) == 4
        autoragged.unwrap(enc)
        want = enc(x, mask=causal, src_key_padding_mask=mask, is_causal=True)
    torch.testing.assert_close(got[~mask], want[~mask], rtol=1e-4, atol=1e-4)


def test_timed_batches_reach_the_policy_and_the_database(tmp_path):
    """On a CPU the host clock times a batch. The first MIN_SAMPLES batches of the running arm are timed; their
    timings are the shape's costs and go to the database as runtime measurements."""
    from autoragged.tuning_db import TuningDB

    path = tmp_path / "t.sqlite"
    enc = autoragged.wrap(make_encoder(), db=path, sample_every=32)
    rt = with_model(enc, Fixed({"padded": 1.0, "ragged": 2.0}))
    x, _ = batch(LENGTHS, 64, "cpu")
    with torch.no_grad():
        for _ in range(MIN_SAMPLES + 2):
            enc(x, lengths=LENGTHS)
    rt.harvest(wait=True)
    (state,) = rt.shapes.values()
    assert len(state.timed["padded"]) == MIN_SAMPLES
    timed = [d for d in autoragged.recent_decisions(enc, 10) if d.measured_ms is not None]
    assert len(timed) == MIN_SAMPLES and all(d.measured_ms > 0 for d in timed)
    autoragged.flush()
    with TuningDB.open(path) as db:
        found = db.measurements(source="runtime")
    assert len(found) == MIN_SAMPLES and {m.arm for m in found} == {"padded"}


def test_warmup_batches_are_recorded_and_say_so(tmp_path):
    from autoragged.tuning_db import TuningDB

    path = tmp_path / "t.sqlite"
    enc = autoragged.wrap(make_encoder(), db=path)
    summary = autoragged.warmup(enc, [[5, 3], [7, 7, 2]], progress=False)
    # each batch three times: as traffic, exploring (each shape's other arm), again (nothing left to explore)
    assert summary.modules == 1 and summary.batches == 6
    autoragged.flush()
    with TuningDB.open(path) as db:
        rows = db.decisions()
    assert len(rows) == 6 and all(r.reason.endswith("(warmup)") for r in rows)
    assert {(r.stats.batch, r.arm) for r in rows} == {(b, arm) for b in (2, 3) for arm in ("padded", "ragged")}


def test_after_warmup_traffic_on_its_shapes_meets_no_trial_even_of_an_arm_priced_far_off():
    """Warm-up times every arm on each shape (policy rule 5), the eager arm here too, though predicted at 50x the
    padded arm: were it untimed, a later drift of the module's scales could make traffic try it."""
    enc = autoragged.wrap(make_encoder(), db=False)
    rt = with_model(enc, Fixed({"padded": 1.0, "ragged": 50.0}))
    groups = [[9, 3, 5], [12, 12, 1], [7, 2, 2, 2]]
    summary = autoragged.warmup(enc, groups, progress=False)
    assert len(rt.shapes) == 2 and summary.explored >= 2  # the eager arm on each shape, at least
    for state in rt.shapes.values():
        assert set(state.timed) == {"padded", "ragged"} and all(state.timed.values())
    with torch.no_grad():
        for lens in groups * 4:
            x, mask = batch(lens, 64, "cpu")
            enc(x, src_key_padding_mask=mask)
    decisions = autoragged.recent_decisions(enc, 12)
    assert [d.arm for d in decisions] == ["padded"] * 12 and not any("trying" in d.reason for d in decisions)


def test_forcing_runs_the_block_on_the_forced_arm_and_restores_the_policy():
    enc = autoragged.wrap(make_encoder(), db=False, sample_every=0)
    rt = with_model(enc, Fixed({"padded": 1.0, "ragged": 2.0}))
    x, _ = batch(LENGTHS, 64, "cpu")
    with torch.no_grad():
        with rt.forcing("ragged"):
            enc(x, lengths=LENGTHS)
        with pytest.raises(RuntimeError, match="inside"), rt.forcing("ragged"):
            raise RuntimeError("inside")
        enc(x, lengths=LENGTHS)
    forced, chosen = autoragged.recent_decisions(enc, 2)
    assert (forced.arm, forced.reason) == ("ragged", "policy=ragged")
    assert chosen.arm == "padded" and rt.policy == "auto"
    with pytest.raises(ValueError, match="policy must be one of"):
        with rt.forcing("fast"):
            pass


def test_a_new_width_of_a_known_batch_size_is_predicted_unread(device_masks):
    """A mask-only shape's first batch is predicted with its batch size's nearest width's stats, not read (a read
    is a sync of the stream: MNLI B=64's first 96-wide batch took 1.8 ms of host time against 0.09); its record
    still gets its own stats. A batch size never read is read."""
    enc = make_encoder()
    autoragged.wrap(enc, db=False, sample_every=0)
    rt = with_model(enc, Fixed({"padded": 1.0, "ragged": 2.0}))
    wide = [57, 1, 3, 9, 40]
    seqs = [LENGTHS, wide, LENGTHS, wide]
    with torch.no_grad():
        for lens in seqs:
            x, mask = batch(lens, 64, "cpu")
            enc(x, src_key_padding_mask=mask)
    assert len(device_masks) == 1
    assert len({key.width for key in rt.shapes}) == 2
    decisions = autoragged.recent_decisions(enc, 4)
    assert [d.arm for d in decisions] == ["padded"] * 4
    assert [(d.stats.total, d.stats.max_len) for d in decisions] == [(sum(s), max(s)) for s in seqs]
    x, mask = batch(LENGTHS + [2], 64, "cpu")
    with torch.no_grad():
        enc(x, src_key_padding_mask=mask)
    assert len(device_masks) == 2
