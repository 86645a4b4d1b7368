"""A hostile or damaged tuning database: every kind of bad cost model payload falls back to the analytic prior
with one warning while the wrapped model's forward stays right; non-finite predictions never reach a decision
or the writer; one bad record never costs the rest of a flush, and a flush bounds the decisions it keeps.
CPU only, tiny models, a few seconds in all."""

from __future__ import annotations

import json
import logging
import math
import sqlite3
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from _broken_db import damage_pages, deny_writes, in_readonly_mount
from autoragged.tuning_db import BatchStats, Decision, Measurement, TuningDB
from torch import nn

import autoragged
from autoragged.models.torch_encoder import signature_of
from autoragged.planning import payload as _payload
from autoragged.planning.buckets import mask_width
from autoragged.planning.costmodel import FEATURE_VERSION, PADDED, AnalyticPrior, Arm
from autoragged.planning.device import device_key
from autoragged.planning.learned import KIND, CompiledModel, Forest
from autoragged.planning.load import load_planner_inputs
from autoragged.planning.planner import Planner, default_ragged_config, graph_config
from autoragged.runtime import recorder as _recorder
from autoragged.runtime.policy import MIN_SAMPLES

CPU = device_key("cpu")
CFG = default_ragged_config(32, 64).to_dict()


@pytest.fixture(autouse=True)
def _fast_cpu(monkeypatch):
    """The CPU reference path (the Triton interpreter is far too slow for these forwards), on one thread: these
    tiny forwards took 450 ms instead of 30 ms on two threads while other processes kept the cores busy."""
    from autoragged import ops
    from autoragged.ragged import tensor as _ragged

    monkeypatch.setattr(ops, "use_triton", lambda t: False)
    monkeypatch.setattr(_ragged, "use_triton", lambda t: False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _forest() -> Forest:
    """Two trees of one split each (feature 0 and 1), leaves +-0.1 and +-0.2 (a log-residual)."""
    trees = {
        "feature": [0, 0, 0, 1, 0, 0],
        "threshold": [3.0, 0.0, 0.0, 5.0, 0.0, 0.0],
        "left": [1, 0, 0, 4, 0, 0],
        "right": [2, 0, 0, 5, 0, 0],
        "value": [0.0, 0.1, -0.1, 0.0, 0.2, -0.2],
        "leaf": [False, True, True, False, True, True],
    }
    return Forest(0.0, {k: np.asarray(v) for k, v in trees.items()}, np.asarray([0, 3]), 1)


def good_payload() -> dict:
    model = CompiledModel(CPU, _forest(), {"*": [{"max_len_le": 1 << 20, "configs": [CFG]}]}, relative=_forest(),
                          reference="padded")  # fmt: skip
    return json.loads(json.dumps(model.to_payload()))


def store(path, payload, *, text: str | None = None) -> int:
    """A models row for this CPU holding `payload` (or the raw `text`, which need not be JSON); its id."""
    with TuningDB.open(path) as db:
        model_id = db.save_model(device=CPU, feature_version=FEATURE_VERSION, kind=KIND, payload={}, metrics={})
    if text is None:
        text = json.dumps(payload)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE models SET payload = ? WHERE id = ?", [text, model_id])
    conn.close()
    return model_id


def encoder() -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 2, 64, batch_first=True, dropout=0.0)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


def run_wrapped(path, db="path"):
    """(wrapped output, original output, the planner's model, the decision) for one batch with padding.
    db="path": wrap(db=path); db="env": wrap's default ($AUTORAGGED_DB, which the caller sets to path)."""
    model = encoder()
    lengths = [40, 3, 17]
    x = torch.randn(3, 40, 64)
    mask = torch.arange(40)[None, :] >= torch.tensor(lengths)[:, None]
    with torch.no_grad():
        want = model(x, src_key_padding_mask=mask)
        autoragged.wrap(model, db=path if db == "path" else None, sample_every=0)
        got = model(x, src_key_padding_mask=mask)
    decision = autoragged.recent_decisions(model, 1)[0]
    planner_model = model._autoragged.planners[torch.device("cpu")].model
    autoragged.unwrap(model)
    real = ~mask
    return got[real], want[real], planner_model, decision


def _within(seconds: float, fn, *args):
    """fn(*args), failing the test (not hanging it) when it takes longer than `seconds`."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn.__name__} still running after {seconds} s"
    assert out, f"{fn.__name__} raised (see the thread's traceback above)"
    return out[0]


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "autoragged" and r.levelno >= logging.WARNING]


# ------------------------------------------------------------------------------------------ payloads


def test_a_good_payload_is_used(tmp_path, caplog):
    path = tmp_path / "t.sqlite"
    store(path, good_payload())
    got, want, model, decision = run_wrapped(path)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert isinstance(model, CompiledModel) and decision.reason.endswith("cost model (learned)")
    assert warnings_of(caplog) == []


def _detached_cycle(p: dict) -> None:
    """One tree (nodes 0-2) reached from the roots, and nodes 3-6 that point at each other (3 -> 4 -> 3):
    every node has one parent, and 3-6 are reached from no root."""
    p["roots"] = [0]
    p["trees"] = {
        "feature": [0] * 7, "threshold": [1.0] * 7, "value": [0.1] * 7,
        "left": [1, 0, 0, 4, 3, 0, 0], "right": [2, 0, 0, 5, 6, 0, 0],
        "leaf": [False, True, True, False, False, True, True],
    }  # fmt: skip


BAD_PAYLOADS = {
    # name: (mutate the payload dict, or None; raw text, or None; words the warning must hold)
    "cycle": (
        lambda p: p["trees"].update(left=[1, 0, 0, 0, 0, 0], leaf=[False, True, True, False, True, True]),
        None,
        "do not form trees",
    ),
    "cycle, huge depth": (
        lambda p: p.update(depth=10**12) or p["trees"].update(left=[0, 0, 0, 4, 0, 0]),
        None,
        "depth",
    ),
    "detached cycle": (_detached_cycle, None, "not reached from any root"),
    "bad JSON": (None, '{"kind": "gbt-arrays", "trees": [1, 2', "unreadable payload JSON"),
    "a list": (None, "[1, 2, 3]", "not a JSON object"),
    "200k-deep nesting": (None, "[" * 200_000 + "]" * 200_000, "nested too deeply"),
    "feature names": (lambda p: p["feature_names"].reverse(), None, "other features"),
    "feature version": (lambda p: p.update(feature_version=FEATURE_VERSION - 1), None, "other features"),
    "shortlist config": (
        lambda p: p["candidates"]["*"][0]["configs"].append({"block_m": 48}),
        None,
        "not a valid KernelConfig",
    ),
    "shortlist shape": (lambda p: p.update(candidates={"*": {"max_len_le": 3}}), None, "not a list"),
    "missing field": (lambda p: p.pop("baseline"), None, "no field 'baseline'"),
    "missing tree array": (lambda p: p["relative"]["trees"].pop("value"), None, "no field 'value'"),
    "non-numeric depth": (lambda p: p.update(depth="six"), None, "depth is a str"),
    "string in a tree array": (lambda p: p["trees"]["left"].__setitem__(0, "1"), None, "not a flat list"),
    "NaN leaf": (None, "NaN", "unreadable payload JSON"),
    "inf leaf": (None, "1e999", "must be finite"),
    "inf threshold": (lambda p: p["trees"]["threshold"].__setitem__(0, "INF"), None, "must be finite"),
    "negative feature": (lambda p: p["trees"]["feature"].__setitem__(0, -1), None, "feature index is out of range"),
    "feature past the end": (lambda p: p["trees"]["feature"].__setitem__(3, 10**6), None, "out of range"),
    "negative depth": (lambda p: p.update(depth=-1), None, "depth is -1"),
    "depth that is not the trees'": (lambda p: p.update(depth=5), None, "trees are 1 levels deep"),
    "child out of range": (lambda p: p["trees"]["right"].__setitem__(0, 99), None, "right child index is out"),
    "too many trees": (lambda p: p.update(roots=list(range(_payload.MAX_TREES + 1))), None, "trees; at most"),
    "unknown reference": (lambda p: p["relative"].update(reference="eval"), None, "unknown reference arm"),
    "device fields": (lambda p: p["device"].update(sm_count="many"), None, "payload.device.sm_count"),
    "oversized": (None, '{"pad": "' + "x" * (_payload.MAX_PAYLOAD_BYTES + 1) + '"}', "bytes, over the"),
}


def _bad_text(name: str) -> str:
    mutate, text, _ = BAD_PAYLOADS[name]
    if text is not None and mutate is None and name in ("NaN leaf", "inf leaf"):
        dumped = json.dumps(good_payload())
        return dumped.replace('"value": [0.0, 0.1', f'"value": [0.0, {text}', 1)
    if text is not None:
        return text
    payload = good_payload()
    mutate(payload)
    return json.dumps(payload).replace('"INF"', "1e999")


@pytest.mark.parametrize("name", list(BAD_PAYLOADS))
def test_a_bad_payload_falls_back_to_the_prior_with_one_warning(tmp_path, caplog, name):
    path = tmp_path / "t.sqlite"
    text = _bad_text(name)
    assert text != json.dumps(good_payload())
    model_id = store(path, None, text=text)
    got, want, model, decision = _within(60, run_wrapped, path)  # a cycle used to hang here forever
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert isinstance(model, AnalyticPrior) and decision.reason.endswith("cost model (prior)")
    (warning,) = warnings_of(caplog)
    assert f"models row {model_id} of {path}" in warning and "analytic prior" in warning
    assert BAD_PAYLOADS[name][2] in warning, warning


def test_load_planner_inputs_survives_any_exception(tmp_path, monkeypatch, caplog):
    path = tmp_path / "t.sqlite"
    store(path, good_payload())
    sig = signature_of(encoder())
    assert load_planner_inputs(path, CPU, sig) is not None

    def boom(*args, **kwargs):
        raise MemoryError("no memory for this payload")

    monkeypatch.setattr(CompiledModel, "from_payload", boom)
    assert load_planner_inputs(path, CPU, sig) is None
    monkeypatch.undo()
    monkeypatch.setattr(TuningDB, "latest_model", boom)
    assert load_planner_inputs(path, CPU, sig) is None
    first, second = warnings_of(caplog)
    assert "models row 1 of" in first and "no memory for this payload" in first
    assert str(path) in second and "no memory for this payload" in second


def test_the_evaluator_steps_at_most_the_validated_depth():
    forest = _forest()
    forest.left[1], forest.leaf[1] = 0, False  # a cycle made after validation: still `depth` steps, then stop
    assert forest.residual(np.zeros((2, 40))).shape == (2,)
    with pytest.raises(ValueError, match="at most"):
        Forest(0.0, {k: getattr(forest, k) for k in ("feature", "threshold", "left", "right", "value", "leaf")},
               forest.roots, _payload.MAX_DEPTH + 1)  # fmt: skip


# ------------------------------------------------------------------------------- non-finite predictions


class _Model:
    """Predicts `values` for the planner's arms in order: padded, the eager ragged arm, the ragged graph."""

    name = "fake"

    def __init__(self, values, prior=None):
        self.values, self.prior = values, prior

    def predict_ms(self, sig, stats, arms):
        return np.asarray(self.values[: len(arms)], dtype=float)


SIG = signature_of(encoder())
STATS = BatchStats.from_lengths((40, 3, 17))
WIDTH = mask_width(STATS.max_len)


def _decisions(values, batches: int = 1, sample_every: int = 0) -> list[Decision]:
    """The decisions of a wrapped encoder, on `batches` batches of STATS, whose planner's model is _Model(values)."""
    model = autoragged.wrap(encoder(), db=False, sample_every=sample_every)
    rt = model._autoragged
    rt.planners[torch.device("cpu")] = Planner(rt.sig, _Model(values))
    x = torch.randn(3, 40, 64)
    with torch.no_grad():
        for _ in range(batches):
            model(x, lengths=[40, 3, 17])
    return autoragged.recent_decisions(model, batches)


def test_a_nan_prediction_is_no_argmin():
    # np.argmin takes the NaN: padded before, although ragged was predicted 1 ms against no prediction
    got = Planner(SIG, _Model([np.nan, 1.0, 1.0])).predict(STATS, WIDTH)
    assert got.ms["padded"] == math.inf and got.ms["ragged"] == 1.0
    assert "prediction for padded was not finite (none used)" in got.note
    (d,) = _decisions([np.nan, 1.0, 1.0])
    assert d.arm == "ragged" and "not finite (none used)" in d.reason
    (d,) = _decisions([2.0, np.inf, np.nan])
    assert d.arm == "padded" and d.predicted_ms["padded"] == 2.0


def test_a_non_finite_prediction_takes_the_priors():
    prior = AnalyticPrior(CPU)
    arms = [PADDED, Arm("ragged", default_ragged_config(32, 40)), Arm("ragged_graph", graph_config(32, WIDTH))]
    expected = prior.predict_ms(SIG, STATS, arms)
    got = Planner(SIG, _Model([np.nan, 1.5, -1.0], prior)).predict(STATS, WIDTH)  # the eager arm's is kept
    assert [got.ms[k] for k in ("padded", "ragged", "ragged_graph")] == pytest.approx([expected[0], 1.5, expected[2]])
    assert f"prediction for padded, {arms[2].label} was not finite (the prior used)" in got.note


def test_no_finite_prediction_runs_padded():
    """Nothing usable predicted, not even after the padded arm's timings: the module as written runs."""
    got = Planner(SIG, _Model([np.nan, np.inf, 0.0])).predict(STATS, WIDTH)
    assert got.ms == {"padded": math.inf, "ragged": math.inf, "ragged_graph": math.inf} and "(none used)" in got.note
    decisions = _decisions([np.nan, np.inf, 0.0], batches=2 * MIN_SAMPLES, sample_every=1)
    assert [d.arm for d in decisions] == ["padded"] * 2 * MIN_SAMPLES
    assert any(d.measured_ms is not None for d in decisions)  # timed, and still no trial of the ragged arm


def test_leaves_that_overflow_fall_back_per_arm_and_the_forward_is_right(tmp_path, caplog):
    payload = good_payload()
    payload["relative"]["trees"]["value"] = [0.0, 1e300, 1e300, 0.0, 1e300, 1e300]  # finite, but exp() overflows
    path = tmp_path / "t.sqlite"
    store(path, payload)
    got, want, model, decision = run_wrapped(path)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert isinstance(model, CompiledModel) and "was not finite (the prior used)" in decision.reason
    assert set(decision.predicted_ms) == {"padded", "ragged", "ragged_graph"}
    assert all(np.isfinite(v) for v in decision.predicted_ms.values())
    autoragged.flush()
    with TuningDB.open(path) as db:
        (stored,) = db.decisions()
    assert stored.reason == decision.reason and warnings_of(caplog) == []


# ------------------------------------------------------------------------------------------ the writer


def _decision(i: int, **kw) -> Decision:
    fields = dict(time=1000.0 + i, device=CPU.key, signature=SIG.key, stats=STATS, arm="padded", config=None,
                  predicted_ms={"padded": 1.0 + i}, reason=f"r{i}")  # fmt: skip
    return Decision(**{**fields, **kw})


def test_flush_writes_every_good_row_around_a_nan(tmp_path, caplog):
    path = tmp_path / "t.sqlite"
    rec = _recorder.Recorder(interval_s=3600)
    good = [_decision(i) for i in range(5)]
    bad = [
        _decision(10, predicted_ms={"padded": float("nan"), "ragged": 2.0}),  # the NaN prediction is left out
        _decision(11, measured_ms=float("inf")),  # stored without a measurement
        _decision(12, stats=BatchStats(3, 40, 60, 1818, float("nan"), 0.0, 0.5)),  # NOT NULL: this row only
        _decision(13, device=None),  # NOT NULL: this row only (it used to fail the transaction of all)
    ]
    measurement = Measurement(CPU.key, SIG.key, "padded", None, STATS, float("nan"), 1.0, 1.0, 1, 1000.0)
    for d in [*good[:3], *bad, *good[3:]]:
        rec.add(path, CPU, d)
    rec.add(path, CPU, None, measurement)
    rec.add(path, CPU, None, Measurement(CPU.key, SIG.key, "padded", None, STATS, 1.0, float("nan"), 1.0, 1, 1.0))
    assert rec.flush() == 5 + 2 + 1
    with TuningDB.open(path) as db:
        stored = {d.reason: d for d in db.decisions()}
        measurements = db.measurements()
    assert set(stored) == {f"r{i}" for i in (0, 1, 2, 3, 4, 10, 11)}
    assert stored["r10"].predicted_ms == {"ragged": 2.0} and stored["r11"].measured_ms is None
    assert [(m.median_ms, m.p10_ms) for m in measurements] == [(1.0, None)]
    (warning,) = warnings_of(caplog)
    assert "left 3 of 11 records out of" in warning and str(path) in warning
    rec.add(path, CPU, _decision(20))  # the file is not marked broken: later flushes still write
    assert rec.flush() == 1


def test_the_flush_prunes_in_one_more_transaction_not_one_per_batch(tmp_path, monkeypatch):
    path = tmp_path / "t.sqlite"
    rec = _recorder.Recorder(interval_s=3600, keep_decisions=5)
    for i in range(40):
        rec.add(path, CPU, _decision(i, signature="a" if i % 4 else "b"))
    db = rec.open_db(path)
    statements: list[str] = []
    db._conn.set_trace_callback(statements.append)
    assert rec.flush() == 40
    db._conn.set_trace_callback(None)
    # the device, the decisions, the pruning of both signatures: three transactions for 40 batches
    assert [s for s in statements if s.startswith("BEGIN")] == ["BEGIN IMMEDIATE"] * 3
    assert len(db.decisions(signature="a")) == len(db.decisions(signature="b")) == 5
    assert [d.reason for d in db.decisions(signature="b")] == [f"r{i}" for i in (20, 24, 28, 32, 36)]
    assert sum(t.batches for t in db.decision_totals()) == 30
    monkeypatch.setenv("AUTORAGGED_DB_KEEP_DECISIONS", "all")
    rec.keep_decisions = None  # from the environment at each flush: now every row is kept
    for i in range(40, 50):
        rec.add(path, CPU, _decision(i, signature="a"))
    assert rec.flush() == 10 and len(db.decisions(signature="a")) == 15


def test_the_flush_keeps_the_newest_runtime_timings(tmp_path):
    """A long-running model's sampled timings stay bounded as its decisions do; the tuner's are kept."""
    path = tmp_path / "t.sqlite"
    rec = _recorder.Recorder(interval_s=3600, keep_decisions=3)
    for flush in range(3):
        for i in range(4):
            n = 4 * flush + i
            rec.add(path, CPU, measurement=Measurement(CPU.key, SIG.key, "padded", None, STATS, 1.0, 1.0, 1.0, 1,
                                                       1000.0 + n, source="runtime"))  # fmt: skip
        rec.add(path, CPU, measurement=Measurement(CPU.key, SIG.key, "padded", None, STATS, 1.0, 1.0, 1.0, 1,
                                                   2000.0 + flush, source="tune"))  # fmt: skip
        assert rec.flush() == 5
    with TuningDB.open(path) as db:
        timings = db.measurements()
    assert [m.time for m in timings if m.source == "runtime"] == [1009.0, 1010.0, 1011.0]
    assert [m.time for m in timings if m.source == "tune"] == [2000.0, 2001.0, 2002.0]


def test_a_prune_that_fails_warns_once_and_recording_goes_on(tmp_path, caplog):
    path = tmp_path / "t.sqlite"
    rec = _recorder.Recorder(interval_s=3600, keep_decisions=2)
    rec.add(path, CPU, _decision(0))
    rec.flush()
    with sqlite3.connect(path) as conn:  # a damaged file: the totals table is gone
        conn.execute("DROP TABLE decision_totals")
    conn.close()
    for flush in range(3):
        for i in range(5):
            rec.add(path, CPU, _decision(10 * flush + i))
        assert rec.flush() == 5
    (warning,) = warnings_of(caplog)
    assert "could not prune old decisions" in warning and str(path) in warning
    with TuningDB.open(path) as db:
        assert len(db.decisions()) == 16  # every decision written, none pruned


# ------------------------------------------------------------------------------ damaged or read-only files


def _unwritten(path: Path, before: bytes) -> bool:
    """Nothing was written to the database at `path` since it held `before` (its WAL included)."""
    wal = Path(f"{path}-wal")
    return path.read_bytes() == before and (not wal.exists() or wal.stat().st_size == 0)


@pytest.mark.parametrize("db", ["path", "env"])
def test_a_damaged_file_is_neither_read_nor_written(tmp_path, monkeypatch, caplog, db):
    """A valid header, damaged pages: the runtime used to read its cost model and record into it. Now one warning,
    the analytic prior, nothing written, and the forward stays right."""
    path = tmp_path / "t.sqlite"
    store(path, good_payload())  # a cost model the runtime would use, in a page left intact
    with TuningDB.open(path) as tdb:
        tdb.add_decisions([_decision(i) for i in range(300)])
    damaged = damage_pages(path)
    monkeypatch.setenv("AUTORAGGED_DB", str(path))
    got, want, model, decision = run_wrapped(path, db)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert isinstance(model, AnalyticPrior) and "cost model (prior)" in decision.reason
    assert autoragged.flush() == 0 and _unwritten(path, damaged)
    (warning,) = warnings_of(caplog)
    assert f"{path} is damaged" in warning and "analytic prior" in warning and "recording nothing" in warning


@pytest.mark.parametrize("denied", ["file", "directory"])
def test_a_read_only_calibration_is_used_and_nothing_is_recorded(tmp_path, caplog, denied):
    """A deployment ships its calibration read-only: the runtime reads the cost model, records nothing, and says
    so once (in a read-only directory it used to refuse the file at wrap, or warn and use the prior)."""
    path = tmp_path / "t.sqlite"
    store(path, good_payload())
    before = path.read_bytes()
    with pytest.MonkeyPatch.context() as mp:
        deny_writes(mp, path if denied == "file" else tmp_path)
        got, want, model, decision = run_wrapped(path)
        assert autoragged.flush() == 0
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert isinstance(model, CompiledModel) and "cost model (learned)" in decision.reason
    (warning,) = warnings_of(caplog)
    assert f"{path} is read-only" in warning and "recording nothing" in warning
    assert path.read_bytes() == before
    with TuningDB.open(path) as tdb:
        assert tdb.decisions() == []


_IN_A_READ_ONLY_MOUNT = """
import json, logging, sys
import torch
from torch import nn
import autoragged

warnings = []
handler = logging.Handler(logging.WARNING)
handler.emit = lambda record: warnings.append(record.getMessage())
logging.getLogger("autoragged").addHandler(handler)
torch.manual_seed(0)
layer = nn.TransformerEncoderLayer(64, 2, 64, batch_first=True, dropout=0.0)
model = autoragged.wrap(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval(), db=sys.argv[1])
with torch.inference_mode():
    model(torch.randn(3, 40, 64), lengths=[40, 3, 17])
print(json.dumps([autoragged.recent_decisions(model, 1)[0].reason, autoragged.flush(), warnings]))
"""


def test_a_calibration_in_a_read_only_mount_is_used(tmp_path):
    """For real: a read-only bind mount, where even root cannot write and SQLite cannot make the -shm file a WAL
    reader needs; wrap used to refuse the path ("not writable")."""
    path = tmp_path / "t.sqlite"
    store(path, good_payload())
    done = in_readonly_mount(tmp_path, ["-c", _IN_A_READ_ONLY_MOUNT, str(path)], env={"TRITON_INTERPRET": "0"})
    assert done.returncode == 0, done.stderr
    reason, written, warnings = json.loads(done.stdout.splitlines()[-1])
    assert "cost model (learned)" in reason and written == 0
    (warning,) = warnings
    assert f"{path} is read-only" in warning and "recording nothing" in warning
