"""Llama-style decoder layers (Llama, Mistral, Qwen2, Qwen3) on packed rows, run by our kernels where HF's
modules spend passes over memory.

A prefill of long documents is GEMM-bound, and cuBLAS on packed rows is already padding-free: the model's own
linear weights go to `F.linear` unchanged. What HF's modules add between the GEMMs are elementwise passes: the
RMSNorm is seven kernels (a cast to fp32, pow, mean, rsqrt, product, cast back, weight product), rotary five
per tensor and a concatenation, the MLP's activation and product two passes over the (rows, F) gate, and the
residual adds one each. On a Qwen2.5-7B-shaped layer with 15K packed rows those passes move several GB, about
a sixth of the layer's time. Here a layer is

    [add +] RMSNorm (kernels/rms_norm) -> q, k, v projections -> [q/k RMSNorm (Qwen3)] -> rotary
    (kernels/rotary) -> our varlen attention -> o projection -> add + RMSNorm -> gate, up projections
    -> silu * up (kernels/gated_act, over the gate) -> down projection

and each residual add is folded into the next norm (the last into the final norm). Every kernel rounds where
HF's modules round (see each kernel's docstring), so the output is the module path's to an ulp or so; the
tests hold both to the original model.

Only layers whose every part is one of the known modules take this path (`why_not` says why not); the rest
run the model's own modules with our attention through transformers' attention interface. A peft adapter layer
(LoRA) in a linear's place runs as its own module, and HF's gradient checkpointing checkpoints each layer here as
the model's own layers would (_modules.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..graphs.train import why_not_call
from ._modules import adapted_linear, layer_checkpoint

__all__ = ["why_not", "why_not_graphed", "run", "DecoderStack"]

# RMSNorm classes whose forward is LlamaRMSNorm's (weight * normalised.to(dtype), statistics in fp32)
_RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _norm_reason(name: str, norm, dtype) -> str | None:
    if type(norm).__name__ not in _RMS_NORMS:
        return f"{name} is a {type(norm).__name__}"
    if norm.weight.dtype != dtype:
        return f"{name}'s weight is {norm.weight.dtype}, the model {dtype}"
    return None


def why_not(layers, final_norm, config, dtype) -> str | None:
    """Why these decoder layers cannot take the fused path, or None when every one can."""
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {getattr(config, 'hidden_act', None)!r} (the fused MLP is silu's)"
    why = _norm_reason("the final norm", final_norm, dtype)
    if why:
        return why
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        parts = [(f"self_attn.{p}", getattr(attn, p, None)) for p in _ATTENTION]
        parts += [(f"mlp.{p}", getattr(mlp, p, None)) for p in _MLP]
        for name, part in parts:
            if type(part) is not nn.Linear and not adapted_linear(part):
                return f"layer {i}: {name} is not an nn.Linear"
        names = ["input_layernorm", "post_attention_layernorm"]
        norms = [(n, getattr(layer, n, None)) for n in names]
        norms += [(f"self_attn.{n}", getattr(attn, n)) for n in ("q_norm", "k_norm") if hasattr(attn, n)]
        for name, norm in norms:
            why = _norm_reason(f"layer {i}: {name}", norm, dtype)
            if why:
                return why
        if not getattr(attn, "is_causal", False):
            return f"layer {i}: attention is not causal"
    return None


def _head_norm(t: torch.Tensor, norm) -> torch.Tensor:
    rows, heads, dh = t.shape
    return ops.add_rms_norm_values(t.reshape(-1, dh), None, norm.weight, norm.variance_epsilon)[0].view(rows, heads, dh)


def _linear(linear: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """An nn.Linear's product on the packed rows; a peft adapter layer runs as itself (_modules.py)."""
    return F.linear(h, linear.weight, linear.bias) if type(linear) is nn.Linear else linear(h)


class _Shared(NamedTuple):
    """What every layer of one call shares: the rows' layout, the attention kernel's config, each row's rotary (cos,
    sin) (rows, Dh), and the KV-cache sink (or None)."""

    layout: object
    kernel_config: object
    cos: torch.Tensor
    sin: torch.Tensor
    sink: Callable | None


def _attention(attn, h, shared: _Shared, window) -> torch.Tensor:
    layout, kernel_config, cos, sin, sink = shared
    rows, dh = h.shape[0], attn.head_dim
    q = _linear(attn.q_proj, h).view(rows, -1, dh)
    k = _linear(attn.k_proj, h).view(rows, -1, dh)
    v = _linear(attn.v_proj, h).view(rows, -1, dh)
    q_norm = getattr(attn, "q_norm", None)
    if q_norm is not None:  # Qwen3: RMSNorm over each head's dim, before rotary
        q, k = (_head_norm(t, norm) for t, norm in ((q, q_norm), (k, attn.k_norm)))
    q, k = ops.rotary_pair_values(q, k, cos, sin)
    if sink is not None:
        sink(attn, k[None].transpose(1, 2), v[None].transpose(1, 2))  # (1, Hkv, rows, Dh), as HF hands them
    keys = ops.CAUSAL if window is None else (window - 1, 0)
    dropout = getattr(attn, "attention_dropout", 0.0) if attn.training else 0.0
    out = ops.attention_values(q, k, v, layout, window=keys, scale=attn.scaling, config=kernel_config, dropout=dropout)
    return _linear(attn.o_proj, out.reshape(rows, -1))


def _mlp(mlp, h) -> torch.Tensor:
    gate, up = _linear(mlp.gate_proj, h), _linear(mlp.up_proj, h)
    return _linear(mlp.down_proj, ops.silu_mul_values(gate, up))


def _layer(layer, branch, residual, shared: _Shared, window):
    """One layer on the previous layer's MLP branch and the residual stream it adds to (None before the first layer,
    whose input is `branch`) -> (their sum, the previous layer's output, or None for the first layer; the residual
    stream after this layer's attention; this layer's MLP branch)."""
    norm = layer.input_layernorm
    h, total = ops.add_rms_norm_values(branch, residual, norm.weight, norm.variance_epsilon, store_sum=True)
    if residual is None:
        total, stream = None, branch
    else:
        stream = total
    branch = _attention(layer.self_attn, h, shared, window)
    norm = layer.post_attention_layernorm
    h, residual = ops.add_rms_norm_values(branch, stream, norm.weight, norm.variance_epsilon, store_sum=True)
    return total, residual, _mlp(layer.mlp, h)


class DecoderStack(NamedTuple):
    """The modules the fused path runs: the decoder `layers` (those `why_not` accepted), the model's `final_norm`,
    and the family's `window_of(attention module)` -> that layer's sliding window or None."""

    layers: Sequence[nn.Module]
    final_norm: nn.Module
    window_of: Callable


def why_not_graphed(stack: DecoderStack, x: torch.Tensor, layout) -> str | None:
    """Why a training graph (graphs/train.py) cannot replay this call of the stack exactly, or None: a replay draws
    no adapter's own code, checkpoints nothing and casts nothing (attention dropout draws its seed on the device:
    a replay draws new masks)."""
    reason = why_not_call(x, layout)
    if reason is not None:
        return reason
    if torch.is_autocast_enabled(x.device.type):
        return "autocast"
    for layer in stack.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if layer_checkpoint(layer) is not None:
            return "gradient checkpointing"
        if any(type(getattr(m, n)) is not nn.Linear for m, names in ((attn, _ATTENTION), (mlp, _MLP)) for n in names):
            return "an adapter layer"
    return None


def run(
    stack: DecoderStack,
    x: torch.Tensor,
    layout,
    kernel_config,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    sink=None,
    hidden: list | None = None,
) -> torch.Tensor:
    """The stack's layers and final norm on packed values x (rows, D) -> (rows, D). position_embeddings: HF's
    (cos, sin), (1, rows, Dh) gathered per packed row; sink and hidden as `HFDecoderBody.values`."""
    layers, final_norm, window_of = stack
    cos, sin = (t[0] for t in position_embeddings)
    shared = _Shared(layout, kernel_config, cos, sin, sink)
    residual, branch = None, x
    for layer in layers:
        run = functools.partial(_layer, layer, shared=shared, window=window_of(layer.self_attn))
        # HF's gradient checkpointing, where it applies (a call that fills a KV cache is not recomputed: the
        # recompute would fill it twice)
        checkpoint = layer_checkpoint(layer) if sink is None else None
        total, residual, branch = run(branch, residual) if checkpoint is None else checkpoint(run, branch, residual)
        if total is not None and hidden is not None:  # the previous layer's output
            hidden.append(total)
    if residual is None:  # no layers
        return ops.add_rms_norm_values(x, None, final_norm.weight, final_norm.variance_epsilon)[0]
    y, residual = ops.add_rms_norm_values(
        branch, residual, final_norm.weight, final_norm.variance_epsilon, store_sum=True
    )
    if hidden is not None:
        hidden.append(residual)
    return y
