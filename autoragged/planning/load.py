"""The calibrated cost model as the runtime sees it: read from the tuning database, lazily, once.

The models table may come from a shared file, damaged or hostile: the newest row is read with its size capped
before it is parsed (`payload.MAX_PAYLOAD_BYTES`), parsed with a guard against deep nesting, and validated in
full (`CompiledModel.from_payload`). Anything wrong on that path, whatever the exception, costs one WARNING
naming the file, the row and the problem, and the planner decides with the analytic prior: reading a model
never stalls or fails a forward.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..tuning_db import DeviceKey, ModuleSignature, RowError
from .costmodel import FEATURE_VERSION
from .payload import MAX_PAYLOAD_BYTES

log = logging.getLogger("autoragged")

_REMEDY = "refit with python -m autoragged.tune --refit (or delete the row)"


def load_planner_inputs(db_path: Path | None, device: DeviceKey, sig: ModuleSignature):
    """(model, candidates) from the newest calibration of `device` that covers `sig`, or None (then the
    planner uses the analytic prior; a calibration that cannot be used was reported in one warning, a database
    that cannot be used by the recorder's, and a fit the tuner did not adopt at tune time)."""
    if db_path is None or not db_path.exists():
        return None
    from ..runtime.recorder import RECORDER

    db = RECORDER.usable_db(db_path)  # None: a damaged file, or a path that cannot be opened (warned once)
    if db is None:
        return None
    try:
        record = db.latest_model(
            device.key, feature_version=FEATURE_VERSION, signature=sig.key, max_payload_bytes=MAX_PAYLOAD_BYTES
        )
    except RowError as e:
        log.warning("autoragged: using the analytic prior: the cost model in models row %s of %s is unusable: %s; "
                    "%s", e.row_id, db_path, e.problem, _REMEDY)  # fmt: skip
        return None
    except Exception as e:  # noqa: BLE001 - whatever the file holds, a forward must not fail on reading it
        log.warning("autoragged: using the analytic prior: cannot read the cost model from %s: %s", db_path, e)
        return None
    if record is None:
        return None
    if record.metrics.get("adopted") is False:  # tune said so when it stored it
        log.debug("autoragged: the cost model in models row %s of %s lost to the analytic prior on held-out "
                  "batches (not adopted): deciding with the prior", record.id, db_path)  # fmt: skip
        return None
    from .learned import CompiledModel

    try:
        model = CompiledModel.from_payload(record.payload, device=device)
        return model, model.candidates_for(sig)
    except Exception as e:  # noqa: BLE001 - a PayloadError, or anything a hostile payload might still raise
        log.warning("autoragged: using the analytic prior: the cost model in models row %s of %s is unusable: %s; %s",
                    record.id, db_path, e, _REMEDY)  # fmt: skip
        return None


def load_training_ratios(db_path: Path | None, device: DeviceKey, sig: ModuleSignature, per_arm: int) -> dict:
    """Per arm kind ("padded", "ragged"), the measured / predicted ratios of the newest `per_arm` training
    measurements of `sig` on `device` (`tune --train`'s and earlier runs' timed training batches, each stored with
    the forward-only prediction it was priced against), oldest first; {} without a usable database. Rows that
    cannot be read are left out; reading never fails a forward."""
    if db_path is None or not db_path.exists():
        return {}
    from ..runtime.recorder import RECORDER
    from ..tuning_db import Skipped

    db = RECORDER.usable_db(db_path)
    if db is None:
        return {}
    out = {}
    try:
        for kind in ("padded", "ragged"):
            rows = db.training_measurements(device.key, sig.key, kind, per_arm, skipped=Skipped())
            ratios = [m.median_ms / p for m in rows if _positive(p := m.extra.get("predicted")) and m.median_ms > 0]
            if ratios:
                out[kind] = ratios
    except Exception as e:  # noqa: BLE001 - whatever the file holds, a forward must not fail on reading it
        log.warning("autoragged: training costs start from the analytic prior: cannot read %s: %s", db_path, e)
        return {}
    return out


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")
