"""Whole jobs on a wrapped HF model: documents in token-budget bins, one result per document in input order, on
one process or split over the ranks of torch.distributed (torchrun).

```python
model = autoragged.wrap(AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16).cuda())
docs = tokenizer(texts)["input_ids"]                      # lists of token ids, any lengths
for scores in autoragged.packing.run_job(model, docs, output="token_logprobs"):
    ...                                                   # per document, in the order of `docs`
```
```
torchrun --nproc-per-node 4 -m autoragged.job --model DIR --input texts.jsonl --output out.npy --output-kind mean
```

Two families, one job (`_FAMILIES`, keyed by the adapter that wrapped the base model): an HF decoder (Llama,
Mistral, Qwen2/3, Gemma, Phi-3, GPT-2 and their task models; hf_decoder runs a RaggedTensor of token ids itself)
and an HF encoder (the BERT family, ModernBERT, a SentenceTransformer's base; jobs/encoder.py). A family names
its outputs, stages a bin's side inputs and runs a bin; the bins, staging, reductions, ordering and ranks are
shared.

Each bin is a RaggedTensor of token ids (FFD bins of `autoragged.packing.ffd_pack`, at most `max_tokens`
aligned tokens) that the wrapped base model runs packed (no padded tensor exists at any point), always on the
ragged arm: a bin mixes lengths on purpose, and its padded form is what the job avoids (it can need many times
the memory the budget was measured for). The output then reduces on the device to what the job keeps per
document, and only that goes to the host.

The budget: `max_tokens`, or measured once (`token_budget`): `probe_capacity` runs the job's own bin (its
longest document repeated, and the same reduction) at a cap, halving on out-of-memory, and keeps `safety`
of what fitted. The pipeline: the next bin's ids are gathered with numpy slices (no Python loop per token),
copied from pinned memory without blocking, and queued while the GPU runs the current one; results come
back through pinned memory without blocking, and the host waits on a bin's copy only once the next bin is
queued behind it.

Past one process: under an initialised process group (`init_distributed()` makes one from torchrun's
environment) every rank calls `run_job` with the same documents. The bins are the same on every rank; each rank
takes the next one from a counter in the process group's store as it stages its last (`BinClaims`), or, where the
store cannot be reached, runs a share split by tokens with no communication (`rank_shares`: largest bin first to
the least-loaded rank). Results come back in input order on rank 0 (`gather="rank0"`: one gather_object at the
end), and/or each rank writes them as it goes to a directory of shards (`shards=DIR`: one file per rank per chunk
of documents, written whole or not at all). A rerun skips the documents the directory holds and splits the rest
afresh, so a crash loses nothing written; `read_shards(DIR)` gives every result in input order.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from torch import nn

from .jobs.ranks import BinClaims, Ranks, init_distributed, rank_shares
from .jobs.shards import JobIdentity, ShardStore, read_shards
from .ragged.backend import host_to_device
from .ragged.layout import Layout, check_align
from .ragged.tensor import RaggedTensor

if TYPE_CHECKING:
    from tqdm import tqdm

__all__ = ["run_job", "token_budget", "read_shards", "rank_shares", "init_distributed", "OUTPUTS"]

log = logging.getLogger("autoragged")

DECODER_OUTPUTS = ("last_hidden", "mean", "hidden", "last_logits", "token_logprobs")
ENCODER_OUTPUTS = ("cls", "mean", "pooler", "hidden")
OUTPUTS = tuple(dict.fromkeys(DECODER_OUTPUTS + ENCODER_OUTPUTS))
_CHUNK_BYTES = 1 << 28  # token_logprobs: float32 logits of at most this many bytes at once (256 MiB)
_SAFETY, _CAP = 0.9, 16384  # token_budget's defaults (see there)


# -- the model and its family -------------------------------------------------------------------------------
def _wrapped(model: nn.Module):
    """(the wrapped HF base model in `model` that a job family runs, its runtime); a clear error otherwise."""
    found = [m for m in model.modules() if getattr(getattr(m, "_autoragged", None), "adapter", None) is not None]
    bases = [m for m in found if m._autoragged.adapter.name in _FAMILIES]
    if not bases:
        what = "nothing wrapped" if not found else "no HF decoder or encoder wrapped"
        raise ValueError(
            f"run_job needs a wrapped HF decoder or encoder model ({what} in {type(model).__name__}): "
            "call autoragged.wrap(model) first (decoders: Llama, Mistral, Qwen2/3, Gemma, Phi-3, GPT-2 and their task "
            "models; encoders: BERT, RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA, ALBERT, DistilBERT, ModernBERT, their "
            "task models, a SentenceTransformer)"
        )
    if len(bases) > 1:
        raise ValueError(f"run_job found {len(bases)} wrapped base models in {type(model).__name__}; pass one of them")
    base = bases[0]
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


class _DecoderJob:
    """The decoder side of a job: hf_decoder takes a RaggedTensor of token ids itself (its own embedding step,
    each document from position 0), so a bin needs no side inputs. `head`: the LM head or score the logit
    outputs apply."""

    outputs = DECODER_OUTPUTS
    default = "last_hidden"

    def __init__(self, model: nn.Module, base: nn.Module, output):
        self.head = _head(model, base, output) if output in ("last_logits", "token_logprobs") else None

    def longest(self, body) -> int | None:
        return None  # (rotary models extend past max_position_embeddings; the model says so where it cannot)

    def stage(self, ids: np.ndarray, layout: Layout, types) -> dict:
        return {}

    def hidden(self, base: nn.Module, ids: RaggedTensor, extra: dict) -> RaggedTensor:
        return base(input_ids=ids, use_cache=False, return_dict=True).last_hidden_state


def _encoder_job(model: nn.Module, base: nn.Module, output):
    from .jobs.encoder import EncoderJob  # (imports transformers' encoder family)

    return EncoderJob(model, base, output)


# the adapter that wrapped the base model -> (the family's name in messages, its job side)
_FAMILIES: dict[str, tuple[str, Callable]] = {
    "hf_decoder": ("an HF decoder", _DecoderJob),
    "hf_encoder": ("an HF encoder", _encoder_job),
}


class _Job(NamedTuple):
    """What every bin of one job runs with."""

    base: nn.Module
    runtime: object
    family: object  # _DecoderJob / jobs.encoder.EncoderJob
    output: str | Callable
    device: torch.device
    align: int


# -- documents and bins ----------------------------------------------------------------------------------
class _Docs(NamedTuple):
    """Every document's token ids back to back, on the host."""

    flat: np.ndarray  # (N,) int64
    starts: np.ndarray  # (n,) int64, each document's first id in flat
    lengths: np.ndarray  # (n,) int64
    types: np.ndarray | None  # (N,) int64 token type ids beside flat, where the caller gave them


def _flat(documents, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids back to back (N,) int64, lengths (n,) int64) of lists of ints (lists, arrays or 1-D tensors)."""
    if isinstance(documents, (str, bytes)) or not isinstance(documents, (Sequence, np.ndarray, torch.Tensor)):
        raise TypeError(f"{what} must be a sequence of token id lists, got {type(documents).__name__}")
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
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(arrays), np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))


def _documents(documents) -> _Docs:
    """The documents from lists of token ids, or a tokenizer's output: a mapping holding "input_ids" (and
    "token_type_ids", used by encoders whose embeddings take them)."""
    types = None
    if isinstance(documents, Mapping):
        if "input_ids" not in documents:
            raise ValueError(f"documents is a mapping without 'input_ids' (keys: {list(documents)})")
        types = documents.get("token_type_ids")
        documents = documents["input_ids"]
    flat, lengths = _flat(documents, "documents")
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    if types is not None:
        types, type_lengths = _flat(types, "token_type_ids")
        if not np.array_equal(type_lengths, lengths):
            i = int(np.flatnonzero(type_lengths != lengths)[0]) if len(type_lengths) == len(lengths) else None
            where = f"document {i} has {lengths[i]} ids but {type_lengths[i]} token types" if i is not None else (
                f"{len(type_lengths)} token type lists for {len(lengths)} documents")  # fmt: skip
            raise ValueError(f"token_type_ids do not match input_ids: {where}")
    return _Docs(flat, starts, lengths, types)


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
    """One bin on its way to the device: its members, layout, ids and the family's side inputs (non-blocking
    copies from pinned memory)."""

    __slots__ = ("members", "layout", "ids", "extra")

    def __init__(self, docs: _Docs, members, job: _Job):
        self.members = list(members)
        self.layout = layout = Layout.make(tuple(int(n) for n in docs.lengths[self.members]), job.align)
        host = _bin_ids(docs.flat, docs.starts, docs.lengths, self.members, layout)
        types = None if docs.types is None else _bin_ids(docs.types, docs.starts, docs.lengths, self.members, layout)
        self.ids = RaggedTensor(host_to_device(host, job.device), layout)
        self.extra = {k: host_to_device(v, job.device) for k, v in job.family.stage(host, layout, types).items()}


# -- reductions on the device ----------------------------------------------------------------------------------
def _rows(layout: Layout, device, which: str = "all") -> torch.Tensor:
    """int64 rows of `layout` on `device` (built on the host, copied without blocking): every real row ("all"),
    every real row but each component's last ("but_last"), or each component's first or last row only ("first",
    "last")."""
    lens = np.asarray(layout.lengths, dtype=np.int64)
    starts = np.asarray(layout.offsets[:-1], dtype=np.int64)
    if which in ("first", "last"):
        return host_to_device(starts if which == "first" else starts + lens - 1, device)
    keep = lens - 1 if which == "but_last" else lens
    first = np.repeat(np.cumsum(keep) - keep, keep)
    return host_to_device(np.repeat(starts, keep) + np.arange(int(keep.sum()), dtype=np.int64) - first, device)


def _reduce(output, head: Callable | None, hidden: RaggedTensor, ids: RaggedTensor):
    """(device tensor whose first dim stacks every document's result, each document's share of that dim) for
    a built-in `output`, or the callable's result with shares of 1. `head`: the LM head or score (logit
    outputs), or the model's pooler (first rows (B, D) -> (B, D))."""
    layout, values, device = hidden.layout, hidden.values, hidden.device
    lens = layout.lengths
    if callable(output):
        return output(hidden, ids), [1] * len(lens)
    if output in ("last_hidden", "last_logits", "cls", "pooler"):
        picked = values.index_select(0, _rows(layout, device, "first" if output in ("cls", "pooler") else "last"))
        return (picked if output in ("last_hidden", "cls") else head(picked)), [1] * len(lens)
    if output == "hidden":
        return values.index_select(0, _rows(layout, device)), list(lens)
    if output == "mean":
        rows = values.index_select(0, _rows(layout, device)).float()
        # a segmented sum, not index_add_: CUDA's index_add_ adds with atomics, in an order that changes run to run
        lengths = host_to_device(np.asarray(lens, dtype=np.int64), device)
        sums = torch.segment_reduce(rows, "sum", lengths=lengths, unsafe=True)  # unsafe: no validating sync
        counts = host_to_device(np.asarray(lens, dtype=np.float32), device)
        return (sums / counts[:, None]).to(values.dtype), [1] * len(lens)
    # token_logprobs: log p(token t | tokens < t) for t >= 1, the logits of row t - 1 against the id of row t
    src = _rows(layout, device, "but_last")
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
def _prepare(model: nn.Module, documents, output, align: int | None) -> tuple[_Job, _Docs]:
    """The job and its documents, checked: the output is one the family gives (None: the family's default), no
    document is longer than the model takes."""
    if output is not None and not callable(output) and output not in OUTPUTS:
        raise ValueError(f"output must be one of {OUTPUTS} or a function (hidden, ids) -> results, got {output!r}")
    base, runtime = _wrapped(model)
    name, make = _FAMILIES[base._autoragged.adapter.name]
    family = make(model, base, output)
    output = family.default if output is None else output
    if not callable(output) and output not in family.outputs:
        raise ValueError(
            f"output={output!r} is not one that {name} ({type(base).__name__}) gives: one of {family.outputs}, "
            "or a function (hidden, ids) -> results"
        )
    docs = _documents(documents)
    longest = family.longest(runtime.body)
    if len(docs.lengths) and longest is not None and int(docs.lengths.max()) > longest:
        i = int(np.argmax(docs.lengths))
        raise ValueError(
            f"document {i} has {int(docs.lengths[i])} tokens but {type(base).__name__} takes at most {longest} (its "
            f"position embeddings): truncate when tokenizing (truncation=True, max_length={longest})"
        )
    align = _align(runtime, int(docs.lengths.max()) if len(docs.lengths) else 1, align)
    return _Job(base, runtime, family, output, runtime.body.probe().device, align), docs


def _run_bin(job: _Job, staged: _Staged):
    with torch.inference_mode(), job.runtime.forcing("ragged"):  # the bin's call runs ragged
        hidden = job.family.hidden(job.base, staged.ids, staged.extra)
        return _reduce(job.output, job.family.head, hidden, staged.ids)


def token_budget(
    model: nn.Module,
    documents,
    *,
    output: str | Callable | None = None,
    align: int | None = None,
    safety: float = _SAFETY,
    cap: int = _CAP,
) -> int:
    """The bin budget (aligned tokens) for `run_job` on this device: `probe_capacity` runs one bin of the
    job's longest document repeated up to `cap` tokens (and the job's reduction) and halves on out-of-memory
    down to that document alone; the budget is `safety` times what fitted. A one-off: each try is a forward.
    cap: the largest bin tried. Once a bin's linears run at their full rate a larger one adds memory rather
    than speed; 16384 is a choice, not a measurement (benchmarks/llm_table.py --cap measures it)."""
    job, docs = _prepare(model, documents, output, align)
    if len(docs.lengths) == 0:
        raise ValueError("token_budget needs at least one document")
    return _budget(job, docs, np.arange(len(docs.lengths)), safety, cap)


def _budget(job: _Job, docs: _Docs, todo: np.ndarray, safety: float, cap: int) -> int:
    """token_budget over the documents `todo`."""
    from .packing import probe_capacity

    longest = int(todo[np.argmax(docs.lengths[todo])])
    size = -(-int(docs.lengths[longest]) // job.align) * job.align

    def make_batch(tokens: int):
        return (_Staged(docs, [longest] * max(1, tokens // size), job),)

    tokens = max(cap, size)
    while True:
        try:
            found = probe_capacity(lambda staged: _run_bin(job, staged), make_batch,
                                   start=tokens, step=tokens, max_tokens=tokens, safety=safety)  # fmt: skip
        except RuntimeError as e:
            if "does not fit" not in str(e):
                raise
            if tokens <= size:
                raise RuntimeError(
                    f"the longest document ({int(docs.lengths[longest])} tokens) does not fit in memory on its own"
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
    output: str | Callable | None = None,
    max_tokens: int | None = None,
    align: int | None = None,
    progress: bool | tqdm = True,
    gather: str | None = "rank0",
    shards: str | os.PathLike | None = None,
) -> Iterator:
    """Run `documents` through a wrapped HF decoder or encoder in token-budget bins; yields one result per
    document, in the order of `documents` (under a process group: on rank 0).

    model:      a model `autoragged.wrap` wrapped, holding one HF decoder (Llama, Mistral, Qwen2/3, Gemma, Phi-3,
                GPT-2: the base model or its `...ForCausalLM` / `...ForSequenceClassification`) or one HF encoder
                (BERT, RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA, ALBERT, DistilBERT, ModernBERT: the base model, a
                task model holding it, or a SentenceTransformer)
    documents:  token id lists as a tokenizer returns them (lists, numpy arrays or 1-D tensors of ints, at least
                one token each), or the tokenizer's output mapping with "input_ids" (and "token_type_ids", which
                encoders whose embeddings take them use; zeros otherwise)
    output:     per document of n tokens, on the host (CPU tensors); None: "last_hidden" for a decoder, "mean" for an
                encoder. Decoders:
                "last_hidden"    (D,) final hidden state at the last token (last-token embedding models)
                "mean"           (D,) mean of the final hidden states (accumulated in float32)
                "hidden"         (n, D) every final hidden state
                "last_logits"    (V,) the LM head's logits at the last token (next-token scoring), or a
                                 classifier's (num_labels,): what the model's head gives at its last real token
                "token_logprobs" (n - 1,) float32, log p(token t | tokens before t) for t = 1 .. n-1 (the LM
                                 head in chunks of 256 MiB of float32 logits, never the whole bin's)
                encoders: "cls" (D,) the first token's final hidden state, "mean", "hidden", and
                "pooler"         (D,) the model's own pooler on the first token (BERT, RoBERTa, ALBERT, ...)
                fn(hidden, ids)  a function of the bin's final hidden states (a RaggedTensor (rows, D)) and
                                 token ids (a RaggedTensor (rows,)), both on the device, returning one result
                                 per component: a tensor (B, ...) (brought to the host) or a list of B
    max_tokens: the bin budget in aligned tokens; None: measured (`token_budget`'s defaults; call it yourself
                for another safety or cap), the smallest of the ranks' under a process group
    align:      bin alignment; None: that of the config the ragged arm runs (see `_align`)
    progress:   a tqdm bar over this process's documents (on stderr; rank 0's only under a process group), or
                the caller's own tqdm bar, advanced by this process's documents and left open (one bar over
                several calls)
    gather:     "rank0": the results are yielded in input order (by rank 0 under a process group, other ranks
                yield nothing); None: nothing is yielded (with `shards`: the results stay in the directory)
    shards:     a directory the results are written to as they come (one file per rank per chunk of documents,
                each whole or absent); documents whose results it holds are skipped, so a rerun after a crash
                resumes. With gather="rank0" the results are read back from it once every rank is done.

    Under an initialised torch.distributed process group (`init_distributed()`), run_job is a collective:
    every rank calls it with the same documents and iterates it to its end. The bins are the same on every rank,
    and each rank takes the next from a counter in the process group's store as it goes (`BinClaims`; a share
    split by tokens, `rank_shares`, where there is no store), after a check that the documents agree and, for a
    measured budget, the smallest budget. Results equal a one-process run's (the same bins, each run the same
    way; on a resumed run the remaining documents are binned afresh).

    Every bin runs on the ragged arm (see the module docstring); a document longer than the budget gets a bin
    of its own (with an OversizeSequenceWarning). Results are buffered on the host until every earlier
    document's is in: FFD runs the longest documents first.
    """
    from .packing import ffd_pack

    job, docs = _prepare(model, documents, output, align)
    if gather not in ("rank0", None):
        raise ValueError(f"gather must be 'rank0' or None, got {gather!r}")
    if gather is None and shards is None:
        raise ValueError("gather=None keeps no result: pass shards=DIR to have each rank write its results there")
    ranks = Ranks.current()
    n = len(docs.lengths)
    identity = JobIdentity(n, _fingerprint(docs, job.output), _output_name(job.output))
    if ranks.world > 1:
        ranks.check_same((n, identity.fingerprint))
    store = ShardStore.open(shards, identity, ranks) if shards is not None else None
    todo = store.todo if store is not None else np.arange(n)
    bins: list[list[int]] = []
    if len(todo):
        if max_tokens is None:
            max_tokens = min(ranks.all(_budget(job, docs, todo, _SAFETY, _CAP)))
            log.info("run_job: bins of at most %d tokens (align %d)", max_tokens, job.align)
        packed = ffd_pack(docs.lengths[todo], max_tokens, job.align, stacklevel=3)  # a warning names the caller
        bins = [todo[b].tolist() for b in packed]
    mine = _mine(bins, docs, job, ranks, identity.fingerprint)
    results = _bin_results(job, docs, mine, _bar(mine, progress, ranks))
    if store is not None:
        store.write(results)
        if gather is not None:
            ranks.barrier()  # every rank's shards are written
            if ranks.rank == 0:
                yield from read_shards(shards)
    elif ranks.world == 1:
        yield from _in_order(results, n)
    else:
        gathered = ranks.gather(list(results))
        if gathered is not None:
            yield from _in_order((pair for pairs in gathered for pair in pairs), n)


_CALLS = itertools.count()  # run_job calls under a process group: a collective, so the same count on every rank


def _mine(bins: list[list[int]], docs: _Docs, job: _Job, ranks: Ranks, job_key: str) -> BinClaims | list[list[int]]:
    """The bins this rank runs: taken one at a time from the process group's store (`BinClaims`), else its share
    by tokens; one process runs them all."""
    if ranks.world == 1:
        return bins
    call = next(_CALLS)
    store = ranks.store()
    if store is not None:
        return BinClaims(bins, store, f"autoragged/run_job/{call}/{job_key}/next_bin")
    mine = [bins[i] for i in rank_shares(bins, docs.lengths, ranks.world, job.align)[ranks.rank]]
    log.debug("run_job: rank %d of %d runs %d of %d bins", ranks.rank, ranks.world, len(mine), len(bins))
    return mine


def _bar(bins, progress: bool | tqdm, ranks: Ranks):
    """This process's bar over its documents: their count where its bins are known ahead (none when taken one at a
    time), on rank 0 only under a process group; or the caller's."""
    from tqdm.auto import tqdm

    if not isinstance(progress, bool):
        return _LentBar(progress)
    desc = "autoragged run_job" + (f" (rank 0 of {ranks.world})" if ranks.world > 1 else "")
    total = sum(map(len, bins)) if isinstance(bins, list) else None
    return tqdm(total=total, unit="doc", disable=not progress or ranks.rank != 0, desc=desc)


class _LentBar(NamedTuple):
    """The caller's progress bar (run_job(progress=bar)): advanced here, closed by its owner."""

    bar: tqdm

    def update(self, n: int) -> None:
        self.bar.update(n)

    def close(self) -> None:
        pass


def _bin_results(job: _Job, docs: _Docs, bins: Iterable[list[int]], bar) -> Iterator[tuple[list[int], list]]:
    """(members, their results) per bin, in the order of `bins` (taken one at a time: the next is taken once this
    one is queued): queue bin i, then stage bin i + 1 and read bin i - 1's results (the GPU stays one bin ahead)."""
    pending: deque[_Results] = deque()
    upcoming = iter(bins)
    first = next(upcoming, None)
    staged = _Staged(docs, first, job) if first is not None else None
    try:
        while staged is not None:
            current = staged
            value, shares = _run_bin(job, current)
            pending.append(_Results(current.members, value, shares))
            following = next(upcoming, None)
            staged = _Staged(docs, following, job) if following is not None else None
            while len(pending) > (1 if staged is not None else 0):
                done = pending.popleft()
                results = done.split()
                bar.update(len(done.members))
                yield done.members, results
    finally:
        bar.close()


def _in_order(pairs, n: int) -> Iterator:
    """Each document's result in input order, from (members, results) pairs in any order."""
    ready: dict[int, object] = {}
    next_out = 0
    for members, results in pairs:
        ready.update(zip(members, results))
        while next_out in ready:
            yield ready.pop(next_out)
            next_out += 1
    if next_out != n:
        raise RuntimeError(f"internal error: run_job yielded {next_out} of {n} documents")


def _output_name(output) -> str:
    return output if isinstance(output, str) else f"function {getattr(output, '__qualname__', type(output).__name__)}"


def _fingerprint(docs: _Docs, output) -> str:
    """A digest of the documents' token ids (and token types) and the output: equal jobs, equal digests."""
    h = hashlib.blake2b(digest_size=16)
    for array in (docs.lengths, docs.flat) + (() if docs.types is None else (docs.types,)):
        h.update(memoryview(np.ascontiguousarray(array, dtype=np.int64)).cast("B"))
    h.update(f"types={docs.types is not None} output={_output_name(output)}".encode())
    return h.hexdigest()


if __name__ == "__main__":  # python -m autoragged.job: the command (autoragged/jobs/cli.py)
    from autoragged.jobs.cli import main

    raise SystemExit(main())
