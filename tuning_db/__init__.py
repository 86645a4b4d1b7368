"""The SQLite tuning database: every measurement, decision and cost model of autoragged, per device.

    from autoragged.tuning_db import TuningDB
    with TuningDB.open() as db:          # ~/.cache/autoragged/tuning.sqlite, or $AUTORAGGED_DB
        db.add_decisions(buffer)         # one transaction for the whole list
        db.decisions(device=key, limit=100)

Everything read back is validated: a damaged or hostile row raises `RowError` naming it, or, given a
`Skipped`, is left out and counted there (`python -m autoragged.report` does that). A file with damaged pages is
refused when it is opened (`DamagedDatabase`); one this process cannot write raises `ReadOnlyDatabase` when
opened for writing, and can be opened with `readonly=True`.

Retention: `prune_decisions(keep, rollup)` keeps the newest `keep` decisions per (device, signature) and adds
the rest up into `decision_totals` / `decision_buckets`; `prune_measurements(keep)` keeps the newest `keep` of the
runtime's timings per (device, signature) and deletes the rest (autoragged's recorder does both in each flush, with
`keep_decisions()`: `$AUTORAGGED_DB_KEEP_DECISIONS`, default 20,000, "all" for no bound).

Layer rule: this package imports sqlite-utils and the standard library only (no torch, numpy or autoragged);
sqlite-utils itself is imported when a database is opened, so importing the records is cheap.
"""

from ._connect import check_location
from ._db import DEFAULT_KEEP_DECISIONS, KEEP_ENV_VAR, ModelRecord, TuningDB, default_path, keep_decisions
from ._errors import DamagedDatabase, DatabaseError, ReadOnlyDatabase, RowError
from ._rows import Skipped
from .records import (
    BatchStats,
    BucketTotals,
    Decision,
    DecisionTotals,
    DeviceKey,
    Measurement,
    ModuleSignature,
    config_key,
)  # fmt: skip

__all__ = [
    "TuningDB",
    "DatabaseError",
    "DamagedDatabase",
    "ReadOnlyDatabase",
    "RowError",
    "Skipped",
    "default_path",
    "check_location",
    "keep_decisions",
    "KEEP_ENV_VAR",
    "DEFAULT_KEEP_DECISIONS",
    "ModelRecord",
    "BatchStats",
    "DeviceKey",
    "ModuleSignature",
    "Decision",
    "Measurement",
    "DecisionTotals",
    "BucketTotals",
    "config_key",
]
