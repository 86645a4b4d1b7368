"""The tuning database (tuning_db): schema and migrations, exact round trips, filters, one transaction per
batch, several processes and threads, a writer killed mid-transaction, clear errors, and optuna's tables
in the same file. CPU only; no torch in tuning_db."""

from __future__ import annotations

import itertools
import json
import os
import select
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import sqlite_utils
from _broken_db import damaged_db, deny_writes, in_readonly_mount
from autoragged.tuning_db import (
    BatchStats,
    DamagedDatabase,
    DatabaseError,
    Decision,
    DecisionTotals,
    DeviceKey,
    Measurement,
    ModelRecord,
    ModuleSignature,
    ReadOnlyDatabase,
    RowError,
    Skipped,
    TuningDB,
    config_key,
    default_path,
)
from autoragged.tuning_db import migrations as mig
from autoragged.tuning_db._db import decision_row, measurement_row
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_db_worker.py")
OUR_TABLES = {"_migrations", "devices", "kernel_configs", "measurements", "models", "decisions", "tune_items",
              "decision_totals", "decision_buckets"}  # fmt: skip
N_MIGRATIONS = len(mig.MIGRATIONS)

H100 = DeviceKey("NVIDIA H100 80GB HBM3", "9.0", 132, 81559, "550.54", "2.11.0", "3.6.0")
CPU = DeviceKey("cpu", "cpu", 0, 0, "", "2.11.0", "")
ENC = ModuleSignature("encoder", 6, 512, 8, 2048, "relu", False, "float16")
CFG = {"block_m": 64, "block_n": 64, "warps": 4, "stages": 2, "align": 16}


def decision(i: int = 0, *, device: str = H100.key, signature: str = ENC.key, t: float = 1000.0, **kw) -> Decision:
    fields = dict(
        time=t + i,
        device=device,
        signature=signature,
        stats=BatchStats.from_lengths((i % 7, 65, 129, 3)),
        arm="ragged",
        config=CFG,
        predicted_ms={"padded": 1.25 + i, "ragged": 0.1 + 0.2},
        reason="cost model",
        measured_ms=None,
    )
    fields.update(kw)
    return Decision(**fields)


def measurement(i: int = 0, *, device: str = H100.key, signature: str = ENC.key, t: float = 1000.0, **kw):
    fields = dict(
        device=device,
        signature=signature,
        arm="padded",
        config=None,
        stats=BatchStats.from_lengths((1, 257, 65 + i)),
        median_ms=0.3 + i / 3,
        p10_ms=0.29,
        p90_ms=0.41,
        reps=50,
        time=t + i,
        source="tune",
        distribution="mnli",
        extra={"l2_flush": True, "sizes": [1, 2, 3]},
    )
    fields.update(kw)
    return Measurement(**fields)


@pytest.fixture
def db(tmp_path):
    with TuningDB.open(tmp_path / "t.sqlite") as opened:
        yield opened


def tables(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:
        return {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def query(path: Path, sql: str, args=()) -> list[tuple]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


# ------------------------------------------------------------------------------------ schema, migrations


def test_fresh_file_has_every_table_in_wal_mode_at_latest_version(tmp_path):
    path = tmp_path / "new" / "dir" / "t.sqlite"  # parent directories are created
    with TuningDB.open(path) as db:
        assert db.path == path
        assert db.schema_version == N_MIGRATIONS == 3
        assert db._conn.execute("PRAGMA busy_timeout").fetchone()[0] == 30_000
        assert db.counts() == dict.fromkeys(mig.DATA_TABLES, 0)
    assert OUR_TABLES <= tables(path)
    assert query(path, "PRAGMA journal_mode") == [("wal",)]  # persistent in the file
    assert [n for (n,) in query(path, "SELECT name FROM _migrations ORDER BY name")] == [n for n, _ in mig.MIGRATIONS]


def test_reopening_is_idempotent_and_keeps_rows(tmp_path):
    path = tmp_path / "t.sqlite"
    with TuningDB.open(path) as db:
        db.add_decisions([decision(1)])
    schema = query(path, "SELECT type, name, sql FROM sqlite_master ORDER BY name")
    stamps = query(path, "SELECT name, applied FROM _migrations ORDER BY name")
    for _ in range(2):
        with TuningDB.open(path) as db:
            assert db.schema_version == N_MIGRATIONS
            assert db.decisions() == [decision(1)]
    assert query(path, "SELECT type, name, sql FROM sqlite_master ORDER BY name") == schema
    assert query(path, "SELECT name, applied FROM _migrations ORDER BY name") == stamps  # nothing re-applied


def test_default_path_env_and_explicit_path(tmp_path, monkeypatch):
    env_path = Path(os.environ["AUTORAGGED_DB"])  # set by the autouse fixture in conftest.py
    assert default_path() == env_path
    with TuningDB.open() as db:
        assert db.path == env_path and env_path.exists()
    explicit = tmp_path / "explicit.sqlite"
    with TuningDB.open(str(explicit)) as db:  # path= beats the environment
        assert db.path == explicit
    monkeypatch.delenv("AUTORAGGED_DB")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_path() == tmp_path / "home" / ".cache" / "autoragged" / "tuning.sqlite"
    with TuningDB.open() as db:
        assert db.path == default_path() and db.path.exists()


def _build_at_version(path: Path, k: int) -> dict[str, int]:
    """A file with only the first `k` migrations applied, and one row in each table the schema has so far."""
    db = sqlite_utils.Database(sqlite3.connect(path, isolation_level=None))
    mig.migrate(db, target=k)
    rows = {
        "devices": {"key": H100.key, **H100.to_dict(), "first_seen": 5.0},
        "kernel_configs": {"key": config_key(CFG), "op": "ragged_attention", "config": json.dumps(CFG)},
        "measurements": measurement_row(measurement(3)),
        "decisions": decision_row(decision(2)),
        "models": {
            "device": H100.key,
            "signature": "*",
            "feature_version": 1,
            "kind": "gbt-arrays",
            "payload": json.dumps({"trees": [[1, 2]]}),
            "metrics": json.dumps({"mape": 0.05}),
            "created": 7.0,
        },
        "tune_items": {"device": H100.key, "plan": "p", "item": "a", "done": 8.0},
    }
    present = {table: 1 for table, row in rows.items() if db[table].exists()}
    for table in present:
        db[table].insert(rows[table])
    db.conn.close()
    return present


@pytest.mark.parametrize("k", range(N_MIGRATIONS))
def test_upgrade_from_every_earlier_version(tmp_path, k):
    path = tmp_path / "old.sqlite"
    present = _build_at_version(path, k)
    assert len(query(path, "SELECT name FROM _migrations")) == k
    with TuningDB.open(path) as db:
        assert db.schema_version == N_MIGRATIONS
        counts = db.counts()
        assert counts == {table: present.get(table, 0) for table in mig.DATA_TABLES}
        if k >= 1:
            assert db.decisions() == [decision(2)]
            assert db.measurements() == [measurement(3)]
            assert db.devices() == [H100]
            assert db.latest_model(H100.key).payload == {"trees": [[1, 2]]}
    assert OUR_TABLES <= tables(path)


def test_empty_file_is_a_fresh_database(tmp_path):
    path = tmp_path / "empty.sqlite"
    path.write_bytes(b"")  # a 0-byte file is a valid, empty SQLite database
    with TuningDB.open(path) as db:
        assert db.schema_version == N_MIGRATIONS


def test_a_failing_migration_rolls_back_alone(tmp_path, monkeypatch):
    path = tmp_path / "t.sqlite"

    def boom(db):
        db["half_done"].create({"x": int})
        raise RuntimeError("migration bug")

    monkeypatch.setattr(mig, "MIGRATIONS", [*mig.MIGRATIONS, ("0099_boom", boom)])
    with pytest.raises(RuntimeError, match="migration bug"):
        TuningDB.open(path)
    assert [n for (n,) in query(path, "SELECT name FROM _migrations ORDER BY name")] == [
        name for name, _ in mig.MIGRATIONS[:-1]
    ]
    assert "half_done" not in tables(path)  # the failed migration's DDL was rolled back with it
    monkeypatch.undo()
    with TuningDB.open(path) as db:
        assert db.schema_version == N_MIGRATIONS


# ------------------------------------------------------------------------------------------ round trips


def test_decision_round_trip_is_exact(db):
    originals = [
        decision(0),
        decision(1, arm="padded", config=None, predicted_ms={}, reason="attn_mask not supported"),
        decision(2, measured_ms=0.123456789012345, stats=BatchStats.from_lengths(())),
        decision(3, arm="ragged_graph", config={}, predicted_ms={"padded_graph": 1e-9, "ragged": 12345.678}),
    ]
    assert db.add_decisions(originals) == 4
    assert db.decisions() == originals
    assert db.add_decisions([]) == 0
    stored = query(db.path, "SELECT config_key, config, predicted_ms FROM decisions ORDER BY id")
    assert stored[0] == (config_key(CFG), json.dumps(CFG, separators=(",", ":")), stored[0][2])
    assert stored[1][:2] == ("", None)  # padded: no config, NULL (not "null")
    assert json.loads(stored[3][2]) == {"padded_graph": 1e-9, "ragged": 12345.678}


def test_measurement_round_trip_is_exact(db):
    originals = [
        measurement(0),
        measurement(1, arm="ragged", config=CFG, source="runtime", distribution="", extra={}),
        measurement(2, p10_ms=0.1 + 0.2, extra={"nested": {"a": [1.5, None, "x"]}, "unicode": "µs ✓"}),
    ]
    assert db.add_measurements(originals) == 3
    assert db.measurements() == originals


def test_decision_round_trip_property(tmp_path):
    finite = st.floats(allow_nan=False, allow_infinity=False)
    lengths = st.lists(st.integers(0, 70_000), max_size=40).map(tuple)
    config = st.none() | st.dictionaries(st.sampled_from(["block_m", "warps", "align"]), st.integers(1, 256))
    examples = itertools.count()
    with TuningDB.open(tmp_path / "prop.sqlite") as db:

        @settings(max_examples=60, deadline=None)
        @given(
            t=finite,
            lengths=lengths,
            config=config,
            predicted=st.dictionaries(st.text(max_size=12), finite, max_size=4),
            reason=st.text(max_size=40),
            measured=st.none() | finite,
        )
        def check(t, lengths, config, predicted, reason, measured):
            device = f"dev-{next(examples)}"  # one device per example: read back exactly what was written
            d = Decision(
                t, device, "s", BatchStats.from_lengths(lengths), "ragged", config, predicted, reason, measured
            )
            db.add_decisions([d])
            assert db.decisions(device=device) == [d]

        check()


def test_json_columns_refuse_what_json_cannot_hold_and_write_nothing(db):
    with pytest.raises(ValueError, match="strict JSON"):
        db.add_decisions([decision(0), decision(1, predicted_ms={"padded": float("inf")})])
    with pytest.raises(TypeError, match="never pickle"):
        db.add_measurements([measurement(0, extra={"array": {1, 2}})])
    assert db.counts()["decisions"] == db.counts()["measurements"] == 0


def _damage(path: Path, table: str, row_id: int, **columns) -> None:
    """Set columns of one row to raw SQL values (text where a number belongs, broken JSON, ...)."""
    conn = sqlite3.connect(path)
    try:
        with conn:
            sets = ", ".join(f"{c} = {v}" for c, v in columns.items())
            conn.execute(f"UPDATE {table} SET {sets} WHERE {'key' if table == 'devices' else 'id'} = ?", [row_id])
    finally:
        conn.close()


DAMAGED_DECISIONS = {  # row id -> (columns set to raw SQL, the problem a reader reports)
    2: ({"predicted_ms": "'{\"padded\": 1.0'"}, "unreadable predicted_ms JSON"),
    3: ({"predicted_ms": '\'{"padded": "fast"}\''}, "predicted_ms holds a value that is not a finite number"),
    4: ({"batch": "'many'"}, "batch is not a non-negative integer"),
    5: ({"time": "'yesterday'"}, "time is not a finite number"),
    6: ({"config": "'[1, 2]'"}, "config is not a JSON object"),
    7: ({"measured_ms": "'slow'"}, "measured_ms is not a finite number"),
    8: ({"predicted_ms": "'" + "[" * 100_000 + "]" * 100_000 + "'"}, "predicted_ms JSON is nested too deeply"),
    9: ({"predicted_ms": "'{\"padded\": NaN}'"}, "unreadable predicted_ms JSON"),
    10: ({"device": "zeroblob(2)"}, "device is not text"),  # a 42 would be stored as the text '42'
    11: ({"batch": "4"}, None),  # not damaged: read back as it is
}


def test_damaged_rows_raise_a_row_error_or_are_skipped_and_counted(db):
    db.add_decisions([decision(i) for i in range(12)])
    for row_id, (columns, _) in DAMAGED_DECISIONS.items():
        _damage(db.path, "decisions", row_id, **columns)
    _damage(db.path, "decisions", 12, reason="CAST(X'C3FF' AS TEXT)")  # invalid UTF-8: read, not fatal
    with pytest.raises(RowError, match=rf"decisions row 2 of the tuning database {db.path}: unreadable predicted_ms"):
        db.decisions()
    skipped = Skipped()
    kept = db.decisions(skipped=skipped)
    assert [d.time for d in kept] == [1000.0, 1010.0, 1011.0] and kept[1].reason == "cost model"
    assert kept[2].stats.batch == 4 and kept[-1].reason != "cost model"  # row 12: replacement characters
    assert skipped.count("decisions") == 9 and skipped.seen["decisions"] == 12
    (line,) = skipped.lines()
    assert line.startswith("skipped 9 of 12 decisions rows: unreadable predicted_ms JSON (ids 2, 9); ")
    for row_id, (_, problem) in DAMAGED_DECISIONS.items():
        if problem and row_id not in (2, 9):
            assert f"{problem} (id {row_id})" in line


def test_damaged_measurements_models_and_devices_are_skipped(db):
    db.register_device(H100)
    db.register_device(CPU)
    db.add_measurements([measurement(i) for i in range(4)])
    for i in range(3):
        db.save_model(device=H100, feature_version=1, kind="k", payload={"v": i}, metrics={"mape": 0.1})
    _damage(db.path, "measurements", 1, extra="'nope'")
    _damage(db.path, "measurements", 2, median_ms="'x'")
    _damage(db.path, "models", 1, metrics="'['")
    _damage(db.path, "models", 2, created="'today'")
    _damage(db.path, "devices", CPU.key, sm_count="'lots'")
    skipped = Skipped()
    assert [m.time for m in db.measurements(skipped=skipped)] == [1002.0, 1003.0]
    assert [m.payload for m in db.models(skipped=skipped)] == [{"v": 2}]
    assert [(m.id, m.payload) for m in db.models(payload=False, skipped=Skipped())] == [(3, None)]
    assert db.devices(skipped=skipped) == [H100]
    assert skipped.lines() == [
        "skipped 2 of 4 measurements rows: unreadable extra JSON (id 1); median_ms is not a finite number (id 2)",
        "skipped 2 of 3 models rows: unreadable metrics JSON (id 1); created is not a finite number (id 2)",
        f"skipped 1 of 2 devices rows: sm_count is not a non-negative integer (key {CPU.key})",
    ]
    with pytest.raises(RowError, match="models row 2 .*created is not a finite number.*--refit"):
        db.latest_model(H100, feature_version=1)  # the newest row is damaged: an error, never an older model


def test_latest_model_refuses_a_payload_over_the_cap_before_reading_it(db):
    db.save_model(device=H100, feature_version=1, kind="k", payload={"pad": "x" * 5000}, metrics={})
    assert db.latest_model(H100, max_payload_bytes=10_000).payload == {"pad": "x" * 5000}
    with pytest.raises(RowError, match=r"models row 1 .*payload is 5,010 bytes, over the 1,000 read at most"):
        db.latest_model(H100, max_payload_bytes=1000)


# ---------------------------------------------------------------------------------------------- filters


def test_measurement_filters(db):
    rows = [
        measurement(0, t=10.0),
        measurement(1, t=20.0, device=CPU.key),
        measurement(2, t=30.0, signature="other", source="runtime"),
        measurement(3, t=40.0, arm="ragged", config=CFG),
    ]
    db.add_measurements(rows[::-1])  # written newest first: reads come back oldest first
    assert db.measurements() == rows
    assert db.measurements(device=H100.key) == [rows[0], rows[2], rows[3]]
    assert db.measurements(device=CPU) == [rows[1]]  # a DeviceKey stands for its key
    assert db.measurements(signature=ENC) == [rows[0], rows[1], rows[3]]
    assert db.measurements(source="runtime") == [rows[2]]
    assert db.measurements(arm="ragged") == [rows[3]]
    assert db.measurements(since=30.0) == [rows[2], rows[3]]
    assert db.measurements(device=H100.key, source="tune", since=15.0) == [rows[3]]
    assert db.measurements(device="nope") == []


def test_decision_filters_and_limit_order(db):
    rows = [decision(i, t=100.0, device=H100.key if i % 2 else CPU.key) for i in range(10)]
    db.add_decisions(rows[5:])
    db.add_decisions(rows[:5])  # ids are not in time order: ordering must follow time
    assert db.decisions() == rows
    assert db.decisions(limit=3) == [rows[9], rows[8], rows[7]]  # newest first
    assert db.decisions(device=H100, limit=2) == [rows[9], rows[7]]
    assert db.decisions(since=107.0) == rows[7:]
    assert db.decisions(device=CPU.key, since=104.0) == [rows[4], rows[6], rows[8]]
    assert db.decisions(signature="other") == []
    assert db.decisions(limit=0) == []


# ---------------------------------------------------------------------------------- devices and configs


def test_register_device_is_an_idempotent_upsert(db):
    assert db.register_device(H100) == H100.key
    first_seen = query(db.path, "SELECT first_seen FROM devices")[0][0]
    assert db.register_device(H100) == H100.key
    assert db.devices() == [H100]
    newer_driver = DeviceKey(**{**H100.to_dict(), "driver": "560.1"})  # same key, fields updated
    db.register_device(newer_driver)
    db.register_device(CPU)
    assert db.devices() == [newer_driver, CPU]
    assert query(db.path, "SELECT first_seen FROM devices WHERE key = ?", [H100.key]) == [(first_seen,)]


def test_register_config_is_an_idempotent_upsert(db):
    key = db.register_config("ragged_attention", CFG)
    assert key == config_key(CFG) != ""
    assert db.register_config("ragged_attention", dict(reversed(CFG.items()))) == key  # key order is irrelevant
    db.register_config("ragged_linear", {"block_m": 128})
    stored = query(db.path, "SELECT key, op, config FROM kernel_configs ORDER BY op")
    assert [(k, op) for k, op, _ in stored] == [
        (key, "ragged_attention"),
        (config_key({"block_m": 128}), "ragged_linear"),
    ]
    assert json.loads(stored[0][2]) == CFG
    with pytest.raises(ValueError, match="padded arm"):
        db.register_config("ragged_attention", {})


# ---------------------------------------------------------------------------------------------- models


def test_latest_model_is_the_newest_by_created(db):
    first = db.save_model(device=H100, feature_version=1, kind="gbt-arrays", payload={"v": 1}, metrics={"mape": 0.2})
    second = db.save_model(device=H100.key, feature_version=1, kind="gbt-arrays", payload={"v": 2}, metrics={})
    assert second > first
    assert db.latest_model(H100).payload == {"v": 2}
    with sqlite3.connect(db.path) as conn:  # make the older id the newer model: `created` decides, not id
        conn.execute("UPDATE models SET created = created + 3600 WHERE id = ?", [first])
    latest = db.latest_model(H100.key)
    assert isinstance(latest, ModelRecord)
    assert (latest.id, latest.payload, latest.metrics, latest.kind) == (first, {"v": 1}, {"mape": 0.2}, "gbt-arrays")
    assert db.latest_model(CPU.key) is None
    assert [m.id for m in db.models()] == [second, first]  # oldest first by created
    assert db.models(CPU) == []


def test_latest_model_feature_version_and_signature(db):
    general = db.save_model(device=H100, feature_version=2, kind="k", payload={"fit": "*"}, metrics={})
    specific = db.save_model(
        device=H100, feature_version=2, kind="k", payload={"fit": "enc"}, metrics={}, signature=ENC
    )
    newer_general = db.save_model(device=H100, feature_version=2, kind="k", payload={"fit": "*2"}, metrics={})
    old_features = db.save_model(device=H100, feature_version=1, kind="k", payload={}, metrics={})
    assert db.latest_model(H100).id == old_features  # no filter: newest of all
    assert db.latest_model(H100, feature_version=2).id == newer_general
    assert db.latest_model(H100, feature_version=2, signature=ENC).id == specific  # fit for it beats "*"
    assert db.latest_model(H100, feature_version=2, signature="other").id == newer_general  # falls back to "*"
    assert db.latest_model(H100, feature_version=3) is None
    assert general < specific


def test_model_payload_is_stored_as_json_text_never_pickle(db):
    payload = {"feature_version": 3, "thresholds": [0.5, 1e-300, -2.0], "leaves": [[1, 2], [3]], "names": ("a", "b")}
    model_id = db.save_model(device=H100, feature_version=3, kind="gbt-arrays", payload=payload, metrics={"r2": 0.9})
    ((kind, text, metrics),) = query(
        db.path, "SELECT typeof(payload), payload, metrics FROM models WHERE id = ?", [model_id]
    )
    assert kind == "text" and text.startswith("{")
    assert json.loads(text) == {**payload, "names": ["a", "b"]}  # JSON: a tuple comes back as a list
    assert json.loads(metrics) == {"r2": 0.9}
    assert db.latest_model(H100).payload == json.loads(text)
    with pytest.raises(TypeError, match="never pickle"):
        db.save_model(device=H100, feature_version=3, kind="k", payload={"model": object()}, metrics={})
    with pytest.raises(ValueError, match="NaN"):
        db.save_model(device=H100, feature_version=3, kind="k", payload={"x": float("nan")}, metrics={})
    assert db.counts()["models"] == 1


# --------------------------------------------------------------------------------- tuner resume, counts


def test_mark_done_and_done_items(db):
    assert db.done_items(H100, "plan-a") == set()
    assert db.mark_done(H100, "plan-a", ["mnli@32", "wiki@64"]) == 2
    assert db.mark_done(H100.key, "plan-a", ["wiki@64", "race@128"]) == 1  # already-done items are kept as they were
    db.mark_done(CPU, "plan-a", ["x"])
    db.mark_done(H100, "plan-b", ["y"])
    assert db.done_items(H100.key, "plan-a") == {"mnli@32", "wiki@64", "race@128"}
    assert db.done_items(CPU.key, "plan-a") == {"x"}
    assert db.mark_done(H100, "plan-a", []) == 0


def test_counts(db):
    db.register_device(H100)
    db.register_config("ragged_attention", CFG)
    db.add_measurements([measurement(i) for i in range(3)])
    db.add_decisions([decision(i) for i in range(5)])
    db.save_model(device=H100, feature_version=1, kind="k", payload={}, metrics={})
    db.mark_done(H100, "p", ["a", "b"])
    assert db.counts() == {
        "devices": 1,
        "kernel_configs": 1,
        "measurements": 3,
        "models": 1,
        "decisions": 5,
        "tune_items": 2,
        "decision_totals": 0,
        "decision_buckets": 0,
    }


# -------------------------------------------------------------------------------------------- retention


def _count_rollup(decisions):
    """A stand-in for autoragged's rollup: one totals record per (device, signature, arm), batches and time range."""
    out: dict = {}
    for d in decisions:
        t = DecisionTotals(d.device, d.signature, 0.0, d.arm, d.arm, "r", False, 1, d.time, d.time,
                           sampled=int(d.measured_ms is not None), measured_sum=d.measured_ms or 0.0,
                           measured_min=d.measured_ms, measured_max=d.measured_ms)  # fmt: skip
        key = (d.device, d.signature, d.arm)
        if key in out:
            out[key].merge(t)
        else:
            out[key] = t
    return list(out.values()), []


def test_prune_keeps_the_newest_per_signature_and_adds_the_rest_up(db):
    db.add_decisions([decision(i, measured_ms=float(i) if i % 3 == 0 else None) for i in range(10)])
    db.add_decisions([decision(i, signature="other", t=5000.0) for i in range(3)])
    seen = []

    def rollup(decisions):
        seen.append([d.time for d in decisions])
        return _count_rollup(decisions)

    statements: list[str] = []
    db._conn.set_trace_callback(statements.append)
    assert db.prune_decisions(4, rollup) == 6
    db._conn.set_trace_callback(None)
    assert [s for s in statements if s.startswith("BEGIN")] == ["BEGIN IMMEDIATE"]  # one transaction for all
    assert seen == [[1000.0 + i for i in range(6)]]  # the oldest six of ENC; "other" has only three
    assert [d.time for d in db.decisions(signature=ENC)] == [1006.0 + i for i in range(4)]
    assert len(db.decisions(signature="other")) == 3
    (t,) = db.decision_totals()
    assert (t.batches, t.first, t.last, t.sampled, t.measured_sum, t.measured_min, t.measured_max) == (
        6,
        1000.0,
        1005.0,
        2,
        3.0,
        0.0,
        3.0,
    )
    db.add_decisions([decision(i) for i in (20, 21)])
    assert db.prune_decisions(4, rollup, pairs=[(H100.key, ENC.key)]) == 2  # totals merge: sums add, min/max
    (t,) = db.decision_totals()
    assert (t.batches, t.first, t.last, t.sampled, t.measured_sum, t.measured_max) == (8, 1000.0, 1007.0, 3, 9.0, 6.0)
    assert db.decision_totals(since=1007.0) == [t] and db.decision_totals(since=1007.5) == []
    assert db.decision_totals(device=CPU) == [] and db.counts()["decisions"] == 4 + 3
    assert db.prune_decisions(0, _count_rollup) == 7 and db.counts()["decisions"] == 0
    with pytest.raises(ValueError, match="keep must be an int >= 0"):
        db.prune_decisions(-1, _count_rollup)


def test_prune_measurements_keeps_the_newest_runtime_timings_per_signature(db):
    """The runtime records a timing every sample_every-th batch without end: the newest `keep` of each (device,
    signature) stay, older ones go; the tuner's measurements are never pruned."""
    db.add_measurements([measurement(i, source="runtime") for i in range(10)])
    db.add_measurements([measurement(i, source="runtime", signature="other", t=5000.0) for i in range(3)])
    db.add_measurements([measurement(i) for i in range(4)])  # the tuner's
    assert db.prune_measurements(4, pairs=[(H100.key, ENC.key)]) == 6
    runtime = [m.time for m in db.measurements(signature=ENC.key) if m.source == "runtime"]
    assert runtime == [1006.0 + i for i in range(4)]
    assert len([m for m in db.measurements(signature=ENC.key) if m.source == "tune"]) == 4
    assert len(db.measurements(signature="other")) == 3  # not among the pairs
    assert db.prune_measurements(1) == 3 + 2 and len(db.measurements(signature="other")) == 1  # every pair
    assert db.prune_measurements(1) == 0
    with pytest.raises(ValueError, match="keep must be an int >= 0"):
        db.prune_measurements(-1)


def test_prune_deletes_unreadable_rows_without_counting_them(db):
    db.add_decisions([decision(i) for i in range(5)])
    _damage(db.path, "decisions", 1, predicted_ms="'{'")
    assert db.prune_decisions(2, _count_rollup) == 3
    (t,) = db.decision_totals()
    assert t.batches == 2 and len(db.decisions()) == 2


def test_a_failing_rollup_prunes_nothing(db):
    db.add_decisions([decision(i) for i in range(5)])

    def broken(decisions):
        raise RuntimeError("rollup bug")

    with pytest.raises(RuntimeError, match="rollup bug"):
        db.prune_decisions(1, broken)
    assert len(db.decisions()) == 5 and db.decision_totals() == []


def test_keep_decisions_from_the_environment(monkeypatch, caplog):
    from autoragged.tuning_db import DEFAULT_KEEP_DECISIONS, KEEP_ENV_VAR, keep_decisions

    monkeypatch.delenv(KEEP_ENV_VAR, raising=False)
    assert keep_decisions() == DEFAULT_KEEP_DECISIONS == 20_000
    for text, keep in (("0", 0), ("1_000", 1000), (" 50 ", 50), ("all", None), ("ALL", None)):
        monkeypatch.setenv(KEEP_ENV_VAR, text)
        assert keep_decisions() == keep, text
    for text in ("-3", "lots", "1e4"):
        monkeypatch.setenv(KEEP_ENV_VAR, text)
        assert keep_decisions() == DEFAULT_KEEP_DECISIONS
        assert keep_decisions() == DEFAULT_KEEP_DECISIONS  # warned once per value
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 3 and all(KEEP_ENV_VAR in w and "'all'" in w for w in warnings)


def test_a_reader_opens_a_file_from_before_the_rollup_tables(tmp_path):
    path = tmp_path / "old.sqlite"
    _build_at_version(path, 2)
    with TuningDB.open(path, readonly=True) as db:  # nothing to migrate for a reader: the totals read as empty
        assert db.decisions() == [decision(2)] and db.decision_totals() == [] and db.decision_buckets() == []
        assert db.counts()["decision_totals"] == 0 and db.device_keys() == [H100.key]
    assert "decision_totals" not in tables(path)  # and the file is left as it was
    with TuningDB.open(path) as db:
        assert db.schema_version == N_MIGRATIONS and db.decisions() == [decision(2)]


# -------------------------------------------------------------------------------------------- transactions


def test_a_batch_is_one_transaction(db):
    statements: list[str] = []
    db._conn.set_trace_callback(statements.append)
    db.add_decisions([decision(i) for i in range(500)])
    db.add_measurements([measurement(i) for i in range(500)])
    db._conn.set_trace_callback(None)
    begins = [s for s in statements if s.startswith("BEGIN")]
    assert begins == ["BEGIN IMMEDIATE"] * 2
    assert statements.count("COMMIT") == 2
    assert db.counts()["decisions"] == db.counts()["measurements"] == 500


def test_a_failing_batch_writes_nothing(db):
    good = [decision(i) for i in range(200)]  # several INSERT chunks before the bad row
    with pytest.raises(DatabaseError, match=str(db.path)):
        db.add_decisions([*good, decision(200, device=None)])  # NOT NULL fails on the last row
    assert db.counts()["decisions"] == 0
    assert db.add_decisions(good) == 200  # the connection is usable afterwards


def test_usable_from_flusher_threads(db):
    errors: list[BaseException] = []

    def flusher(start: int):
        try:
            for b in range(20):
                db.add_decisions([decision(start + b * 10 + i) for i in range(10)])
        except BaseException as e:  # surfaces in the main thread's assert
            errors.append(e)

    threads = [threading.Thread(target=flusher, args=(start,)) for start in (0, 1000)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        assert len(db.decisions(limit=5)) <= 5  # the main thread reads while two threads write
    for thread in threads:
        thread.join()
    assert errors == []
    assert db.counts()["decisions"] == 400


def test_closed_database_says_so(tmp_path):
    with TuningDB.open(tmp_path / "t.sqlite") as db:
        pass
    with pytest.raises(DatabaseError, match="closed"):
        db.decisions()
    db.close()  # idempotent


# ------------------------------------------------------------------------------------ several processes


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKER), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0, cwd=ROOT
    )


def _read_line(proc: subprocess.Popen, timeout_s: float = 60.0) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline().decode() if ready else ""
    if not line:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"worker said nothing (rc={proc.returncode}): {err.decode()[-2000:]}")
    return line.strip()


def _finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()[-2000:]
    return out.decode()


def test_two_processes_writing_at_once_lose_no_rows(tmp_path):
    path = tmp_path / "shared.sqlite"
    go = tmp_path / "go"
    TuningDB.open(path).close()
    procs = [_spawn("write", str(path), tag, "20", "50", str(go)) for tag in ("a", "b")]
    assert [_read_line(p) for p in procs] == ["ready", "ready"]
    go.touch()  # both start writing together
    for p in procs:
        assert "done" in _finish(p)
    with TuningDB.open(path) as db:
        reasons = [d.reason for d in db.decisions()]
    assert len(reasons) == 2000
    assert set(reasons) == {f"{tag}:{i}" for tag in "ab" for i in range(1000)}


def test_processes_opening_a_fresh_file_at_once_migrate_it_once(tmp_path):
    path = tmp_path / "fresh.sqlite"
    go = tmp_path / "go"
    procs = [_spawn("open", str(path), str(go)) for _ in range(4)]
    go.touch()
    assert [_finish(p).strip() for p in procs] == [f"version {N_MIGRATIONS}"] * 4
    assert len(query(path, "SELECT name FROM _migrations")) == N_MIGRATIONS


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_writer_killed_mid_transaction_leaves_a_consistent_file(tmp_path):
    path = tmp_path / "crash.sqlite"
    TuningDB.open(path).close()
    wal_before = os.path.getsize(f"{path}-wal") if os.path.exists(f"{path}-wal") else 0
    proc = _spawn("hold", str(path), "10", "3000")
    line = _read_line(proc)
    assert line.startswith("holding")
    assert int(line.split()[1]) > wal_before + 100_000, "uncommitted pages should have reached the WAL file"
    with TuningDB.open(path) as reader:  # WAL: a reader is not blocked by the open write transaction
        assert len(reader.decisions()) == 10
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    with TuningDB.open(path) as db:
        assert db._conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        reasons = [d.reason for d in db.decisions()]
        assert reasons == [f"committed:{i}" for i in range(10)]
        assert db.add_decisions([decision(0)]) == 1  # the dead writer's lock is gone
        assert db.counts()["decisions"] == 11


# ---------------------------------------------------------------------------------------------- errors


def test_a_directory_is_not_a_database(tmp_path):
    for readonly in (False, True):  # a reader said "nothing was recorded there yet"
        with pytest.raises(DatabaseError, match="is a directory") as info:
            TuningDB.open(tmp_path, readonly=readonly)
        message = str(info.value)
        assert str(tmp_path / "tuning.sqlite") in message and "nothing was recorded" not in message
        # the remedy names what users pass: wrap's db=, the CLIs' --db, the variable (not TuningDB.open's path=)
        assert "path=" not in message and "db=" in message and "--db" in message and "AUTORAGGED_DB" in message


def test_a_parent_that_is_a_file(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    path = blocker / "sub" / "t.sqlite"
    with pytest.raises(DatabaseError, match="cannot create the directory") as info:
        TuningDB.open(path)
    assert str(path) in str(info.value)


@pytest.mark.skipif(os.name != "posix", reason="needs POSIX permissions")
def test_a_parent_that_is_not_writable(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.geteuid() == 0:  # root may write anyway: make the permission check see what a user would see
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == locked else real_access(p, mode))
    try:
        with pytest.raises(DatabaseError, match="not writable") as info:
            TuningDB.open(locked / "t.sqlite")
        assert str(locked / "t.sqlite") in str(info.value)
        assert not (locked / "t.sqlite").exists()
    finally:
        locked.chmod(0o700)


@pytest.mark.parametrize("content", [os.urandom(8192), b"hello, not a database\n"], ids=["random", "text"])
def test_a_file_that_is_not_sqlite(tmp_path, content):
    path = tmp_path / "t.sqlite"
    path.write_bytes(content)
    with pytest.raises(DatabaseError, match=r"is not a tuning database \(corrupt or not SQLite\)") as info:
        TuningDB.open(path)
    assert str(path) in str(info.value) and "AUTORAGGED_DB" in str(info.value)
    assert path.read_bytes() == content  # left untouched for the user to inspect


def test_a_corrupt_sqlite_file(tmp_path):
    path = tmp_path / "t.sqlite"
    with TuningDB.open(path) as db:
        db.add_decisions([decision(i) for i in range(100)])
    data = bytearray(path.read_bytes())
    data[100:] = os.urandom(len(data) - 100)  # keep the SQLite header, destroy the pages
    path.write_bytes(bytes(data))
    with pytest.raises(DatabaseError, match="corrupt") as info:
        with TuningDB.open(path) as db:
            db.decisions()
    assert str(path) in str(info.value)


def test_a_file_with_damaged_pages_is_refused_when_opened(tmp_path):
    """A valid header and first page with damaged pages further in: SQLite opens such a file and fails only where
    a query reads those pages, so a writer used to go on writing into it. Opening it checks it."""
    path = tmp_path / "t.sqlite"
    damaged = damaged_db(path)
    for readonly in (False, True):
        with pytest.raises(DatabaseError, match="is damaged") as info:
            TuningDB.open(path, readonly=readonly)
        assert isinstance(info.value, DamagedDatabase)
        assert str(path) in str(info.value) and "AUTORAGGED_DB" in str(info.value)
    assert path.read_bytes() == damaged  # left as it was, for the user to inspect


def test_the_damage_check_reads_a_file_once_until_it_changes(tmp_path, monkeypatch):
    """PRAGMA quick_check reads every page (86 ms for a 74 MB file on a 2-core CPU): once per process and file,
    again only when the file has changed."""
    from autoragged.tuning_db import _connect

    path = tmp_path / "t.sqlite"
    TuningDB.open(path).close()
    checked = []
    real = _connect._quick_check
    monkeypatch.setattr(_connect, "_quick_check", lambda conn, path: checked.append(path) or real(conn, path))
    for _ in range(3):
        TuningDB.open(path).close()
        TuningDB.open(path, readonly=True).close()
    assert checked == [path]
    with TuningDB.open(path) as db:
        db.add_decisions([decision(i) for i in range(50)])
    TuningDB.open(path, readonly=True).close()  # the file was written since its check
    assert checked == [path, path]


@pytest.mark.parametrize("denied", ["file", "directory"])
def test_a_read_only_file_is_refused_for_writing_and_read_as_it_is(tmp_path, monkeypatch, denied):
    path = tmp_path / "t.sqlite"
    with TuningDB.open(path) as db:
        db.add_decisions([decision(0)])
    before = path.read_bytes()
    deny_writes(monkeypatch, path if denied == "file" else tmp_path)
    with pytest.raises(DatabaseError, match="read-only") as info:
        TuningDB.open(path)
    assert isinstance(info.value, ReadOnlyDatabase) and str(path) in str(info.value)
    with TuningDB.open(path, readonly=True) as db:
        assert db.readonly and db.decisions() == [decision(0)]
    assert path.read_bytes() == before


def test_a_file_in_a_read_only_mount_is_read(tmp_path):
    """For real: the directory is a read-only bind mount, where SQLite cannot make the -shm file a WAL reader
    needs (it said "unable to open database file"), root included."""
    path = tmp_path / "t.sqlite"
    with TuningDB.open(path) as db:
        db.add_decisions([decision(i) for i in range(3)])
    probe = (
        "import sys\n"
        "from autoragged.tuning_db import ReadOnlyDatabase, TuningDB\n"
        "try:\n"
        "    TuningDB.open(sys.argv[1])\n"
        "except ReadOnlyDatabase as e:\n"
        "    print('refused:', e)\n"
        "with TuningDB.open(sys.argv[1], readonly=True) as db:\n"
        "    print('read', len(db.decisions()))\n"
    )
    done = in_readonly_mount(tmp_path, ["-c", probe, str(path)])
    assert done.returncode == 0, done.stderr
    refused, read = done.stdout.splitlines()
    assert refused.startswith(f"refused: the tuning database {path} is read-only") and read == "read 3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.sqlite"]


def test_a_schema_from_a_newer_autoragged(tmp_path):
    path = tmp_path / "t.sqlite"
    TuningDB.open(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO _migrations VALUES ('0099_from_the_future', 1e10)")
    with pytest.raises(DatabaseError, match="newer autoragged") as info:
        TuningDB.open(path)
    assert str(path) in str(info.value) and "0099_from_the_future" in str(info.value)


# ---------------------------------------------------------------------------------------------- optuna


def _optuna():
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def test_optuna_shares_the_file(tmp_path):
    optuna = _optuna()
    path = tmp_path / "t.sqlite"
    with TuningDB.open(path) as db:
        db.register_device(H100)
        db.add_decisions([decision(i) for i in range(5)])
        assert db.optuna_storage_url() == f"sqlite:///{path}"  # nothing to escape in this path
        study = optuna.create_study(storage=db.optuna_storage_url(), study_name="x")
        study.optimize(lambda trial: trial.suggest_float("block", 0.0, 1.0) ** 2, n_trials=3)
        db.add_decisions([decision(5)])  # our writes still work while optuna holds its engine
    optuna_tables = tables(path) - OUR_TABLES
    assert {"studies", "trials", "trial_params", "trial_values", "version_info"} <= optuna_tables
    with TuningDB.open(path) as db:
        assert db.schema_version == N_MIGRATIONS
        assert db.counts()["decisions"] == 6 and db.devices() == [H100]
        assert db.decisions() == [decision(i) for i in range(6)]
        assert len(optuna.load_study(study_name="x", storage=db.optuna_storage_url()).trials) == 3


def test_optuna_shares_a_file_whose_path_needs_escaping(tmp_path):
    """`?` starts a URL's query, `#` its fragment, `%` an escape, and optuna runs the URL through str.format:
    unescaped, optuna's tables went to another file (or failed) while ours stayed here."""
    optuna = _optuna()
    from autoragged import tune

    folder = tmp_path / "odd ?#% {dir}"
    path = folder / "t?u#n%41e {0}.sqlite"
    with TuningDB.open(path) as db:
        url = db.optuna_storage_url()
        optuna.create_study(storage=url, study_name="by url").optimize(lambda t: t.suggest_int("a", 0, 3), 2)
        storage = optuna.storages.RDBStorage(url, engine_kwargs=db.optuna_engine_kwargs())
        optuna.create_study(storage=storage, study_name="by path").optimize(lambda t: t.suggest_int("a", 0, 3), 2)
        study = tune._Context(db, None, CPU).study(ENC, 100)  # what python -m autoragged.tune opens
        study.optimize(lambda t: t.suggest_int("a", 0, 3), 1)
    written = [p for p in tmp_path.rglob("*") if p != folder]
    assert written and all(str(p) in (str(path), f"{path}-wal", f"{path}-shm") for p in written)  # nowhere else
    names = [n for (n,) in query(path, "SELECT study_name FROM studies ORDER BY study_id")]
    assert names == ["by url", "by path", study.study_name]
    assert query(path, "SELECT count(*) FROM trials") == [(5,)] and OUR_TABLES <= tables(path)


def test_tuning_db_opens_a_file_optuna_created_first(tmp_path):
    optuna = _optuna()
    path = tmp_path / "t.sqlite"
    optuna.create_study(storage=f"sqlite:///{path}", study_name="first").optimize(lambda t: t.suggest_int("a", 0, 3), 2)
    with TuningDB.open(path) as db:
        assert db.schema_version == N_MIGRATIONS
        db.add_decisions([decision(0)])
        assert db.counts()["decisions"] == 1
    assert len(optuna.load_study(study_name="first", storage=f"sqlite:///{path}").trials) == 2


# -------------------------------------------------------------------------------------------- layering


def test_importing_tuning_db_pulls_in_no_torch_numpy_or_runtime():
    probe = (
        "import sys, autoragged.tuning_db as tuning_db\n"
        "heavy = ('torch', 'numpy', 'sqlite_utils', 'autoragged.wrapper', 'autoragged.kernels')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "tuning_db.TuningDB.open(sys.argv[1]).close()\n"
        "print(sorted(m for m in ('torch', 'autoragged.wrapper', 'autoragged.kernels', 'optuna') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, os.environ["AUTORAGGED_DB"]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "[]"]


def test_readonly_open_reads_and_never_writes(tmp_path):
    import sqlite3

    path = tmp_path / "ro.sqlite"
    with TuningDB.open(path) as db:
        db.register_device(DeviceKey("g", "9.0", 1, 1, "d", "t", "tr"))
    before = path.read_bytes()
    with TuningDB.open(path, readonly=True) as db:
        assert [d.name for d in db.devices()] == ["g"]
        with pytest.raises(DatabaseError):
            db.register_device(DeviceKey("h", "9.0", 1, 1, "d", "t", "tr"))
    assert path.read_bytes() == before
    other = tmp_path / "other.sqlite"
    sqlite3.connect(other).execute("CREATE TABLE x (a)").connection.close()
    with pytest.raises(DatabaseError, match="not a tuning database"):
        TuningDB.open(other, readonly=True)
    assert sqlite3.connect(other).execute("SELECT name FROM sqlite_master").fetchall() == [("x",)]
    with pytest.raises(DatabaseError, match="no tuning database"):
        TuningDB.open(tmp_path / "missing.sqlite", readonly=True)
