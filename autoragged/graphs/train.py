"""Training graphs: a fused stack's forward and backward on packed rows, replayed as two CUDA graphs (the decoders'
Llama/Mistral/Qwen stack, the BERT family's encoder stack).

An eager training step of a Qwen2.5-0.5B-shaped model on 2,400 packed rows is host-bound: about 44 ms of GPU
work, and 35-43 ms of forward plus 37-70 ms of backward host time (launches, autograd nodes); on tiny batches the
step still takes 90-100 ms (H100). Replayed, the 24 layers' forward is one launch and their backward another.

A graph serves every batch of up to `rows` packed rows in up to `components` - 1 sequences (`TrainGraphKey`; the
rows on the eager arm's cuBLAS rungs, `planning.buckets.cublas_rows`): the batch's rows are copied into the
graph's static rows, and the static rows past them form one more sequence of their own, so every row the kernels
read holds finite values and no attention row is left unwritten (a weight gradient sums every row: 0 x a NaN is
NaN). The layout (offsets, lengths, both block sizes' preludes) is one int32 buffer filled from the host per
batch; the attention kernels run a fixed grid whose spare programs exit.

A key is captured once its batches recur (`RECUR`: the capture, a warm-up step and the recording, costs a few
steps, paid only by a shape that comes back). A stack's graphs share one memory pool and one gradient buffer:
what lives from one replay to the next is only the latest forward's activations, so a key with fewer rows than one
captured before fits the blocks that one's activations free, and a key with more adds about its own (its tensors
fit no smaller key's blocks: six keys captured as they came took 11 GB, the largest alone 6.4; Qwen2.5-0.5B shape,
8 documents a step, H100). Every output a replay writes is copied out before the next, and a backward whose
forward's activations a later forward replaced recomputes its stack eagerly (`generation`). What the pool takes
leaves room for one eager step as large (the warm-up step measures a key's activations; `pool_fit`): where a
larger key's growth would not, the graphs start over in a pool sized by that key, and a key that would not fit
even so runs eagerly.

A backward whose forward's activations are gone (a later replay of any key, or an earlier backward, reused their
memory) replays its forward again first, from its saved input and the random state its replay started from: the
dropouts (PyTorch's, and the attention kernel's, whose seed is drawn on the device: a replay draws new masks) draw
the same masks again. The graphs serve only what they replay exactly: no adapters, no gradient checkpointing, no KV
cache or hidden states (`fused_decoder.why_not_graphed`, `encoder.why_not_graphed`); autocast is captured as the
call has it (its casts read the current weights), and what the capture bakes in besides the parameters (autocast,
dropout probabilities) is the graphs' `mode`: another mode starts them anew. Gradients come out of the shared buffer,
cloned per backward, so that accumulating over several backwards is right.
"""

from __future__ import annotations

import gc
import logging
from typing import NamedTuple

import numpy as np
import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ..kernels import ragged_attention_backward as k_attn_bwd
from ..kernels.config import aligned
from ..planning.buckets import cublas_rows
from ..ragged.layout import Layout
from .cache import obtainable_bytes
from .worker import worker

__all__ = [
    "ENABLED",
    "StackModule",
    "TrainGraphKey",
    "TrainGraphs",
    "graph_key",
    "why_not_call",
    "pool_fit",
    "static_meta",
    "RECUR",
]

log = logging.getLogger("autoragged")

# off: every training call of a stack runs eagerly (a Qwen2.5-0.5B SFT step of 8 documents: 52.7 ms replayed against
# 66.2 eager, H200)
ENABLED = True
RECUR = 2  # batches of a key before it is captured: a shape seen once may never come back
# the floor of a key's sequence count: 16 split 8,192-token DDP bins of 15 and of 16-31 documents into two keys, whose
# first sights stalled every rank (1.76x on 2 GPUs, 1.97x at 64); a component costs each head one exiting program
MIN_COMPONENTS = 64


class TrainGraphKey(NamedTuple):
    """What one training graph serves: batches of up to `rows` packed rows in up to `components` - 1 sequences."""

    rows: int
    components: int


def why_not_call(x: torch.Tensor, layout) -> str | None:
    """Why no training graph can serve a call of a stack on x of `layout`, whatever the stack, or None: a graph
    records autograd on the GPU and lays the batch out as packed components (no query-only rows)."""
    if not x.is_cuda or not torch.is_grad_enabled():
        return "not a CUDA training call"
    if type(layout) is not Layout or not layout.packed:
        return "not a packed layout"
    return None


def graph_key(rows: int, sequences: int) -> TrainGraphKey:
    """The key of a batch of `rows` packed rows in `sequences` sequences (one component more: the spare rows)."""
    return TrainGraphKey(cublas_rows(max(rows, 1)), max(MIN_COMPONENTS, 1 << sequences.bit_length()))


class _Sections(NamedTuple):
    """Where each part of the int32 layout buffer starts (each at a multiple of 16 elements: `aligned`)."""

    offsets: int
    lengths: int
    preludes: tuple  # per block size: (start of grid_mapping, its programs, start of block_offsets)
    size: int


def _sections(key: TrainGraphKey, block_sizes: tuple[int, ...]) -> _Sections:
    C = key.components
    at = aligned(C + 1)
    lengths, at = at, at + aligned(C)
    preludes = []
    for bm in block_sizes:
        programs = -(-key.rows // bm) + C
        preludes.append((at, programs, at + aligned(programs)))
        at += aligned(programs) + aligned(C + 1)
    return _Sections(0, lengths, tuple(preludes), at)


def static_meta(lengths, key: TrainGraphKey, block_sizes: tuple[int, ...]) -> np.ndarray:
    """The layout buffer of a batch of `lengths` in graph `key`: the sequences, then the spare rows as one more,
    then empty components; per block size a prelude whose programs past the batch's are -1 (they exit)."""
    lens = np.zeros(key.components, dtype=np.int64)
    lens[: len(lengths)] = lengths
    total = int(lens.sum())
    if total > key.rows or len(lengths) >= key.components:
        raise ValueError(f"{len(lengths)} sequences of {total} rows do not fit graph {key}")
    lens[len(lengths)] = key.rows - total
    s = _sections(key, block_sizes)
    meta = np.zeros(s.size, dtype=np.int32)
    C = key.components
    meta[s.offsets + 1 : s.offsets + C + 1] = np.cumsum(lens)
    meta[s.lengths : s.lengths + C] = lens
    for bm, (grid_at, programs, blocks_at) in zip(block_sizes, s.preludes):
        counts = -(-lens // bm)
        meta[blocks_at + 1 : blocks_at + C + 1] = np.cumsum(counts)
        grid = np.repeat(np.arange(C, dtype=np.int32), counts)
        meta[grid_at : grid_at + programs] = -1
        meta[grid_at : grid_at + len(grid)] = grid
    return meta


class _StaticLayout:
    """The layout the captured kernels read: views of the graph's int32 buffer (what `ops.attention_values` and
    the attention backward ask of a layout)."""

    align = 1
    key_lengths = None
    live = None
    tile_rows = None

    def __init__(self, meta: torch.Tensor, key: TrainGraphKey, block_sizes: tuple[int, ...]):
        s, C = _sections(key, block_sizes), key.components
        self._offsets, self._lengths = meta[: C + 1], meta[s.lengths : s.lengths + C]
        self._preludes = {
            bm: (meta[g : g + programs], meta[b : b + C + 1]) for bm, (g, programs, b) in zip(block_sizes, s.preludes)
        }
        self.offsets = (0, key.rows)  # every row is in a component: the attention leaves none to zero
        self.max_len = key.rows

    def device_meta(self, device):
        return self._offsets, self._lengths

    def prelude(self, block_m: int, device):
        hit = self._preludes.get(block_m)
        if hit is None:
            raise ValueError(f"this training graph has preludes for blocks {sorted(self._preludes)}, not {block_m}")
        return hit


class StackModule(nn.Module):
    """The graphed layers as one module, whose parameters `torch.func.functional_call` swaps: `run(x, layout,
    config, tables)` is the stack's forward over `parts` (its modules, whose parameters it reads as it runs);
    `tables`: per-row inputs beside x (the decoders' rotary cos and sin), each (rows, width)."""

    def __init__(self, run, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.run = run

    def forward(self, x, layout, config, tables):
        return self.run(x, layout, config, tables)

    def trained(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]


class TrainGraph:
    """One key's graphs: static rows, per-row tables, layout and output gradient; the forward, and the backward into
    the stack's shared gradient buffer. Its static buffers are its own, outside the pool."""

    def __init__(self, holder: StackModule, key: TrainGraphKey, config, head_dim: int, like: torch.Tensor,
                 tables: tuple[torch.Tensor, ...], amp: torch.dtype | None):  # fmt: skip
        self.key = key
        named = [(n, p) for n, p in holder.named_parameters() if p.requires_grad]
        self.shapes = [p.shape for _, p in named]
        self.block_sizes = tuple(sorted({config.block_m, k_attn_bwd.backward_config(head_dim, key.rows).block_m}))
        device, dtype = like.device, like.dtype
        R, D = key.rows, like.shape[1]
        self.x = torch.zeros(R, D, dtype=dtype, device=device, requires_grad=True)
        self.tables = tuple(torch.zeros(R, t.shape[1], dtype=t.dtype, device=device) for t in tables)
        self.amp = amp  # the autocast dtype the forward runs under, or None
        self.meta = torch.zeros(_sections(key, self.block_sizes).size, dtype=torch.int32, device=device)
        self.meta.copy_(torch.from_numpy(static_meta((), key, self.block_sizes)))
        self.gy = torch.zeros(R, D, dtype=dtype, device=device)
        layout = _StaticLayout(self.meta, key, self.block_sizes)
        # the graphs differentiate leaves of their own that share the parameters' storage: the parameters' own
        # gradient accumulators live on the default stream, which a capture must not wait on
        self.aliases = [p.detach().requires_grad_() for _, p in named]
        swap = {n: alias for (n, _), alias in zip(named, self.aliases)}
        args = (self.x, layout, config, self.tables)
        # (a closure over these, never over self: a cycle would keep the graph's memory until a collection)
        self._run = lambda: torch.func.functional_call(holder, swap, args, tie_weights=False)
        self.fwd = self.bwd = self.y = self.gx = None

    def warm_up(self, stream) -> int:
        """An eager step on `stream` (compiles, cuBLAS's workspace for the stream) -> the bytes a forward keeps for
        its backward (what a replay's activations take in the pool)."""
        device = self.x.device
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            before = torch.cuda.memory_allocated(device)
            with self._autocast():
                y = self._run()
            kept = torch.cuda.memory_allocated(device) - before
            torch.autograd.grad(y, [self.x, *self.aliases], self.gy, allow_unused=True)
            del y
        torch.cuda.current_stream(device).wait_stream(stream)
        return kept

    def record(self, pool, stream, flat: torch.Tensor) -> None:
        """Record the forward, and the backward whose parameters' gradients land in `flat`."""
        grad_of = [self.x, *self.aliases]
        collecting = gc.isenabled()
        gc.disable()  # a collection that destroys some other CUDA graph mid-capture makes the capture fail
        try:
            self.fwd = torch.cuda.CUDAGraph()
            # (thread-local: the background worker may be warming an inference graph up meanwhile)
            with torch.cuda.graph(self.fwd, pool=pool, stream=stream, capture_error_mode="thread_local"):
                with self._autocast():
                    self.y = self._run()
            self.bwd = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.bwd, pool=pool, stream=stream, capture_error_mode="thread_local"):
                grads = torch.autograd.grad(self.y, grad_of, self.gy, allow_unused=True)
                self.gx = grads[0]
                parts = [(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(self.aliases, grads[1:])]
                torch.cat(parts, out=flat)
                del grads, parts
        finally:
            if collecting:
                gc.enable()

    def _autocast(self):
        # (no cache: a replay casts the weights as they are then, after the optimizer's steps)
        return torch.autocast("cuda", self.amp or torch.float16, enabled=self.amp is not None, cache_enabled=False)

    def load(self, x: torch.Tensor, lengths, tables: tuple[torch.Tensor, ...]) -> None:
        """Copy a batch in and replay the forward."""
        rows = x.shape[0]
        meta = torch.from_numpy(static_meta(lengths, self.key, self.block_sizes))
        with torch.no_grad():
            self.x[:rows].copy_(x)
            for static, table in zip(self.tables, tables):
                static[:rows].copy_(table)
            self.meta.copy_(meta.pin_memory() if self.meta.is_cuda else meta, non_blocking=True)
        self.fwd.replay()

    def backward(self, gy: torch.Tensor, flat: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Replay the backward for the rows' gradient gy -> (dx for those rows, each parameter's gradient)."""
        rows = gy.shape[0]
        self.gy[:rows].copy_(gy)
        self.gy[rows:].zero_()
        self.bwd.replay()
        flat = flat.clone()  # a later backward replays into the shared buffer
        grads = [g.view(s) for g, s in zip(flat.split([s.numel() for s in self.shapes]), self.shapes)]
        return self.gx[:rows].clone(), grads


class _Replay(torch.autograd.Function):
    """The stack's output rows from a replay of `graph`; its backward replays the backward graph, after the forward
    again where the activations are gone (`TrainGraphs.generation`)."""

    @staticmethod
    def forward(ctx, graphs: TrainGraphs, graph: TrainGraph, lengths, tables, x, *params):
        ctx.rng = torch.cuda.get_rng_state(x.device)  # (host state: no sync) the dropout masks a replay draws
        graph.load(x, lengths, tables)
        graphs.generation += 1
        ctx.graphs, ctx.graph, ctx.generation, ctx.batch = graphs, graph, graphs.generation, (lengths, tables)
        ctx.save_for_backward(x)
        return graph.y[: x.shape[0]].clone()

    @staticmethod
    @once_differentiable  # (our kernels give first derivatives only: a second is an error, never silent)
    @torch.compiler.disable
    def backward(ctx, gy):
        graphs, graph = ctx.graphs, ctx.graph
        if ctx.generation != graphs.generation:  # the activations are gone: replay the forward as it ran
            (x,) = ctx.saved_tensors
            now = torch.cuda.get_rng_state(x.device)
            torch.cuda.set_rng_state(ctx.rng, x.device)
            graph.load(x, *ctx.batch)
            torch.cuda.set_rng_state(now, x.device)
        gx, grads = graph.backward(gy, graphs.flat)
        graphs.generation += 1  # (the backward's replay reuses the activations' blocks)
        return (None, None, None, None, gx, *grads)


def pool_fit(reserved: int, kept: int, larger: bool, obtainable: int) -> str:
    """Whether a key whose forward keeps `kept` bytes is recorded into a pool of `reserved` bytes ("record"), into
    a fresh pool after the other graphs are dropped ("start over"), or not at all ("refuse"); `larger`: it has more
    rows than every captured key; `obtainable`: the device memory free or cached unused. A smaller key fits the
    pool as it is; a larger one grows it by about its activations (the module docstring). What the pool takes must
    leave room for one eager step as large, the step of a key not captured yet."""
    if not larger or 2 * kept <= obtainable:
        return "record"
    return "start over" if 2 * kept <= obtainable + reserved else "refuse"


class TrainGraphs:
    """One stack's (`holder`'s) training graphs by key, captured where batches recur (`RECUR`), in one pool that
    leaves room for an eager step (`pool_fit`)."""

    def __init__(self, holder: StackModule):
        self.holder = holder
        self.seen: dict[TrainGraphKey, int] = {}
        self.graphs: dict[TrainGraphKey, TrainGraph] = {}
        self.refused: set[TrainGraphKey] = set()  # keys whose activations would not fit (`pool_fit`)
        self.failed: str | None = None
        self.params: list[nn.Parameter] = []  # the trained parameters the graphs were captured for
        self._ptrs: tuple[int, ...] = ()
        self.mixed = False  # the parameters are of several dtypes: no graphs
        self.mode: tuple = ()  # what the graphs bake in besides the parameters (`run`)
        self.pool = None
        self.flat: torch.Tensor | None = None  # every captured backward's parameter gradients, flattened
        self.reserved_bytes = 0  # what the recordings took from the device (the pool's growth)
        self.generation = 0  # replays so far: the pool holds the activations of the latest, if a forward

    def run(self, x, lengths, config, head_dim: int, tables: tuple[torch.Tensor, ...] = (), mode: tuple = ()):
        """The stack's output rows for packed x (rows, D) of a batch of `lengths` (and per-row `tables`) through
        its key's graph, or None where none serves it (then the caller runs eagerly). `mode`: what the stack's run
        bakes into a capture besides the parameters and autocast (its dropout probabilities)."""
        if self.failed is not None:
            return None
        params = self.holder.trained()
        if not params:
            return None
        amp = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        mode = (amp, *mode)
        if not self._serves(params) or mode != self.mode:
            self._reset(params)
            self.mode = mode
        if self.mixed:
            return None
        key = graph_key(sum(lengths), len(lengths))  # (x may hold spare rows: the eager arm's rung, `cublas_rows`)
        if x.shape[0] > key.rows:
            return None
        graph = self.graphs.get(key)
        if graph is None:
            self.seen[key] = count = self.seen.get(key, 0) + 1
            if count < RECUR or key in self.refused:
                return None
            graph = self._capture(key, config, head_dim, x, tables, amp)
            if graph is None:
                return None
        return _Replay.apply(self, graph, tuple(lengths), tables, x, *params)

    def _serves(self, params: list[nn.Parameter]) -> bool:
        """Whether the captured parameters are still these, where they were (`model.to(...)`, a reassigned or
        frozen weight: no)."""
        return len(params) == len(self.params) and all(
            p is q and p.data_ptr() == ptr for p, q, ptr in zip(params, self.params, self._ptrs)
        )

    def _reset(self, params: list[nn.Parameter]) -> None:
        """Start anew for these trained parameters: graphs captured for others serve them not."""
        self._drop_graphs()
        self.seen.clear()
        self.refused.clear()
        self.params, self._ptrs = params, tuple(p.data_ptr() for p in params)
        self.mixed = len({p.dtype for p in params}) > 1  # (their gradients could not share one buffer)
        self.flat = None

    def _drop_graphs(self) -> None:
        """Drop the graphs (they are captured anew as they recur) and their pool."""
        if self.graphs:
            self.graphs.clear()
            torch.cuda.empty_cache()  # (the old pool's memory, freed with its graphs)
        self.pool = None  # (PyTorch refuses a capture into a pool whose graphs were all freed)
        self.reserved_bytes = 0

    def _capture(self, key, config, head_dim, x, tables, amp) -> TrainGraph | None:
        device = x.device
        worker.note()  # this batch's time is no sample of its arm's cost
        stream = worker.stream(device, "capture")
        try:
            graph = TrainGraph(self.holder, key, config, head_dim, x, tables, amp)
            kept = graph.warm_up(stream)
            # the warm-up's blocks are cached for the capture stream alone: give them back (one sync; without it
            # each capture kept a step's activations, and a Qwen2.5-0.5B SFT table ran out of memory on an H100)
            torch.cuda.empty_cache()
            larger = key.rows > max((k.rows for k in self.graphs), default=0)
            fit = pool_fit(self.reserved_bytes, kept, larger, obtainable_bytes(device))
            if fit == "refuse":
                self.refused.add(key)
                log.info("autoragged: no training graph of %d rows: its %.1f GB and an eager step's would not fit",
                         key.rows, kept / 2**30)  # fmt: skip
                return None
            if fit == "start over":
                self._drop_graphs()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            if self.flat is None:
                numel = sum(p.numel() for p in self.params)
                self.flat = torch.empty(numel, dtype=self.params[0].dtype, device=device)
            reserved = torch.cuda.memory_reserved(device)
            graph.record(self.pool, stream, self.flat)
            self.reserved_bytes += torch.cuda.memory_reserved(device) - reserved
        except torch.OutOfMemoryError:
            self.failed = f"out of memory capturing a training graph of {key.rows} rows"
            log.warning("autoragged: %s; training runs eagerly from now on", self.failed)
            self._drop_graphs()
            self.flat = None
            torch.cuda.empty_cache()  # (also what the failed capture took)
            return None
        self.graphs[key] = graph
        log.info("autoragged: captured a training graph of %d rows, %d components: activations %.2f GB, the pool"
                 " now %.2f GB", key.rows, key.components, kept / 2**30, self.reserved_bytes / 2**30)  # fmt: skip
        return graph
