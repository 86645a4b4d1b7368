"""Reading rows back, strictly: a shared file is input, and any row may be damaged or hostile.

Every decoder checks each column's type (SQLite stores whatever it is given: text in a REAL column, NULL
where the schema never writes one), parses JSON columns with a size-independent guard (nesting deeper
than Python's recursion limit, NaN/Infinity, which this package never writes), and raises `BadRow` with a
short problem ("unreadable predicted_ms JSON") on the first thing wrong. Readers either raise that as a
`RowError` naming the table and row, or, given a `Skipped`, leave the row out and count it, so a report
over a damaged file shows everything else and one line per table of what it left out.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter, defaultdict
from typing import Any

from .records import BatchStats, BucketTotals, Decision, DecisionTotals, DeviceKey, Measurement

__all__ = [
    "BadRow", "Skipped", "parse_json", "decision_from", "measurement_from", "device_from", "model_fields",
    "totals_from", "buckets_from",
]  # fmt: skip

_IDS_SHOWN = 8  # row ids listed per problem in a Skipped line


class BadRow(ValueError):
    """A row that cannot be read as what its table holds; the message is the problem, without the row's values
    (so that rows damaged the same way group into one line)."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not strict JSON")


def parse_json(text: Any, column: str) -> Any:
    """json.loads of a TEXT column, or BadRow: not text, not JSON, NaN/Infinity, or nested too deeply."""
    if not isinstance(text, str):
        raise BadRow(f"{column} is not JSON text")
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise BadRow(f"{column} JSON is nested too deeply") from None
    except ValueError:
        raise BadRow(f"unreadable {column} JSON") from None


def _text(row: dict[str, Any], column: str, *, nullable: bool = False) -> str | None:
    value = row.get(column)
    if value is None and nullable:
        return None
    if not isinstance(value, str):
        raise BadRow(f"{column} is {'NULL' if value is None else 'not text'}")
    return value


def _int(row: dict[str, Any], column: str) -> int:
    value = row.get(column)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRow(f"{column} is not a non-negative integer")
    return value


def _real(row: dict[str, Any], column: str, *, nullable: bool = False) -> float | None:
    value = row.get(column)
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRow(f"{column} is not a finite number")
    return float(value)


def _object(row: dict[str, Any], column: str, *, nullable: bool = False) -> dict[str, Any] | None:
    text = row.get(column)
    if text is None and nullable:
        return None
    value = parse_json(text, column)
    if not isinstance(value, dict):
        raise BadRow(f"{column} is not a JSON object")
    return value


def _predictions(row: dict[str, Any]) -> dict[str, float]:
    value = _object(row, "predicted_ms")
    for ms in value.values():
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms):
            raise BadRow("predicted_ms holds a value that is not a finite number")
    return value


_COUNTS = ("batch", "max_len", "total", "sum_sq")
_MOMENTS = ("mean", "std", "pad_fraction")


def _stats(row: dict[str, Any]) -> BatchStats:
    counts = [_int(row, name) for name in _COUNTS]
    return BatchStats(*counts, *(_real(row, name) for name in _MOMENTS))


def decision_from(row: dict[str, Any]) -> Decision:
    return Decision(
        time=_real(row, "time"),
        device=_text(row, "device"),
        signature=_text(row, "signature"),
        stats=_stats(row),
        arm=_text(row, "arm"),
        config=_object(row, "config", nullable=True),
        predicted_ms=_predictions(row),
        reason=_text(row, "reason"),
        measured_ms=_real(row, "measured_ms", nullable=True),
    )


def measurement_from(row: dict[str, Any]) -> Measurement:
    return Measurement(
        device=_text(row, "device"),
        signature=_text(row, "signature"),
        arm=_text(row, "arm"),
        config=_object(row, "config", nullable=True),
        stats=_stats(row),
        median_ms=_real(row, "median_ms"),
        p10_ms=_real(row, "p10_ms", nullable=True),
        p90_ms=_real(row, "p90_ms", nullable=True),
        reps=_int(row, "reps"),
        time=_real(row, "time"),
        source=_text(row, "source"),
        distribution=_text(row, "distribution", nullable=True) or "",
        extra=_object(row, "extra", nullable=True) or {},
    )


def device_from(row: dict[str, Any]) -> DeviceKey:
    fields = {}
    for f in dataclasses.fields(DeviceKey):
        fields[f.name] = _int(row, f.name) if f.type in (int, "int") else _text(row, f.name)
    return DeviceKey(**fields)


def model_fields(row: dict[str, Any], *, payload: bool) -> dict[str, Any]:
    """The `ModelRecord` fields of a models row; payload: parse it (else None: a report never needs it)."""
    return dict(
        id=row["id"],
        device=_text(row, "device"),
        signature=_text(row, "signature"),
        feature_version=_int(row, "feature_version"),
        kind=_text(row, "kind"),
        payload=_object(row, "payload") if payload else None,
        metrics=_object(row, "metrics"),
        created=_real(row, "created"),
    )


_BY_TYPE = {
    "str": _text,
    "int": _int,
    "float": _real,
    "float | None": lambda row, column: _real(row, column, nullable=True),
    "bool": lambda row, column: bool(_int(row, column)),
}


def _dataclass_from(cls: type, row: dict[str, Any]) -> Any:
    """An instance of a dataclass of plain fields (str, int, float, float | None, bool), each column checked."""
    return cls(**{f.name: _BY_TYPE[str(f.type)](row, f.name) for f in dataclasses.fields(cls)})


def totals_from(row: dict[str, Any]) -> DecisionTotals:
    return _dataclass_from(DecisionTotals, row)


def buckets_from(row: dict[str, Any]) -> BucketTotals:
    return _dataclass_from(BucketTotals, row)


class Skipped:
    """What readers given it left out: per table, the rows they looked at and, per problem, the ids skipped.

    Pass one to `TuningDB` readers (`decisions(..., skipped=s)`); `lines()` says what was left out, one line
    per table: `skipped 3 of 120 decisions rows: unreadable stats JSON (ids 4, 9, 12)`."""

    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()
        self.problems: dict[str, dict[str, list[Any]]] = defaultdict(lambda: defaultdict(list))

    def saw(self, table: str, n: int = 1) -> None:
        self.seen[table] += n

    def skip(self, table: str, row_id: Any, problem: str) -> None:
        self.problems[table][problem].append(row_id)

    def count(self, table: str | None = None) -> int:
        tables = self.problems if table is None else [table]
        return sum(len(ids) for t in tables for ids in self.problems.get(t, {}).values())

    def lines(self) -> list[str]:
        out = []
        for table, problems in self.problems.items():
            parts = []
            word = "key" if table == "devices" else "id"  # the devices table's primary key is its key
            for problem, ids in sorted(problems.items(), key=lambda kv: -len(kv[1])):
                shown = ", ".join(map(str, ids[:_IDS_SHOWN])) + (", ..." if len(ids) > _IDS_SHOWN else "")
                parts.append(f"{problem} ({word if len(ids) == 1 else word + 's'} {shown})")
            n = self.count(table)
            seen = max(self.seen[table], n)
            out.append(f"skipped {n} of {seen} {table} rows: " + "; ".join(parts))
        return out

    def __bool__(self) -> bool:
        return self.count() > 0
