"""A counter bumped whenever a parameter is (re-)registered on any module.

`module.weight = Parameter(...)` and `load_state_dict(assign=True)` go through PyTorch's global
parameter-registration hook; code that caches a parameter object (the dispatcher's dtype/device probe,
a CUDA graph's parameter list) re-reads it only when this epoch moved, instead of walking the module on
every batch.
"""

from __future__ import annotations

import torch

__all__ = ["param_epoch"]

_EPOCH = [0]


def _on_parameter_registration(module, name, param):
    _EPOCH[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_on_parameter_registration)


def param_epoch() -> int:
    return _EPOCH[0]
