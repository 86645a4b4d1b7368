"""Ragged encoder modules: PyTorch's encoder modules run on `RaggedTensor`s with the ragged ops.

Each wraps an existing `nn.MultiheadAttention` / `nn.TransformerEncoderLayer` / `nn.TransformerEncoder`
and shares its parameters (no copies: an in-place update of the original is seen at once). Supported:
norm_first both ways, relu and (exact) gelu, bias on and off, any layer_norm_eps, the encoder's final
norm, self-attention with one in-projection; `support_error()` names anything else.

The layers run as specs of the fused ragged encoder (`autoragged/models/encoder.py`, shared with the HF
BERT family): qkv linear, attention, out linear, add+LayerNorm, ff1 linear (+ activation fused), ff2
linear, add+LayerNorm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .kernels.config import KernelConfig
from .kernels.ragged_attention import HEAD_DIMS
from .models.encoder import Dropouts, EncoderLayerSpec, encoder_values, linear_config
from .ops import CAUSAL, FULL, attention_values, linear_values
from .ragged.layout import Layout
from .ragged.tensor import RaggedTensor, zero_gaps

__all__ = [
    "RaggedMultiheadAttention",
    "RaggedTransformerEncoderLayer",
    "RaggedTransformerEncoder",
    "activation_kind",
    "support_error",
    "layer_spec",
    "encoder_specs",
]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def activation_kind(layer: nn.TransformerEncoderLayer) -> str:
    """ "relu", "gelu" (exact, erf) or a description of another activation (unsupported)."""
    act = layer.activation
    if act is F.relu or isinstance(act, nn.ReLU):
        return "relu"
    if act is F.gelu or (isinstance(act, nn.GELU) and act.approximate == "none"):
        return "gelu"
    if isinstance(act, nn.GELU):
        return f"gelu(approximate={act.approximate!r})"
    return getattr(act, "__name__", type(act).__name__)


def _mha_support_error(mha: nn.MultiheadAttention) -> str | None:
    if not mha._qkv_same_embed_dim:
        return "MultiheadAttention with kdim/vdim != embed_dim"
    if mha.bias_k is not None or mha.add_zero_attn:
        return "MultiheadAttention with add_bias_kv or add_zero_attn"
    head_dim = mha.embed_dim // mha.num_heads
    if head_dim not in HEAD_DIMS:
        return f"head dim {head_dim} (supported: {HEAD_DIMS})"
    if mha.in_proj_weight.dtype not in _DTYPES:
        return f"parameters of dtype {mha.in_proj_weight.dtype} (supported: float16, bfloat16, float32)"
    return None


def support_error(module: nn.Module) -> str | None:
    """Why the ragged arm cannot run `module` (a static property of the module), or None if it can."""
    if isinstance(module, nn.TransformerEncoder):
        for i, layer in enumerate(module.layers):
            if type(layer) is not nn.TransformerEncoderLayer and not _is_dispatching_layer(layer):
                return f"layer {i} is a {type(layer).__name__}, not an nn.TransformerEncoderLayer"
            err = support_error(layer)
            if err:
                return f"layer {i}: {err}"
        if module.norm is not None and not isinstance(module.norm, nn.LayerNorm):
            return f"final norm is a {type(module.norm).__name__}, not an nn.LayerNorm"
        return None
    if isinstance(module, nn.TransformerEncoderLayer):
        kind = activation_kind(module)
        if kind not in ("relu", "gelu"):
            return f"activation {kind} (supported: relu, exact gelu)"
        for norm in (module.norm1, module.norm2):
            if not isinstance(norm, nn.LayerNorm) or len(norm.normalized_shape) != 1:
                return "norms other than a 1-D nn.LayerNorm"
        return _mha_support_error(module.self_attn)
    if isinstance(module, nn.MultiheadAttention):
        return _mha_support_error(module)
    return f"{type(module).__name__} is not an encoder module"


def _is_dispatching_layer(layer: nn.Module) -> bool:
    return isinstance(layer, nn.TransformerEncoderLayer) and hasattr(layer, "_autoragged")


# -- as specs of the fused ragged encoder (models/encoder.py) ------------------------------------
def _norm_args(norm: nn.LayerNorm) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
    return norm.weight, norm.bias, norm.eps


def layer_spec(layer: nn.TransformerEncoderLayer) -> EncoderLayerSpec:
    """A supported `nn.TransformerEncoderLayer` as the fused encoder's layer spec (its own parameters)."""
    mha = layer.self_attn
    return EncoderLayerSpec(
        heads=mha.num_heads,
        qkv=((mha.in_proj_weight, mha.in_proj_bias),),
        out=(mha.out_proj.weight, mha.out_proj.bias),
        norm1=_norm_args(layer.norm1),
        ff1=(layer.linear1.weight, layer.linear1.bias),
        activation=activation_kind(layer),
        ff2=(layer.linear2.weight, layer.linear2.bias),
        norm2=_norm_args(layer.norm2),
        norm_first=bool(layer.norm_first),
        dropout=Dropouts(
            probs=mha.dropout, attn_out=layer.dropout1.p, ff_inner=layer.dropout.p, ff_out=layer.dropout2.p
        ),
    )


def encoder_specs(layers, norm: nn.LayerNorm | None):
    """(layer specs, final norm args or None) of supported `nn.TransformerEncoderLayer`s and a final norm."""
    return [layer_spec(layer) for layer in layers], (None if norm is None else _norm_args(norm))


def mha_values(
    mha: nn.MultiheadAttention, x: torch.Tensor, layout: Layout, config: KernelConfig | None, causal: bool
) -> torch.Tensor:
    """Self-attention of `mha` on values x (rows, D) -> (rows, D)."""
    rows, D = x.shape
    H = mha.num_heads
    lin, live, tiles = linear_config(config), layout.live, layout.tile_rows
    qkv = linear_values(x, mha.in_proj_weight, mha.in_proj_bias, None, lin, live=live, rows=tiles)
    q, k, v = qkv.view(rows, 3, H, D // H).unbind(1)
    a = attention_values(q, k, v, layout, window=CAUSAL if causal else FULL, config=config)
    return linear_values(a.view(rows, D), mha.out_proj.weight, mha.out_proj.bias, None, lin, live=live, rows=tiles)


# -- modules ---------------------------------------------------------------------------------------
def _require_supported(module: nn.Module) -> None:
    err = support_error(module)
    if err:
        raise ValueError(f"the ragged arm does not support this module: {err}")


def _check_input(x: object, d_model: int, dtype: torch.dtype, device: torch.device) -> RaggedTensor:
    if not isinstance(x, RaggedTensor):
        raise TypeError(f"expected a RaggedTensor, got {type(x).__name__} (build one with RaggedTensor.from_padded)")
    if tuple(x.feature_shape) != (d_model,):
        raise ValueError(f"expected values (T, {d_model}), got {tuple(x.values.shape)}")
    if x.dtype != dtype or x.device != device:
        raise ValueError(f"input is {x.dtype} on {x.device}; the module's parameters are {dtype} on {device}")
    return x


class RaggedMultiheadAttention(nn.Module):
    """Self-attention of an `nn.MultiheadAttention` on a RaggedTensor (values (T, embed_dim))."""

    def __init__(self, mha: nn.MultiheadAttention):
        super().__init__()
        _require_supported(mha)
        self.mha = mha

    def forward(self, x: RaggedTensor, *, causal: bool = False, config: KernelConfig | None = None) -> RaggedTensor:
        w = self.mha.in_proj_weight
        x = _check_input(x, self.mha.embed_dim, w.dtype, w.device)
        out = mha_values(self.mha, x.values, x.layout, config, causal)
        return x.with_values(zero_gaps(out, x.layout))


class RaggedTransformerEncoderLayer(nn.Module):
    """An `nn.TransformerEncoderLayer` (inference) on a RaggedTensor of values (T, d_model)."""

    def __init__(self, layer: nn.TransformerEncoderLayer):
        super().__init__()
        _require_supported(layer)
        self.layer = layer

    def forward(self, x: RaggedTensor, *, causal: bool = False, config: KernelConfig | None = None) -> RaggedTensor:
        w = self.layer.linear1.weight
        x = _check_input(x, self.layer.self_attn.embed_dim, w.dtype, w.device)
        out = encoder_values(*encoder_specs([self.layer], None), x.values, x.layout, config, causal)
        return x.with_values(zero_gaps(out, x.layout))


class RaggedTransformerEncoder(nn.Module):
    """An `nn.TransformerEncoder` (inference) on a RaggedTensor, including its final norm."""

    def __init__(self, encoder: nn.TransformerEncoder):
        super().__init__()
        _require_supported(encoder)
        self.encoder = encoder

    def forward(self, x: RaggedTensor, *, causal: bool = False, config: KernelConfig | None = None) -> RaggedTensor:
        first = self.encoder.layers[0]
        w = first.linear1.weight
        x = _check_input(x, first.self_attn.embed_dim, w.dtype, w.device)
        out = encoder_values(*encoder_specs(self.encoder.layers, self.encoder.norm), x.values, x.layout, config, causal)
        return x.with_values(zero_gaps(out, x.layout))
