"""PyTorch's `nn.TransformerEncoder` and `nn.TransformerEncoderLayer`.

`install` changes the instance's class to a subclass of its own (`DispatchingTransformerEncoder` /
`DispatchingTransformerEncoderLayer`): same object, same parameters, same `state_dict` keys, same hooks,
`isinstance` still true; `uninstall` puts the class back. The padded arm is the module's own forward (its
output's padded positions zeroed); the ragged arm runs its layers as specs of the fused ragged encoder
(models/encoder.py).

forward(src, mask=None, src_key_padding_mask=None, is_causal=None, *, lengths=None): `src` may also be a
RaggedTensor (then the result is one); `lengths` are host ints (B) that make the mask optional.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..nn import activation_kind, encoder_specs, support_error
from ..ragged.tensor import RaggedTensor, pad_mask, padded_from_ragged, ragged_from_padded, zero_pads
from ..tuning_db import ModuleSignature
from .base import Body, Call, EpochCache
from .encoder import autocast_reason, encoder_values

__all__ = ["DispatchingTransformerEncoder", "DispatchingTransformerEncoderLayer", "signature_of", "ADAPTER"]

log = logging.getLogger("autoragged")


class DispatchingTransformerEncoder(nn.TransformerEncoder):
    """An `nn.TransformerEncoder` whose forward picks padded or ragged per batch (see `autoragged.wrap`).

    forward(src, mask=None, src_key_padding_mask=None, is_causal=None, *, lengths=None): `src` may also
    be a RaggedTensor (then the result is one); `lengths` are host ints (B) that make the mask optional.
    """

    @torch.compiler.disable  # eager under torch.compile: see models/hf.py's docstring
    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None, *, lengths=None):
        runtime = self._autoragged.ready(self)
        return runtime.run(self, TorchCall(runtime.body, src, mask, src_key_padding_mask, is_causal, lengths))


class DispatchingTransformerEncoderLayer(nn.TransformerEncoderLayer):
    """An `nn.TransformerEncoderLayer` whose forward picks padded or ragged per batch."""

    @torch.compiler.disable  # eager under torch.compile: see models/hf.py's docstring
    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False, *, lengths=None):
        runtime = self._autoragged.ready(self)
        return runtime.run(self, TorchCall(runtime.body, src, src_mask, src_key_padding_mask, is_causal, lengths))


_DISPATCHING = {
    nn.TransformerEncoder: DispatchingTransformerEncoder,
    nn.TransformerEncoderLayer: DispatchingTransformerEncoderLayer,
}
_BASE = {v: k for k, v in _DISPATCHING.items()}


def _layer_dict(module: nn.Module):
    """The `_modules` dict of an encoder's layer list (None for a layer): `del layers[i]` replaces it."""
    layers = module._modules.get("layers") if isinstance(module, nn.TransformerEncoder) else None
    return layers._modules if layers is not None else None


def signature_of(module: nn.Module) -> ModuleSignature:
    """The cost-relevant shape of an encoder or encoder layer ("unknown" parts for exotic layers)."""
    if isinstance(module, nn.TransformerEncoder):
        layers, final_norm, kind = list(module.layers), module.norm is not None, "encoder"
    else:
        layers, final_norm, kind = [module], False, "encoder_layer"
    first = layers[0]
    mha = getattr(first, "self_attn", None)
    if not isinstance(mha, nn.MultiheadAttention) or not isinstance(getattr(first, "linear1", None), nn.Linear):
        return ModuleSignature(kind, len(layers), 0, 0, 0, "unknown", False, "unknown", final_norm=final_norm)
    return ModuleSignature(
        kind=kind,
        layers=len(layers),
        d_model=mha.embed_dim,
        heads=mha.num_heads,
        ff=first.linear1.out_features,
        activation=activation_kind(first),
        norm_first=bool(first.norm_first),
        dtype=str(first.linear1.weight.dtype).replace("torch.", ""),
        bias=first.linear1.bias is not None,
        final_norm=final_norm,
        nested=bool(getattr(module, "use_nested_tensor", False)),
    )


class TorchEncoderBody(Body):
    def __init__(self, module: nn.Module):
        super().__init__(module)
        self.module = module
        self.base = _BASE.get(type(module), type(module))
        if isinstance(module, nn.TransformerEncoder):
            self.layers, self.norm = list(module.layers), module.norm
        else:
            self.layers, self.norm = [module], None
        first = self.layers[0]
        mha = getattr(first, "self_attn", None)
        self.batch_first = bool(getattr(mha, "batch_first", False))
        self.static_reason = support_error(module)
        self.has_dropout = any(m.p > 0 for layer in self.layers for m in layer.modules() if isinstance(m, nn.Dropout))
        self.sig = signature_of(module)
        self.d_model = self.sig.d_model
        self.head_dim = self.sig.d_model // max(self.sig.heads, 1)
        self.fused = self.mask_graph = self.trains = True
        self._float_mask_checked = False
        self._layers_dict = _layer_dict(module)
        self._layer_count = len(self._layers_dict) if self._layers_dict is not None else 0
        # the layers as specs, re-made only when a parameter or module was (re-)registered
        self._specs = EpochCache(lambda: encoder_specs(self.layers, self.norm))

    def probe(self) -> torch.Tensor:
        return self.layers[0].linear1.weight

    def check_float_mask(self, kpm: torch.Tensor) -> None:
        """Warn about a float key padding mask holding values other than 0 and -inf: an HF-style mask (1.0 = keep),
        which PyTorch adds to the attention scores, so it pads nothing. Checked once per module (a device sync)."""
        if self._float_mask_checked:
            return
        self._float_mask_checked = True
        if not bool(((kpm == 0) | torch.isneginf(kpm)).all()):
            log.warning(
                "autoragged %s: the float key padding mask holds values other than 0 and -inf; PyTorch adds a float "
                "mask to the attention scores (-inf = pad), so a 1 = keep mask is not a padding mask. Pass a bool "
                "mask, True = pad (e.g. attention_mask == 0)", self.sig.key,
            )  # fmt: skip

    def autocast_reason(self, dtype, cast):
        return autocast_reason(dtype)

    def values(self, x, layout, config, causal, hidden=None):
        return encoder_values(*self._specs.get(), x, layout, config, causal, hidden, self.module.training)

    def synthetic(self, lengths, L: int, device, mask: bool = True) -> tuple[tuple, dict]:
        """(args, kwargs) of a call of this module on a batch of `lengths` padded to L (zeros; right padding),
        with its key padding mask or with `lengths=` (`autoragged.warmup`)."""
        shape = (len(lengths), L, self.d_model) if self.batch_first else (L, len(lengths), self.d_model)
        x = torch.zeros(shape, dtype=self.probe().dtype, device=device)
        if mask:
            return (x,), {"src_key_padding_mask": pad_mask(tuple(lengths), L, torch.device(device))}
        return (x,), {"lengths": list(lengths)}

    def layers_moved(self, module) -> bool:
        layers = self._layers_dict
        if layers is None:
            return False
        own = module._modules.get("layers")
        return own is None or own._modules is not layers or len(layers) != self._layer_count

    def restructured(self, module) -> bool:
        if super().restructured(module):
            return True
        # the same modules: the layer dict was replaced by an equal one; follow it
        self._layers_dict = _layer_dict(module)
        self._layer_count = len(self._layers_dict) if self._layers_dict is not None else 0
        return False


class TorchCall(Call):
    """A call of a wrapped torch encoder (see the module docstring for the signature)."""

    __slots__ = ("body", "src", "x", "ragged_in", "attn_mask", "given_kpm", "kpm", "is_causal", "lengths", "B", "L",
                 "causal", "reason", "passthrough", "device", "dtype", "requires_grad")  # fmt: skip

    def __init__(self, body: TorchEncoderBody, src, attn_mask, kpm, is_causal, lengths):
        self.body, self.src, self.attn_mask, self.is_causal, self.lengths = body, src, attn_mask, is_causal, lengths
        self.given_kpm = kpm  # as the caller gave it: the padded arm passes it on
        if kpm is not None and kpm.dtype.is_floating_point:  # PyTorch's float convention: -inf = pad
            body.check_float_mask(kpm)
            kpm = torch.isneginf(kpm)
        self.kpm = kpm  # bool, True = pad: what the runtime reads
        ragged_in = isinstance(src, RaggedTensor)
        self.ragged_in = src if ragged_in else None
        x = self.x = src.values if ragged_in else src
        self.passthrough = self.reason = None
        self.causal = bool(is_causal) and attn_mask is not None
        if not ragged_in and not (isinstance(x, torch.Tensor) and not x.is_nested and x.dim() == 3):
            if lengths is not None:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) and not x.is_nested else type(x).__name__
                raise ValueError(f"lengths= needs a batched (B, L, D) input (or (L, B, D)), got {shape}")
            self.passthrough = "input is not a batched (B, L, D) tensor"
            self.B = self.L = 0
            return
        self.device, self.dtype, self.requires_grad = x.device, x.dtype, x.requires_grad
        if ragged_in:
            self.B, self.L = src.batch_size, src.max_len
        else:
            self.B, self.L = (x.shape[0], x.shape[1]) if body.batch_first else (x.shape[1], x.shape[0])
        if ragged_in and tuple(src.feature_shape) != (body.d_model,):
            raise ValueError(
                f"a RaggedTensor input to this encoder must have values (T, {body.d_model}), got values of shape "
                f"{tuple(src.values.shape)} (a RaggedTensor of token ids or of (B, L) rows has no feature dimension)"
            )
        if attn_mask is not None and not is_causal:
            self.reason = "attn_mask other than key padding (pass is_causal=True with a causal mask)"
        elif is_causal and attn_mask is None:
            self.reason = "is_causal without attn_mask"
        elif self.given_kpm is not None and self.given_kpm.dtype != torch.bool:
            self.reason = "key padding mask is not bool"

    def original(self, module):
        return self.body.base.forward(module, self.src, self.attn_mask, self.given_kpm, self.is_causal)

    def no_tokens(self) -> str:
        raise ValueError(
            f"every sequence of this batch of {self.B} is empty (all lengths 0, or the mask pads every position): "
            "PyTorch's encoder cannot run it (its nested-tensor path raises); leave empty batches out"
        )

    def padded(self, module, lens, stats):
        body, ragged_in, L = self.body, self.ragged_in, self.L
        seq_axis = 1 if body.batch_first else 0
        padded_in = padded_from_ragged(ragged_in, 0.0, L, seq_axis) if ragged_in is not None else self.src
        has_pads = stats.total < stats.batch * L
        given, pads = self.given_kpm, self.kpm
        if given is None or ragged_in is not None:
            given = pads = pad_mask(lens, L, self.device) if has_pads else None
        out = body.base.forward(module, padded_in, self.attn_mask, given, self.is_causal)
        if has_pads and pads is not None:
            out = zero_pads(out, pads, body.batch_first)
        if ragged_in is not None:
            return ragged_from_padded(out, lens, ragged_in.align, seq_axis)
        return out

    def padded_mask(self, module):
        out = self.body.base.forward(module, self.x, self.attn_mask, self.given_kpm, self.is_causal)
        return zero_pads(out, self.kpm, self.body.batch_first)


class TorchEncoderAdapter:
    """Finds and wraps PyTorch's encoder modules (their exact classes, not subclasses)."""

    name = "torch_encoder"

    def targets(self, model: nn.Module) -> list[nn.Module]:
        """Encoders, and encoder layers not inside an encoder, in module order."""
        found: list[nn.Module] = []
        inside: set[int] = set()
        for module in model.modules():
            if id(module) in inside:
                continue
            base = _BASE.get(type(module), type(module))
            if base is nn.TransformerEncoder:
                found.append(module)
                inside.update(id(m) for m in module.modules())
            elif base is nn.TransformerEncoderLayer:
                found.append(module)
        return found

    def skipped(self, model: nn.Module) -> list[tuple[nn.Module, str]]:
        """Subclasses of PyTorch's encoder modules in `model`, with why they are not wrapped (their forward
        may compute something else; the layers inside one are wrapped on their own)."""
        return [
            (m, f"{name or 'the model'} is a {type(m).__name__}, a subclass of nn.{m.__class__.__mro__[1].__name__}"
             " (only the exact classes are wrapped: their forward may differ)")
            for name, m in model.named_modules()
            if isinstance(m, (nn.TransformerEncoder, nn.TransformerEncoderLayer)) and type(m) not in _DISPATCHING
            and type(m) not in _BASE
        ]  # fmt: skip

    def bind(self, module: nn.Module) -> TorchEncoderBody:
        return TorchEncoderBody(module)

    def install(self, module: nn.Module) -> None:
        module.__class__ = _DISPATCHING[_BASE.get(type(module), type(module))]

    def uninstall(self, module: nn.Module) -> None:
        module.__class__ = _BASE.get(type(module), type(module))


ADAPTER = TorchEncoderAdapter()
