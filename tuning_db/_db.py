"""`TuningDB`: the typed read/write API over one SQLite file.

One file per user (default `~/.cache/autoragged/tuning.sqlite`, `AUTORAGGED_DB` overrides, `path=` overrides
both), in WAL mode so that readers never block the writer and several processes can share it. Every
write is one `BEGIN IMMEDIATE` transaction: a list of decisions or measurements goes in as one
transaction, never one per row. The connection may be used from any thread (the runtime flushes from a
background thread); a lock serialises its use inside the process, SQLite's locks across processes.

JSON columns hold strict JSON (no NaN/inf, no pickle): a shared file must be safe to load, and SQLite's
own `json_extract` must be able to read it in reports. What is read back is checked column by column
(`_rows`): a damaged or hostile row raises `RowError` naming it, or is skipped and counted in a `Skipped`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._connect import (
    BUSY_TIMEOUT_S,
    ENV_VAR,
    check_intact,
    check_location,
    check_readable,
    connect_optuna,
    connect_readonly,
    connect_wal,
    directory_error,
    migrate_checked,
)  # fmt: skip
from ._encode import (
    DECISION_REQUIRED,
    MEASUREMENT_REQUIRED,
    decision_row,
    finite_decision,
    finite_measurement,
    key_of,
    measurement_row,
    strict_json,
)  # fmt: skip
from ._errors import DatabaseError, RowError, explain
from ._rows import (
    BadRow,
    Skipped,
    buckets_from,
    decision_from,
    device_from,
    measurement_from,
    model_fields,
    totals_from,
)  # fmt: skip
from .migrations import (
    DATA_TABLES,
    applied_migrations,
    write_transaction,
)
from .records import (
    MAX_TOTALS,
    MIN_TOTALS,
    SUMMED_TOTALS,
    BucketTotals,
    Decision,
    DecisionTotals,
    DeviceKey,
    Measurement,
    ModuleSignature,
    config_key,
)  # fmt: skip

if TYPE_CHECKING:  # imported lazily in TuningDB.open: sqlite-utils pulls in numpy and click (~100 ms)
    import sqlite_utils

__all__ = [
    "TuningDB", "ModelRecord", "default_path", "keep_decisions", "ENV_VAR", "KEEP_ENV_VAR", "DEFAULT_KEEP_DECISIONS",
    "BUSY_TIMEOUT_S",
]  # fmt: skip

log = logging.getLogger("autoragged")

# Retention: the newest KEEP decisions of each (device, module signature) are kept one by one (the report's
# pictures, and any query of single batches, read them); older ones are added up into decision_totals and
# decision_buckets (`prune_decisions`). The newest KEEP of the runtime's sampled timings stay too, older ones are
# deleted (`prune_measurements`: a refit reads the newest). The runtime's recorder runs both in its batched flush.
# 20,000 of each take 15.8 MB of file per module, flat from 650,000 batches to 1M (benchmarks/soak.py), and the
# report's decision map draws at most 20,000 points anyway (`autoragged.report.plots._MAX_MAP_POINTS`).
KEEP_ENV_VAR = "AUTORAGGED_DB_KEEP_DECISIONS"
DEFAULT_KEEP_DECISIONS = 20_000
_warned_keep: set[str] = set()


def keep_decisions() -> int | None:
    """How many decisions per (device, signature) the runtime keeps one by one: `$AUTORAGGED_DB_KEEP_DECISIONS`
    (an int >= 0; 0 adds every decision up at once), "all" for no bound (the file then grows by ~0.5 KB per
    batch), or unset for DEFAULT_KEEP_DECISIONS. None means all. A value that is none of these costs one warning
    and the default."""
    text = os.environ.get(KEEP_ENV_VAR, "").strip()
    if not text:
        return DEFAULT_KEEP_DECISIONS
    if text.lower() == "all":
        return None
    try:
        keep = int(text.replace("_", ""))
        if keep < 0:
            raise ValueError
        return keep
    except ValueError:
        if text not in _warned_keep:
            _warned_keep.add(text)
            log.warning("autoragged: %s=%r is not a number of decisions >= 0 or 'all'; keeping %d per module",
                        KEEP_ENV_VAR, text, DEFAULT_KEEP_DECISIONS)  # fmt: skip
        return DEFAULT_KEEP_DECISIONS


def default_path() -> Path:
    """`$AUTORAGGED_DB` when set (and not empty), else `~/.cache/autoragged/tuning.sqlite`; absolute."""
    env = os.environ.get(ENV_VAR)
    path = Path(env) if env else Path.home() / ".cache" / "autoragged" / "tuning.sqlite"
    return Path(os.path.abspath(path.expanduser()))


@dataclass
class ModelRecord:
    """A fitted cost model as stored: `payload` is the compiled model (JSON), `metrics` its fit quality.

    signature: the `ModuleSignature.key` it was fit for, "*" for all signatures; created: unix seconds.
    """

    id: int
    device: str
    signature: str
    feature_version: int
    kind: str
    payload: dict[str, Any] | None  # None when read with payload=False
    metrics: dict[str, Any]
    created: float


# ----------------------------------------------------------------------------------------------- rows


@functools.cache
def _upsert(table: str, cls: type) -> tuple[str, list[str]]:
    """(INSERT ... ON CONFLICT DO UPDATE that adds a totals record into `table`, the column order)."""
    names = [f.name for f in dataclasses.fields(cls)]
    sets = []
    for name in names:
        if name in SUMMED_TOTALS:
            sets.append(f"{name} = {name} + excluded.{name}")
        elif name in MIN_TOTALS or name in MAX_TOTALS:
            pick = "min" if name in MIN_TOTALS else "max"  # the scalar min/max of SQLite: NULL when either is NULL
            sets.append(f"{name} = coalesce({pick}({name}, excluded.{name}), {name}, excluded.{name})")
    sql = (
        f"INSERT INTO {table} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))}) "
        f"ON CONFLICT ({', '.join(cls.KEY)}) DO UPDATE SET {', '.join(sets)}"
    )
    return sql, names


_MODEL_COLUMNS = "id, device, signature, feature_version, kind, metrics, created"


def _model_from(row: dict[str, Any]) -> ModelRecord:
    return ModelRecord(**model_fields(row, payload=True))


def _model_without_payload(row: dict[str, Any]) -> ModelRecord:
    return ModelRecord(**model_fields(row, payload=False))


def _where(**filters: Any) -> tuple[str | None, list[Any]]:
    """`col = ?` for each filter given (None = no filter); `since` means `time >= ?` (unix seconds)."""
    clauses, args = [], []
    for column, value in filters.items():
        if value is None:
            continue
        clauses.append("time >= ?" if column == "since" else f"{column} = ?")
        args.append(key_of(value))
    return (" AND ".join(clauses) or None), args


class TuningDB:
    """An open tuning database. Build with `TuningDB.open(path)`; also a context manager that closes it."""

    def __init__(self, path: Path, conn: sqlite3.Connection, db: sqlite_utils.Database, readonly: bool = False):
        """Private: use `TuningDB.open`. readonly: opened with readonly=True (every write raises DatabaseError)."""
        self.path = path
        self.readonly = readonly
        self._conn: sqlite3.Connection | None = conn
        self._db = db
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: str | os.PathLike[str] | None = None, *, readonly: bool = False) -> TuningDB:
        """Open (creating and migrating as needed) the database at `path` (default: `default_path()`).

        readonly=True opens an existing database for reading only: nothing is created or migrated, and a
        file that is not a tuning database, or one at an older schema, is refused (a reader must not
        change a file it was merely pointed at). It reads a file in a read-only directory too.

        The file's pages are checked first (`PRAGMA quick_check`, once per process for each version of the file).
        Raises DatabaseError, naming the path and the remedy, for a directory, an unwritable location, or a schema
        written by a newer autoragged; its subclass DamagedDatabase for a file that is damaged or not SQLite, and
        ReadOnlyDatabase for an existing file this process cannot write (open it with readonly=True).
        """
        db_path = default_path() if path is None else Path(os.path.abspath(Path(path).expanduser()))
        if db_path.is_dir():
            raise directory_error(db_path)
        if readonly:
            if not db_path.is_file():
                raise DatabaseError(f"no tuning database at {db_path} (nothing was recorded there yet)")
            return cls._open_with(db_path, "opening it read-only", connect_readonly, check_readable, readonly=True)
        check_location(db_path)
        return cls._open_with(db_path, "opening it", connect_wal, migrate_checked)

    @classmethod
    def _open_with(cls, db_path: Path, doing: str, connect, prepare, readonly: bool = False) -> TuningDB:
        """connect(path), the pages checked, then prepare(db, path); the connection is closed on any error, and
        SQLite's errors are explained with the path."""
        import sqlite_utils

        conn = None
        try:
            conn = connect(db_path)
            check_intact(conn, db_path)
            db = sqlite_utils.Database(conn, execute_plugins=False)
            prepare(db, db_path)
        except sqlite3.Error as e:
            if conn is not None:
                conn.close()
            raise explain(e, db_path, doing) from e
        except BaseException:
            if conn is not None:
                conn.close()
            raise
        return cls(db_path, conn, db, readonly)

    # -- plumbing

    def _decoded(self, table: str, rows: Iterable[dict], decode, skipped: Skipped | None, key: str = "id",
                 check: Callable[[Any], str | None] | None = None) -> list:  # fmt: skip
        """decode(row) for each row; a BadRow (or a problem `check(record)` names) raises RowError, or with
        `skipped` is counted there and the row left out."""
        out, n = [], 0
        for row in rows:
            n += 1
            try:
                record = decode(row)
                problem = check(record) if check is not None else None
                if problem:
                    raise BadRow(problem)
                out.append(record)
            except BadRow as e:
                if skipped is None:
                    raise RowError(self.path, table, row.get(key), str(e)) from None
                skipped.skip(table, row.get(key), str(e))
        if skipped is not None:
            skipped.saw(table, n)
        return out

    @staticmethod
    def _encoded(records: Iterable, encode, clean, skipped: list | None, required: Iterable[str] = ()) -> list[dict]:
        """The rows of `records`, all encoded before anything is written: strictly (a bad record raises) without
        `skipped`; with it, each record `clean`ed first, and one that still cannot be encoded or lacks a `required`
        column (which would fail the whole transaction) collected there."""
        if skipped is None:
            return [encode(r) for r in records]
        rows = []
        for record in records:
            try:
                row = encode(clean(record))
                missing = [column for column in required if row[column] is None]
                if missing:
                    raise ValueError(f"{type(record).__name__} has no {', '.join(missing)}")
                rows.append(row)
            except (TypeError, ValueError, AttributeError) as e:
                skipped.append((record, str(e)))
        return rows

    def __enter__(self) -> TuningDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TuningDB({str(self.path)!r}{', readonly' if self.readonly else ''}{'' if self._conn else ', closed'})"

    def close(self) -> None:
        """Close the connection (idempotent). SQLite checkpoints the WAL when the last connection closes."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    @contextmanager
    def _use(self, doing: str) -> Iterator[sqlite_utils.Database]:
        """The sqlite-utils handle, under the lock, with sqlite3 errors turned into DatabaseError."""
        with self._lock:
            if self._conn is None:
                raise DatabaseError(f"the tuning database {self.path} is closed; open it again with TuningDB.open")
            try:
                yield self._db
            except sqlite3.Error as e:
                raise explain(e, self.path, doing) from e

    @contextmanager
    def _write(self, doing: str) -> Iterator[sqlite_utils.Database]:
        """One write transaction (`BEGIN IMMEDIATE` ... `COMMIT`, rolled back on any exception)."""
        with self._use(doing) as db, write_transaction(db.conn):
            yield db

    @property
    def schema_version(self) -> int:
        """The number of migrations applied to this file."""
        with self._use("reading the schema version") as db:
            return len(applied_migrations(db))

    def optuna_storage_url(self) -> str:
        """The SQLAlchemy URL of this same file, for optuna's study tables: `sqlite:///` + the absolute path,
        percent-encoded. A path may hold `?` (a URL's query), `#`, `%`, spaces or braces (optuna runs the URL
        through str.format); SQLAlchemy 2 decodes the database part of a URL, so the file is this one. Pass
        `optuna_engine_kwargs()` beside it and the connection does not depend on the URL at all."""
        return "sqlite:///" + urllib.parse.quote(str(self.path), safe="/")

    def optuna_engine_kwargs(self) -> dict[str, Any]:
        """Engine arguments for optuna's `RDBStorage(url, engine_kwargs=...)` that connect to this file by its
        path (a `creator`), whatever SQLAlchemy version reads the URL."""
        return {"creator": functools.partial(connect_optuna, str(self.path))}

    def counts(self) -> dict[str, int]:
        """Rows per table of this package (not optuna's), for reports and tests."""
        with self._use("counting rows") as db:
            return {
                table: db.execute(f"SELECT count(*) FROM [{table}]").fetchone()[0] if db[table].exists() else 0
                for table in DATA_TABLES
            }

    # -- devices and kernel configs

    def register_device(self, dev: DeviceKey) -> str:
        """Insert or update `dev` (first_seen is kept from the first time); returns `dev.key`."""
        row = {"key": dev.key, **dev.to_dict()}
        with self._write("registering a device") as db:
            db["devices"].upsert(row, pk="key")
            db.execute("UPDATE devices SET first_seen = ? WHERE key = ? AND first_seen IS NULL", [time.time(), dev.key])
        return dev.key

    def devices(self, *, skipped: Skipped | None = None) -> list[DeviceKey]:
        """Every registered device, oldest first (`skipped`: see `decisions`)."""
        with self._use("reading devices") as db:
            rows = db["devices"].rows_where(order_by="first_seen, key")
            return self._decoded("devices", rows, device_from, skipped, key="key")

    def device_keys(self, *, since: float | None = None) -> list[str]:
        """The device keys that decisions or measurements name (from `since` on, when given), sorted: rows
        written by hand need not have a registered device. Keys that are not text are left out."""
        where = "typeof(device) = 'text'" + (" AND time >= ?" if since is not None else "")
        args = [since] * (since is not None)
        with self._use("reading device keys") as db:
            keys = set()
            for table in ("decisions", "measurements"):
                keys.update(k for (k,) in db.execute(f"SELECT DISTINCT device FROM {table} WHERE {where}", args))
            if db["decision_totals"].exists():
                rolled = f"SELECT DISTINCT device FROM decision_totals WHERE {where.replace('time', 'last')}"
                keys.update(k for (k,) in db.execute(rolled, args))
            return sorted(keys)

    def register_config(self, op: str, config: dict[str, Any]) -> str:
        """Insert or update a kernel config of `op` (e.g. "ragged_attention"); returns `config_key(config)`.

        The key depends on the config dict only: one dict registered for two ops is one row (last op wins).
        """
        if not config:
            raise ValueError("config is empty: the padded arm has no kernel config to register")
        key = config_key(config)
        row = {"key": key, "op": op, "config": strict_json(config, "config")}
        with self._write("registering a kernel config") as db:
            db["kernel_configs"].upsert(row, pk="key")
        return key

    # -- measurements and decisions

    def add_measurements(
        self, measurements: Iterable[Measurement], *, skipped: list[tuple[Measurement, str]] | None = None
    ) -> int:
        """Append measurements in one transaction; returns the number of rows written.

        skipped: None (default) raises on a record that cannot be stored, and nothing is written; a list
        collects (record, why) for such records, stores non-finite optional values (p10_ms, p90_ms) as NULL, and
        writes every other record (what the runtime's recorder does: one bad record must not cost the rest)."""
        rows = self._encoded(measurements, measurement_row, finite_measurement, skipped, MEASUREMENT_REQUIRED)
        if rows:
            with self._write(f"writing {len(rows)} measurements") as db:
                db["measurements"].insert_all(rows)
        return len(rows)

    def measurements(
        self,
        *,
        device: str | DeviceKey | None = None,
        signature: str | ModuleSignature | None = None,
        source: str | None = None,
        arm: str | None = None,
        since: float | None = None,
        skipped: Skipped | None = None,
        check: Callable[[Measurement], str | None] | None = None,
    ) -> list[Measurement]:
        """Measurements matching every filter given (`since`: time >= since, unix seconds), oldest first
        (`skipped`, `check`: see `decisions`)."""
        where, args = _where(device=device, signature=signature, source=source, arm=arm, since=since)
        with self._use("reading measurements") as db:
            rows = db["measurements"].rows_where(where, args, order_by="time, id")
            return self._decoded("measurements", rows, measurement_from, skipped, check=check)

    def training_measurements(
        self, device: str | DeviceKey, signature: str | ModuleSignature, arm: str, limit: int,
        skipped: Skipped | None = None,
    ) -> list[Measurement]:  # fmt: skip
        """The newest `limit` training measurements (a forward and its backward: extra "train") of one arm of one
        module on one device, oldest first (what a wrapped model in training starts its prices from)."""
        where, args = _where(device=device, signature=signature, arm=arm)
        where += " AND json_extract(extra, '$.train') = 1"
        with self._use("reading training measurements") as db:
            rows = db["measurements"].rows_where(where, args, order_by="time DESC, id DESC", limit=limit)
            return self._decoded("measurements", rows, measurement_from, skipped)[::-1]

    def add_decisions(self, decisions: Iterable[Decision], *, skipped: list[tuple[Decision, str]] | None = None) -> int:
        """Append decisions in one transaction (the runtime's flush); returns the number of rows written.

        skipped: None (default) raises on a record that cannot be stored (NaN, a non-JSON value), and nothing is
        written; a list collects (record, why) for such records and writes every other one, with non-finite
        predictions left out of predicted_ms and a non-finite measured_ms stored as NULL (unusable values, not
        reasons to lose the batch's record)."""
        rows = self._encoded(decisions, decision_row, finite_decision, skipped, DECISION_REQUIRED)
        if rows:
            with self._write(f"writing {len(rows)} decisions") as db:
                db["decisions"].insert_all(rows)
        return len(rows)

    def decisions(
        self,
        *,
        device: str | DeviceKey | None = None,
        signature: str | ModuleSignature | None = None,
        since: float | None = None,
        limit: int | None = None,
        skipped: Skipped | None = None,
        check: Callable[[Decision], str | None] | None = None,
    ) -> list[Decision]:
        """Decisions matching every filter given: oldest first, or with `limit` the newest `limit`, newest first.

        A row that cannot be read (damaged or hostile: wrong types, NULLs, unreadable JSON), or that the
        caller's `check(decision)` finds a problem with (it returns the problem, else None: e.g. an arm this
        package does not know of), raises RowError naming it; given `skipped` (a `Skipped`), such rows are left
        out and counted there instead."""
        where, args = _where(device=device, signature=signature, since=since)
        order = "time, id" if limit is None else "time DESC, id DESC"
        with self._use("reading decisions") as db:
            rows = db["decisions"].rows_where(where, args, order_by=order, limit=limit)
            return self._decoded("decisions", rows, decision_from, skipped, check=check)

    # -- retention

    def prune_decisions(
        self,
        keep: int,
        rollup: Callable[[list[Decision]], tuple[list[DecisionTotals], list[BucketTotals]]],
        *,
        pairs: Iterable[tuple[str, str]] | None = None,
    ) -> int:
        """Keep the newest `keep` decisions of each (device, signature) and add the older ones up, in one
        transaction: `rollup(decisions)` makes their totals (autoragged's `report.rollup.rollup`: this package does not
        know arm labels or planner buckets), which are added into decision_totals / decision_buckets, and the
        rows are deleted. pairs: the (device, signature) pairs to look at (default: all). Rows too damaged to
        read are deleted without being counted. Returns the number of decisions pruned."""
        if not isinstance(keep, int) or keep < 0:
            raise ValueError(f"keep must be an int >= 0 (decisions kept per device and signature), got {keep!r}")
        with self._write("pruning decisions") as db:
            if pairs is None:
                pairs = db.execute("SELECT DISTINCT device, signature FROM decisions").fetchall()
            return sum(self._prune_one(db, device, signature, keep, rollup) for device, signature in pairs)

    def prune_measurements(self, keep: int, *, pairs: Iterable[tuple[str, str]] | None = None,
                           source: str = "runtime") -> int:  # fmt: skip
        """Keep the newest `keep` measurements of `source` of each (device, signature) and delete the older ones, in
        one transaction: a wrapped model records a timing every `sample_every`-th batch, without end, and a refit
        reads the newest. The tuner's measurements ("tune") are bounded by its runs and stay. pairs: the (device,
        signature) pairs to look at (default: all). Returns the number of measurements deleted."""
        if not isinstance(keep, int) or keep < 0:
            raise ValueError(f"keep must be an int >= 0 (measurements kept per device and signature), got {keep!r}")
        where = "device = ? AND signature = ? AND source = ?"
        deleted = 0
        with self._write("pruning measurements") as db:
            if pairs is None:
                pairs = db.execute("SELECT DISTINCT device, signature FROM measurements WHERE source = ?",
                                   [source]).fetchall()  # fmt: skip
            for device, signature in pairs:
                args = [device, signature, source]
                (n,) = db.execute(f"SELECT count(*) FROM measurements WHERE {where}", args).fetchone()
                if n > keep:
                    old = f"SELECT id FROM measurements WHERE {where} ORDER BY time, id LIMIT ?"
                    deleted += db.execute(f"DELETE FROM measurements WHERE id IN ({old})", [*args, n - keep]).rowcount
        return deleted

    def _prune_one(self, db: sqlite_utils.Database, device: str, signature: str, keep: int, rollup) -> int:
        where, args = "device = ? AND signature = ?", [device, signature]
        (n,) = db.execute(f"SELECT count(*) FROM decisions WHERE {where}", args).fetchone()
        if n <= keep:
            return 0
        cursor = db.execute(f"SELECT * FROM decisions WHERE {where} ORDER BY time, id LIMIT ?", [*args, n - keep])
        columns = [c[0] for c in cursor.description]
        ids, decisions = [], []
        for values in cursor:
            row = dict(zip(columns, values))
            ids.append((row["id"],))
            try:
                decisions.append(decision_from(row))
            except BadRow:
                pass  # beyond retention and unreadable: nothing to add up
        totals, buckets = rollup(decisions)
        for table, records in (("decision_totals", totals), ("decision_buckets", buckets)):
            if records:
                sql, names = _upsert(table, type(records[0]))
                db.conn.executemany(sql, [[getattr(r, name) for name in names] for r in records])
        db.conn.executemany("DELETE FROM decisions WHERE id = ?", ids)
        if len(decisions) < len(ids):
            log.debug("tuning database %s: pruned %d unreadable decisions", self.path, len(ids) - len(decisions))
        return len(ids)

    def decision_totals(
        self, *, device: str | DeviceKey | None = None, since: float | None = None, skipped: Skipped | None = None
    ) -> list[DecisionTotals]:
        """The decisions pruned so far, added up per hour (`prune_decisions`; empty for a file that predates
        them). since: the totals whose last decision is at or after it, i.e. whole hours that overlap the
        window. `skipped`: see `decisions`."""
        return self._rolled("decision_totals", totals_from, device, since, skipped)

    def decision_buckets(
        self, *, device: str | DeviceKey | None = None, since: float | None = None, skipped: Skipped | None = None
    ) -> list[BucketTotals]:
        """The timed decisions pruned so far, added up per planner bucket and day (see `decision_totals`)."""
        return self._rolled("decision_buckets", buckets_from, device, since, skipped)

    def _rolled(self, table: str, decode, device, since, skipped) -> list:
        where, args = _where(device=device)
        if since is not None:
            where = (f"{where} AND " if where else "") + "last >= ?"
            args.append(since)
        with self._use(f"reading {table}") as db:
            if not db[table].exists():
                return []
            rows = db[table].rows_where(where, args, order_by="period, rowid", select="rowid AS id, *")
            return self._decoded(table, rows, decode, skipped)

    # -- cost models

    def save_model(
        self,
        *,
        device: str | DeviceKey,
        feature_version: int,
        kind: str,
        payload: dict[str, Any],
        metrics: dict[str, Any],
        signature: str | ModuleSignature = "*",
    ) -> int:
        """Store a fitted model (payload and metrics as strict JSON, never pickle); returns its id."""
        row = {
            "device": key_of(device),
            "signature": key_of(signature),
            "feature_version": feature_version,
            "kind": kind,
            "payload": strict_json(payload, "model payload"),
            "metrics": strict_json(metrics, "model metrics"),
            "created": time.time(),
        }
        with self._write("saving a model") as db:
            return db["models"].insert(row).last_pk

    def latest_model(
        self,
        device: str | DeviceKey,
        *,
        feature_version: int | None = None,
        signature: str | ModuleSignature | None = None,
        max_payload_bytes: int | None = None,
    ) -> ModelRecord | None:
        """The newest model (by `created`) for `device`, or None.

        feature_version: only models with these features. signature: only models that apply to it, i.e.
        fit for it or for "*" (all); one fit for it wins over a "*" one. None: any signature.
        max_payload_bytes: refuse a payload longer than this before reading it. The newest row that cannot be
        read (a payload too long, unreadable JSON, wrong types) raises RowError naming it: the caller decides
        what to use instead (the runtime: its analytic prior), never an older model silently.
        """
        where, args = _where(device=device, feature_version=feature_version)
        order = "created DESC, id DESC"
        if signature is not None:
            where = (f"{where} AND " if where else "") + "signature IN (?, '*')"
            args.append(key_of(signature))
            order = "signature = '*', " + order  # 0 (fit for this signature) sorts first
        select = f"{_MODEL_COLUMNS}, length(CAST(payload AS BLOB)) AS payload_bytes"
        with self._use("reading models") as db:
            rows = list(db["models"].rows_where(where, args, order_by=order, limit=1, select=select))
            if not rows:
                return None
            row = rows[0]
            if max_payload_bytes is not None and (row["payload_bytes"] or 0) > max_payload_bytes:
                raise RowError(
                    self.path, "models", row["id"],
                    f"its payload is {row['payload_bytes']:,} bytes, over the {max_payload_bytes:,} read at most",
                )  # fmt: skip
            row["payload"] = db.execute("SELECT payload FROM models WHERE id = ?", [row["id"]]).fetchone()[0]
            (model,) = self._decoded("models", [row], _model_from, None)
            return model

    def models(
        self, device: str | DeviceKey | None = None, *, payload: bool = True, skipped: Skipped | None = None
    ) -> list[ModelRecord]:
        """Every model (of `device` when given), oldest first. payload=False leaves the payloads unread (None):
        what a report needs is in the other columns. `skipped`: see `decisions`."""
        where, args = _where(device=device)
        select = _MODEL_COLUMNS + (", payload" if payload else "")
        decode = _model_from if payload else _model_without_payload
        with self._use("reading models") as db:
            rows = db["models"].rows_where(where, args, order_by="created, id", select=select)
            return self._decoded("models", rows, decode, skipped)

    # -- tuner bookkeeping

    def mark_done(self, device: str | DeviceKey, plan: str, items: Iterable[str]) -> int:
        """Record `items` of a tuning `plan` as finished (one transaction); returns how many were new."""
        now = time.time()
        rows = [{"device": key_of(device), "plan": plan, "item": item, "done": now} for item in items]
        if not rows:
            return 0
        with self._write("marking tuning items done") as db:
            before = db.conn.total_changes
            db["tune_items"].insert_all(rows, ignore=True)
            return db.conn.total_changes - before

    def done_items(self, device: str | DeviceKey, plan: str) -> set[str]:
        """The items of `plan` already finished on `device` (for a resumed tuning run)."""
        where, args = _where(device=device, plan=plan)
        with self._use("reading tuning progress") as db:
            return {row["item"] for row in db["tune_items"].rows_where(where, args, select="item")}
