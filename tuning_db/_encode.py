"""Writing rows: a record as the row the tuning database stores, in strict JSON and finite numbers only; the
values no one can use (NaN/inf predictions, spreads) left out first. Reading rows back is `_rows.py`."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from .records import BatchStats, Decision, DeviceKey, Measurement, ModuleSignature, config_key

__all__ = [
    "decision_row", "measurement_row", "key_of", "strict_json", "finite_decision", "finite_measurement",
    "DECISION_REQUIRED", "MEASUREMENT_REQUIRED",
]  # fmt: skip

_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(BatchStats))


def key_of(value: Any) -> Any:
    """A `DeviceKey`/`ModuleSignature` stands for its `.key`; strings (and None) pass through."""
    return value.key if isinstance(value, (DeviceKey, ModuleSignature)) else value


def strict_json(value: Any, what: str) -> str:
    """Strict, compact JSON of `value`; a clear error when it is not JSON (arrays, NaN, objects)."""
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise type(e)(
            f"{what} cannot be stored as JSON ({e}); the tuning database stores strict JSON only (never pickle): "
            "convert arrays with .tolist() and leave out NaN/inf"
        ) from e


def _stats_row(stats: BatchStats) -> dict[str, Any]:
    return {name: getattr(stats, name) for name in _STATS_FIELDS}


def decision_row(d: Decision) -> dict[str, Any]:
    """The `decisions` row of `d` (without id); ValueError for a value JSON or SQLite would not keep (NaN, inf)."""
    return _check_finite_row(
        {
            "time": d.time,
            "device": key_of(d.device),
            "signature": key_of(d.signature),
            "arm": d.arm,
            "config_key": config_key(d.config),
            "config": None if d.config is None else strict_json(d.config, "Decision.config"),
            **_stats_row(d.stats),
            "predicted_ms": strict_json(d.predicted_ms, "Decision.predicted_ms"),
            "reason": d.reason,
            "measured_ms": d.measured_ms,
        },
        "Decision",
    )


def measurement_row(m: Measurement) -> dict[str, Any]:
    """The `measurements` row of `m` (without id); ValueError for a value JSON or SQLite would not keep."""
    return _check_finite_row(
        {
            "device": key_of(m.device),
            "signature": key_of(m.signature),
            "arm": m.arm,
            "config_key": config_key(m.config),
            "config": None if m.config is None else strict_json(m.config, "Measurement.config"),
            **_stats_row(m.stats),
            "median_ms": m.median_ms,
            "p10_ms": m.p10_ms,
            "p90_ms": m.p90_ms,
            "reps": m.reps,
            "time": m.time,
            "source": m.source,
            "distribution": m.distribution,
            "extra": strict_json(m.extra, "Measurement.extra"),
        },
        "Measurement",
    )


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def finite_decision(d: Decision) -> Decision:
    """`d` without the values no one can use: non-finite predictions left out, a non-finite measured_ms None."""
    predicted = d.predicted_ms
    if isinstance(predicted, dict) and not all(map(_finite, predicted.values())):
        predicted = {label: ms for label, ms in predicted.items() if _finite(ms)}
    measured = d.measured_ms if d.measured_ms is None or _finite(d.measured_ms) else None
    if predicted is d.predicted_ms and measured is d.measured_ms:
        return d
    return dataclasses.replace(d, predicted_ms=predicted, measured_ms=measured)


def finite_measurement(m: Measurement) -> Measurement:
    """`m` with non-finite spread values (p10_ms, p90_ms, nullable) as None; a non-finite median stays and fails."""
    p10 = m.p10_ms if m.p10_ms is None or _finite(m.p10_ms) else None
    p90 = m.p90_ms if m.p90_ms is None or _finite(m.p90_ms) else None
    return m if (p10, p90) == (m.p10_ms, m.p90_ms) else dataclasses.replace(m, p10_ms=p10, p90_ms=p90)


def _check_finite_row(row: dict[str, Any], what: str) -> dict[str, Any]:
    """SQLite stores a NaN float as NULL and inf as a REAL that reads back inf: refuse both, naming the column."""
    for column, value in row.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{what}.{column} is {value}; the tuning database stores finite numbers only")
    return row


# NOT NULL columns (migrations.py): a record without one would fail its whole batch's transaction
DECISION_REQUIRED = ("time", "device", "signature", "arm", "config_key", *_STATS_FIELDS, "predicted_ms", "reason")
MEASUREMENT_REQUIRED = (
    "device", "signature", "arm", "config_key", *_STATS_FIELDS, "median_ms", "reps", "time", "source"
)  # fmt: skip
