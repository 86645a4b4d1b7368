"""What the fused ragged arms (encoder.py, fused_decoder.py) run of a model's own modules rather than of its weights.

- A peft adapter layer (LoRA, DoRA, ... over an `nn.Linear`: `peft.tuners.tuners_utils.BaseTunerLayer`) in a linear's
  place runs as its own module on the packed rows: its `weight` is the base layer's alone, so a product with it would
  drop the adapter's update. Its merged, disabled and multi-adapter states are the module's own business.
- HF's gradient checkpointing (`model.gradient_checkpointing_enable()`: each `GradientCheckpointingLayer` holds the
  flag and the checkpoint function, `use_reentrant` and offloading bound in) applies to the same layers on the
  ragged arm: each runs inside the function it was given, so the arm keeps each layer's input and recomputes the rest
  in the backward, as the original does.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["adapted_linear", "layer_checkpoint"]


def adapted_linear(module) -> bool:
    """True for a peft adapter layer over an `nn.Linear` (it runs as itself on packed rows)."""
    peft = sys.modules.get("peft.tuners.tuners_utils")  # (no model holds one before peft is imported)
    return peft is not None and isinstance(module, peft.BaseTunerLayer) and type(module.get_base_layer()) is nn.Linear


def layer_checkpoint(layer: nn.Module) -> Callable | None:
    """The checkpoint function HF's gradient checkpointing gave `layer`, where it applies to this call (the layer in
    training mode, autograd on, as `GradientCheckpointingLayer.__call__` decides), else None."""
    if getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
        return layer._gradient_checkpointing_func
    return None
