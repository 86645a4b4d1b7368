"""`run_job` on a wrapped HF encoder (the BERT family, ModernBERT, a SentenceTransformer's base): what the job
needs of the family, beside hf_encoder.py (the wrapped encoder's own call takes padded inputs only).

A bin is a RaggedTensor of token ids with no padded form. `EncoderBin` is the Call the runtime runs for it:
the model's own embedding step (hf_encoder's `Family.embed`) on the packed ids as one (1, rows) row, each
token's position given as the original computes it for that document alone (from 0; RoBERTa's family from
`padding_idx + 1`, a pad id inside the text at `padding_idx`), then the layers on the packed rows, the
runtime's ragged arm. It returns the packed final hidden states; the job reduces them ("cls", "mean", the
model's own pooler on the first rows). Where the runtime runs a bin padded (a forward hook on a submodule,
...), the original forward runs on the padded bin and its output is packed.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
from torch import nn

from ..models import hf as _hf
from ..models.hf_encoder import FAMILIES
from ..ragged.layout import Layout
from ..ragged.tensor import RaggedTensor, pad_mask, padded_from_ragged, ragged_from_padded

__all__ = ["EncoderJob"]

OUTPUTS = ("cls", "mean", "pooler", "hidden")
# families whose positions count from padding_idx + 1 and skip pad ids (transformers'
# create_position_ids_from_input_ids); ModernBERT has no position ids (rotary, counted by the ragged arm)
_FROM_PADDING_IDX = ("roberta", "xlm-roberta", "camembert")
_NO_POSITION_IDS = ("modernbert",)


def _within(layout: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(each real row of `layout`, its position within its component, the index in the first array of its
    component's first row): int64 host arrays."""
    lens = np.asarray(layout.lengths, dtype=np.int64)
    first = np.repeat(np.cumsum(lens) - lens, lens)
    within = np.arange(int(lens.sum()), dtype=np.int64) - first
    return np.repeat(np.asarray(layout.offsets[:-1], dtype=np.int64), lens) + within, within, first


class EncoderJob:
    """The encoder side of a job: the outputs it gives, the staged side inputs of a bin, a bin's final hidden
    states, and the pooler (`head`, for output="pooler")."""

    outputs = OUTPUTS
    default = "mean"

    def __init__(self, model: nn.Module, base: nn.Module, output):
        self.model_type = base.config.model_type
        self.family = FAMILIES[self.model_type]
        embeddings = getattr(base, "embeddings", None)
        self.padding_idx = getattr(embeddings, "padding_idx", None)
        self.token_types = getattr(embeddings, "token_type_embeddings", None) is not None
        self.head = self._pool(base) if output == "pooler" else None  # what the job applies to the first rows

    def _pool(self, base):
        """(B, D) first rows -> (B, D) pooler outputs, the model's own pooler; a clear error where none."""
        if self.family.pool is None or getattr(base, "pooler", None) is None:
            raise ValueError(
                f"output='pooler' needs the model's own pooler; {type(base).__name__} has none "
                "(BERT, RoBERTa, XLM-RoBERTa, CamemBERT and ALBERT have one, unless built with "
                "add_pooling_layer=False): use output='cls' or 'mean'"
            )
        pool = self.family.pool
        return lambda first: pool(base, first[:, None])  # the pooler reads column 0 of (B, L, D)

    def longest(self, body) -> int | None:
        """The longest document the model's position embeddings take, or None."""
        return None if self.model_type in _NO_POSITION_IDS else body.max_tokens

    def stage(self, ids: np.ndarray, layout: Layout, types: np.ndarray | None) -> dict[str, np.ndarray]:
        """The bin's side inputs on the host, (rows,) int64 each: position ids as the original computes them for
        each document alone, and token type ids where the embeddings take them (zeros when none were given)."""
        extra = {}
        if self.token_types:
            extra["token_type_ids"] = types if types is not None else np.zeros(layout.rows, dtype=np.int64)
        if self.model_type in _NO_POSITION_IDS:
            return extra
        rows, within, first = _within(layout)
        positions = np.zeros(layout.rows, dtype=np.int64)  # alignment gaps: 0, any valid index
        if self.model_type in _FROM_PADDING_IDX:  # pad + the count of non-pad ids so far in the document, pads: pad
            pad = int(self.padding_idx)
            real = (ids[rows] != pad).astype(np.int64)
            count = np.cumsum(real)
            positions[rows] = (count - (count[first] - real[first])) * real + pad
        else:
            positions[rows] = within
        extra["position_ids"] = positions
        return extra

    def hidden(self, base: nn.Module, ids: RaggedTensor, extra: dict[str, torch.Tensor]) -> RaggedTensor:
        """The bin's final hidden states (rows, D), packed like `ids`, through the runtime (a forced policy holds)."""
        runtime = base._autoragged.ready(base)
        call = EncoderBin(runtime.body, base, ids, extra)
        with call.scope():
            return runtime.run(base, call)


class EncoderBin(_hf.HFCall):
    """One bin of packed token ids as the runtime's Call: its embeddings packed (`ragged_in`), no mask, no padded
    tensor; `finish` gives the packed final hidden states."""

    __slots__ = ("ids", "extra")

    def __init__(self, body, module, ids: RaggedTensor, extra: dict[str, torch.Tensor]):
        self.body, self.module, self.ids, self.extra = body, module, ids, extra
        self.kwargs, self.lengths = {"input_ids": ids, **extra}, None
        self.kpm = self._x = self.passthrough = self.eager_only = self.reason = None
        self.B, self.L = ids.batch_size, ids.max_len
        self.device, self.dtype, self.requires_grad = ids.device, body.probe().dtype, False
        self.return_dict, self.wants_hidden = True, False
        inputs = {"input_ids": ids.values[None], **{k: v[None] for k, v in extra.items()}}
        self.ragged_in = RaggedTensor(body.family.embed(module, inputs)[0], ids.layout)

    def finish(self, y, hidden=None):
        return y

    def padded(self, module, lens, stats):
        """The original forward on the padded bin (pads: id 0, masked), its last hidden state packed."""
        layout, L = self.ids.layout, self.L
        kwargs = {name: padded_from_ragged(RaggedTensor(v, layout), 0, L, 1) for name, v in self.kwargs.items()
                  if name != "input_ids"}  # fmt: skip
        kwargs["input_ids"] = padded_from_ragged(self.ids, 0, L, 1)
        kwargs["attention_mask"] = (~pad_mask(lens, L, self.device)).long()
        if "return_dict" in inspect.signature(type(module).forward).parameters:
            kwargs["return_dict"] = True
        out = self.body.forward_of(module)(**kwargs)
        return ragged_from_padded(out.last_hidden_state, lens, self.ids.align, 1)

    def padded_mask(self, module):
        return self.padded(module, self.ids.lengths, None)

    def original(self, module):
        return self.padded(module, self.ids.lengths, None)
