"""One q/k/v product per layer instead of three: each layer's q, k and v parameters laid side by side in one buffer.

HF's BERT family keeps three (D, D) linears per layer. On a packed batch of a few hundred tokens the ragged arm
then runs three small GEMMs, mostly launch and latency: in a CUDA graph on an H100, three (M, 768) x (768, 768)
products took 13.9 us against 7.2 for one (768 -> 2304) at M = 416; by 46,000 rows one product is no faster
(benchmarks/diagnostics/qkv_products.py). PyTorch's `nn.MultiheadAttention` keeps one in-projection too.

`FusedQKV.fuse` copies a layer's three weights (and biases) into one (3 D, D) buffer (and one (3 D,)) and makes
each parameter a view of its block (`param.data = block`). The parameters stay the same objects with the same
values, names and shapes (`state_dict`, `save_pretrained`, optimizers and the model's own forward, the padded arm,
are unchanged); an in-place update of any of them by any route (`copy_`, `.data.copy_`, an optimizer step,
`load_state_dict`) writes the buffer, so the next eager run and CUDA-graph replay see it. What changes: the three
tensors share one storage (safetensors >= 0.8 saves such non-overlapping views); `unwrap` gives each its own
storage back (`unfuse`).

Parameters that are inference tensors (a model made, loaded or deep-copied under `torch.inference_mode()`) stay
three: as views of a plain buffer they made the model's own forward raise.

The views can be undone behind our back: `.to()`, `.half()` or `param.data = t` after `wrap` give a parameter
storage of its own. `FusedQKV.layers` compares the parameters' data pointers with those the buffers hold (we keep
the buffers alive, so no other tensor can own those addresses) on every eager run and capture: where one moved,
it lays the layer out again (not inside a CUDA-graph capture, which then runs the three products), and the
runtime's graphs, whose parameter pointers moved too, are dropped and recaptured (graphs/cache.py).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ._modules import adapted_linear

__all__ = ["FusedQKV", "unfuse"]

_data_ptr = torch.Tensor.data_ptr


def _fusable(linears: tuple[nn.Linear, nn.Linear, nn.Linear]) -> bool:
    if any(map(adapted_linear, linears)):  # (it runs as itself: its weight is the base layer's alone)
        return False
    weights = [lin.weight for lin in linears]
    biases = [lin.bias for lin in linears]
    w0 = weights[0]
    if len({id(w) for w in weights}) != 3 or w0.device.type == "meta" or w0.dim() != 2:
        return False
    # made (or loaded, or deep-copied) under inference_mode: views of a plain buffer broke the model's own forward
    if any(t is not None and t.is_inference() for t in (*weights, *biases)):
        return False
    if any(w.shape != w0.shape or w.dtype != w0.dtype or w.device != w0.device for w in weights):
        return False
    if all(b is None for b in biases):
        return True
    return len({id(b) for b in biases}) == 3 and all(
        b is not None and b.shape == (w0.shape[0],) and b.dtype == w0.dtype and b.device == w0.device for b in biases
    )


def _lay_out(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One buffer holding `tensors` end to end; each tensor's data becomes a view of its block."""
    with torch.inference_mode(False), torch.no_grad():  # (a buffer made under inference_mode could not train)
        buffer = torch.cat([t.detach() for t in tensors])
        n = tensors[0].shape[0]
        for i, t in enumerate(tensors):
            t.data = buffer[i * n : (i + 1) * n]
    return buffer


class FusedQKV:
    """The fused q/k/v buffers of a model's layers. `triples`: each layer's (q, k, v) linears, in any order,
    repeats allowed (ALBERT runs one layer's modules several times)."""

    def __init__(self, triples: list[tuple[nn.Linear, nn.Linear, nn.Linear]]):
        unique: dict[int, tuple] = {}
        for t in triples:
            unique.setdefault(id(t[0].weight), t)
        self.triples = [t for t in unique.values() if _fusable(t)]
        self.buffers: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # id(q weight) -> (W, b)
        self._params = [p for t in self.triples for lin in t for p in (lin.weight, lin.bias) if p is not None]
        self._ptrs: tuple[int, ...] = ()
        self._cache: tuple = (None, None)  # (specs, the same specs with fused q/k/v)
        self.fuse()

    def fuse(self) -> None:
        """Lay every layer's q/k/v out in one buffer (again)."""
        self.buffers = {}
        for t in self.triples:
            if not _fusable(t):  # (a dtype or device changed on one of the three only)
                continue
            weight = _lay_out([lin.weight for lin in t])
            bias = _lay_out([lin.bias for lin in t]) if t[0].bias is not None else None
            self.buffers[id(t[0].weight)] = (weight, bias)
        self._ptrs = tuple(map(_data_ptr, self._params))
        self._cache = (None, None)

    def current(self) -> bool:
        """True while every parameter is still the view of its buffer that `fuse` made."""
        return tuple(map(_data_ptr, self._params)) == self._ptrs

    def layers(self, specs: list) -> list:
        """`specs` (EncoderLayerSpecs whose qkv are the three linears) with each fused layer's q/k/v as its one
        buffer; the layers laid out again first where a parameter moved (outside a CUDA-graph capture; inside
        one, `specs` as they are: three products)."""
        if not self.triples:
            return specs
        if not self.current():
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return specs
            self.fuse()
        if self._cache[0] is not specs:
            fused = []
            for spec in specs:
                three = len(spec.qkv) == 3 and isinstance(spec.qkv[0], tuple)  # (weights, not a module)
                buffer = self.buffers.get(id(spec.qkv[0][0])) if three else None
                fused.append(spec if buffer is None else dataclasses.replace(spec, qkv=(buffer,)))
            self._cache = (specs, fused)
        return self._cache[1]


def unfuse(triples: list[tuple[nn.Linear, nn.Linear, nn.Linear]]) -> None:
    """Give each q/k/v parameter that shares its storage with another of its layer's a storage of its own."""
    with torch.inference_mode(False), torch.no_grad():
        for t in triples:
            for name in ("weight", "bias"):
                params = [getattr(lin, name) for lin in t]
                if any(p is None for p in params):
                    continue
                storages = {p.untyped_storage().data_ptr() for p in params}
                if len(storages) < len(params):
                    for p in params:
                        p.data = p.data.clone()
