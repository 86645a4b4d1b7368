"""CUDA-graph arms: each arm captured per shape bucket and replayed.

On the short rows of the benchmark of record the GPU work of a batch is tens of microseconds and the
eager arms spend about a millisecond launching kernels; a replay launches the whole encoder at once.

ragged_graph: the layout, pack, the encoder layers on static values of `rows` bucket rows, and unpack,
    captured together. The graph builds its layout (offsets, lengths, prelude; one static int32 buffer)
    from the batch's lengths (kernels/graph_layout.py), pack reads the caller's padded input and unpack
    writes a fresh output through pointers (kernels/ragged_pack.py, indirect forms). Per batch: those
    arguments (pointers, strides, sizes, lengths) written into a slot of a pinned ring, which the graph's
    first kernel reads (kernels/graph_args.py), and the replay; no host->device copy, no sync, no copy of
    the input in or of the output out, no Triton launch from Python. Spare components have length 0;
    spare attention programs see a grid_mapping of -1 and exit.
    The bucket's spare rows: Triton linears and norms (KernelConfig.backend "triton") stop at the rows
    the batch fills, which the layout holds on the device (`Layout.live`); cuBLAS computes them too (it
    needs its row count on the host), and nothing reads them. A graph with cuBLAS linears holds its rung's
    rows or one more, whichever replayed faster when the bucket was first captured (`_ROW_CHOICE`).
    io="mask": a mask-only batch whose lengths are never read (the shape was judged to win without them):
    the graph counts each row's real tokens from the mask, builds the layout from those counts and packs
    the tokens, in any padding pattern, back to back (kernels/masked_pack.py), in values with room for
    batch x padded-bucket rows. Only the device knows how many rows the batch fills, so the linears are
    our Triton kernel (cuBLAS needs the row count on the host) and they and the norms read that count
    and stop there (`Layout.live`): the work is that of the real tokens, as with io="padded". Where CUDA graphs
    take SWITCH nodes the graph also holds the layers with cuBLAS linears on a few rungs of rows around the
    tokens its batches bring, and a kernel in the graph picks the branch the counted rows fit (`_Rungs`). Nothing
    synchronises. A body whose pooler reads column 0 (`first_column`) gets a left-padded row's column 0, a
    pad the original computes, as one more, query-only row (kernels/masked_pack.py, `mask_pass`).
padded_graph: the original module captured on a static (B, bucket length) input with the key padding
    mask computed in the graph from static lengths (io="lengths"), or copied in from the caller's mask
    (io="mask": no lengths needed, any padding pattern, the graph also counts each row's pads);
    PyTorch's nested-tensor conversion is off during capture (it synchronises, so it cannot be
    captured). Per batch: copy in (the lengths through a pinned slot, as the ragged graph's args), replay,
    copy out.

Everything a graph reads must outlive it: static buffers live on the graph object, and the capture
closure is kept with the graph (a buffer only the closure held was freed after capture and reused by
the next allocation: the padded graph's replays went wrong, error ~4, until 2026-11-22). The closure holds
the buffers, never the graph object, so no reference cycle keeps an evicted graph for the garbage
collector, and the collector is off during a capture: a collection that destroyed some unreachable graph
mid-capture made the capture fail (CUDA forbids it), and the bucket then ran eagerly for good.

A graph's static buffers (its args, layout and values) serve every replay of it, so a wrapped module's
batches must follow one another on one stream (a replay's args fetch is ordered after the previous replay
only there); calling one wrapped module from several streams at once is not supported. The tensors a ragged
replay reads and writes through pointers are used like any kernel's arguments on the current stream.
"""

from __future__ import annotations

import functools
import gc
import os

import torch

from .._ragged import _zero_pads
from ..kernels import graph_args, graph_layout, masked_pack, ragged_pack

__all__ = ["record_event", "event_done", "event_pending", "mask_pass"]


class _StaticLayout:
    """What the ragged kernels read of a layout, as views of one static int32 buffer. `live` (as on
    `Layout`): None, or a device view of the rows the batch fills."""

    def __init__(self, meta: torch.Tensor, batch: int, programs: int, block_m: int, align: int, max_len: int):
        self.offsets, self.lengths, self.grid_mapping, self.block_offsets = graph_layout.sections(meta, batch, programs)
        self.block_m, self.align, self.max_len = block_m, align, max_len
        self.live = self.tile_rows = None
        # io="mask" for a first-token pooler: each row's keys (its rows past them are queries only)
        self.key_lengths = None

    def device_meta(self, device):
        return self.offsets, self.lengths

    def prelude(self, block_m, device):
        if block_m != self.block_m:
            raise ValueError(f"this graph was captured for block_m={self.block_m}, asked for {block_m}")
        return self.grid_mapping, self.block_offsets


class _ArgsMailbox:
    """The pinned ring a graph's first kernel fetches its per-batch args from (kernels/graph_args.py): per
    batch the host writes a slot (a numpy store), replays, and records the slot's event; a slot is written
    again only once the replay that read it has completed. No host->device copy is launched: the copy and
    its event took 15-17 us of host time on the H100 host, a post 3 (benchmarks/results/short_rows_host_steps*).
    The check is the C-level event query, with a wait only if the host is a whole ring of replays ahead
    (under cProfile on the H100 host, the `Event.synchronize` it replaced took 20 us per call on work long
    done, 2026-11-23)."""

    def __init__(self, n_args: int, device, slots: int = 8):
        index = torch.device(device).index
        self.ring = torch.zeros(slots, n_args + 1, dtype=torch.int64).pin_memory()
        self.array = self.ring.numpy()
        self.args = torch.zeros(n_args, dtype=torch.int64, device=device)
        self.state = torch.zeros(2, dtype=torch.int64, device=device)  # [last stamp fetched, replays unposted]
        self.events = [torch.cuda.Event() for _ in range(slots)]
        self.used = [False] * slots
        self.filled = [0] * slots  # args of each slot that may be non-zero (see post)
        self.stamp, self.last, self.newest = 0, (), None
        self.index = torch.cuda.current_device() if index is None else index

    def post(self, values: tuple) -> int:
        """Write `values` (zeros after them) into the slot of the next stamp; returns the slot, for `sent`."""
        stamp = self.stamp + 1
        slot = stamp % len(self.events)
        if self.used[slot]:
            event_done(self.events[slot])
        n, row = len(values), self.array[slot]
        if n >= len(row):
            raise ValueError(f"{n} args do not fit this graph's {len(row) - 1}")
        row[1 : n + 1] = values
        if self.filled[slot] > n:
            row[n + 1 : self.filled[slot] + 1] = 0
        self.filled[slot] = n
        row[0] = stamp
        self.last = values
        return slot

    def sent(self, slot: int) -> None:
        """The replay that fetches `slot` is queued: the stamp is taken, and the slot is free once it completes."""
        self.stamp += 1
        record_event(self.events[slot], self.index)
        self.used[slot] = True
        self.newest = slot

    def __del__(self):
        """Keep the ring until the last replay that may read it has completed: PyTorch's pinned allocator
        hands a freed block out again at once (it waits only for copies it saw, not for a kernel's reads),
        and a graph dropped with replays still queued (`clear()`, parameters moved) would otherwise have
        them read whatever the next pinned allocation wrote there. A wait happens only if that replay is still
        queued: at a drop, off the steady hot path (an eviction comes after a capture, which synchronised)."""
        if self.newest is not None:
            try:
                event_done(self.events[self.newest])  # replays complete in stream order: the newest is last
            except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone; nothing is queued then
                pass

    def fetch(self) -> None:
        """The graph's first node (or an eager run's first kernel): args from the slot of the next stamp."""
        graph_args.fetch(self.ring, self.args, self.state)


_current_stream = getattr(torch._C, "_cuda_getCurrentStream", None)  # (stream_id, device_index, device_type)
_EVENT = getattr(torch._C, "_CudaEventBase", None)
_record = getattr(_EVENT, "record", None)  # Event.record minus the lookup
_query = getattr(_EVENT, "query", None)
_STREAMS: dict[tuple, torch.cuda.Stream] = {}


def record_event(event: torch.cuda.Event, device_index: int) -> None:
    """event.record() on the current stream of `device_index`. Event.record() looks the stream up through
    several Python layers (~30 us of host time on the H100 host); the C lookup and a cached Stream
    object cost about 2 us."""
    if _current_stream is None or _record is None:  # a torch without these internals: the plain way
        event.record()
        return
    ident = _current_stream(device_index)
    stream = _STREAMS.get(ident)
    if stream is None:
        stream = _STREAMS[ident] = torch.cuda.Stream(stream_id=ident[0], device_index=ident[1], device_type=ident[2])
    _record(event, stream)


def event_done(event: torch.cuda.Event) -> None:
    """Return once the work before `event` has completed: a query, and a wait only if it has not."""
    if not (_query(event) if _query is not None else event.query()):
        event.synchronize()


def event_pending(event: torch.cuda.Event) -> bool:
    """True while the work before `event` has not completed (a query: never waits)."""
    return not (_query(event) if _query is not None else event.query())


def mask_pass(values_fn, args, meta, values, layout, batch, programs, config, causal, width, rungs=None):
    """What a ragged graph fed a mask runs (io="mask"), on the batch `args` points at (kernels/masked_pack.py):
    the layout counted from the mask, pack, the layers (`values_fn`, a body's `values`), unpack. A layout with
    `key_lengths` (a body's `first_column`) adds a left-padded row's column 0 as a query-only row. With
    `rungs` (`_Rungs`) the layers and the unpack run in the branch the counted rows pick: cuBLAS linears on a
    rung's rows, or the Triton linears on all of them. Returns each row's pads over `width` columns (for the
    decision record)."""
    first = layout.key_lengths is not None
    graph_layout.layout(args, meta, batch, programs, config.block_m, 1, from_mask=True, first_column=first)
    masked_pack.pack_masked(args, values, layout.offsets, batch, width, first)

    def branch(rows: int | None, branch_config) -> None:
        out = values_fn(values if rows is None else values[:rows], layout, branch_config, causal)
        # (a rung's branch runs only for a batch whose rows fit its rung)
        masked_pack.unpack_masked(args, out, layout.offsets, batch, width, first, fits=rows is not None)

    if rungs is None:
        branch(None, config)
    else:
        rungs.run(layout.live, [functools.partial(branch, *b) for b in rungs.branches(config)])
    return width - (layout.key_lengths if first else layout.lengths)


def mask_rungs_supported() -> bool:
    """Whether ragged graphs fed the mask may hold cuBLAS branches (`_Rungs`) in this process: PyTorch built
    with CUDA 12.4+ (conditional graph nodes), whose CUDAGraph can keep its graph, and AUTORAGGED_MASK_RUNGS not
    "0". The device's own check (a CUDA 12.8+ driver for SWITCH nodes, NVRTC: `_cuda_if.why_not`) comes at the
    first capture."""
    cuda = torch.version.cuda
    version = tuple(int(p) for p in cuda.split(".")[:2]) if cuda else (0, 0)
    return (
        os.environ.get("AUTORAGGED_MASK_RUNGS", "1") != "0" and version >= (12, 4)
        and hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph")
    )  # fmt: skip


class _Rungs:
    """The branches of a ragged graph fed the mask: cuBLAS linears on each of a few rungs of rows, and the
    Triton linears (which stop at the counted rows) for a batch that fits none. Only the device knows how many
    rows a batch fills, and cuBLAS needs its row count on the host; so each branch is captured as a graph of its
    own, and the ragged graph holds them as the branches of one SWITCH node (CUDA 12.8+, runtime/_cuda_if.py),
    one kernel in the graph picking the branch from the counted rows: the graph does the cuBLAS graph's work on
    the rung's rows without reading the lengths. On bert-base the replay then took what the cuBLAS graph fed
    lengths takes, within -10% to +5% (the Triton linears alone: +5% to +27%; H200, 2026-11-26).
    `rungs`: (lowest, rows) per branch (`_buckets.mask_rungs`); a batch of T rows takes the branch with
    lowest < T <= rows, else the Triton one. `run`: the rows each branch's layers run (its rung's or one more:
    graphs.py `branch_rows`; default the rungs'). Outside a capture the branches run eagerly: all of them in the
    warm-up run (`eager="all"`, compiling each one's kernels and making cuBLAS's handles before the capture; the
    branches are kept for `capture_bodies`), or only the one picked (`eager="taken"`: a sync; the CPU tests)."""

    def __init__(self, rungs, device, eager: str = "all", run=None):
        self.rows = tuple(run) if run else tuple(r for _, r in rungs)
        if len(self.rows) != len(rungs) or any(not high <= n for (_, high), n in zip(rungs, self.rows)):
            raise ValueError(f"each branch must run at least its rung's rows: rungs {rungs}, rows {self.rows}")
        self.bounds_host = tuple(tuple(b) for b in rungs)
        self.bounds = torch.tensor(rungs, dtype=torch.int32, device=device).reshape(-1, 2)
        self.taken = torch.zeros(1, dtype=torch.int32, device=device)  # the branch the last replay ran
        self.eager = eager
        self.capturing = False  # `_warm_and_capture` sets it for the capture of the graph that holds the branches
        self.fns = None  # the branches of the last eager run (`capture_bodies` captures them)
        self.bodies = None  # their graphs, for the capture

    def holds(self, rows: int) -> bool:
        """Whether a batch of `rows` counted rows takes a cuBLAS branch."""
        return any(low < rows <= high for low, high in self.bounds_host)

    def branches(self, config):
        """(rows or None for all, the branch's config) per branch, the Triton one last."""
        cublas = config.replace(backend="cublas")
        return [*((rows, cublas) for rows in self.rows), (None, config)]

    def run(self, live: torch.Tensor, fns) -> None:
        """The branches `fns` (one per `branches`) on a batch whose counted rows are live[0]: in the capture,
        the conditional nodes (their bodies captured by `capture_bodies`); outside, eagerly (see the class)."""
        if self.capturing:
            from . import _cuda_if

            _cuda_if.add_branches(live[:1], self.bounds, self.taken, [g.raw_cuda_graph() for g in self.bodies])
            return
        self.fns = fns
        if self.eager == "all":
            for fn in reversed(fns):  # (the most rows first: see capture_bodies)
                fn()
        else:
            from ._cuda_if import pick_branch_ref

            pick = pick_branch_ref(int(live[0]), self.bounds_host)
            self.taken.fill_(pick)
            fns[pick]()

    def capture_bodies(self, pool, capture_error_mode: str) -> None:
        """Capture each branch of the last eager run as a graph of its own (kept for the conditional nodes), on
        `pool`: the branches run one at a time, so each one's buffers may take the memory another's left. The
        most rows first (the Triton branch, then the rungs downwards), so that a smaller branch's buffers may fit
        in the larger one's blocks. The memory is still several times the Triton graph's alone: for bert-base at
        128 x 128 rows, 2.3 GB reserved (2.8 in ascending order) against 0.7 (H200, 2026-11-26)."""
        bodies: list = [None] * len(self.fns)
        for i in reversed(range(len(self.fns))):
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            graph.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
            try:
                self.fns[i]()
            finally:
                graph.capture_end()
            bodies[i] = graph
        self.bodies, self.fns = bodies, None

    def release(self) -> None:
        """After the capture: the conditional nodes hold copies of the bodies."""
        self.bodies = self.fns = None
        self.capturing = False


class _RaggedGraph:
    """io="padded": the layout, pack, layers and unpack in the graph; pack reads the caller's padded input
    and unpack writes a fresh output, both through the pointers of the per-batch args (no copy in or out).
    io="values": the layout and the layers, for RaggedTensor inputs (copy values in and out).
    Per batch, the args (pointers, strides, sizes and lengths) go through `replay`: a pinned slot the
    graph's first kernel reads."""

    def __init__(
        self, runtime, module, config, causal: bool, key, dtype, device, pool, tile_rows=None, rungs=(), rung_rows=None
    ):  # fmt: skip
        rows, batch, max_len, io = key[0], key[1], key[2], key[5]
        # io="mask" or "padded": None (the graph packs the caller's x), or "ids" / "ids_tt": the graph runs the
        # body's embedding step itself on static token ids (and token types), which `run_mask_ids` or
        # `run_padded_ids` fills per batch (the host launches no embedding step: 0.2-0.4 ms of host time on HF
        # bert-base, which a mask read waited for; H100, 2026-11-25, benchmarks/mask_path.py)
        self.inputs = key[6] if len(key) > 6 else None
        body = runtime.body
        D = body.d_model
        self.config, self.batch, self.rows, self.io = config, batch, rows, io
        self.rungs = None
        self.dtype, self.device, self.batch_first, self.d_model = dtype, device, body.batch_first, D
        index = torch.device(device).index  # compared with x.get_device(): cheaper than building x.device
        self.index = torch.cuda.current_device() if index is None else index
        # io="mask": the columns `pads` counts over (the padded bucket length); io="padded": the bucket's longest
        # component, the columns the unpack's grid covers
        self.width = max_len
        programs = self.programs = rows // config.block_m + batch
        # The capture closure holds the buffers, never `self`: no reference cycle, so an evicted graph is
        # freed at once (a cycle left it to the garbage collector, which could run it mid-capture).
        values = self.values = torch.zeros(rows, D, dtype=dtype, device=device)
        # io="mask" for a body whose pooler reads column 0 (`first_column`): a left-padded row's column 0 is a
        # query-only row of its own (kernels/masked_pack.py), so the pooler reads what the original pools
        first = io == "mask" and body.first_column
        size = graph_layout.meta_size(batch, programs, first)
        meta = self.meta = torch.zeros(size, dtype=torch.int32, device=device)
        # The warm-up run fetches a posted batch of no components (all zeros), so nothing is read or written
        # through its pointers; each replay fetches its own batch first (kernels/graph_args.py).
        n_args = masked_pack.MASK_ARGS if io == "mask" else ragged_pack.ARGS_HEAD + batch
        mailbox = self.mailbox = _ArgsMailbox(n_args, device)
        args = self.args = mailbox.args
        layout = self.layout = _StaticLayout(meta, batch, programs, config.block_m, config.align, max_len)
        layout.live = layout.offsets[batch:]  # the rows the batch fills: Triton linears and norms stop there
        layout.tile_rows = tile_rows
        if first:
            layout.key_lengths = graph_layout.key_lengths(meta, batch, programs)
        values_fn, block_m, align = body.values, config.block_m, config.align

        if io == "values":

            def run():
                mailbox.fetch()
                graph_layout.layout(args, meta, batch, programs, block_m, align)
                return values_fn(values, layout, config, causal)

        elif io == "mask":  # rows = batch * width: room for any mask; the batch's tokens fill the first rows
            width, embed_ids = max_len, self._embed_step(module, body, batch, max_len, D, device)
            # cuBLAS branches on rungs of rows (`_Rungs`), each a conditional node; () for the Triton linears alone
            switch = self.rungs = _Rungs(rungs, device, run=rung_rows) if rungs else None

            def run():
                mailbox.fetch()
                if embed_ids is not None:
                    embed_ids()
                return mask_pass(values_fn, args, meta, values, layout, batch, programs, config, causal, width, switch)

        else:  # io="padded": pack the caller's x, or the embeddings of static token ids (`run_padded_ids`)
            extent, embed_ids = -(-max_len // align) * align, self._embed_step(module, body, batch, max_len, D, device)

            def run():
                mailbox.fetch()
                graph_layout.layout(args, meta, batch, programs, block_m, align)
                if embed_ids is not None:  # pack reads them through the args' pointer, as it reads a caller's x
                    embed_ids()
                ragged_pack.pack_from(args, values, layout.offsets, layout.lengths, extent)
                out = values_fn(values, layout, config, causal)
                ragged_pack.unpack_to(args, out, layout.offsets, layout.lengths, max_len)

        slot = mailbox.post(())  # for the warm-up run; the capture itself runs nothing
        _warm_and_capture(self, run, device, pool)
        mailbox.sent(slot)
        if io == "mask":
            self.pads = self.output
        if self.inputs is not None:
            self.x = self._made["x"]  # the captured run's embeddings: the replays write them in place
            del self._made

    def _embed_step(self, module, body, batch: int, width: int, D: int, device):
        """With `inputs` ("ids" / "ids_tt"): the static token ids (and types) the replays fill, and the graph's
        step that runs the body's embedding module on them ((batch, width, D), kept in `_made` for `self.x`);
        else None. The step holds the buffers, never `self` (the capture closure must not)."""
        if self.inputs is None:
            return None
        embed, made = body.embed, {}
        ids = self.ids = torch.zeros(batch, width, dtype=torch.long, device=device)
        types = self.types = torch.zeros_like(ids) if self.inputs == "ids_tt" else None
        self._made = made

        def embed_ids():
            made["x"] = x = embed(module, {"input_ids": ids, "token_type_ids": types})
            if x.shape != (batch, width, D) or x.stride(2) != 1:
                raise ValueError(f"the embeddings came out {tuple(x.shape)}, not ({batch}, {width}, {D})")

        return embed_ids

    def replay(self, values: tuple | None = None) -> None:
        """Replay on the batch of args `values` (the head, then any lengths; () for no batch, None for the
        last batch's again: its tensors must still be alive). Every replay must go through here or `run_*`:
        a bare `graph.replay()` posts nothing, so it takes the next batch posted before it runs, leaving
        that batch's replay none (kernels/graph_args.py); `mailbox.state[1]` counts such misses."""
        mailbox = self.mailbox
        slot = mailbox.post(mailbox.last if values is None else values)
        self.graph.replay()
        mailbox.sent(slot)

    def _check(self, name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
        if t.dtype != dtype or t.get_device() != self.index or t.stride(-1) != 1 or t.shape != shape:
            raise ValueError(
                f"the graph needs a {dtype} {name} of shape {shape} on {self.device} with stride 1 on the last "
                f"dim, got {t.dtype} on {t.device}, shape {tuple(t.shape)}, strides {t.stride()}"
            )

    def _io(self, x: torch.Tensor) -> tuple[tuple, torch.Tensor]:
        """(the args' head for input x as the module takes it, a fresh output of x's shape): the graph reads
        x and writes the output through their pointers, with the strides of batch-major (B, L, D) views
        (computed, not built: two views cost more host time than the rest of this step)."""
        if x.dim() != 3 or x.shape[2] != self.d_model or x.dtype != self.dtype or x.get_device() != self.index:
            raise ValueError(
                f"the graph needs a {self.dtype} input (B, L, {self.d_model}) or (L, B, {self.d_model}) on "
                f"{self.device}, got {x.dtype} on {x.device}, shape {tuple(x.shape)}"
            )
        if x.stride(2) != 1:
            x = x.contiguous()
        # empty_like skips parsing a shape, dtype and device: ~3 us less than torch.empty(...) per call
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        sx, so = x.stride(), out.stride()
        if self.batch_first:
            head = (x.data_ptr(), out.data_ptr(), sx[0], sx[1], so[0], so[1], x.shape[0], x.shape[1])
        else:
            head = (x.data_ptr(), out.data_ptr(), sx[1], sx[0], so[1], so[0], x.shape[1], x.shape[0])
        return head, out

    def run_padded(self, x: torch.Tensor, lengths) -> torch.Tensor:
        """The output of the batch x (as the module takes it) of host `lengths`; pads are zeros."""
        head, out = self._io(x)
        self.replay((*head, *lengths))
        if head[7] > self.width:  # padded past the bucket's longest component: columns the unpack's grid misses
            (out[:, self.width :] if self.batch_first else out[self.width :]).zero_()
        return out

    def run_padded_ids(self, ids: torch.Tensor, types: torch.Tensor | None, lengths) -> torch.Tensor:
        """io="padded" with the embeddings in the graph (`inputs`): the output of the batch of token ids (B, L)
        int64 (and token types for inputs "ids_tt", None meaning zeros) of host `lengths`; pads are zeros. The
        first min(L, width) columns are copied into the static ids (the real tokens lie there: width is the
        bucket's longest component); the rest keep an earlier batch's, which no real token reads (positions
        come from the columns or from the ids before them), nor do the bucket's spare rows (length 0)."""
        B, L = ids.shape
        if B > self.batch or ids.get_device() != self.index:
            raise ValueError(f"this graph runs batches of up to {self.batch} rows on {self.device}, "
                             f"got ids {tuple(ids.shape)} on {ids.device}")  # fmt: skip
        n = min(L, self.width)
        self.ids[:B, :n].copy_(ids[:, :n])
        if self.types is not None:  # no token types given: zeros, the embeddings' own default
            self.types[:B, :n].copy_(types[:, :n]) if types is not None else self.types.zero_()
        x = self.x
        out = torch.empty((B, L, self.d_model), dtype=self.dtype, device=x.device)
        sx, so = x.stride(), out.stride()
        self.replay((x.data_ptr(), out.data_ptr(), sx[0], sx[1], so[0], so[1], B, L, *lengths))
        if L > self.width:
            out[:, self.width :].zero_()
        return out

    def run_mask(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """io="mask": the output of the batch x with its key padding mask (B, L) bool, True = pad, any
        pattern; no lengths needed, nothing synchronises. `self.pads` holds each row's pad count over
        `self.width` columns until the next replay."""
        head, out = self._io(x)
        B, L = head[6], head[7]
        if B != self.batch or L > self.width:
            raise ValueError(f"this graph runs batches of {self.batch} rows up to {self.width} long, got ({B}, {L})")
        mask = mask if mask.stride(-1) == 1 else mask.contiguous()
        self._check("mask", mask, (B, L), torch.bool)
        self.replay((*head, mask.data_ptr(), *mask.stride()))
        return out

    def run_mask_ids(self, ids: torch.Tensor, types: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
        """io="mask" with the embeddings in the graph (`inputs`): as `run_mask`, from the batch's token ids (B, L)
        int64 (and token types for inputs "ids_tt", None meaning zeros); they are copied into the static ids,
        whose columns past L keep an earlier batch's (no real token reads them: positions come from the columns
        or from the ids before them, and the mask covers L columns)."""
        B, L = ids.shape
        if B != self.batch or L > self.width or ids.get_device() != self.index:
            raise ValueError(f"this graph runs batches of {self.batch} rows up to {self.width} long on {self.device}, "
                             f"got ids {tuple(ids.shape)} on {ids.device}")  # fmt: skip
        self.ids[:, :L].copy_(ids)
        if self.types is not None:  # no token types given: zeros, the embeddings' own default
            self.types[:, :L].copy_(types) if types is not None else self.types.zero_()
        x = self.x
        out = torch.empty((B, L, self.d_model), dtype=self.dtype, device=x.device)
        sx, so = x.stride(), out.stride()
        mask = mask if mask.stride(-1) == 1 else mask.contiguous()
        self._check("mask", mask, (B, L), torch.bool)
        self.replay((x.data_ptr(), out.data_ptr(), sx[0], sx[1], so[0], so[1], B, L, mask.data_ptr(), *mask.stride()))
        return out

    def run_values(self, values: torch.Tensor, lengths) -> torch.Tensor:
        rows = values.shape[0]
        self.values[:rows].copy_(values)
        self.replay((0, 0, 0, 0, 0, 0, len(lengths), 0, *lengths))
        return self.output[:rows].clone()


class _PaddedGraph:
    """io="lengths": the key padding mask is built in the graph from static host-given lengths (`run`);
    io="mask": the caller's mask is copied into a static one (`run_mask`), so no lengths are needed and
    nothing synchronises; the graph also counts each row's pads for the decision record."""

    inputs = None  # (as _RaggedGraph's: it runs the module's own forward on x)

    def __init__(self, runtime, module, key, dtype, device, pool):
        batch, length, io = key[1], key[2], key[3]
        D = runtime.body.d_model
        self.batch_first, self.width = runtime.body.batch_first, length
        shape = (batch, length, D) if self.batch_first else (length, batch, D)
        x = self.x = torch.zeros(shape, dtype=dtype, device=device)
        # Everything the graph reads must outlive it: static buffers live on self, and the capture closure
        # holds them, never `self` (no reference cycle: an evicted graph is freed at once).
        if io == "mask":
            static_mask = self.mask = torch.ones(batch, length, dtype=torch.bool, device=device)  # True = pad
            self._filled_from = length  # mask[:, n:] is all True for every n >= this
        else:  # the lengths come through a pinned slot the graph's first kernel reads (kernels/graph_args.py)
            mailbox = self.mailbox = _ArgsMailbox(batch, device)
            lengths = self.lengths = mailbox.args
            positions = self.positions = torch.arange(length, dtype=torch.int64, device=device)
        forward, batch_first = runtime.body.padded_forward, self.batch_first

        def run():
            if io != "mask":
                mailbox.fetch()
            mask = static_mask if io == "mask" else positions[None, :] >= lengths[:, None]
            out = forward(module, x, mask)
            out = _zero_pads(out, mask, batch_first)
            # io="mask": each row's pad count, for the decision record
            return (out, mask.sum(1, dtype=torch.int32)) if io == "mask" else out

        # PyTorch's nested-tensor conversion synchronises (not capturable): off while capturing. The fused
        # encoder-layer fast path stays on (it captures and replays exactly: benchmarks/graph_check.py).
        nested = getattr(module, "use_nested_tensor", None)
        try:
            if nested is not None:
                module.use_nested_tensor = False
            slot = None if io == "mask" else mailbox.post(())  # the warm-up run's (no lengths: all pads)
            _warm_and_capture(self, run, device, pool)
            if slot is not None:
                mailbox.sent(slot)
        finally:
            if nested is not None:
                module.use_nested_tensor = nested
        if io == "mask":
            self.output, self.pads = self.output

    def run(self, x: torch.Tensor, lengths) -> torch.Tensor:
        L = x.shape[1] if self.batch_first else x.shape[0]
        slot = self.mailbox.post(lengths)
        if self.batch_first:
            self.x[:, :L].copy_(x)
        else:
            self.x[:L].copy_(x)
        self.graph.replay()
        self.mailbox.sent(slot)
        return (self.output[:, :L] if self.batch_first else self.output[:L]).clone()

    def run_mask(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x as the module takes it, mask (B, L) bool, True = pad (any pattern, not only right padding).
        Returns the output; `self.pads` holds each row's pad count over the bucket's `self.width` columns
        until the next replay."""
        L = mask.shape[1]
        if self.batch_first:
            self.x[:, :L].copy_(x)
        else:
            self.x[:L].copy_(x)
        self.mask[:, :L].copy_(mask)
        if L < self._filled_from:  # columns a longer batch wrote must read as pad again
            self.mask[:, L:].fill_(True)
        self._filled_from = L
        self.graph.replay()
        return (self.output[:, :L] if self.batch_first else self.output[:L]).clone()


# `torch.cuda.graph` synchronises the device, empties the caching allocator (whose blocks the next eager
# batches then allocate again) and the pinned host cache before every capture. A capture needs none of it:
# it records work, it runs none, and what the graph reads is ordered before its replays by the stream. So
# graphs are captured with `capture_begin` / `capture_end` on a capture stream of our own, while the GPU may
# still be running earlier batches; AUTORAGGED_CAPTURE_DRAIN=1 brings back `torch.cuda.graph` (for a
# comparison, or should a driver or PyTorch version need the drain). The allocator's cache is emptied first
# only when the device is short of free memory (the capture's pool could not grow, and during a capture the
# allocator cannot release cached blocks to make room).
_DRAIN = os.environ.get("AUTORAGGED_CAPTURE_DRAIN", "") == "1"
_LOW_MEMORY = 1 << 30  # bytes
_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _capture_stream(device) -> torch.cuda.Stream:
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    stream = _CAPTURE_STREAMS.get(index)
    if stream is None:
        stream = _CAPTURE_STREAMS[index] = torch.cuda.Stream(index)
    return stream


def _capture_branches(holder, pool) -> None:
    """A ragged graph with `_Rungs`: its branches, as the warm-up run left them, captured as graphs of their
    own for the conditional nodes of the capture that follows."""
    switch = getattr(holder, "rungs", None)
    if switch is not None:
        switch.capture_bodies(pool, "thread_local")
        switch.capturing = True


def _warm_and_capture(holder, run, device, pool) -> None:
    """One eager run on a side stream (compiles Triton kernels, creates cuBLAS handles), then the capture.

    The garbage collector is off meanwhile: a collection during capture that frees an unreachable CUDA
    graph (anyone's, held in a reference cycle) destroys it mid-capture, which CUDA forbids, and the
    capture fails (seen on the H100: "operation not permitted when stream is capturing", then cuBLAS
    failing). PyTorch no longer collects before a capture (torch.compiler.config.force_cudagraph_gc).
    The capture does not drain the device first (see _DRAIN)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), torch.inference_mode():
            run()
        torch.cuda.current_stream(device).wait_stream(stream)
        holder.graph = graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (the user's, say) do not invalidate this capture
        if _DRAIN:
            with torch.inference_mode(), torch.cuda.stream(_capture_stream(device)):
                _capture_branches(holder, pool)
            with torch.inference_mode(), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                holder.output = run()
        else:
            if torch.cuda.mem_get_info(device)[0] < _LOW_MEMORY:
                torch.cuda.empty_cache()
            with torch.inference_mode(), torch.cuda.stream(_capture_stream(device)):
                _capture_branches(holder, pool)
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    holder.output = run()
                finally:
                    graph.capture_end()
    finally:
        if collecting:
            gc.enable()
        if getattr(holder, "rungs", None) is not None:
            holder.rungs.release()  # (the conditional nodes hold copies of the branches' graphs)
    # The graph reads whatever `run` read; keep its closure (and all it holds) alive with the graph. A
    # buffer only the closure referenced was freed after capture and reused by later allocations: the
    # padded graph's mask positions did, and its replays went wrong after the next eager allocation.
    holder.keepalive = run
