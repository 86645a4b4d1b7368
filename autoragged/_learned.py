"""The calibrated cost model as the runtime sees it: read from the tuning database, lazily, once."""

from __future__ import annotations

import logging
from pathlib import Path

from ._costmodel import FEATURE_VERSION
from .tuning_db import DatabaseError, DeviceKey, ModuleSignature

log = logging.getLogger("autoragged")


def load_planner_inputs(db_path: Path | None, device: DeviceKey, sig: ModuleSignature):
    """(model, candidates) from the newest calibration of `device` that covers `sig`, or None (then the
    planner uses the analytic prior)."""
    if db_path is None or not db_path.exists():
        return None
    from ._recorder import RECORDER

    try:
        record = RECORDER.open_db(db_path).latest_model(device.key, feature_version=FEATURE_VERSION, signature=sig.key)
    except DatabaseError as e:
        log.warning("autoragged: cannot read the cost model, using the prior: %s", e)
        return None
    if record is None:
        return None
    from ._model import CompiledModel

    model = CompiledModel.from_payload(record.payload)
    return model, model.candidates_for(sig)
