"""Training graphs: a fused decoder stack's forward and backward on packed rows, replayed as two CUDA graphs.

An eager training step of a Qwen2.5-0.5B-shaped model on 2,400 packed rows is host-bound: about 44 ms of GPU
work, and 35-43 ms of forward plus 37-70 ms of backward host time (launches, autograd nodes); on tiny batches the
step still takes 90-100 ms (H100). Replayed, the 24 layers' forward is one launch and their backward another.

A graph serves every batch of up to `rows` packed rows in up to `components` - 1 sequences (`TrainGraphKey`): the
batch's rows are copied into the graph's static rows, and the static rows past them form one more sequence of
their own, so every row the kernels read holds finite values and no attention row is left unwritten (a weight
gradient sums every row: 0 x a NaN is NaN). The layout (offsets, lengths, both block sizes' preludes) is one int32
buffer filled from the host per batch; the attention kernels run a fixed grid whose spare programs exit.

Off by default (`models/hf_decoder.TRAIN_GRAPHS`): its gain has not yet been shown past the runs' spread.

A key is captured once its batches recur (`RECUR`: the capture, two warm-up steps and the recording, costs a few
steps, paid only by a shape that comes back), at most `MAX_GRAPHS` per stack (each holds its rows' activations).
The graphs serve only what they replay exactly: no dropout inside the stack (a replay draws no new mask), no
adapters, no gradient checkpointing, no autocast, no KV cache or hidden states. Gradients come out of one flat
buffer, cloned per backward, so that accumulating over several backwards is right; a backward whose forward's
activations a later forward replaced recomputes its stack eagerly.
"""

from __future__ import annotations

import gc
import logging
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from ..kernels import ragged_attention_backward as k_attn_bwd
from ..kernels._config import aligned

__all__ = ["StackModule", "TrainGraphKey", "TrainGraphs", "graph_key", "static_meta", "RECUR", "MAX_GRAPHS"]

log = logging.getLogger("autoragged")

ROW_STEP = 512  # a graph's rows: the batch's rows rounded up to this (the spare rows cost their linears)
RECUR = 2  # batches of a key before it is captured: a shape seen once may never come back
MAX_GRAPHS = 2  # per stack: each keeps its rows' activations and a copy of the stack's gradients
MEMORY_LEFT = 0.25  # a capture leaves at least this share of the GPU's memory free (the graphs' size known so far)
MIN_COMPONENTS = 16


class TrainGraphKey(NamedTuple):
    """What one training graph serves: batches of up to `rows` packed rows in up to `components` - 1 sequences."""

    rows: int
    components: int


def graph_key(rows: int, sequences: int) -> TrainGraphKey:
    """The key of a batch of `rows` packed rows in `sequences` sequences (one component more: the spare rows)."""
    return TrainGraphKey(-(-max(rows, 1) // ROW_STEP) * ROW_STEP, max(MIN_COMPONENTS, 1 << sequences.bit_length()))


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
    config, position_embeddings)` is the stack's forward, over `parts` (its modules)."""

    def __init__(self, run, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.run = run

    def forward(self, x, layout, config, position_embeddings):
        return self.run(x, layout, config, position_embeddings)

    def trained(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]


class TrainGraph:
    """One key's graphs: static rows, rotary tables and layout; the forward, and the backward into one flat buffer
    of the parameters' gradients. `run(x, layout, cos, sin)` is differentiable in x and the parameters."""

    def __init__(self, holder: StackModule, key: TrainGraphKey, config, head_dim: int, like: torch.Tensor):
        self.key = key
        named = [(n, p) for n, p in holder.named_parameters() if p.requires_grad]
        self.params = params = [p for _, p in named]
        self.ptrs = tuple(p.data_ptr() for p in params)
        self.block_sizes = tuple(sorted({config.block_m, k_attn_bwd.backward_config(head_dim, key.rows).block_m}))
        device, dtype = like.device, like.dtype
        R, D = key.rows, like.shape[1]
        self.x = torch.zeros(R, D, dtype=dtype, device=device, requires_grad=True)
        self.cos = torch.zeros(R, head_dim, dtype=dtype, device=device)
        self.sin = torch.zeros(R, head_dim, dtype=dtype, device=device)
        self.meta = torch.zeros(_sections(key, self.block_sizes).size, dtype=torch.int32, device=device)
        self.meta.copy_(torch.from_numpy(static_meta((), key, self.block_sizes)))
        self.gy = torch.zeros(R, D, dtype=dtype, device=device)
        layout = _StaticLayout(self.meta, key, self.block_sizes)
        # the graphs differentiate leaves of their own that share the parameters' storage: the parameters' own
        # gradient accumulators live on the default stream, which a capture must not wait on
        self.aliases = [p.detach().requires_grad_() for p in params]
        swap = {n: alias for (n, _), alias in zip(named, self.aliases)}

        args = (self.x, layout, config, (self.cos[None], self.sin[None]))
        # (a closure over these, never over self: a cycle would keep the graph's memory until a collection)
        self._run = lambda: torch.func.functional_call(holder, swap, args, tie_weights=False)
        self.generation = 0
        self.fwd = self.bwd = None
        self.bytes = 0  # the memory the capture took (TrainGraphs._capture)

    def capture(self, pool) -> None:
        """Two warm-up steps on a side stream (compiles, cuBLAS handles and workspaces), then the two recordings."""
        grad_of = [self.x, *self.aliases]
        stream = torch.cuda.Stream(self.x.device)
        stream.wait_stream(torch.cuda.current_stream(self.x.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                y = self._run()
                torch.autograd.grad(y, grad_of, self.gy, allow_unused=True)
                del y
        torch.cuda.current_stream(self.x.device).wait_stream(stream)
        collecting = gc.isenabled()
        gc.disable()  # a collection that destroys some other CUDA graph mid-capture makes the capture fail
        try:
            self.fwd = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.fwd, pool=pool, stream=stream):
                self.y = self._run()
            self.bwd = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.bwd, pool=pool, stream=stream):
                grads = torch.autograd.grad(self.y, grad_of, self.gy, allow_unused=True)
                self.gx = grads[0]
                self.shapes = [p.shape for p in self.params]
                self.flat = torch.cat([
                    (torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(self.params, grads[1:])
                ])  # fmt: skip
        finally:
            if collecting:
                gc.enable()

    def serves(self, params: list[nn.Parameter]) -> bool:
        """Whether the captured parameters are still these, where they were (`model.to(...)`, a reassigned or
        frozen weight: no)."""
        return len(params) == len(self.params) and all(
            p is q and p.data_ptr() == ptr for p, q, ptr in zip(params, self.params, self.ptrs)
        )

    def load(self, x: torch.Tensor, lengths, cos: torch.Tensor, sin: torch.Tensor) -> int:
        """Copy a batch in and replay the forward; returns the replay's generation."""
        rows = x.shape[0]
        meta = torch.from_numpy(static_meta(lengths, self.key, self.block_sizes))
        with torch.no_grad():
            self.x[:rows].copy_(x)
            self.cos[:rows].copy_(cos)
            self.sin[:rows].copy_(sin)
            self.meta.copy_(meta.pin_memory() if self.meta.is_cuda else meta, non_blocking=True)
        self.fwd.replay()
        self.generation += 1
        return self.generation

    def backward(self, gy: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Replay the backward for the rows' gradient gy -> (dx for those rows, each parameter's gradient)."""
        rows = gy.shape[0]
        self.gy[:rows].copy_(gy)
        self.gy[rows:].zero_()
        self.bwd.replay()
        flat = self.flat.clone()  # a later backward replays into the static buffer
        grads = [g.view(s) for g, s in zip(flat.split([s.numel() for s in self.shapes]), self.shapes)]
        return self.gx[:rows].clone(), grads


class _Replay(torch.autograd.Function):
    """The stack's output rows from a replay; its backward replays the backward graph (or recomputes eagerly where
    a later forward replaced this one's activations)."""

    @staticmethod
    def forward(ctx, graph: TrainGraph, eager, lengths, cos, sin, x, *params):
        ctx.graph, ctx.eager, ctx.lengths, ctx.tables = graph, eager, lengths, (cos, sin)
        ctx.generation = graph.load(x, lengths, cos, sin)
        ctx.save_for_backward(x)
        return graph.y[: x.shape[0]].clone()

    @staticmethod
    @torch.compiler.disable
    def backward(ctx, gy):
        graph = ctx.graph
        if ctx.generation == graph.generation:
            gx, grads = graph.backward(gy)
        else:  # this forward's activations were replaced by a later replay: recompute the stack
            (x,) = ctx.saved_tensors
            with torch.enable_grad():
                x = x.detach().requires_grad_()
                y = ctx.eager(x, *ctx.tables)
                gx, *grads = torch.autograd.grad(y, [x, *graph.params], gy, allow_unused=True)
        return (None, None, None, None, None, gx, *grads)


class TrainGraphs:
    """One stack's (`holder`'s) training graphs by key, captured where batches recur (`RECUR`), at most
    `MAX_GRAPHS`."""

    def __init__(self, holder: StackModule):
        self.holder = holder
        self.seen: dict[TrainGraphKey, int] = {}
        self.graphs: dict[TrainGraphKey, TrainGraph] = {}
        self.failed: str | None = None

    def run(self, x, lengths, config, head_dim: int, cos, sin):
        """The stack's output rows for packed x (rows, D) of a batch of `lengths` through its key's graph, or None
        where none serves it (then the caller runs eagerly)."""
        holder = self.holder
        params = holder.trained()
        if self.failed is not None or not params:
            return None
        key = graph_key(x.shape[0], len(lengths))
        graph = self.graphs.get(key)
        if graph is not None and not graph.serves(params):
            del self.graphs[key]
            graph = None
        if graph is None:
            self.seen[key] = count = self.seen.get(key, 0) + 1
            if count < RECUR or len(self.graphs) >= MAX_GRAPHS:
                return None
            graph = self._capture(holder, key, config, head_dim, x)
            if graph is None:
                return None

        def eager(xx, c, s):
            from ..ragged.layout import Layout

            return holder(xx, Layout.make(tuple(lengths)), config, (c[None], s[None]))

        return _Replay.apply(graph, eager, tuple(lengths), cos, sin, x, *params)

    def _capture(self, holder, key, config, head_dim, x) -> TrainGraph | None:
        free, total = torch.cuda.mem_get_info(x.device)
        need = max((g.bytes for g in self.graphs.values()), default=0)
        if free - need < MEMORY_LEFT * total:
            return None  # (the next recurring key may be a smaller one)
        before = torch.cuda.memory_allocated(x.device)
        try:
            graph = TrainGraph(holder, key, config, head_dim, x)
            graph.capture(torch.cuda.graph_pool_handle())  # a pool of its own: no other graph reuses its memory
        except torch.OutOfMemoryError:
            self.failed = f"out of memory capturing a training graph of {key.rows} rows"
            log.warning("autoragged: %s; training runs eagerly from now on", self.failed)
            torch.cuda.empty_cache()
            return None
        graph.bytes = torch.cuda.memory_allocated(x.device) - before
        self.graphs[key] = graph
        log.info("autoragged: captured a training graph of %d rows, %d components", key.rows, key.components)
        return graph
