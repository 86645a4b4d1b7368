"""Whole jobs on a wrapped HF decoder: documents in token-budget bins, one result per document in input order.

```python
model = autoragged.wrap(AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16).cuda())
docs = tokenizer(texts)["input_ids"]                      # lists of token ids, any lengths
for scores in autoragged.packing.run_job(model, docs, output="token_logprobs"):
    ...                                                   # per document, in the order of `docs`
```

Each bin is a RaggedTensor of token ids (FFD bins of `autoragged.packing.ffd_pack`, at most `max_tokens`
aligned tokens) that the wrapped base model runs packed (hf_decoder: no padded tensor exists at any point),
always on the ragged arm: a bin mixes lengths on purpose, and its padded form is what the job avoids (it can
need many times the memory the budget was measured for). The output then reduces on the device to what the
job keeps per document, and only that goes to the host.

The budget: `max_tokens`, or measured once (`token_budget`): `probe_capacity` runs the job's own bin (its
longest document repeated, and the same reduction) at a cap, halving on out-of-memory, and keeps `safety`
of what fitted. The pipeline: the next bin's ids are gathered with numpy slices (no Python loop per token),
copied from pinned memory without blocking, and queued while the GPU runs the current one; results come
back through pinned memory without blocking, and the host waits on a bin's copy only once the next bin is
queued behind it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from .ragged.backend import host_to_device
from .ragged.layout import Layout, check_align
from .ragged.tensor import RaggedTensor

__all__ = ["run_job", "token_budget", "OUTPUTS"]

log = logging.getLogger("autoragged")

OUTPUTS = ("last_hidden", "mean", "hidden", "last_logits", "token_logprobs")
_CHUNK_BYTES = 1 << 28  # token_logprobs: float32 logits of at most this many bytes at once (256 MiB)


# -- the model ----------------------------------------------------------------------------------------------
def _wrapped_decoder(model: nn.Module):
    """(the wrapped HF decoder base model in `model`, its runtime); a clear error otherwise."""
    found = [m for m in model.modules() if getattr(getattr(m, "_autoragged", None), "adapter", None) is not None]
    decoders = [m for m in found if m._autoragged.adapter.name == "hf_decoder"]
    if not decoders:
        what = "nothing wrapped" if not found else "no HF decoder wrapped"
        raise ValueError(
            f"run_job needs a wrapped HF decoder model ({what} in {type(model).__name__}): "
            "call autoragged.wrap(model) first (Llama, Mistral, Qwen2/3, Gemma, Phi-3, GPT-2 and their task models)"
        )
    if len(decoders) > 1:
        raise ValueError(f"run_job found {len(decoders)} wrapped decoders in {type(model).__name__}; pass one of them")
    base = decoders[0]
    runtime = base._autoragged.ready(base)
    if runtime.static_reason:
        raise ValueError(f"{type(base).__name__} cannot run packed ({runtime.static_reason}); use padded batches")
    return base, runtime


def _head(model: nn.Module, base: nn.Module, output: str) -> nn.Module:
    """The head that turns final hidden states into logits: a causal LM's output embeddings, or a sequence
    classifier's `score`."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = head if head is not None else getattr(model, "score", None)
    if head is None or model is base:
        raise ValueError(
            f"output={output!r} needs a head (an LM head or a classifier's score); {type(model).__name__} has none: "
            "pass the ...ForCausalLM / ...ForSequenceClassification model, or use output='last_hidden'"
        )
    return head


# -- documents and bins ----------------------------------------------------------------------------------
def _documents(documents) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(all token ids back to back (N,) int64, starts (n,), lengths (n,)) from lists of token ids (or a
    tokenizer's output: a mapping holding "input_ids")."""
    if isinstance(documents, Mapping):
        if "input_ids" not in documents:
            raise ValueError(f"documents is a mapping without 'input_ids' (keys: {list(documents)})")
        documents = documents["input_ids"]
    if isinstance(documents, (str, bytes)) or not isinstance(documents, (Sequence, np.ndarray, torch.Tensor)):
        raise TypeError(f"documents must be a sequence of token id lists, got {type(documents).__name__}")
    arrays = []
    for i, doc in enumerate(documents):
        if isinstance(doc, torch.Tensor):
            doc = doc.detach().cpu().numpy()
        a = np.asarray(doc)
        if a.ndim != 1 or not (a.dtype.kind in "iu" or a.size == 0):
            raise ValueError(f"document {i} is not a flat list of token ids (shape {a.shape}, dtype {a.dtype})")
        if a.size == 0:
            raise ValueError(f"document {i} is empty: every document needs at least one token")
        arrays.append(a.astype(np.int64, copy=False))
    if not arrays:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    starts = np.zeros(len(arrays), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return np.concatenate(arrays), starts, lengths


def _bin_ids(flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray, members, layout: Layout) -> np.ndarray:
    """The bin's token ids at their rows of `layout` (alignment gaps hold id 0), gathered with one fancy index."""
    members = np.asarray(members, dtype=np.int64)
    lens = lengths[members]
    first = np.repeat(np.cumsum(lens) - lens, lens)  # each token's offset within the concatenated bin
    within = np.arange(int(lens.sum()), dtype=np.int64) - first
    rows = np.repeat(np.asarray(layout.offsets[:-1], dtype=np.int64), lens) + within
    out = np.zeros(layout.rows, dtype=np.int64)
    out[rows] = flat[np.repeat(starts[members], lens) + within]
    return out


class _Staged:
    """One bin on its way to the device: its members, layout and ids (a non-blocking copy from pinned memory)."""

    __slots__ = ("members", "layout", "ids")

    def __init__(self, flat, starts, lengths, members, align: int, device: torch.device):
        self.members = list(members)
        self.layout = Layout.make(tuple(int(n) for n in lengths[self.members]), align)
        host = _bin_ids(flat, starts, lengths, self.members, self.layout)
        self.ids = RaggedTensor(host_to_device(host, device), self.layout)


# -- reductions on the device ----------------------------------------------------------------------------------
def _rows(layout: Layout, device, drop_last: bool = False, only_last: bool = False) -> torch.Tensor:
    """int64 rows of `layout` on `device`: every real row, every real row but each component's last, or each
    component's last row only (built on the host, copied without blocking)."""
    lens = np.asarray(layout.lengths, dtype=np.int64)
    starts = np.asarray(layout.offsets[:-1], dtype=np.int64)
    if only_last:
        return host_to_device(starts + lens - 1, device)
    keep = lens - 1 if drop_last else lens
    first = np.repeat(np.cumsum(keep) - keep, keep)
    return host_to_device(np.repeat(starts, keep) + np.arange(int(keep.sum()), dtype=np.int64) - first, device)


def _reduce(output, head: nn.Module | None, hidden: RaggedTensor, ids: RaggedTensor):
    """(device tensor whose first dim stacks every document's result, each document's share of that dim) for
    a built-in `output`, or the callable's result with shares of 1."""
    layout, values, device = hidden.layout, hidden.values, hidden.device
    lens = layout.lengths
    if callable(output):
        return output(hidden, ids), [1] * len(lens)
    if output in ("last_hidden", "last_logits"):
        last = values.index_select(0, _rows(layout, device, only_last=True))
        return (last if output == "last_hidden" else head(last)), [1] * len(lens)
    if output == "hidden":
        return values.index_select(0, _rows(layout, device)), list(lens)
    if output == "mean":
        comp = host_to_device(np.repeat(np.arange(len(lens), dtype=np.int64), lens), device)
        sums = torch.zeros(len(lens), values.shape[1], dtype=torch.float32, device=device)
        sums.index_add_(0, comp, values.index_select(0, _rows(layout, device)).float())
        counts = host_to_device(np.asarray(lens, dtype=np.float32), device)
        return (sums / counts[:, None]).to(values.dtype), [1] * len(lens)
    # token_logprobs: log p(token t | tokens < t) for t >= 1, the logits of row t - 1 against the id of row t
    src = _rows(layout, device, drop_last=True)
    targets = ids.values.index_select(0, src + 1)
    vocab = head.out_features if hasattr(head, "out_features") else head.weight.shape[0]
    chunk = max(1, _CHUNK_BYTES // (4 * vocab))
    out = torch.empty(src.shape[0], dtype=torch.float32, device=device)
    for s in range(0, src.shape[0], chunk):
        logits = head(values.index_select(0, src[s : s + chunk])).float()
        picked = logits.gather(1, targets[s : s + chunk, None])[:, 0]
        out[s : s + chunk] = picked - torch.logsumexp(logits, dim=1)
    return out, [n - 1 for n in lens]


class _Results:
    """A bin's results on their way to the host (pinned memory, no blocking), split per document when read."""

    __slots__ = ("members", "value", "shares", "event")

    def __init__(self, members, value, shares):
        self.members, self.shares, self.event = members, shares, None
        if isinstance(value, torch.Tensor) and value.device.type == "cuda":
            host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            host.copy_(value, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
            value = host
        self.value = value

    def split(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        value = self.value
        if isinstance(value, torch.Tensor):
            value = value.split(self.shares) if any(n != 1 for n in self.shares) else value.unbind(0)
        if len(value) != len(self.members):
            raise ValueError(f"the output function returned {len(value)} results for a bin of {len(self.members)}")
        return list(value)


# -- the job ---------------------------------------------------------------------------------------------------
def _check_output(output) -> None:
    if not callable(output) and output not in OUTPUTS:
        raise ValueError(f"output must be one of {OUTPUTS} or a function (hidden, ids) -> results, got {output!r}")


def _run_bin(base, runtime, head, output, ids: RaggedTensor):
    with torch.inference_mode(), runtime.forcing("ragged"):  # the bin's call runs ragged
        hidden = base(input_ids=ids, use_cache=False, return_dict=True).last_hidden_state
        return _reduce(output, head, hidden, ids)


def token_budget(
    model: nn.Module,
    documents,
    *,
    output: str | Callable = "last_hidden",
    align: int | None = None,
    safety: float = 0.9,
    cap: int = 16384,
) -> int:
    """The bin budget (aligned tokens) for `run_job` on this device: `probe_capacity` runs one bin of the
    job's longest document repeated up to `cap` tokens (and the job's reduction) and halves on out-of-memory
    down to that document alone; the budget is `safety` times what fitted. A one-off: each try is a forward.
    cap: the largest bin tried. Once a bin's linears run at their full rate a larger one adds memory rather
    than speed; 16384 is a choice, not a measurement (benchmarks/llm_table.py --cap measures it)."""
    from .packing import probe_capacity

    _check_output(output)
    base, runtime = _wrapped_decoder(model)
    head = _head(model, base, output) if output in ("last_logits", "token_logprobs") else None
    flat, starts, lengths = _documents(documents)
    if len(lengths) == 0:
        raise ValueError("token_budget needs at least one document")
    align = _align(runtime, int(lengths.max()), align)
    longest = int(np.argmax(lengths))
    size = -(-int(lengths[longest]) // align) * align
    device = runtime.body.probe().device

    def make_batch(tokens: int):
        copies = max(1, tokens // size)
        return (_Staged(flat, starts, lengths, [longest] * copies, align, device).ids,)

    tokens = max(cap, size)
    while True:
        try:
            found = probe_capacity(lambda ids: _run_bin(base, runtime, head, output, ids), make_batch,
                                   start=tokens, step=tokens, max_tokens=tokens, safety=safety)  # fmt: skip
        except RuntimeError as e:
            if "does not fit" not in str(e):
                raise
            if tokens <= size:
                raise RuntimeError(
                    f"the longest document ({int(lengths[longest])} tokens) does not fit in memory on its own"
                ) from e
            tokens = max(size, tokens // 2)
            continue
        return max(found.safe_tokens, size)


def _align(runtime, longest: int, align: int | None) -> int:
    """The bins' alignment: the caller's, else that of the config the ragged arm runs (the runtime's forced
    one, or the untuned default): a RaggedTensor keeps its own layout on that arm, so this is no repack."""
    if align is not None:
        return check_align(align)
    from .planning.planner import default_ragged_config

    config = runtime.options.config or default_ragged_config(runtime.body.head_dim, longest)
    return config.align


def run_job(
    model: nn.Module,
    documents,
    *,
    output: str | Callable = "last_hidden",
    max_tokens: int | None = None,
    align: int | None = None,
    safety: float = 0.9,
    cap: int = 16384,
    progress: bool = True,
) -> Iterator:
    """Run `documents` through a wrapped HF decoder in token-budget bins; yields one result per document, in the
    order of `documents`.

    model:      a model `autoragged.wrap` wrapped, holding one HF decoder (Llama, Mistral, Qwen2/3, Gemma, Phi-3,
                GPT-2): the base model or its `...ForCausalLM` / `...ForSequenceClassification`
    documents:  token id lists as a tokenizer returns them (lists, numpy arrays or 1-D tensors of ints, at least
                one token each), or the tokenizer's output mapping with "input_ids"
    output:     per document of n tokens, on the host (CPU tensors):
                "last_hidden"    (D,) final hidden state at the last token (last-token embedding models)
                "mean"           (D,) mean of the final hidden states (accumulated in float32)
                "hidden"         (n, D) every final hidden state
                "last_logits"    (V,) the LM head's logits at the last token (next-token scoring), or a
                                 classifier's (num_labels,): what the model's head gives at its last real token
                "token_logprobs" (n - 1,) float32, log p(token t | tokens before t) for t = 1 .. n-1 (the LM
                                 head in chunks of 256 MiB of float32 logits, never the whole bin's)
                fn(hidden, ids)  a function of the bin's final hidden states (a RaggedTensor (rows, D)) and
                                 token ids (a RaggedTensor (rows,)), both on the device, returning one result
                                 per component: a tensor (B, ...) (brought to the host) or a list of B
    max_tokens: the bin budget in aligned tokens; None: measured (`token_budget` with `safety` and `cap`)
    align:      bin alignment; None: that of the config the ragged arm runs (see `_align`)
    progress:   a tqdm bar over documents (on stderr)

    Every bin runs on the ragged arm (see the module docstring); a document longer than the budget gets a bin
    of its own (with an OversizeSequenceWarning). Results are buffered on the host until every earlier
    document's is in: FFD runs the longest documents first.
    """
    from .packing import ffd_pack

    _check_output(output)
    base, runtime = _wrapped_decoder(model)
    head = _head(model, base, output) if output in ("last_logits", "token_logprobs") else None
    flat, starts, lengths = _documents(documents)
    if len(lengths) == 0:
        return
    align = _align(runtime, int(lengths.max()), align)
    if max_tokens is None:
        max_tokens = token_budget(model, documents, output=output, align=align, safety=safety, cap=cap)
        log.info("run_job: bins of at most %d tokens (align %d)", max_tokens, align)
    bins = ffd_pack(lengths, max_tokens, align, stacklevel=3)  # an oversize warning names run_job's caller
    yield from _pipeline(base, runtime, head, output, bins, (flat, starts, lengths), align, progress)


def _pipeline(base, runtime, head, output, bins, docs, align, progress) -> Iterator:
    """Queue bin i, then stage bin i + 1 and read bin i - 1's results (the GPU stays one bin ahead), on the
    device of the runtime's module."""
    from tqdm.auto import tqdm

    flat, starts, lengths = docs
    device = runtime.body.probe().device
    n = len(lengths)
    bar = tqdm(total=n, unit="doc", disable=not progress, desc="autoragged run_job")
    ready: dict[int, object] = {}
    pending: deque[_Results] = deque()
    next_out = 0
    staged = _Staged(flat, starts, lengths, bins[0], align, device) if bins else None
    try:
        for i in range(len(bins)):
            current = staged
            value, shares = _run_bin(base, runtime, head, output, current.ids)
            pending.append(_Results(current.members, value, shares))
            staged = _Staged(flat, starts, lengths, bins[i + 1], align, device) if i + 1 < len(bins) else None
            while len(pending) > (1 if staged is not None else 0):
                done = pending.popleft()
                ready.update(zip(done.members, done.split()))
                bar.update(len(done.members))
                while next_out in ready:
                    yield ready.pop(next_out)
                    next_out += 1
    finally:
        bar.close()
    if next_out != n:
        raise RuntimeError(f"internal error: run_job yielded {next_out} of {n} documents")
