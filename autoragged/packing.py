"""Token-budget batching: first-fit-decreasing packing, a ragged batch sampler and collate, a device
capacity probe, and the padding overhead of a batching.

```python
from torch.utils.data import DataLoader
from autoragged.packing import TokenBudgetBatchSampler, ragged_collate

sampler = TokenBudgetBatchSampler(lengths, max_tokens=16384, align=16, shuffle=True, seed=0)
loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=functools.partial(ragged_collate, align=16))
for epoch in range(epochs):
    sampler.set_epoch(epoch)                  # a new order of bins each epoch, reproducible
    for rt in loader:                         # a RaggedTensor of at most 16384 aligned tokens, no padding
        y = wrapped(rt.to("cuda"))
```

Whole jobs on a wrapped HF decoder LLM or encoder (scoring, classification, embedding), one call, on one
process or over the ranks of torchrun (autoragged/job.py):

```python
model = autoragged.wrap(AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16).cuda())
for logprobs in run_job(model, tokenizer(texts)["input_ids"], output="token_logprobs"):
    ...                                       # one result per text, in input order; bins sized to memory
```

Token counts are *aligned* throughout: a sequence of `length` tokens costs `ceil(length / align) * align`
rows, which is what it occupies in a `RaggedTensor` built with that `align`.
"""

from __future__ import annotations

import gc
import logging
import math
import operator
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler, default_collate

from .ragged.layout import as_lengths, check_align
from .ragged.tensor import RaggedTensor

__all__ = [
    "ffd_pack",
    "OversizeSequenceWarning",
    "TokenBudgetBatchSampler",
    "ragged_collate",
    "probe_capacity",
    "CapacityProbe",
    "padding_overhead",
    "fixed_size_batches",
    "length_sorted_batches",
    "run_job",
    "token_budget",
    "read_shards",
]

logger = logging.getLogger("autoragged")


class OversizeSequenceWarning(UserWarning):
    """A sequence longer than the token budget: it gets a bin of its own (never truncated)."""


# -- validation -------------------------------------------------------------------------------
def _host_lengths(lengths: object) -> np.ndarray:
    """(n,) int64 host lengths from a sequence of ints, a 1-D numpy int array or a 1-D CPU int tensor."""
    if isinstance(lengths, (np.ndarray, torch.Tensor)) and lengths.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {tuple(lengths.shape)}")
    return np.asarray(as_lengths(lengths), dtype=np.int64)


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive int, got {value!r} ({type(value).__name__})")
    value = operator.index(value)
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def _aligned(lens: np.ndarray, align: int) -> np.ndarray:
    return (lens + (align - 1)) // align * align


# -- first-fit decreasing ---------------------------------------------------------------------
def ffd_pack(
    lengths: Sequence[int] | np.ndarray | torch.Tensor, max_tokens: int, align: int = 16, *, stacklevel: int = 2
) -> list[list[int]]:
    """Pack sequence indices into bins of at most `max_tokens` aligned tokens, first fit decreasing.

    lengths:    (n,) non-negative ints: a sequence, a numpy int array or a CPU int tensor
    max_tokens: positive int, the budget of one bin in aligned tokens
    align:      positive power of two; sequence i costs ceil(lengths[i] / align) * align tokens
    stacklevel: the frame an oversize warning points at, as `warnings.warn`'s: 2 is ffd_pack's caller
    Returns the bins in the order FFD opens them, each a list of indices in the order they were placed;
    every index appears exactly once.

    Sequences are taken longest first (key: length descending, then index ascending, so the result is
    deterministic) and each goes into the first open bin with room for it, or a new bin. A sequence whose
    aligned size exceeds `max_tokens` gets a bin of its own (the first bins, since they are the longest)
    and an `OversizeSequenceWarning` naming it: never silent truncation. Zero-length sequences cost 0
    and join the first bin that is not an oversize singleton.

    Complexity: O(n log n) for the sort plus O(p log m) for the placements. m <= 2 * tokens / max_tokens + 2
    bounds the bins other than oversize singletons (tokens: their aligned sum; first fit leaves at most one
    bin half empty); p <= n is the number of (run of equal aligned sizes, bin) placements, since a run of
    equal sizes fills a bin in one step. The first bin with room is found by descending a max segment tree
    over the bins' remaining capacities (unopened bins hold the full budget, so "no open bin fits" needs no
    special case). Measured on one CPU core: 100k RACE-like lengths (align 16, budget 16384) in 45 ms;
    100k lengths uniform in 1..100k (align 1, 25k bins) in 0.2 s.
    """
    return _ffd_pack(lengths, max_tokens, align, stacklevel=stacklevel + 1)


def _ffd_pack(lengths: object, max_tokens: object, align: object, stacklevel: int) -> list[list[int]]:
    """ffd_pack; an oversize warning points `stacklevel` frames up from here (at the user's call)."""
    lens = _host_lengths(lengths)
    max_tokens = _positive_int(max_tokens, "max_tokens")
    align = check_align(align)
    if len(lens) == 0:
        return []
    order = np.argsort(-lens, kind="stable")
    sizes = _aligned(lens, align)[order]  # non-increasing
    n_over = int(np.count_nonzero(sizes > max_tokens))
    idx = order.tolist()
    if n_over:
        _warn_oversize(idx[:n_over], lens, sizes[:n_over], max_tokens, align, stacklevel + 1)
    bins = [[i] for i in idx[:n_over]]
    rest = sizes[n_over:]
    if len(rest) == 0:
        return bins
    starts = [0, *(np.flatnonzero(rest[1:] != rest[:-1]) + 1).tolist(), len(rest)]
    run_sizes = rest[starts[:-1]].tolist()
    bound = min(len(rest), 2 * int(rest.sum()) // max_tokens + 2)
    return bins + _first_fit_runs(idx[n_over:], starts, run_sizes, max_tokens, bound)


def _first_fit_runs(
    idx: list[int], starts: list[int], run_sizes: list[int], capacity: int, max_bins: int
) -> list[list[int]]:
    """First fit of items `idx` (sorted by size, runs of equal size `run_sizes[r]` at idx[starts[r]:starts[r+1]])
    into bins of `capacity`, at most `max_bins` of them. tree[1] is the root, leaf P + b is bin b's room."""
    P = 1 << max(0, (max_bins - 1).bit_length())
    tree = [capacity] * (2 * P)
    bins: list[list[int]] = []
    for r, s in enumerate(run_sizes):
        p, end = starts[r], starts[r + 1]
        while p < end:
            i = 1
            while i < P:  # leftmost leaf with room >= s
                i <<= 1
                if tree[i] < s:
                    i += 1
            room = tree[i]
            if room < s:
                raise RuntimeError(f"internal error: first fit ran out of its {P} bins")  # the bound above is wrong
            b = i - P
            k = end - p if s == 0 else min(end - p, room // s)
            if b == len(bins):
                bins.append([])
            bins[b].extend(idx[p : p + k])
            p += k
            tree[i] = room - k * s
            i >>= 1
            while i:
                v = max(tree[2 * i], tree[2 * i + 1])
                if tree[i] == v:
                    break
                tree[i] = v
                i >>= 1
    return bins


def _warn_oversize(
    idx: list[int], lens: np.ndarray, sizes: np.ndarray, max_tokens: int, align: int, stacklevel: int
) -> None:
    shown = ", ".join(f"index {i} (length {int(lens[i])}, {int(s)} aligned)" for i, s in zip(idx[:5], sizes))
    more = f" and {len(idx) - 5} more" if len(idx) > 5 else ""
    what = "sequence exceeds" if len(idx) == 1 else f"{len(idx)} sequences exceed"
    warnings.warn(
        f"{what} the budget max_tokens={max_tokens} (align={align}): {shown}{more}; "
        "each gets a bin of its own (not truncated)",
        OversizeSequenceWarning,
        stacklevel=stacklevel,
    )


# -- sampler ------------------------------------------------------------------------------------
class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Batches of at most `max_tokens` aligned tokens, packed once by `ffd_pack`; for
    `DataLoader(dataset, batch_sampler=sampler, collate_fn=ragged_collate)`.

    len(sampler) is the number of bins. shuffle=False yields the bins in FFD order (longest first);
    shuffle=True yields them in a random order drawn from `seed + epoch` (call `set_epoch(epoch)` before
    each epoch, as with `DistributedSampler`): the order changes, the bins' contents never do. Iteration
    is deterministic for a given (lengths, max_tokens, align, shuffle, seed, epoch). Oversize sequences
    warn once, here, when the bins are packed.

    Distributed (`num_replicas` > 1, or a torch.distributed process group initialised): every rank packs the same
    bins, sorts them by tokens and deals them out a step at a time, `num_replicas` bins of neighbouring sizes to a
    step, one to each rank (rank `rank` takes the step's `rank`-th). Every rank runs the same number of steps
    (len(sampler), the bins over the ranks rounded up: the last step repeats the first bins, as `DistributedSampler`
    repeats samples) and, within a step, ranks' budgets differ by at most two neighbouring bins' sizes: no rank waits
    long in the gradient all-reduce. Shuffling permutes the steps, the same way on every rank.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray | torch.Tensor,
        max_tokens: int,
        align: int = 16,
        shuffle: bool = False,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
    ):
        super().__init__()
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle must be a bool, got {shuffle!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"seed must be an int, got {seed!r} ({type(seed).__name__})")
        self.max_tokens = max_tokens
        self.align = align
        self.shuffle = shuffle
        self.seed = int(seed)
        self.epoch = 0
        self._bins = _ffd_pack(lengths, max_tokens, align, stacklevel=3)
        self.num_replicas, self.rank = _replicas(num_replicas, rank)
        self._steps = _deal(self._bins, _host_lengths(lengths), align, self.num_replicas)

    @property
    def bins(self) -> list[list[int]]:
        """The bins in FFD order (a copy)."""
        return [list(b) for b in self._bins]

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order `__iter__` yields when shuffling (the generator is seeded with seed + epoch)."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)):
            raise TypeError(f"epoch must be an int, got {epoch!r} ({type(epoch).__name__})")
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self._steps)

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self._steps), generator=g).tolist()
        else:
            order = range(len(self._steps))
        for j in order:
            yield list(self._bins[self._steps[j][self.rank]])


def _replicas(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """(ranks, this rank): as given, else the initialised process group's, else (1, 0)."""
    if num_replicas is None:
        import torch.distributed as dist

        initialised = dist.is_available() and dist.is_initialized()
        num_replicas = dist.get_world_size() if initialised else 1
        rank = (dist.get_rank() if initialised else 0) if rank is None else rank
    rank = 0 if rank is None else rank
    for name, value in (("num_replicas", num_replicas), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be in [0, num_replicas) and num_replicas >= 1, got rank={rank}, "
                         f"num_replicas={num_replicas}")  # fmt: skip
    return int(num_replicas), int(rank)


def _deal(bins: list[list[int]], lengths: np.ndarray, align: int, world: int) -> list[list[int]]:
    """Steps of `world` bin indices each (one a rank), bins of neighbouring token counts together; with one rank,
    each bin its own step in FFD order."""
    if world == 1:
        return [[i] for i in range(len(bins))]
    if not bins:
        return []
    tokens = [int(_aligned(lengths[np.asarray(b, dtype=np.int64)], align).sum()) for b in bins]
    order = sorted(range(len(bins)), key=lambda i: (-tokens[i], i))
    order += [order[i % len(order)] for i in range(-len(order) % world)]  # the last step repeats the first bins
    return [order[k : k + world] for k in range(0, len(order), world)]


# -- collate ------------------------------------------------------------------------------------
def ragged_collate(samples: Sequence[Any], align: int = 1, *, key: Any = None) -> Any:
    """Collate variable-length samples into a `RaggedTensor` (copied once into its values; no padded tensor).

    Supported samples (all of one kind):
      tensors `[length_i, *features]`   -> RaggedTensor
      tuples/lists of equal size        -> tuple: field `key` (default 0) holds the `[length_i, *features]`
                                           tensors and becomes a RaggedTensor; every other field goes through
                                           `torch.utils.data.default_collate` (e.g. (x, label) -> (rt, labels))
      dicts (Mappings) with equal keys  -> dict: entry `key` (required) becomes a RaggedTensor, every other
                                           entry goes through `default_collate`
    Only one field is ragged; the others must collate by stacking. Features, dtype and device must agree.
    Use `functools.partial(ragged_collate, align=16)` (or `key="tokens"`) as a DataLoader's collate_fn.
    """
    align = check_align(align)
    if isinstance(samples, (str, bytes)) or not isinstance(samples, Sequence):
        raise TypeError(f"samples must be a sequence (a list of samples), got {type(samples).__name__}")
    if len(samples) == 0:
        raise ValueError("ragged_collate got an empty batch; a RaggedTensor needs at least one sample")
    first = samples[0]
    if isinstance(first, torch.Tensor):
        if key is not None:
            raise TypeError(f"key={key!r} applies to tuple or dict samples; the samples are tensors")
        return RaggedTensor.from_list(_ragged_field(samples, lambda s: s, "samples[{i}]"), align=align)
    if isinstance(first, Mapping):
        return _collate_dicts(samples, align, key)
    if isinstance(first, (tuple, list)):
        return _collate_tuples(samples, align, 0 if key is None else key)
    raise TypeError(
        f"ragged_collate supports tensors [length, *features], tuples/lists holding one, or dicts holding one; "
        f"samples[0] is a {type(first).__name__}"
    )


def _ragged_field(samples: Sequence[Any], get: Callable[[Any], Any], where: str) -> list[torch.Tensor]:
    out = []
    for i, s in enumerate(samples):
        t = get(s)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where.format(i=i)} is a {type(t).__name__}, not a tensor [length, *features]")
        if t.dim() < 1:
            raise ValueError(f"{where.format(i=i)} is a 0-d tensor; a ragged sample needs a length dim")
        out.append(t)
    return out


def _collate_tuples(samples: Sequence[Any], align: int, key: Any) -> tuple[Any, ...]:
    n = len(samples[0])
    if isinstance(key, bool) or not isinstance(key, int) or not -n <= key < n:
        raise TypeError(f"key must be an int index into the {n}-field samples, got {key!r}")
    key %= n
    for i, s in enumerate(samples):
        if not isinstance(s, (tuple, list)) or len(s) != n:
            what = f"a {len(s)}-field {type(s).__name__}" if isinstance(s, (tuple, list)) else type(s).__name__
            raise TypeError(f"samples[{i}] is {what}; samples[0] is a {n}-field {type(samples[0]).__name__}")
    out = []
    for f in range(n):
        if f == key:
            tensors = _ragged_field(samples, operator.itemgetter(f), f"samples[{{i}}][{f}]")
            out.append(RaggedTensor.from_list(tensors, align=align))
        else:
            out.append(default_collate([s[f] for s in samples]))
    return tuple(out)


def _collate_dicts(samples: Sequence[Any], align: int, key: Any) -> dict[Any, Any]:
    keys = list(samples[0].keys())
    if key is None:
        raise TypeError(
            f"dict samples need the ragged entry named: functools.partial(ragged_collate, key=...), one of {keys}"
        )
    if key not in samples[0]:
        raise KeyError(f"key={key!r} is not in the samples; they have {keys}")
    for i, s in enumerate(samples):
        if not isinstance(s, Mapping) or set(s.keys()) != set(keys):
            what = f"a dict with keys {list(s.keys())}" if isinstance(s, Mapping) else f"a {type(s).__name__}"
            raise TypeError(f"samples[{i}] is {what}; samples[0] has keys {keys}")
    out = {}
    for k in keys:
        if k == key:
            tensors = _ragged_field(samples, operator.itemgetter(k), f"samples[{{i}}][{k!r}]")
            out[k] = RaggedTensor.from_list(tensors, align=align)
        else:
            out[k] = default_collate([s[k] for s in samples])
    return out


# -- capacity probe -----------------------------------------------------------------------------
@dataclass
class CapacityProbe:
    """What `probe_capacity` found.

    max_tokens:  the largest token count tried whose forward fitted
    safe_tokens: floor(max_tokens * safety), not rounded to the step: a budget with headroom for
                 fragmentation and for batches whose shape costs more than the probe's
    tried:       every (tokens, fitted) in the order tried; growth stops at the first False, or at the cap
    """

    max_tokens: int
    safe_tokens: int
    tried: list[tuple[int, bool]] = field(default_factory=list)

    @property
    def reached_cap(self) -> bool:
        """True when growth stopped at the caller's `max_tokens` cap rather than at an out-of-memory error."""
        return bool(self.tried) and self.tried[-1][1]


def _oom_types() -> tuple[type[BaseException], ...]:
    types = [getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)]
    return tuple(t for t in types if t is not None)


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, _oom_types()) or (isinstance(exc, RuntimeError) and "out of memory" in str(exc))


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def probe_capacity(
    model: Callable[..., Any],
    make_batch: Callable[[int], Any],
    *,
    start: int,
    step: int,
    safety: float = 0.9,
    max_tokens: int | None = None,
) -> CapacityProbe:
    """The largest token count whose forward fits in device memory, by growing until out of memory.

    For tokens = start, start + step, start + 2 step, ...: `args = make_batch(tokens)`, then `model(*args)`
    if args is a tuple, else `model(args)` (a tensor or RaggedTensor), under `torch.no_grad()` (the model's
    train/eval mode is left as it is). The first out-of-memory error (torch.OutOfMemoryError,
    torch.cuda.OutOfMemoryError, or a RuntimeError whose message contains "out of memory") in make_batch or
    the forward stops the growth; the batch is dropped and the CUDA cache emptied before returning. With
    `max_tokens`, growth is capped there (the last try is exactly max_tokens) and stops when it fits; without
    it, growth only stops at an out-of-memory error, so on a host without a memory limit pass a cap.
    Each try is logged at INFO under the "autoragged" logger. Raises RuntimeError when even `start` does not
    fit; any other exception propagates. A one-off helper: every try is a full forward.
    """
    start = _positive_int(start, "start")
    step = _positive_int(step, "step")
    if isinstance(safety, bool) or not isinstance(safety, (int, float)) or not 0 < safety <= 1:
        raise ValueError(f"safety must be a number in (0, 1], got {safety!r}")
    if max_tokens is not None:
        max_tokens = _positive_int(max_tokens, "max_tokens")
        if max_tokens < start:
            raise ValueError(f"max_tokens={max_tokens} is below start={start}")
    tried: list[tuple[int, bool]] = []
    tokens = start
    while True:
        failure = _try_forward(model, make_batch, tokens)
        tried.append((tokens, failure is None))
        if failure is not None:
            _free_memory()
            logger.info("probe_capacity: %d tokens: out of memory (%s)", tokens, failure)
            if len(tried) == 1:
                raise RuntimeError(
                    f"probe_capacity: even start={start} tokens does not fit in memory ({failure}); lower start"
                )
            break
        logger.info("probe_capacity: %d tokens fit", tokens)
        if max_tokens is not None and tokens >= max_tokens:
            break
        tokens = tokens + step if max_tokens is None else min(tokens + step, max_tokens)
    best = max(t for t, ok in tried if ok)
    safe = math.floor(best * safety + 1e-9)
    logger.info("probe_capacity: max_tokens=%d, safe_tokens=%d (safety %g)", best, safe, safety)
    return CapacityProbe(max_tokens=best, safe_tokens=safe, tried=tried)


def _try_forward(model: Callable[..., Any], make_batch: Callable[[int], Any], tokens: int) -> str | None:
    """None if make_batch(tokens) and the forward fit; the error's first line if they ran out of memory.
    The exception (and the frames holding the batch) is dropped before returning, so memory can be freed."""
    try:
        with torch.no_grad():
            args = make_batch(tokens)
            out = model(*args) if isinstance(args, tuple) else model(args)
            del args, out
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
    except Exception as exc:  # only out-of-memory errors are swallowed
        if not _is_oom(exc):
            raise
        return (str(exc).splitlines() or [type(exc).__name__])[0][:200]
    return None


# -- padding overhead ---------------------------------------------------------------------------
def padding_overhead(
    batches: Sequence[Sequence[int]],
    lengths: Sequence[int] | np.ndarray | torch.Tensor,
    *,
    ragged: bool = False,
    align: int = 1,
) -> float:
    """Wasted token rows of a batching, relative to the real tokens: cost / real - 1 (0.0 = no waste).

    batches: lists of indices into `lengths` (an index may appear in several batches; it counts each time)
    real:    sum over batches of sum(lengths[i] for i in batch)
    cost:    ragged=False: the padded rectangles, sum over batches of len(batch) * ceil(max_len / align) * align
             ragged=True:  the aligned rows a RaggedTensor holds, sum over all i of ceil(lengths[i] / align) * align
    Empty batches cost nothing. If there are no real tokens the overhead is 0.0 when nothing was paid for
    either. Counts token rows (what linear layers pay for), not attention's quadratic cost.
    E.g. lengths [3, 1, 2]: [[0, 1, 2]] padded costs 9 for 6 real -> 0.5; ragged with align=4 costs 12 -> 1.0.
    """
    lens = _host_lengths(lengths)
    align = check_align(align)
    if isinstance(batches, (str, bytes)) or not isinstance(batches, Sequence):
        raise TypeError(f"batches must be a sequence of index lists, got {type(batches).__name__}")
    flat: list[int] = []
    sizes = []
    for j, b in enumerate(batches):
        if isinstance(b, (str, bytes)) or not isinstance(b, (Sequence, np.ndarray)):
            raise TypeError(f"batches[{j}] must be a list of indices, got {type(b).__name__}")
        flat.extend(b)
        sizes.append(len(b))
    try:
        idx = np.asarray([operator.index(i) for i in flat], dtype=np.int64)
    except TypeError:
        bad = next(i for i in flat if isinstance(i, bool) or not isinstance(i, (int, np.integer)))
        raise TypeError(f"batch indices must be ints, got {bad!r} ({type(bad).__name__})") from None
    if len(idx) and (idx.min() < 0 or idx.max() >= len(lens)):
        bad = int(idx[(idx < 0) | (idx >= len(lens))][0])
        raise ValueError(f"batch index {bad} is out of range for {len(lens)} lengths")
    got = lens[idx]
    real = int(got.sum())
    if ragged:
        cost = int(_aligned(got, align).sum())
    else:
        counts = np.asarray(sizes, dtype=np.int64)
        nonempty = counts > 0
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])[nonempty]
        maxes = np.maximum.reduceat(got, starts) if len(starts) else np.zeros(0, np.int64)
        cost = int((counts[nonempty] * _aligned(maxes, align)).sum())
    if real == 0:
        return 0.0 if cost == 0 else math.inf
    return cost / real - 1.0


def fixed_size_batches(n: int, batch_size: int) -> list[list[int]]:
    """Indices 0..n-1 in order, in batches of `batch_size` (the last may be smaller): the data-order baseline
    (random batches when the data set is in random order)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    batch_size = _positive_int(batch_size, "batch_size")
    return [list(range(s, min(s + batch_size, int(n)))) for s in range(0, int(n), batch_size)]


def length_sorted_batches(lengths: Sequence[int] | np.ndarray | torch.Tensor, batch_size: int) -> list[list[int]]:
    """Indices sorted by length (descending, ties by index), in batches of `batch_size` (the last may be
    smaller): the bucketing baseline that pads little but keeps a fixed batch size."""
    lens = _host_lengths(lengths)
    batch_size = _positive_int(batch_size, "batch_size")
    order = np.argsort(-lens, kind="stable").tolist()
    return [order[s : s + batch_size] for s in range(0, len(order), batch_size)]


from .job import read_shards, run_job, token_budget  # noqa: E402  (the job uses the packing above)
