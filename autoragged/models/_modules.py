"""What the fused ragged arms (encoder.py, fused_decoder.py) run of a model's own modules rather than of its weights.

- A peft adapter layer (LoRA, DoRA, ... over an `nn.Linear`: `peft.tuners.tuners_utils.BaseTunerLayer`) in a linear's
  place runs as its own module on the packed rows: its `weight` is the base layer's alone, so a product with it would
  drop the adapter's update. Its merged, disabled and multi-adapter states are the module's own business.
- HF's gradient checkpointing (`model.gradient_checkpointing_enable()`: each `GradientCheckpointingLayer` holds the
  flag and the checkpoint function, `use_reentrant` and offloading bound in) applies to the same layers on the
  ragged arm: each runs inside the function it was given, so the arm keeps each layer's input and recomputes the rest
  in the backward, as the original does. Where the layers are the model's own modules around our attention
  (`own_layers`), the attention is ours in the recompute too.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["adapted_linear", "layer_checkpoint", "own_layers"]


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


def own_layers(layers, h: torch.Tensor, attention: Callable, kwargs_of: Callable, hidden: list | None = None,
               fills_cache: bool = False) -> torch.Tensor:  # fmt: skip
    """The model's own layer modules, one after another on h (1, rows, D), each called with `kwargs_of(layer)`, inside
    `attention()` (the context in which their attention is ours over the packed rows: `hf.ragged_attention_of`).
    A layer that HF's gradient checkpointing recomputes runs inside its checkpoint function with `attention()`
    entered there as well: the recompute comes in the backward, after this block, where the model's own attention
    would attend across the packed rows (a reentrant checkpoint recomputes without checking: silently wrong
    gradients). A call that fills a KV cache is not recomputed (the recompute would fill it twice)."""
    with attention():
        for layer in layers:
            checkpoint = layer_checkpoint(layer)
            if checkpoint is None:
                h = layer(h, **kwargs_of(layer))
            elif fills_cache:  # (nn.Module's call: the layer's own would checkpoint it)
                h = nn.Module.__call__(layer, h, **kwargs_of(layer))
            else:
                h = checkpoint(functools.partial(_attended, layer, attention, kwargs_of(layer)), h)
            if hidden is not None:
                hidden.append(h[0])
    return h


def _attended(layer: nn.Module, attention: Callable, kwargs: dict, h: torch.Tensor) -> torch.Tensor:
    with attention():
        return nn.Module.__call__(layer, h, **kwargs)  # (the layer's own call would checkpoint it once more)
