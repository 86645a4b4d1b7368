"""The fused ragged encoder: a stack of self-attention + feed-forward layers on packed rows, family-agnostic.

PyTorch's `nn.TransformerEncoderLayer` and the HuggingFace BERT family (BERT, RoBERTa, XLM-R, CamemBERT,
ELECTRA, ALBERT, DistilBERT) compute the same layer: q/k/v projections, attention, an output projection,
add+LayerNorm, a feed-forward of two linears with an activation between, add+LayerNorm (post-norm; pre-norm
layers normalise first). A family adapter describes each of its layers as an `EncoderLayerSpec` (the module's
own parameters, never copies: an in-place update is seen by the next batch and by every CUDA-graph replay),
and `encoder_values` runs the specs with the ragged ops.

Per layer (post-norm), the ragged arm launches: the q/k/v linear(s), attention, out linear, add+LayerNorm,
ff1 linear (+ relu / exact gelu fused; another activation runs after it), ff2 linear, add+LayerNorm. Pre-norm
layers fuse the residual add that ends one layer into the LayerNorm that starts the next (and into the final
norm). Linears take the arm's backend: cuBLAS, or our Triton kernel, which stops at the rows the batch fills
(`Layout.live`) inside a ragged CUDA graph sized for its batch size and width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..graphs.train import why_not_call
from ..kernels.config import KernelConfig
from ..ops import CAUSAL, FULL, add_layer_norm_values, attention_values, linear_values
from ..ragged.layout import Layout

__all__ = [
    "EncoderLayerSpec",
    "Dropouts",
    "encoder_values",
    "linear_config",
    "autocast_reason",
    "why_not_graphed",
    "spec_tensors",
    "FUSED_ACTIVATIONS",
]

FUSED_ACTIVATIONS = ("relu", "gelu")  # in the linear's epilogue; "gelu" is the exact (erf) one

# (weight (N, K), bias (N,) or None), or a module run as itself on the rows (a peft adapter's linear: _modules.py)
Linear = tuple[torch.Tensor, torch.Tensor | None] | nn.Module
Norm = tuple[torch.Tensor | None, torch.Tensor | None, float]  # (weight, bias, eps) of a LayerNorm


class Dropouts(NamedTuple):
    """A layer's dropout probabilities, applied in training only. `probs`: on the attention probabilities (in the
    attention kernel, forward and backward); `attn_out`: after the out projection;
    `ff_inner`: after the activation; `ff_out`: after the second feed-forward linear."""

    probs: float = 0.0
    attn_out: float = 0.0
    ff_inner: float = 0.0
    ff_out: float = 0.0


@dataclass(frozen=True)
class EncoderLayerSpec:
    """One encoder layer as parameters. `qkv` is one fused in-projection (3 D, D) or three (D, D) ones;
    `activation` is "relu" / "gelu" (fused into ff1) or a callable applied to ff1's output."""

    heads: int
    qkv: tuple[Linear, ...]
    out: Linear
    norm1: Norm
    ff1: Linear
    activation: str | Callable[[torch.Tensor], torch.Tensor]
    ff2: Linear
    norm2: Norm
    norm_first: bool = False
    scale: float | None = None  # attention scale (default 1 / sqrt(head dim))
    dropout: Dropouts = Dropouts()


_CUBLAS = KernelConfig(backend="cublas")
_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}  # FUSED_ACTIVATIONS, for a linear run as its module


def _linear(x: torch.Tensor, linear: Linear, activation: str | None, config, live, rows) -> torch.Tensor:
    """act(x @ weight.T + bias) of a `Linear` on values x (T, K) -> (T, N); a module computes every row."""
    if isinstance(linear, nn.Module):
        y = linear(x)
        return y if activation is None else _ACTIVATIONS[activation](y)
    return linear_values(x, *linear, activation, config, live=live, rows=rows)


def linear_config(config: KernelConfig | None) -> KernelConfig | None:
    """The arm's config names the attention tiles, the alignment and the linears' backend; a Triton
    linear takes its own per-shape default tiles (None), cuBLAS takes none."""
    return _CUBLAS if config is not None and config.backend == "cublas" else None


def _attention(spec: EncoderLayerSpec, x: torch.Tensor, layout: Layout, config, causal: bool, training: bool):
    """Self-attention of one layer on values x (rows, D) -> (rows, D)."""
    rows, D = x.shape
    H = spec.heads
    lin, live, tiles = linear_config(config), layout.live, layout.tile_rows
    if len(spec.qkv) == 1:
        qkv = _linear(x, spec.qkv[0], None, lin, live, tiles)
        q, k, v = qkv.view(rows, 3, H, D // H).unbind(1)
    else:
        q, k, v = (_linear(x, linear, None, lin, live, tiles).view(rows, H, D // H) for linear in spec.qkv)
    drop = spec.dropout.probs if training else 0.0
    window = CAUSAL if causal else FULL
    a = attention_values(q, k, v, layout, window=window, scale=spec.scale, config=config, dropout=drop)
    return _dropout(_linear(a.view(rows, D), spec.out, None, lin, live, tiles), spec.dropout.attn_out, training)


def _feed_forward(spec: EncoderLayerSpec, x: torch.Tensor, config, layout: Layout, training: bool) -> torch.Tensor:
    lin, live, tiles = linear_config(config), layout.live, layout.tile_rows
    fused = spec.activation if isinstance(spec.activation, str) else None
    h = _linear(x, spec.ff1, fused, lin, live, tiles)
    if fused is None:
        h = spec.activation(h)
    h = _dropout(h, spec.dropout.ff_inner, training)
    return _dropout(_linear(h, spec.ff2, None, lin, live, tiles), spec.dropout.ff_out, training)


def autocast_reason(dtype: torch.dtype) -> str | None:
    """Why the fused encoder cannot follow autocast with parameters of `dtype` (its add+LayerNorm takes the float32
    parameters autocast's LayerNorm runs with), or None."""
    if dtype != torch.float32:
        return f"autocast over {str(dtype)[6:]} parameters (the ragged arm's norms take float32 ones)"
    return None


def spec_tensors(spec: EncoderLayerSpec) -> list[torch.Tensor]:
    """The parameters a layer's spec holds (its linears' and norms'), or [] where a linear is a module."""
    linears = (*spec.qkv, spec.out, spec.ff1, spec.ff2)
    if any(isinstance(linear, nn.Module) for linear in linears):
        return []
    held = [t for linear in linears for t in linear] + [*spec.norm1[:2], *spec.norm2[:2]]
    return [t for t in held if t is not None]


def why_not_graphed(specs: list[EncoderLayerSpec], x: torch.Tensor, layout) -> str | None:
    """Why a training graph (graphs/train.py) cannot replay this call of the layers exactly, or None: a replay runs
    no adapter's own code (its dropouts, the attention kernel's included, draw their seeds on the device)."""
    reason = why_not_call(x, layout)
    if reason is not None:
        return reason
    if not all(spec_tensors(spec) for spec in specs):
        return "an adapter layer"
    return None


def _dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    return F.dropout(x, p, training=True) if training and p > 0 else x


def encoder_values(
    specs: list[EncoderLayerSpec],
    final_norm: Norm | None,
    x: torch.Tensor,
    layout: Layout,
    config: KernelConfig | None = None,
    causal: bool = False,
    hidden_states: list | None = None,
    training: bool = False,
) -> torch.Tensor:
    """Run the layers (and the final norm) on values x (rows, D); gap rows of the result are unspecified,
    and so are rows from `layout.live` on where the layout has one. `hidden_states`, when a list, gets each
    layer's output values appended (pre-norm stacks: the residual stream after the layer). `training` applies
    the specs' dropouts."""
    live = layout.live
    autocast = torch.is_autocast_enabled(x.device.type)

    def add_norm(a, residual, norm: Norm, store_sum=False):
        if autocast:  # the original's norm(a + x) under autocast: the sum promoted, LayerNorm in float32
            a, residual = a.float(), None if residual is None else residual.float()
        return add_layer_norm_values(a, residual, *norm, store_sum=store_sum, live=live)

    pending: torch.Tensor | None = None  # pre-norm: the feed-forward output not yet added to x
    for spec in specs:
        if spec.norm_first:
            if pending is None:
                h, _ = add_norm(x, None, spec.norm1)
            else:  # the previous layer's x + ff(x), fused into this layer's first norm
                h, x = add_norm(pending, x, spec.norm1, True)
                if hidden_states is not None:
                    hidden_states.append(x)
            a = _attention(spec, h, layout, config, causal, training)
            h, x = add_norm(a, x, spec.norm2, True)
            pending = _feed_forward(spec, h, config, layout, training)
        else:
            a = _attention(spec, x, layout, config, causal, training)
            x, _ = add_norm(a, x, spec.norm1)
            f = _feed_forward(spec, x, config, layout, training)
            x, _ = add_norm(f, x, spec.norm2)
            if hidden_states is not None:
                hidden_states.append(x)
    if pending is not None:
        if hidden_states is not None:
            hidden_states.append(x + pending)
        if final_norm is not None:
            return add_norm(pending, x, final_norm)[0]
        return x + pending
    if final_norm is not None:
        return add_norm(x, None, final_norm)[0]
    return x
