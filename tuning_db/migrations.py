"""Named, versioned schema migrations of the tuning database.

`MIGRATIONS` is an ordered list of `(name, function)`. A database's schema version is the number of them
applied; the names applied are rows of `_migrations(name TEXT PRIMARY KEY, applied REAL)`. Opening a
database applies the missing ones in order, each in its own `BEGIN IMMEDIATE` transaction, so a crash
or a second process racing on a fresh file never leaves half a migration behind.

Rules for editing this file: never change or reorder a migration that has shipped (files in the wild
already ran it); append a new one instead. Table names must not collide with optuna's study tables
(studies, trials, trial_params, trial_values, version_info, alembic_version, study_directions, ...),
which live in the same file.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # sqlite-utils is imported lazily (it pulls in numpy and click: ~100 ms)
    import sqlite_utils

__all__ = [
    "MIGRATIONS",
    "MIGRATIONS_TABLE",
    "DATA_TABLES",
    "READER_OPTIONAL",
    "applied_migrations",
    "unknown_migrations",
    "migrate",
    "write_transaction",
]

log = logging.getLogger("autoragged")

MIGRATIONS_TABLE = "_migrations"

# The tables this package owns (what `TuningDB.counts()` reports), in creation order.
DATA_TABLES = (
    "devices", "kernel_configs", "measurements", "models", "decisions", "tune_items", "decision_totals",
    "decision_buckets",
)  # fmt: skip
# Tables a read-only reader treats as empty when the file predates them: a report must not refuse a file
# that only lacks what a newer autoragged adds as it writes (opening it read-write migrates it).
READER_OPTIONAL = {"0003_decision_rollups": ("decision_totals", "decision_buckets")}

# Columns shared by `measurements` and `decisions`: the BatchStats fields, in dataclass order.
_STATS_COLUMNS = {
    "batch": int,
    "max_len": int,
    "total": int,
    "sum_sq": int,
    "mean": float,
    "std": float,
    "pad_fraction": float,
}


def _m0001_initial(db: sqlite_utils.Database) -> None:
    """devices, kernel_configs, measurements, models, decisions."""
    db["devices"].create(
        {
            "key": str,
            "name": str,
            "capability": str,
            "sm_count": int,
            "memory_mb": int,
            "driver": str,
            "torch": str,
            "triton": str,
            "first_seen": float,
        },
        pk="key",
        not_null=["name", "capability", "sm_count", "memory_mb", "driver", "torch", "triton"],
    )
    db["kernel_configs"].create({"key": str, "op": str, "config": str}, pk="key", not_null=["op", "config"])
    db["measurements"].create(
        {
            "id": int,
            "device": str,
            "signature": str,
            "arm": str,
            "config_key": str,
            "config": str,  # JSON, NULL for the padded arm
            **_STATS_COLUMNS,
            "median_ms": float,
            "p10_ms": float,
            "p90_ms": float,
            "reps": int,
            "time": float,  # unix seconds
            "source": str,
            "distribution": str,
            "extra": str,  # JSON
        },
        pk="id",
        not_null=["device", "signature", "arm", "config_key", *_STATS_COLUMNS, "median_ms", "reps", "time", "source"],
    )
    db["models"].create(
        {
            "id": int,
            "device": str,
            "signature": str,  # "*" = fit on all signatures
            "feature_version": int,
            "kind": str,  # e.g. "gbt-arrays"
            "payload": str,  # JSON: the compiled model (never pickle)
            "metrics": str,  # JSON
            "created": float,  # unix seconds
        },
        pk="id",
        not_null=["device", "signature", "feature_version", "kind", "payload", "metrics", "created"],
    )
    db["decisions"].create(
        {
            "id": int,
            "time": float,  # unix seconds
            "device": str,
            "signature": str,
            "arm": str,
            "config_key": str,
            "config": str,  # JSON, NULL for the padded arm
            **_STATS_COLUMNS,
            "predicted_ms": str,  # JSON: arm label -> ms
            "reason": str,
            "measured_ms": float,  # NULL until the batch is timed
        },
        pk="id",
        not_null=["time", "device", "signature", "arm", "config_key", *_STATS_COLUMNS, "predicted_ms", "reason"],
    )


def _m0002_indexes_and_tune_items(db: sqlite_utils.Database) -> None:
    """Indexes for the common queries, and `tune_items` (what a tuning plan has finished, for resume)."""
    db["measurements"].create_index(["device", "signature", "source"], index_name="measurements_by_device")
    db["measurements"].create_index(["time"], index_name="measurements_by_time")
    db["decisions"].create_index(["device", "signature", "time"], index_name="decisions_by_device")
    db["decisions"].create_index(["time"], index_name="decisions_by_time")
    db["models"].create_index(["device", "feature_version", "created"], index_name="models_by_device")
    db["tune_items"].create(
        {"device": str, "plan": str, "item": str, "done": float},
        pk=("device", "plan", "item"),
        not_null=["done"],
    )


def _m0003_decision_rollups(db: sqlite_utils.Database) -> None:
    """`decision_totals` and `decision_buckets`: the decisions pruned from `decisions`, added up (records.py
    says what each column holds), so that the table of single decisions can be bounded (TuningDB.prune_decisions)."""
    db["decision_totals"].create(
        {
            "device": str, "signature": str, "period": float, "arm": str, "label": str, "reason": str, "forced": int,
            "batches": int, "first": float, "last": float, "sampled": int, "measured_sum": float,
            "measured_min": float, "measured_max": float, "ape_batches": int, "ape_sum": float,
            "saved_batches": int, "chosen_ms": float, "padded_ms": float, "ragged_ms": float,
        },
        pk=("device", "signature", "period", "arm", "label", "reason", "forced"),
    )  # fmt: skip
    db["decision_buckets"].create(
        {
            "device": str, "signature": str, "period": float, "bucket": str, "label": str, "sampled": int,
            "exploring": int, "measured_sum": float, "measured_min": float, "measured_max": float, "first": float,
            "last": float,
        },
        pk=("device", "signature", "period", "bucket", "label"),
    )  # fmt: skip
    db["decision_totals"].create_index(["last"], index_name="decision_totals_by_last")
    db["decision_buckets"].create_index(["last"], index_name="decision_buckets_by_last")


Migration = tuple[str, Callable[["sqlite_utils.Database"], None]]

MIGRATIONS: list[Migration] = [
    ("0001_initial", _m0001_initial),
    ("0002_indexes_and_tune_items", _m0002_indexes_and_tune_items),
    ("0003_decision_rollups", _m0003_decision_rollups),
]


def applied_migrations(db: sqlite_utils.Database) -> list[str]:
    """Names in `_migrations`, oldest first ([] when the table does not exist yet)."""
    if not db[MIGRATIONS_TABLE].exists():
        return []
    rows = db.execute(f"SELECT name FROM {MIGRATIONS_TABLE} ORDER BY applied, name").fetchall()
    return [name for (name,) in rows]


def unknown_migrations(names: list[str]) -> list[str]:
    """The names this code does not know: a newer autoragged wrote the file."""
    known = {name for name, _ in MIGRATIONS}
    return [name for name in names if name not in known]


def _create_migrations_table(db: sqlite_utils.Database) -> None:
    db.execute(f"CREATE TABLE IF NOT EXISTS {MIGRATIONS_TABLE} (name TEXT PRIMARY KEY, applied REAL NOT NULL)")


@contextmanager
def write_transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """One write transaction: `BEGIN IMMEDIATE` ... `COMMIT`, rolled back on any exception (Ctrl-C included).

    IMMEDIATE takes the write lock up front (waiting up to the busy timeout), so two writers never
    deadlock upgrading a read lock. `conn` must use `isolation_level=None` (explicit transactions).
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _apply_one(db: sqlite_utils.Database, name: str, function: Callable[[sqlite_utils.Database], None]) -> bool:
    """Apply one migration in its own write transaction; False when another process got there first."""
    with write_transaction(db.conn):
        _create_migrations_table(db)
        if db.execute(f"SELECT 1 FROM {MIGRATIONS_TABLE} WHERE name = ?", [name]).fetchone():
            return False
        function(db)
        db[MIGRATIONS_TABLE].insert({"name": name, "applied": time.time()})
    return True


def migrate(db: sqlite_utils.Database, *, target: int | None = None) -> list[str]:
    """Apply the missing migrations among the first `target` (default: all); returns the names applied now.

    `db` must wrap a connection opened with `isolation_level=None` (explicit transactions). Safe to run
    from several processes at once: each migration re-checks `_migrations` inside its write lock.
    """
    wanted = MIGRATIONS if target is None else MIGRATIONS[:target]
    done = set(applied_migrations(db))
    if not db[MIGRATIONS_TABLE].exists():
        with write_transaction(db.conn):
            _create_migrations_table(db)
    applied_now = []
    for name, function in wanted:
        if name not in done and _apply_one(db, name, function):
            log.info("tuning database: applied migration %s", name)
            applied_now.append(name)
    return applied_now
