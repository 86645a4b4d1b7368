"""autoragged: per-batch choice between padded and padding-free execution of transformer encoders.

    model = autoragged.wrap(model)            # same call signature as before
    y = model(x, src_key_padding_mask=mask)   # each batch goes to the predicted-fastest arm

Public modules: `autoragged.ops` (ragged kernels on RaggedTensors), `autoragged.nn` (ragged encoder
modules), `autoragged.packing` (token-budget batching), `autoragged.workloads` (length distributions),
`autoragged.tune` and `autoragged.report` (command-line entry points, `python -m ...`).
"""

from kernels._config import KernelConfig
from tuning_db.records import BatchStats, Decision, Measurement, ModuleSignature

from . import nn, ops
from ._dispatch import flush, recent_decisions, unwrap, wrap
from ._ragged import RaggedTensor, lengths_from_mask, restore_padding, strip_padding

__all__ = [
    "RaggedTensor",
    "KernelConfig",
    "BatchStats",
    "Decision",
    "Measurement",
    "ModuleSignature",
    "lengths_from_mask",
    "strip_padding",
    "restore_padding",
    "wrap",
    "unwrap",
    "recent_decisions",
    "flush",
    "nn",
    "ops",
]
__version__ = "0.1.0"
