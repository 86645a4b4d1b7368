"""`python -m autoragged.report` and `autoragged.report.summary()`: the numbers over a database filled by a
real (CPU) run of a wrapped model plus hand-made decisions with known predictions and latencies, the
terminal tables, the HTML page, and the error paths (missing, empty, corrupt file; bad filters)."""

import base64
import dataclasses
import datetime as dt
import re
import sqlite3
import statistics
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from _broken_db import damaged_db, in_readonly_mount
from autoragged.kernels.config import KernelConfig
from autoragged.tuning_db import BatchStats, Decision, DeviceKey, Measurement, TuningDB
from torch import nn

import autoragged
from autoragged import report
from autoragged.planning.costmodel import FEATURE_VERSION

H100 = DeviceKey("NVIDIA H100 80GB HBM3", "9.0", 132, 81559, "550.54", "2.6.0", "3.2.0")
CORA = "encoder:6x512/8h/ff2048:relu:post:float16:nested"
OLD_SIG = "encoder_layer:1x256/4h/ff1024:gelu:pre:bfloat16"  # only a decision from ten days ago
CFG_A = KernelConfig(block_m=64, block_n=64, backend="cublas").to_dict()
CFG_B = KernelConfig(block_m=128, block_n=32).to_dict()
LA, LB = "ragged:m64n64k64w4s2a1-cublas", "ragged:m128n32k64w4s2a1"
S1 = BatchStats.from_lengths((100, 80, 60, 40) * 8)
S2 = BatchStats.from_lengths((200,) * 16 + (20,) * 16)  # another planner bucket
HOOKS = "forward hooks on submodules"
ATTN = "attn_mask other than key padding (pass is_causal=True with a causal mask)"
EXPLORING = f"exploring (the planner chose {LA})"
REAL_FORWARDS = 23  # _real_run below: 14 with lengths=, 4 with a mask, 3 hooked, 2 with an attn mask
# what the runtime's policy (runtime/policy.py) says of a batch it chose an arm for
PREDICTED, TIMED, TRYING = "predicted: cost model (prior)", "timed on this device", "trying it (the running arm is "


def _hand_made(now):
    """(decisions, expected numbers) for CORA on the H100: every number below is worked out by hand."""
    p = {"padded": 10.0, LA: 6.0, LB: 7.0}

    def d(arm, config, predicted, reason="cost model (gbt-arrays)", measured=None, stats=S1):
        return Decision(now - 600, H100.key, CORA, stats, arm, config, predicted, reason, measured)

    decisions = [
        d("ragged", CFG_A, p, measured=6.6),
        d("ragged", CFG_A, p, measured=7.4),
        # graph-replayed arms are predicted too on CUDA; they are no "always padded/ragged" baseline
        d(
            "padded",
            None,
            {"padded": 5.0, LA: 6.0, LB: 5.5, "padded_graph": 5.2, "ragged_graph:" + LA[7:]: 5.3},
            measured=5.0,
        ),
        d("ragged", CFG_B, p, reason=EXPLORING, measured=8.0),
        d("padded", None, {}, reason=ATTN),  # a fallback: forced, nothing predicted
        d("padded", None, {"padded": 4.0, LA: 4.8}, measured=5.0, stats=S2),
        # forced ragged: not a padded fallback; sampled, but no planner choice, so not in the regret's buckets
        d("ragged", CFG_A, {}, reason="policy=ragged", measured=4.0, stats=S2),
    ]
    chosen, padded, ragged = 6 + 6 + 5 + 7 + 4, 10 + 10 + 5 + 10 + 4, 6 + 6 + 5.5 + 6 + 4.8
    expected = {
        "mape": statistics.fmean([0.6 / 6.6, 1.4 / 7.4, 0.0, 1.0 / 8.0, 1.0 / 5.0]),
        "saved_batches": 5,
        "vs_padded_ms": padded - chosen,  # 11 ms of 39
        "vs_padded_pct": 100 * (padded - chosen) / padded,
        "vs_ragged_ms": ragged - chosen,  # 0.3 ms of 28.3
        "vs_ragged_pct": 100 * (ragged - chosen) / ragged,
        # bucket S1 means: LA (6.6 + 7.4) / 2 = 7, padded 5, LB 8 (exploring: in the means, not in the regret)
        "regret": [7 / 5 - 1, 7 / 5 - 1, 0.0],
    }
    return decisions, expected


def _measurement(now, arm, config, batch, ms, source="tune", age_s=60):
    stats = BatchStats.from_lengths(tuple(range(8, 8 + batch)))
    return Measurement(H100.key, CORA, arm, config, stats, ms, ms * 0.9, ms * 1.1, 5, now - age_s, source=source)


def _real_run(path):
    """A wrapped PyTorch encoder run on CPU, as a user would: decisions recorded by the runtime itself."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 2, 64, batch_first=True, dropout=0.0)
    model = autoragged.wrap(nn.TransformerEncoder(layer, 2).eval(), db=path)
    gen = torch.Generator().manual_seed(0)

    def batch(pad=0):
        lengths = torch.randint(1, 40, (4,), generator=gen).tolist()
        L = max(lengths) + pad
        mask = torch.arange(L)[None, :] >= torch.tensor(lengths)[:, None]
        return torch.randn(4, L, 64, generator=gen), lengths, mask

    with torch.no_grad():
        for i in range(14):
            x, lengths, _ = batch(pad=i % 3)
            if i % 3 == 0:  # one long sequence among short ones: the CPU prior picks the ragged arm
                x, lengths = torch.randn(4, 96 + i, 64, generator=gen), [96 + i, 2, 3, 1]
            model(x, lengths=lengths)
        for _ in range(4):
            x, _, mask = batch(pad=2)
            model(x, src_key_padding_mask=mask)
        hook = model.layers[0].linear1.register_forward_hook(lambda *args: None)
        for _ in range(3):
            x, lengths, _ = batch()
            model(x, lengths=lengths)
        hook.remove()
        for _ in range(2):
            x, _, mask = batch()
            L = x.shape[1]
            model(x, mask=torch.zeros(L, L, dtype=torch.bool), src_key_padding_mask=mask)
    autoragged.unwrap(model)  # flushes the recorder
    return model


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """One database with hand-made H100 measurements (rows 1-8), a real CPU run, hand-made H100 decisions and two
    cost models. Returns (path, the CPU device key, the hand-made expectations and "cpu_timed": the CPU run's
    timed batches, which the host clock decides). Tests copy it before writing."""
    from autoragged import ops
    from autoragged.ragged import tensor as _ragged

    path = tmp_path_factory.mktemp("report") / "tuning.sqlite"
    now = time.time()
    with TuningDB.open(path) as db:
        db.register_device(H100)
        db.add_measurements(
            [_measurement(now, "padded", None, b, 0.1 * b) for b in (8, 32, 128)]
            + [_measurement(now, "ragged", CFG_A, b, 0.07 * b) for b in (8, 32, 128)]
            + [_measurement(now, "ragged", CFG_A, 32, 6.6, source="runtime")]
            + [_measurement(now, "padded", None, 16, 1.0, age_s=10 * 86400)]
        )
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        mp.setattr(ops, "use_triton", lambda t: False)  # the CPU reference path: the interpreter is far too slow
        mp.setattr(_ragged, "use_triton", lambda t: False)
        warnings.filterwarnings("ignore", "The PyTorch API of nested tensors", UserWarning)  # PyTorch's own path
        # one thread: these tiny forwards took 200 ms instead of 1 ms when another process kept the cores busy
        torch.set_num_threads(1)
        try:
            _real_run(path)
        finally:
            torch.set_num_threads(threads)
    decisions, expected = _hand_made(now)
    old = Decision(
        now - 10 * 86400, H100.key, OLD_SIG, S1, "padded", None, {"padded": 1.0, LA: 2.0}, "cost model (prior)"
    )
    with TuningDB.open(path) as db:
        db.add_decisions([*decisions, old])
        metrics = dict(accuracy=0.9, mean_regret=0.0123, p95_regret=0.05, mape=0.08, rows=480,
                       holdout="leave one length family out", batches=40, prior_accuracy=0.625)  # fmt: skip
        db.save_model(device=H100, feature_version=FEATURE_VERSION - 1, kind="gbt-arrays", payload={}, metrics={})
        db.save_model(device=H100, feature_version=FEATURE_VERSION, kind="gbt-arrays", payload={}, metrics=metrics)
        cpu = next(d.key for d in db.devices() if d.capability == "cpu")
        expected["cpu_timed"] = len(db.measurements(device=cpu))
    return path, cpu, expected


def _module(summary, device, signature):
    dev = next(d for d in summary.devices if d.key == device)
    return next(m for m in dev.modules if m.signature == signature)


# ------------------------------------------------------------------------------------------ numbers


def test_real_run_is_reported_as_it_happened(filled):
    path, cpu, e = filled
    s = report.summary(path)
    dev = next(d for d in s.devices if d.key == cpu)
    assert dev.calibration is None and dev.decisions == REAL_FORWARDS
    (m,) = dev.modules
    assert m.signature.startswith("encoder:2x64/2h/ff64:relu:post:float32")
    assert m.batches == REAL_FORWARDS
    assert sum(sh.batches for sh in m.arms) == sum(sh.batches for sh in m.configs) == REAL_FORWARDS
    assert sum(sh.share for sh in m.arms) == pytest.approx(1) and sum(sh.share for sh in m.configs) == pytest.approx(1)
    assert {sh.label for sh in m.arms} == {"padded", "ragged"}
    assert {sh.label.split(":")[0] for sh in m.configs} == {"padded", "ragged"}
    assert m.fallback_reasons == {HOOKS: 3, ATTN: 2}
    assert sum(m.decided_by.values()) == REAL_FORWARDS - 5
    # predicted until a shape's arm is timed, then timed, or a trial of an arm predicted close to the running one
    assert all(r.startswith((PREDICTED, TIMED, TRYING)) for r in m.decided_by), m.decided_by
    assert any(r.startswith(PREDICTED) for r in m.decided_by) and any(r.startswith(TIMED) for r in m.decided_by)
    # every planner decision predicted padded and the eager ragged arm, so every one has a time-saved estimate:
    # the predictions of the arms that ran against those of always padded, always the eager ragged arm (timings,
    # not predictions, chose some of these arms: the estimate may come out either way)
    with TuningDB.open(path) as db:
        planned = [d for d in db.decisions() if d.device == cpu and d.predicted_ms]
    assert m.saved.batches == len(planned) == REAL_FORWARDS - 5
    assert m.saved.chosen_ms == pytest.approx(sum(d.predicted_ms[d.arm] for d in planned))
    assert m.saved.always_padded_ms == pytest.approx(sum(d.predicted_ms["padded"] for d in planned))
    assert m.saved.always_ragged_ms == pytest.approx(sum(d.predicted_ms["ragged"] for d in planned))
    # the host clock timed each shape's first batches (and the database holds each timing as a measurement)
    timed = [d for d in planned if d.measured_ms is not None]
    assert m.sampled == len(timed) == e["cpu_timed"] >= 2  # the long rows' shape and the short rows' at least
    assert m.mape_batches == m.sampled and m.mape is not None  # every timed batch's arm was predicted


def test_hand_made_numbers(filled):
    path, _, e = filled
    s = report.summary(path)
    m = _module(s, H100.key, CORA)
    assert m.batches == 7 and m.sampled == 6
    assert [(sh.label, sh.batches) for sh in m.arms] == [("ragged", 4), ("padded", 3)]
    assert {sh.label: sh.batches for sh in m.configs} == {LA: 3, "padded": 3, LB: 1}
    assert m.fallback_reasons == {ATTN: 1}
    assert m.decided_by == {"cost model (gbt-arrays)": 4, EXPLORING: 1, "policy=ragged": 1}
    assert m.mape == pytest.approx(e["mape"]) and m.mape_batches == 5
    assert m.saved.batches == e["saved_batches"]
    assert m.saved.vs_padded_ms == pytest.approx(e["vs_padded_ms"])
    assert m.saved.vs_padded_pct == pytest.approx(e["vs_padded_pct"])
    assert m.saved.vs_ragged_ms == pytest.approx(e["vs_ragged_ms"])
    assert m.saved.vs_ragged_pct == pytest.approx(e["vs_ragged_pct"])
    r = m.regret
    assert (r.buckets, r.evaluated_buckets, r.batches, r.exploring) == (2, 1, 3, 1)
    assert r.mean == pytest.approx(statistics.fmean(e["regret"])) and r.max == pytest.approx(0.4)


def _as_the_runtime_records(tmp_path) -> Path:
    """A database of three timed CORA batches in one bucket, recorded as this runtime records them: predictions per
    arm kind, reasons from its policy (the third batch a trial of the padded arm)."""
    p = {"padded": 10.0, "ragged": 6.0, "ragged_graph": 5.0}
    now = time.time()
    path = tmp_path / "t.sqlite"
    with TuningDB.open(path) as db:
        db.register_device(H100)
        db.add_decisions([
            Decision(now, H100.key, CORA, S1, "ragged", CFG_A, p, "predicted: cost model (learned)", 6.6),
            Decision(now, H100.key, CORA, S1, "ragged", CFG_A, p, TIMED, 7.4),
            Decision(now, H100.key, CORA, S1, "padded", None, p, f"{TRYING}ragged)", 12.0),
        ])  # fmt: skip
    return path


def test_time_saved_and_mape_read_the_predictions_the_runtime_records(tmp_path):
    """The runtime keys its predictions by arm kind ("ragged"); the report looked a ragged batch's prediction up by
    its arm label ("ragged:m64n64k64w4s2a1-cublas", as older versions keyed them) and found none: no time saved
    and no MAPE for any batch the runtime runs ragged."""
    m = _module(report.summary(_as_the_runtime_records(tmp_path)), H100.key, CORA)
    # chosen 6 + 6 + 10 = 22 ms; always padded 30, always the eager ragged arm 18 (a graph is no baseline)
    assert m.saved.batches == 3
    assert m.saved.vs_padded_ms == pytest.approx(30 - 22) and m.saved.vs_ragged_ms == pytest.approx(18 - 22)
    assert m.mape_batches == 3 and m.mape == pytest.approx(statistics.fmean([0.6 / 6.6, 1.4 / 7.4, 2.0 / 12.0]))


def test_trials_are_left_out_of_the_regret_as_exploration_was(tmp_path):
    """A trial times an arm the policy did not choose: the regret measures choices, and leaves out batches that
    explored; the runtime's trials ("trying it (...)") were counted as choices (3 batches, mean 24%)."""
    r = _module(report.summary(_as_the_runtime_records(tmp_path)), H100.key, CORA).regret
    assert (r.buckets, r.evaluated_buckets, r.batches, r.exploring) == (1, 1, 2, 1)
    assert r.mean == 0.0  # ragged, the choice, averaged 7.0 ms against the trial's 12.0


def test_warm_ups_explored_batches_count_as_exploring():
    """Warm-up's batches that time an arm on a shape (policy rule 5) are exploration, as trials are."""
    from autoragged.report.rollup import exploring
    from autoragged.runtime.policy import EXPLORING as WARM_EXPLORING

    def d(reason):
        return Decision(0.0, H100.key, CORA, S1, "padded", None, {"padded": 5.0}, reason, 5.0)

    assert exploring(d(WARM_EXPLORING + " (warmup)")) and exploring(d(TRYING + "ragged)"))
    assert not exploring(d(TIMED + " (warmup)")) and not exploring(d(PREDICTED))


def test_device_calibration_and_measurements(filled):
    s = report.summary(filled[0])
    dev = next(d for d in s.devices if d.key == H100.key)
    assert dev.name == H100.name and dev.models == 2
    assert dev.measurements == 8 and dev.measurements_by_source == {"tune": 7, "runtime": 1}
    c = dev.calibration
    assert c.current and c.feature_version == FEATURE_VERSION and c.created > time.time() - 600
    assert (c.accuracy, c.mean_regret, c.p95_regret, c.mape, c.rows) == (0.9, 0.0123, 0.05, 0.08, 480)
    assert c.holdout == "leave one length family out"
    assert s.decisions == REAL_FORWARDS + 8 and s.counts["models"] == 2


def test_terminal_report_prints_the_numbers(filled, capsys):
    _, cpu, e = filled
    assert report.main(["--db", str(filled[0])]) == 0
    out = capsys.readouterr().out
    assert f"## device {H100.key}" in out and f"## device {cpu}" in out and f"### module {CORA}" in out
    assert f"{REAL_FORWARDS} batches from" in out
    assert re.search(rf"\| {re.escape(HOOKS)} +\| +3 \|", out)
    assert re.search(rf"\| {re.escape(ATTN)} +\| +2 \|", out)  # the real run's
    assert re.search(rf"\| {re.escape(LA)} +\| +3 \| +42\.9% \|", out)
    assert f"{e['vs_padded_ms']:.3f} ms" in out and f"{e['vs_padded_pct']:+.1f}% of 39.000 ms" in out
    assert f"{e['vs_ragged_ms']:.3f} ms" in out and f"{e['vs_ragged_pct']:+.1f}% of 28.300 ms" in out
    assert "ESTIMATE" in out and "cost-model estimate" in out
    assert f"MAPE {100 * e['mape']:.1f}% over 5 batches" in out
    assert "mean 26.67% (max 40.00%) over 3 batches; 1 of 2 buckets" in out and "1 exploration batch left out" in out
    assert re.search(r"\| decision accuracy \(held out\) +\| 90\.0% +\|", out)
    assert "| mean regret (held out)" in out and "1.23%" in out and "leave one length family out" in out
    assert re.search(r"\| analytic prior's accuracy \(held out\) +\| 62\.5% +\|", out)
    assert "analytic prior's mean regret" not in out  # not stored: no row
    assert "measurements: 8 (tune 7, runtime 1)" in out
    assert "Not calibrated" in out  # the CPU device


def test_configs_are_printed_as_recorded(filled, capsys):
    """The report prints an arm's config as `recent_decisions` and the database give it: the "cublas" linear backend
    is torch.nn.functional.linear, which is cuBLAS on a GPU and PyTorch's own matmul on a CPU (kernels/config.py)."""
    _, cpu, _ = filled
    assert report.main(["--db", str(filled[0]), "--device", cpu]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\| ragged:m\w+-cublas +\| +\d+ \|", out) and "-torch" not in out
    assert report.main(["--db", str(filled[0]), "--device", H100.key]) == 0
    assert re.search(rf"\| {re.escape(LA)} +\| +3 \|", capsys.readouterr().out)


# ------------------------------------------------------------------------------------------ filters


def test_since_narrows_decisions_and_measurements(filled, capsys):
    path = filled[0]
    everything = report.summary(path)
    assert any(m.signature == OLD_SIG for d in everything.devices for m in d.modules)
    yesterday = (dt.date.today() - dt.timedelta(days=1)).isoformat()
    for since in ("7d", yesterday, dt.timedelta(hours=2)):
        s = report.summary(path, since=since)
        assert s.decisions == REAL_FORWARDS + 7, since
        dev = next(d for d in s.devices if d.key == H100.key)
        assert [m.signature for m in dev.modules] == [CORA] and dev.measurements == 7
        assert dev.calibration is not None  # the calibration in effect is shown whatever the window
    assert report.summary(path, since="5m").decisions == REAL_FORWARDS  # the hand-made ones are 10 minutes old
    assert report.main(["--db", str(path), "--since", "7d"]) == 0
    out = capsys.readouterr().out
    assert f"module {CORA}" in out and OLD_SIG not in out


def test_parse_since_forms():
    now = 1_800_000_000.0
    assert report.parse_since("30m", now=now) == now - 1800
    assert report.parse_since("2h", now=now) == now - 7200
    assert report.parse_since("7d", now=now) == now - 7 * 86400
    assert report.parse_since("1.5w", now=now) == now - 1.5 * 604800
    assert report.parse_since("2026-01-31") == dt.datetime(2026, 1, 31).timestamp()
    assert (
        report.parse_since("2026-01-31T14:30:00Z")
        == dt.datetime(2026, 1, 31, 14, 30, tzinfo=dt.timezone.utc).timestamp()
    )
    assert report.parse_since(12.5) == 12.5 and report.parse_since(None) is None
    for bad in ("yesterday", "-2h", "7 days", "", True):
        with pytest.raises(ValueError, match="30m, 2h, 7d"):
            report.parse_since(bad)


def test_bad_since_is_an_argparse_error(filled, capsys):
    with pytest.raises(SystemExit) as exit_:
        report.main(["--db", str(filled[0]), "--since", "last tuesday"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--since" in err and "'last tuesday'" in err and "ISO date" in err and "30m, 2h, 7d" in err


def test_device_filter(filled, capsys):
    path, cpu, _ = filled
    s = report.summary(path, device="h100")  # a unique substring, any case
    assert [d.key for d in s.devices] == [H100.key] and s.device == H100.key
    assert s.decisions == 8 and all(m.device == H100.key for d in s.devices for m in d.modules)
    assert [d.key for d in report.summary(path, device=cpu).devices] == [cpu]  # the exact key
    with pytest.raises(ValueError, match="matches 2 devices"):
        report.summary(path, device="|")
    assert report.main(["--db", str(path), "--device", "TPU"]) == 2
    err = capsys.readouterr().err
    assert "no device" in err and "'TPU'" in err and H100.key in err and cpu in err and "Traceback" not in err
    assert report.main(["--db", str(path), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"device {cpu}" in out and H100.key not in out.replace(f"device {cpu}", "")


def test_unregistered_device_can_be_selected(tmp_path):
    path = tmp_path / "t.sqlite"
    with TuningDB.open(path) as db:  # a row written by hand: its device was never registered
        db.add_decisions([Decision(time.time(), "my-gpu|cc8.0", CORA, S1, "padded", None, {"padded": 1.0}, "x")])
    s = report.summary(path, device="my-gpu")
    assert [d.key for d in s.devices] == ["my-gpu|cc8.0"] and s.devices[0].name is None
    assert s.devices[0].modules[0].saved.batches == 0  # no ragged prediction: no estimate, and the report says so
    assert "no batch had both a padded and a ragged prediction" in report.render_text(s)


# ------------------------------------------------------------------------------------------ HTML


def test_html_report_is_self_contained_with_pictures(filled, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "report.html"
    assert report.main(["--db", str(filled[0]), "--html", str(out)]) == 0
    page = out.read_text()
    images = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) >= 4  # decision maps (3 modules), predicted vs measured, latency by batch size
    assert all(base64.b64decode(img).startswith(b"\x89PNG\r\n\x1a\n") for img in images)
    assert page.count("<img") == len(images) and "src=" not in re.sub(r'src="data:image/png;base64,', "", page)
    assert "http://" not in page and "https://" not in page and "<script" not in page and "<link" not in page
    assert "<h1>autoragged decision report</h1>" in page and f"<h2>device {H100.key}</h2>" in page
    assert f"<h3>module {CORA}</h3>" in page and "decision map of" in page and "predicted vs measured" in page
    assert "latency by batch size" in page
    assert "<td>forward hooks on submodules</td><td>3</td>" in page  # the same tables as the terminal
    assert "<td>attn_mask other than key padding (pass is_causal=True with a causal mask)</td><td>1</td>" in page
    assert str(out) in capsys.readouterr().err


def _cpu_decisions(path, n: int = 22) -> str:
    """`n` decisions of issue #43's light use on a 2-core CPU, none timed, at the prior's predictions (32x128:
    4,743 ms padded, 2,607 ms ragged, where 28 / 17.8 ms were measured); the CPU's device key."""
    cpu = DeviceKey("cpu: x86_64", "cpu", 2, 7900, "", "2.6.0", "3.2.0")
    stats = BatchStats.from_lengths((128,) + (40,) * 31)
    now = time.time()
    with TuningDB.open(path) as db:
        db.register_device(cpu)
        db.add_decisions([Decision(now - i, cpu.key, CORA, stats, "ragged", CFG_A, {"padded": 4743.0, LA: 2607.0},
                                   "cost model (prior)") for i in range(n)])  # fmt: skip
    return cpu.key


def test_a_picture_with_nothing_to_show_is_one_line_saying_why(tmp_path):
    """After light use, section after section said "no data"; now the line says what is missing and why."""
    pytest.importorskip("matplotlib")
    _cpu_decisions(tmp_path / "t.sqlite")
    out = tmp_path / "report.html"
    assert report.main(["--db", str(tmp_path / "t.sqlite"), "--html", str(out)]) == 0
    page = out.read_text()
    assert "no data" not in page and page.count("<img") == 1  # the decision map
    missing = re.findall(r"<p class='missing'>(.*?)</p>", page)
    assert [line.split(":")[0] for line in missing] == ["No latency by batch size and arm on cpu",
                                                        f"No predicted vs measured latency of {CORA.split(':')[0]}"]  # fmt: skip
    assert "nothing was measured on this device" in missing[0] and "python -m autoragged.tune" in missing[0]
    assert "none of its 22 batches kept was timed" in missing[1] and "sample_every" in missing[1]


def test_identical_batches_are_one_point_sized_by_their_count():
    """22 identical batches drew one dot the size of one."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from autoragged.report import plots as _report_plots

    same = [Decision(1.0 + i, H100.key, CORA, S1, "padded", None, {"padded": 2.0}, "x", 3.0) for i in range(22)]
    other = [Decision(1.0, H100.key, CORA, S2, "padded", None, {"padded": 1.0}, "x", 1.5)]
    for draw, where in ((_report_plots._decision_map, (S1.mean, S1.pad_fraction)),
                        (_report_plots._predicted_vs_measured, (2.0, 3.0))):  # fmt: skip
        ax = draw(Figure, same + other).axes[0]
        (points,) = ax.collections
        offsets = [tuple(xy) for xy in points.get_offsets()]
        assert len(offsets) == 2, draw.__name__
        sizes = dict(zip(offsets, points.get_sizes()))
        assert sizes[where] > 4 * min(sizes.values()), draw.__name__
        assert "22" in [t.get_text() for t in ax.texts], draw.__name__


def test_latency_medians_show_their_spread():
    """A CPU calibration's medians zig-zagged between 2 and 180 ms across neighbouring batch sizes (lengths differ
    within a batch size): medians are of power-of-two ranges of batch sizes, each with its interquartile range."""
    pytest.importorskip("matplotlib")
    import numpy as np
    from matplotlib.container import ErrorbarContainer
    from matplotlib.figure import Figure

    from autoragged.report import plots as _report_plots

    ms = {8: [2.0, 3.0, 180.0], 9: [4.0], 16: [5.0, 6.0, 7.0]}  # 8 and 9: one range, drawn at their median size
    points = {CORA: [(b, v, "padded", "tune") for b, vs in ms.items() for v in vs]}
    ax = _report_plots._latency_by_batch(Figure, points).axes[0]
    (bars,) = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    segments = {round(seg[0][0]): (seg[0][1], seg[1][1]) for seg in bars.lines[2][0].get_segments()}
    assert segments == {8: pytest.approx(tuple(np.percentile([2.0, 3.0, 180.0, 4.0], [25, 75]))),
                        16: pytest.approx(tuple(np.percentile(ms[16], [25, 75])))}  # fmt: skip


def test_html_without_matplotlib_fails_clearly(filled, tmp_path, monkeypatch, capsys):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if it were not installed
    out = tmp_path / "report.html"
    assert report.main(["--db", str(filled[0]), "--html", str(out)]) == 2
    err = capsys.readouterr().err
    assert "pip install matplotlib" in err and "Traceback" not in err and not out.exists()
    assert report.main(["--db", str(filled[0])]) == 0  # the terminal report needs nothing more
    assert f"module {CORA}" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ errors


def test_empty_database_says_how_to_fill_it(tmp_path, capsys):
    path = tmp_path / "empty.sqlite"
    TuningDB.open(path).close()
    assert report.main(["--db", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.strip() == report.EMPTY_MESSAGE.format(path=path)
    assert "autoragged.wrap(...)" in out and "python -m autoragged.tune" in out
    assert report.summary(path).empty and not report.summary(path).devices


def test_missing_database_is_not_created(tmp_path, monkeypatch, capsys):
    path = tmp_path / "nowhere" / "tuning.sqlite"
    assert report.main(["--db", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"no tuning database at {path}" in err and "Traceback" not in err
    monkeypatch.setenv("AUTORAGGED_DB", str(path))  # the default path: same
    assert report.main([]) == 1
    with pytest.raises(FileNotFoundError, match="autoragged.wrap"):
        report.summary()
    assert not path.exists() and not path.parent.exists()


def test_corrupt_database_gives_the_database_error(tmp_path, capsys):
    path = tmp_path / "corrupt.sqlite"
    path.write_bytes(b"this is not a SQLite file at all\n" * 200)
    assert report.main(["--db", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not a tuning database" in err and str(path) in err and "Traceback" not in err


def test_a_directory_is_named_as_one(tmp_path, monkeypatch, capsys):
    """$AUTORAGGED_DB set to a directory: the report said "nothing was recorded there yet"."""
    monkeypatch.setenv("AUTORAGGED_DB", str(tmp_path))
    assert report.main([]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'tuning.sqlite'}" in err and "is a directory" in err and "nothing was recorded" not in err


def test_a_damaged_database_is_refused_as_damaged(tmp_path, capsys):
    path = tmp_path / "t.sqlite"
    damaged_db(path)
    capsys.readouterr()  # what setting the database up logged (through the handler of an earlier report.main)
    assert report.main(["--db", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path} is damaged" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_database_in_a_read_only_mount_is_reported(filled, tmp_path):
    """A read-only directory (a bind mount, so root is refused too): SQLite cannot make the -shm file a WAL reader
    needs there, and the report refused the file as read-only."""
    path = _copy(filled[0], tmp_path)
    done = in_readonly_mount(tmp_path, ["-m", "autoragged.report", "--db", str(path)], env={"TRITON_INTERPRET": "0"})
    assert done.returncode == 0, done.stderr
    assert f"### module {CORA}" in done.stdout and f"{REAL_FORWARDS} batches from" in done.stdout


def test_filters_that_match_nothing_say_so(filled, capsys):
    path, cpu, _ = filled
    future = str(dt.date.today() + dt.timedelta(days=2))
    assert report.main(["--db", str(path), "--since", future]) == 0
    out = capsys.readouterr().out
    assert "0 decisions" in out and cpu not in out  # the CPU device has nothing in the window
    assert "No decisions recorded for this device in the window" in out and "90.0%" in out  # the H100's calibration
    assert report.main(["--db", str(path), "--since", future, "--device", cpu]) == 0
    out = capsys.readouterr().out
    assert "No decisions, measurements or cost models match" in out and "## device" not in out


def test_help_has_an_example(capsys):
    with pytest.raises(SystemExit) as exit_:
        report.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "python -m autoragged.report --since 2h --device H100" in out


# ------------------------------------------------------------------------------------------ damaged rows


def _copy(path, tmp_path):
    """A copy of a database (WAL included) that a test may damage."""
    out = tmp_path / "copy.sqlite"
    src, dst = sqlite3.connect(path), sqlite3.connect(out)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()
    return out


def _loosen(conn, table):
    """The table without its NOT NULL constraints: a hostile file need not keep our schema's."""
    columns = conn.execute(f"PRAGMA table_info({table})").fetchall()  # cid, name, type, notnull, default, pk
    spec = ", ".join(f"[{c[1]}] {c[2]}" + (" PRIMARY KEY" if c[5] == 1 and table != "devices" else "") for c in columns)
    conn.execute(f"ALTER TABLE {table} RENAME TO old_{table}")
    conn.execute(f"CREATE TABLE {table} ({spec})")
    conn.execute(f"INSERT INTO {table} SELECT * FROM old_{table}")
    conn.execute(f"DROP TABLE old_{table}")


# (table, row, raw SQL values, the problem the report names); decisions 1-23 are the CPU run's, measurements and
# models the H100's (model 1 is of the previous feature version, 2 the calibration)
DAMAGE = [
    ("decisions", 1, {"predicted_ms": "'{\"padded\": 1.0'"}, "unreadable predicted_ms JSON"),
    ("decisions", 2, {"predicted_ms": "'[1, 2]'"}, "predicted_ms is not a JSON object"),
    ("decisions", 3, {"predicted_ms": '\'{"padded": "1"}\''}, "predicted_ms holds a value that is not a finite"),
    ("decisions", 4, {"config": "'{\"block_m\": '"}, "unreadable config JSON"),
    ("decisions", 5, {"batch": "'four'"}, "batch is not a non-negative integer"),
    ("decisions", 6, {"arm": "'banana'"}, "unknown arm kind"),
    ("decisions", 7, {"time": "NULL"}, "time is not a finite number"),
    ("decisions", 8, {"reason": "NULL"}, "reason is NULL"),
    ("decisions", 9, {"measured_ms": "'fast'"}, "measured_ms is not a finite number"),
    ("decisions", 10, {"mean": "'wide'", "std": "NULL"}, "mean is not a finite number"),
    ("decisions", 11, {"predicted_ms": "'" + "[" * 50_000 + "]" * 50_000 + "'"}, "predicted_ms JSON is nested too"),
    ("decisions", 12, {"config": "'{\"block_m\": [1]}'"}, None),  # readable: labelled by the config's hash
    ("measurements", 1, {"extra": "'{'"}, "unreadable extra JSON"),
    ("measurements", 2, {"median_ms": "NULL"}, "median_ms is not a finite number"),
    ("measurements", 3, {"arm": "'banana'"}, "unknown arm kind"),
    ("measurements", 4, {"reps": "-3"}, "reps is not a non-negative integer"),
    ("models", 1, {"metrics": "'[1]'", "payload": "'not JSON at all'"}, "metrics is not a JSON object"),
    ("devices", H100.key, {"sm_count": "'many'"}, "sm_count is not a non-negative integer"),
]


def test_damaged_rows_are_skipped_and_counted_per_table(filled, tmp_path, capsys):
    path, cpu, e = filled
    path = _copy(path, tmp_path)
    conn = sqlite3.connect(path)
    with conn:
        for table in ("decisions", "measurements"):
            _loosen(conn, table)
        for table, row, values, _ in DAMAGE:
            sets = ", ".join(f"{c} = {v}" for c, v in values.items())
            conn.execute(f"UPDATE {table} SET {sets} WHERE {'key' if table == 'devices' else 'id'} = ?", [row])
        # a model of another feature version, newer than the calibration, whose payload is not JSON: ignored
        conn.execute("INSERT INTO models (device, signature, feature_version, kind, payload, metrics, created) "
                     "VALUES (?, '*', ?, 'gbt-arrays', '[[[', '{\"accuracy\": \"high\", \"rows\": 1.5}', ?)",
                     [H100.key, FEATURE_VERSION + 1, time.time()])  # fmt: skip
    conn.close()
    assert report.main(["--db", str(path)]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    lines = [line for line in captured.out.splitlines() if line.startswith("Skipped")]
    assert [line.split(":")[0] for line in lines] == [
        "Skipped 1 of 2 devices rows", "Skipped 1 of 3 models rows", "Skipped 11 of 31 decisions rows",
        f"Skipped 4 of {8 + e['cpu_timed']} measurements rows",
    ]  # fmt: skip
    text = "\n".join(lines)
    for table, row, _, problem in DAMAGE:
        if problem is not None and table != "decisions" or row in (5, 6, 7, 8, 9, 10):
            assert f"{problem} ({'key' if table == 'devices' else 'id'} {row})" in text, (problem, row)
    assert "unreadable predicted_ms JSON (id 1)" in text and "predicted_ms is not a JSON object (id 2)" in text
    s = report.summary(path)
    dev = next(d for d in s.devices if d.key == cpu)
    assert dev.decisions == REAL_FORWARDS - 11 and sum(sh.batches for sh in dev.modules[0].configs) == dev.decisions
    h100 = next(d for d in s.devices if d.key == H100.key)
    assert h100.name is None and h100.measurements == 4 and h100.models == 2  # the device row is unreadable
    assert h100.calibration.model_id == 2 and h100.calibration.accuracy == 0.9  # the runtime's model, not id 3
    assert _module(s, H100.key, CORA).batches == 7  # the hand-made numbers are untouched
    assert s.skipped == [line[0].lower() + line[1:-1] for line in lines]


def test_a_calibration_with_odd_metrics_is_shown_without_them(tmp_path, capsys):
    path = tmp_path / "t.sqlite"
    with TuningDB.open(path) as db:
        metrics = {"accuracy": "high", "mean_regret": True, "rows": 1.5, "holdout": 3, "mape": 1e308 * 10}
        db.save_model(device=H100, feature_version=FEATURE_VERSION, kind="gbt-arrays", payload={},
                      metrics={k: v for k, v in metrics.items() if k != "mape"})  # fmt: skip
    assert report.main(["--db", str(path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\| decision accuracy \(held out\) +\| - +\|", out) and "| fit rows" in out
    c = report.summary(path).devices[0].calibration
    assert (c.accuracy, c.mean_regret, c.rows, c.holdout) == (None, None, None, None)


def test_a_calibration_not_adopted_is_shown_as_such(tmp_path, capsys):
    """A fit that lost to the analytic prior on held-out batches is stored for the record; the runtime uses the
    prior, and the report says so beside its numbers."""
    path = tmp_path / "t.sqlite"
    metrics = dict(accuracy=0.688, prior_accuracy=0.771, mean_regret=0.35, prior_mean_regret=0.25, adopted=False)
    with TuningDB.open(path) as db:
        db.save_model(device=H100, feature_version=FEATURE_VERSION, kind="gbt-arrays", payload={}, metrics=metrics)
    assert report.summary(path).devices[0].calibration.adopted is False
    assert report.main(["--db", str(path)]) == 0
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if "not adopted" in line]
    assert "analytic prior" in line and "Not calibrated" not in out


def test_cpu_time_saved_by_the_prior_is_relative_only(filled, tmp_path, capsys):
    """On a CPU the prior's latencies ran about 100x the measured ones and are equal for models of one shape: the
    estimate of time saved is shown as a share of the time, not in milliseconds."""
    path = tmp_path / "t.sqlite"
    cpu = _cpu_decisions(path)
    m = report.summary(path).devices[0].modules[0]
    assert m.saved.relative_only and m.saved.vs_padded_pct == pytest.approx(100 * (4743 - 2607) / 4743)
    assert not _module(report.summary(filled[0]), H100.key, CORA).saved.relative_only  # a GPU's stay in ms
    assert report.main(["--db", str(path), "--device", cpu]) == 0
    out = capsys.readouterr().out
    start = out.index("| estimated time saved")
    table = out[start : out.index("\n\n", start)]
    assert "relative only" in table and " ms" not in table and re.search(r"\| +\+45\.0% \|", table)
    assert "python -m autoragged.tune" in out[start:]


def test_a_sqlite_file_that_is_no_tuning_database_is_refused_by_name(tmp_path, capsys):
    path = tmp_path / "other.sqlite"
    sqlite3.connect(path).execute("CREATE TABLE decisions (x)").connection.close()
    assert report.main(["--db", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path} is not a tuning database" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------------ retention


def _numbers(module) -> dict:
    """A module summary's numbers, floats to 9 digits (sums taken in another order), without rolled_up."""

    def rounded(value):
        if isinstance(value, float):
            return round(value, 9)
        if isinstance(value, dict):
            return {k: rounded(v) for k, v in value.items()}
        if isinstance(value, list):
            return [rounded(v) for v in value]
        return value

    numbers = dataclasses.asdict(module)
    numbers.pop("rolled_up")
    return rounded(numbers)


def test_the_numbers_are_the_same_once_decisions_are_added_up(filled, tmp_path, capsys):
    from autoragged.report.rollup import rollup

    path = _copy(filled[0], tmp_path)
    windows = (None, "7d", "5m")
    before = {since: report.summary(path, since=since) for since in windows}
    with TuningDB.open(path) as db:
        assert db.prune_decisions(2, rollup) == (REAL_FORWARDS - 2) + (7 - 2)  # the old signature has one
        assert db.counts()["decisions"] == 5 and db.counts()["decision_totals"] > 0
    for since in windows:
        after = report.summary(path, since=since)
        assert after.decisions == before[since].decisions, since
        devices = zip(before[since].devices, after.devices)
        pairs = [(b, a) for dev_b, dev_a in devices for b, a in zip(dev_b.modules, dev_a.modules)]
        assert len(pairs) == {None: 3, "7d": 2, "5m": 1}[since]
        for b, a in pairs:
            assert _numbers(a) == _numbers(b), (since, b.signature)
            assert a.rolled_up == b.batches - min(b.batches, 2) and b.rolled_up == 0
    assert report.main(["--db", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{REAL_FORWARDS - 2} of them are counted in hourly totals only" in out and "AUTORAGGED_DB_KEEP" in out
    assert re.search(rf"\| {re.escape(LA)} +\| +3 \| +42\.9% \|", out)  # the hand-made shares, as before


def test_a_wrapped_model_keeps_the_newest_decisions_and_reports_all(tmp_path, monkeypatch):
    from autoragged import ops
    from autoragged.ragged import tensor as _ragged

    monkeypatch.setattr(ops, "use_triton", lambda t: False)
    monkeypatch.setattr(_ragged, "use_triton", lambda t: False)
    monkeypatch.setenv("AUTORAGGED_DB_KEEP_DECISIONS", "4")
    path = tmp_path / "t.sqlite"
    layer = nn.TransformerEncoderLayer(32, 2, 32, batch_first=True, dropout=0.0)
    model = autoragged.wrap(nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval(), db=path)
    with torch.no_grad():
        for i in range(10):
            model(torch.randn(2, 8 + i, 32), lengths=[8 + i, 3])
            if i == 4:
                autoragged.flush()  # two flushes: the second prunes what the first kept
    autoragged.unwrap(model)
    with TuningDB.open(path) as db:
        kept = db.decisions()
        assert [d.stats.max_len for d in kept] == [14, 15, 16, 17] and sum(t.batches for t in db.decision_totals()) == 6
    s = report.summary(path)
    (m,) = s.devices[0].modules
    assert (m.batches, m.rolled_up, sum(sh.batches for sh in m.arms)) == (10, 6, 10)
