"""The SQLite tuning database: every measurement, decision and cost model of autoragged, per device.

    from autoragged.tuning_db import TuningDB
    with TuningDB.open() as db:          # ~/.cache/autoragged/tuning.sqlite, or $AUTORAGGED_DB
        db.add_decisions(buffer)         # one transaction for the whole list
        db.decisions(device=key, limit=100)

Everything read back is validated: a damaged or hostile row raises `RowError` naming it, or, given a
`Skipped`, is left out and counted there (`python -m autoragged.report` does that).

Layer rule: this package imports sqlite-utils and the standard library only (no torch, numpy or autoragged);
sqlite-utils itself is imported when a database is opened, so importing the records is cheap.
"""

from ._db import ModelRecord, TuningDB, default_path
from ._errors import DatabaseError, RowError
from ._rows import Skipped
from .records import BatchStats, Decision, DeviceKey, Measurement, ModuleSignature, config_key

__all__ = [
    "TuningDB",
    "DatabaseError",
    "RowError",
    "Skipped",
    "default_path",
    "ModelRecord",
    "BatchStats",
    "DeviceKey",
    "ModuleSignature",
    "Decision",
    "Measurement",
    "config_key",
]
