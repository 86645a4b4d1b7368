"""sentence-transformers around a wrapped HF base model: the tokenizer's output reaches the ragged arm with
host lengths, so `encode()` / `predict()` never wait for a mask read.

`SentenceTransformer.encode` tokenizes each batch on the host (a padded CPU `attention_mask`), moves it to
the device and calls the model: a wrapped base model given only that device mask reads it back, one
device->host sync per batch, and the host then stops tokenizing the next batch until the GPU is idle. The
input module (`model[0]`, sentence-transformers' `Transformer`) gets two instance attributes:

- `preprocess`: ST's own, then the lengths of its CPU mask (host arithmetic, microseconds; right-padded
  rows only, else nothing) under a private features key;
- `forward`: pops that key and hands the lengths to the base model's next call through a context variable
  (`hinted_lengths`), checked against the call's mask shape; ST's own forward runs as before.

Tokenizing itself: a fast tokenizer's own `__call__` turns the Rust encodings into Python lists, checks them
token by token and builds tensors from the lists, which took more host time than the tokenizing
(benchmarks/encode.py). `_call_single_modality_processor` (sentence-transformers 6) gets an
instance attribute that, for plain text (or text pairs) and the call kwargs ST passes, sets the backend's
truncation and padding exactly as the tokenizer's `__call__` does, encodes with the same backend and builds
the same tensors from the encodings with numpy. Its first `_CHECKS` batches also run the tokenizer's own
call and compare keys, dtypes and values; a difference (or an error from the tokenizer's private API in another
transformers version) turns the fast path off with one WARNING. Anything else (other kwargs, a slow tokenizer,
another modality) calls ST's own method. `unwrap` puts back what the instance had.
"""

from __future__ import annotations

import contextvars
import logging
import sys
from collections.abc import MutableMapping

import numpy as np
import torch

from ..ragged.layout import HostLengths

__all__ = ["install", "uninstall", "hinted_lengths"]

log = logging.getLogger("autoragged")

_KEY = "autoragged_host_lengths"  # the private features key between preprocess and forward
_HINT: contextvars.ContextVar = contextvars.ContextVar("autoragged_st_lengths", default=None)
_CHECKS = 2  # batches tokenized both ways before the fast path is trusted
_ATTRS = ("preprocess", "forward", "_call_single_modality_processor")
_CALL_KWARGS = {"padding", "truncation", "max_length", "return_tensors"}


def _input_modules(model) -> list:
    """sentence-transformers' `Transformer` input modules inside `model` that hold a wrapped base model."""
    st = sys.modules.get("sentence_transformers.base.modules.transformer")
    cls = getattr(st, "Transformer", None)
    if cls is None:
        return []
    return [
        m
        for m in model.modules()
        if isinstance(m, cls) and any(hasattr(inner, "_autoragged") for inner in getattr(m, "model", m).modules())
    ]


def install(model) -> None:
    for module in _input_modules(model):
        if "_autoragged_st" in module.__dict__:
            continue
        hooks = _Hooks(module)
        module._autoragged_st = hooks
        module.preprocess, module.forward = hooks.preprocess, hooks.forward
        if hooks.own_call_processor is not None:
            module._call_single_modality_processor = hooks.call_processor


def uninstall(model) -> None:
    for module in list(model.modules()):
        hooks = module.__dict__.pop("_autoragged_st", None)
        if hooks is not None:
            for name in _ATTRS:  # back to what the instance had: its class's methods, or its own attributes
                module.__dict__.pop(name, None)
                if name in hooks.instance_attrs:
                    module.__dict__[name] = hooks.instance_attrs[name]


def hinted_lengths(mask) -> HostLengths | None:
    """The host lengths ST's tokenizer gave for the call whose device `attention_mask` is `mask` (its shape
    checked), or None; taken once."""
    hint = _HINT.get()
    if hint is None or not isinstance(mask, torch.Tensor) or tuple(mask.shape) != hint[0]:
        return None
    _HINT.set(None)
    return hint[1]


def mask_lengths_on_host(mask: torch.Tensor) -> HostLengths | None:
    """(B,) lengths of a CPU (B, L) keep mask (1 / True = token) whose rows are right-padded; None otherwise
    (left padding, holes, another shape). Host arithmetic only."""
    if not isinstance(mask, torch.Tensor) or mask.device.type != "cpu" or mask.dim() != 2:
        return None
    keep = mask.numpy() != 0
    lengths = keep.sum(1)
    if not np.array_equal(keep, np.arange(keep.shape[1])[None, :] < lengths[:, None]):
        return None
    return HostLengths(lengths.tolist())


class _Hooks:
    """The instance attributes of one wrapped ST input module (see the module docstring)."""

    def __init__(self, module):
        self.module = module
        self.instance_attrs = {n: module.__dict__[n] for n in _ATTRS if n in module.__dict__}  # put back by uninstall
        self.own_preprocess, self.own_forward = module.preprocess, module.forward
        self.own_call_processor = getattr(module, "_call_single_modality_processor", None)
        self.checked = 0  # batches whose fast tokenizing equalled the tokenizer's own
        self.fast = True

    def preprocess(self, *args, **kwargs):
        features = self.own_preprocess(*args, **kwargs)
        if isinstance(features, MutableMapping) and "input_ids" in features:
            lengths = mask_lengths_on_host(features.get("attention_mask"))
            if lengths is not None:
                features[_KEY] = (tuple(features["attention_mask"].shape), lengths)
        return features

    def forward(self, features, *args, **kwargs):
        hint = features.pop(_KEY, None) if isinstance(features, MutableMapping) else None
        token = _HINT.set(hint)
        try:
            return self.own_forward(features, *args, **kwargs)
        finally:
            _HINT.reset(token)

    def call_processor(self, modality, processor_inputs, modality_kwargs, common_kwargs):
        own = self.own_call_processor
        call_kwargs = {**modality_kwargs.get("text", {}), **common_kwargs}
        batch = self._text_batch(modality, processor_inputs, call_kwargs) if self.fast else None
        if batch is None:
            return own(modality, processor_inputs, modality_kwargs, common_kwargs)
        try:
            out = fast_tokenize(self.module.processor, batch, call_kwargs)
        except Exception as e:  # noqa: BLE001 - private tokenizer API of another transformers version: its own call
            return self._turn_off(f"{type(e).__name__}: {e}", own(modality, processor_inputs, modality_kwargs,
                                                                  common_kwargs))  # fmt: skip
        if self.checked < _CHECKS:
            want = own(modality, dict(processor_inputs), modality_kwargs, common_kwargs)
            diff = _difference(out, want)
            if diff is not None:
                return self._turn_off(diff, want)
            self.checked += 1
        return out

    def _turn_off(self, why: str, result):
        self.fast = False
        log.warning("autoragged: tokenizing straight from the encodings is not %s's own call here (%s); this model "
                    "tokenizes with its own call from now on", type(self.module.processor).__name__, why)  # fmt: skip
        return result

    def _text_batch(self, modality, processor_inputs, call_kwargs):
        """The texts (or text pairs) to encode when the fast path computes this call exactly, else None."""
        from transformers import PreTrainedTokenizerFast

        tok = self.module.processor
        if modality != "text" or not isinstance(tok, PreTrainedTokenizerFast) or set(call_kwargs) - _CALL_KWARGS:
            return None
        if call_kwargs.get("return_tensors") != "pt" or call_kwargs.get("padding") not in (True, "longest"):
            return None
        if call_kwargs.get("truncation") in (None, False, "do_not_truncate"):
            return None  # the tokenizer's own call warns about sequences past the model's length
        texts = processor_inputs.get("text")
        if set(processor_inputs) != {"text"} or not isinstance(texts, list) or not texts:
            return None
        if all(type(t) is str for t in texts):
            return texts
        if all(type(t) is tuple and len(t) == 2 and type(t[0]) is str and type(t[1]) is str for t in texts):
            return texts  # CrossEncoder's pairs: the tokenizer encodes a list of 2-tuples as pairs too
        return None


def fast_tokenize(tok, batch: list, call_kwargs: dict) -> dict:
    """`tok(batch, **call_kwargs)` for a fast tokenizer, padding to the longest, return_tensors="pt": the same
    backend settings and encodings, the tensors built with numpy from the encodings' id lists."""
    from transformers import BatchEncoding

    padding, truncation, max_length, _ = tok._get_padding_truncation_strategies(
        padding=call_kwargs.get("padding", False), truncation=call_kwargs.get("truncation"),
        max_length=call_kwargs.get("max_length"),
    )  # fmt: skip
    tok.set_truncation_and_padding(
        padding_strategy=padding, truncation_strategy=truncation, max_length=max_length, stride=0,
        pad_to_multiple_of=None, padding_side=None,
    )  # fmt: skip
    if not tok._in_target_context_manager and hasattr(tok, "_switch_to_input_mode"):
        tok._switch_to_input_mode()
    backend = tok._tokenizer
    if backend.encode_special_tokens != tok.split_special_tokens:
        backend.encode_special_tokens = tok.split_special_tokens
    encodings = backend.encode_batch(batch, add_special_tokens=True, is_pretokenized=False)
    names = tok.model_input_names
    fields = {"input_ids": "ids"}
    if "token_type_ids" in names:
        fields["token_type_ids"] = "type_ids"
    if "attention_mask" in names:
        fields["attention_mask"] = "attention_mask"
    data = {
        key: torch.from_numpy(np.array([getattr(e, attr) for e in encodings], dtype=np.int64))
        for key, attr in fields.items()
    }
    return BatchEncoding(data, encodings)


def _difference(ours, want) -> str | None:
    """None when `ours` equals the tokenizer's own output (keys, dtypes, values), else what differs."""
    if set(ours.keys()) != set(want.keys()):
        return f"keys {sorted(ours.keys())} against {sorted(want.keys())}"
    for key in want.keys():
        a, b = ours[key], want[key]
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            return f"{key} differs"
    return None
