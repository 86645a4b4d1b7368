"""A counter bumped whenever a parameter or a submodule is (re-)registered on any module.

`module.weight = Parameter(...)`, `load_state_dict(assign=True)`, `encoder.layers[0] = layer` and
`encoder.norm = None` go through PyTorch's global registration hooks; code that caches a parameter or
module object (the dispatcher's dtype/device probe and parameter list, a CUDA graph's parameter list, the
module structure a wrapped module was bound to) re-reads it only when this epoch moved, instead of walking
the module on every batch. (`del layers[i]` and `layers.insert` register nothing: the dispatcher checks the
layer list's dict and length for those.)
"""

from __future__ import annotations

import torch

__all__ = ["param_epoch"]

_EPOCH = [0]


def _on_registration(module, name, value):
    _EPOCH[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_on_registration)
torch.nn.modules.module.register_module_module_registration_hook(_on_registration)


def param_epoch() -> int:
    return _EPOCH[0]
