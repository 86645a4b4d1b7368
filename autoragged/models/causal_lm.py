"""The LM head and loss of a wrapped causal LM on its real tokens (Llama, Mistral, Qwen2, Qwen3 `...ForCausalLM`).

With labels, HF's causal LM runs its LM head over every padded position, (B, L, V), and the cross-entropy over all of
them in fp32. On a padded SFT batch most of that is padding: Qwen2.5-0.5B, 8 lognormal documents a step (64% of the
positions pads), a wrapped model's step took 33.3 GiB above its weights and optimizer state and 87.5 ms; with the
head on the real tokens, 16.0 GiB and 73.7 ms (H100, one lease; the same documents packed: 15.3 GiB).

When the wrapped base model's ragged arm ran a padded call, the model's own `lm_head` runs here on the real tokens
only, and its own `loss_function` gets their logits and, as `shift_labels`, the label each one predicts (the next
column's, as HF shifts). The output's `logits` are those logits at their padded positions, differentiable, zeros at
the pads (what the original head gives on the wrapped base model's zero pads); they are made after the loss, so the
loss's fp32 passes never see the padding.

The loss counts the predictions real tokens make. HF's counts every position whose shifted label is not -100, pads
included; the two agree whenever no pad position has a target, as with right padding and the pads' labels -100
(DataCollatorForLanguageModeling, DataCollatorForSeq2Seq and TRL's collators set them). Where a pad has a target,
HF's loss counts a prediction made from a pad, whose value depends on the padding (left padding: the last pad
predicting the document's first token); here the loss is the right-padded batch's, whatever the padding side.

Everything else runs the original forward, untouched: no labels, `logits_to_keep`, `shift_labels`, a tuple output,
a call the base model ran padded or packed (its logits are the real tokens already), and any class other than the
four whose forward this reproduces (base model, `lm_head`, `loss_function`, `CausalLMOutputWithPast`).
"""

from __future__ import annotations

import contextvars
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

__all__ = ["install", "uninstall", "note_rows"]

_CLASSES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})
_BASE_ARGS = ("input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds", "use_cache")


@dataclass
class _Rows:
    """Where the base model's ragged arm put its packed rows, written by `note_rows` during the head's base call."""

    base: nn.Module
    flat: torch.Tensor | None = None  # (rows,) int64: each row's padded position b * L + column, B * L for none


_SLOT: contextvars.ContextVar = contextvars.ContextVar("autoragged_lm_rows", default=None)


def note_rows(base: nn.Module, flat: torch.Tensor) -> None:
    """Called by the decoder's ragged arm on a padded call: its rows' padded positions, for the head around it."""
    slot = _SLOT.get()
    if slot is not None and slot.base is base:
        slot.flat = flat


def _heads(model: nn.Module) -> list[nn.Module]:
    """The causal LMs in `model` of the classes above whose base model (`.model`) is wrapped."""
    return [
        m
        for m in model.modules()
        if type(m).__name__ in _CLASSES
        and type(m).__module__.startswith("transformers.models.")
        and hasattr(getattr(m, "model", None), "_autoragged")
    ]


def install(model: nn.Module) -> None:
    for head in _heads(model):
        if not isinstance(head.__dict__.get("forward"), _HeadForward):
            head.forward = _HeadForward(head)


def uninstall(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), _HeadForward):
            del module.forward


class _HeadForward:
    """The instance-level `forward` of a causal LM around a wrapped base model (the module docstring says what)."""

    def __init__(self, head: nn.Module):
        self.head = head
        self.original = type(head).forward.__get__(head)
        self.__signature__ = inspect.signature(self.original)
        self.params = tuple(
            name
            for name, p in self.__signature__.parameters.items()
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.POSITIONAL_ONLY)
        )

    @torch.compiler.disable  # eager under torch.compile, as the wrapped base model (models/hf.py says why)
    def __call__(self, *args, **kwargs):
        if args:
            if len(args) > len(self.params):
                raise TypeError(f"{type(self.head).__name__}.forward takes {len(self.params)} positional arguments")
            kwargs.update(zip(self.params, args))
        if not self._applies(kwargs):
            return self.original(**kwargs)
        head, labels = self.head, kwargs.pop("labels")
        kwargs.pop("logits_to_keep", None)
        kwargs.pop("return_dict", None)
        slot = _Rows(head.model)
        token = _SLOT.set(slot)
        try:
            outputs = head.model(**kwargs)
        finally:
            _SLOT.reset(token)
        extra = {k: v for k, v in kwargs.items() if k not in _BASE_ARGS}  # what HF hands its loss function
        hidden = outputs.last_hidden_state
        if slot.flat is None:  # the base model ran padded or packed: HF's own head and loss
            logits = head.lm_head(hidden)
            loss = head.loss_function(logits=logits, labels=labels, vocab_size=head.config.vocab_size, **extra)
        else:
            loss, logits = _real_token_loss(head, hidden, labels, slot.flat, extra)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )

    def _applies(self, kwargs: dict) -> bool:
        """Whether this call's loss may run on the real tokens (else the original forward runs)."""
        labels = kwargs.get("labels")
        first = kwargs.get("input_ids")
        first = first if first is not None else kwargs.get("inputs_embeds")
        if not isinstance(labels, torch.Tensor) or not isinstance(first, torch.Tensor) or first.dim() < 2:
            return False
        keep = kwargs.get("logits_to_keep", 0)
        if not isinstance(keep, int) or keep != 0 or kwargs.get("shift_labels") is not None:
            return False
        if kwargs.get("return_dict", getattr(self.head.config, "return_dict", True)) is False:
            return False
        return labels.shape == first.shape[:2]


def _real_token_loss(head, hidden: torch.Tensor, labels: torch.Tensor, flat: torch.Tensor, extra: dict):
    """(loss, logits (B, L, V)) from the LM head on the real rows of `hidden` (B, L, D); `flat` as `_Rows.flat`."""
    B, L, D = hidden.shape
    ignore = extra.get("ignore_index", -100)
    index = flat.clamp(max=B * L - 1)
    rows = head.lm_head(hidden.reshape(B * L, D).index_select(0, index))  # (rows, V)
    shifted = F.pad(labels.to(hidden.device), (0, 1), value=ignore)[:, 1:].reshape(-1)  # as ForCausalLMLoss shifts
    targets = shifted.index_select(0, index).masked_fill(flat >= B * L, ignore)
    vocab = head.config.vocab_size
    loss = head.loss_function(logits=rows, labels=None, vocab_size=vocab, shift_labels=targets, **extra)
    logits = rows.new_zeros((B * L + 1, rows.shape[1])).index_copy_(0, flat, rows)[: B * L]
    return loss, logits.view(B, L, -1)
