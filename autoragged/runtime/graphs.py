"""The graph cache of a wrapped module: which CUDA graphs (runtime/capture.py) are kept, and when one is
captured.

Graphs of one module share one memory pool. What is kept: `cap` graphs when a count is given, else as many
as fit a memory budget (`GRAPH_MEMORY_FRACTION` of the device memory obtainable at the first capture; each
graph's bytes are the allocator's growth across its capture); least recently used out, evictions counted.
A failed capture is remembered with its reason and the batch runs eagerly. Parameters are read in place, so
in-place updates are seen by the next replay; parameters replaced by new storage invalidate every graph.

When to capture (`GraphCache._get`): never on a bucket's first sight (`min_seen`, 2). With the runtime's
predictions at hand (`costs`: the ms of the best eager arm and of the graph), only when the replays the
bucket's recurrence promises repay the capture: expected replays x (eager ms - graph ms) >= the capture's
estimated ms. Expected replays: the bucket's share of the module's recent graph lookups (counts decaying
with a half-life of `_HALF_LIFE` lookups) times a horizon of as many lookups as the module has made, at least
`_HORIZON_MIN` and at most the decay's window; with the horizon equal to the past this is the ski-rental rule
(capture once the saving forgone has reached the capture's cost), and the floor assumes a stream lasts a few
hundred batches more. Capture cost: the least of the recent captures of the same kind (ragged or padded, its
io, its linears, a cuBLAS graph's row choice) as a multiple of the eager arm's ms, times this batch's; the
first capture of a kind is left out and the least taken, because a capture that also compiled Triton kernels
(the first, mostly) costs far more than the next, and an estimate that high would decline every later
capture of the kind (none would come to lower it). Such a capture
happens after the batch's own eager run is queued (`capture_deferred`): no device drain before it (see
`capture._warm_and_capture`), so the GPU runs the batch while the host records the graph.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from .._buckets import mask_rungs, mask_tokens, mask_width, padded_bucket, ragged_bucket, widen_mask
from . import _cuda_if
from .capture import _PaddedGraph, _RaggedGraph, event_done, event_pending, mask_pass, record_event

__all__ = [
    "GraphCache", "GraphStats", "GRAPH_MEMORY_FRACTION", "record_event", "event_done", "event_pending", "mask_pass",
]  # fmt: skip

log = logging.getLogger("autoragged")

# The cuBLAS ragged graph's rows: its bucket's rung, or one row more, whichever replays faster. cuBLAS picks a
# GEMM kernel per problem shape, and on the H100 (CUDA 13.0 cuBLAS, 2026-11-23) it picked slower ones on many
# rungs (multiples of 128 rows) than on one row more: the graph of the 24-layer d_model-1024 encoder on a batch
# of 5,856 tokens replayed in 9.26 ms at its rung of 6,400 rows and 8.39 ms at 6,401. Over 18 buckets of three
# encoders the extra row took 0.91x-1.16x the time (geomean 0.98x), slower only under 1K rows
# (benchmarks/graph_rows.py).
# No fixed rule holds across shapes (nor, likely, devices and cuBLAS versions), so both are captured and
# timed, once per (rows, d_model, ff, layers, dtype, device) in a process: replays with no batch loaded, which
# compute every linear on every row and skip the rest (no component). The extra row must win by _ROW_MARGIN.
_ROW_CHOICE: dict[tuple, int] = {}
_ROW_MARGIN = 0.01
# The cuBLAS branches of a ragged graph fed the mask (capture.py `_Rungs`) run a rung's rows too, so they take the
# same choice: `_ROW_CHOICE`'s where a ragged graph of the rung was timed, else one made by timing one layer's
# linears on the rung's rows and on one more (`branch_rows`; a capture is too costly to make twice there, with
# up to 7 branches). At their rungs' rows alone, cuBLAS ran other, slower kernels than the ragged graph fed
# lengths ran on one row more: HF bert-base, CoLA B=64 (896 rows), its linears 0.58 ms a replay against 0.48,
# MNLI B=64 (2,944 rows) 1.05 against 0.93 (H100, 2026-11-26, `mask_gap_h100.json`).
_BRANCH_ROWS: dict[tuple, int] = {}


def linears_ms(linears: list, rows: tuple[int, ...], dtype, device, rounds: int = 3, reps: int = 2) -> list[float]:
    """GPU ms of `reps` runs of the cuBLAS `linears` ((weight, bias, epilogue activation), `Body.layer_linears`)
    on each count of `rows` (random inputs), the least of `rounds` interleaved rounds after one warm run each.
    Waits for the device (and the work queued before)."""
    from ..kernels.ragged_linear import cublas_linear

    inputs = {}
    generator = torch.Generator(device=device).manual_seed(0)  # (the caller's random streams are left alone)
    for w, _, _ in linears:
        if w.shape[1] not in inputs:
            x = torch.empty(max(rows), w.shape[1], dtype=dtype, device=device)
            inputs[w.shape[1]] = x.normal_(generator=generator)

    def run(n: int) -> None:
        for w, b, act in linears:
            cublas_linear(inputs[w.shape[1]][:n], w, b, act)

    with torch.no_grad():
        for n in rows:
            run(n)
        events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in rows]
                  for _ in range(rounds)]  # fmt: skip
        for round_events in events:
            for n, (start, end) in zip(rows, round_events):
                start.record()
                for _ in range(reps):
                    run(n)
                end.record()
        events[-1][-1][1].synchronize()
    return [min(r[i][0].elapsed_time(r[i][1]) for r in events) / reps for i in range(len(rows))]


def branch_rows(runtime, rows: int, capacity: int, dtype, device) -> int:
    """The rows a cuBLAS branch of rung `rows` runs in a ragged graph fed the mask of `capacity` rows: the rung,
    or one more, whichever its linears run faster (see _BRANCH_ROWS). Timed once per (rows, body dims, dtype,
    device) in a process; the rung itself where there is no room for one more or the body names no linears."""
    if rows >= capacity:
        return rows
    memo = (rows, *runtime.body.memo, dtype, device)
    known = _ROW_CHOICE.get(memo, _BRANCH_ROWS.get(memo))
    if known is not None:
        return known
    linears = runtime.body.layer_linears()
    if not linears:
        return rows
    ms = linears_ms(linears, (rows, rows + 1), dtype, device)
    choice = rows + 1 if ms[1] < ms[0] * (1 - _ROW_MARGIN) else rows
    log.debug("autoragged: a mask graph's branch of %d rows: its linears took %.3f ms, on %d rows %.3f ms: %d rows",
              rows, ms[0], rows + 1, ms[1], choice)  # fmt: skip
    if len(_BRANCH_ROWS) >= 4096:
        _BRANCH_ROWS.pop(next(iter(_BRANCH_ROWS)))
    _BRANCH_ROWS[memo] = choice
    return choice


def replay_ms(graphs: list, rounds: int = 2, reps: int = 3) -> list[float]:
    """GPU ms of `reps` back-to-back replays of each ragged graph on no batch (empty args: every linear on
    every row, nothing else), the least of `rounds` interleaved rounds after one warm replay each."""
    for g in graphs:
        g.replay(())
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in graphs]
              for _ in range(rounds)]  # fmt: skip
    for round_events in events:
        for g, (start, end) in zip(graphs, round_events):
            start.record()
            for _ in range(reps):
                g.replay(())
            end.record()
    events[-1][-1][1].synchronize()
    return [min(r[i][0].elapsed_time(r[i][1]) for r in events) / reps for i in range(len(graphs))]


# A GraphCache checks the storage of its module's parameters on every replay (the list comes from the
# runtime, re-listed only when a parameter or module was registered): this catches storage swapped under an
# existing Parameter too (`.data = ...`, `.to()`).
_data_ptr = torch.Tensor.data_ptr


# -- what the cache keeps, and when it captures (see the module docstring) ------------------------------------
# The constants below are not measured yet: the stream benchmark (benchmarks/stream_table.py) is what tells.
GRAPH_MEMORY_FRACTION = 0.1  # of the device memory obtainable at a module's first capture, for its graphs
_MIN_KEEP = 2  # graphs kept whatever their bytes
_HALF_LIFE = 1024  # graph lookups: a bucket's recurrence counts decay with this half-life (drift is followed)
_DECAY = 2.0 ** (-1.0 / _HALF_LIFE)
_HORIZON_MIN = 256  # lookups a stream is assumed to last at least, from any point on
_HORIZON_MAX = 1.0 / (1.0 - _DECAY)  # the window the decayed counts cover (~1,478 lookups)
# capture ms / eager ms before a capture of the kind was timed: a warm-up run and a capture, each about an
# eager run of host time, and the allocations; a cuBLAS graph whose row count is still to choose captures
# twice and replays 14 times (replay_ms)
_CAPTURE_PRIOR = {"single": 4.0, "rows": 12.0}
_COST_SAMPLES = 8
_MAX_SEEN = 4096  # recurrence entries kept (pruned of the faded ones beyond)
FIRST_SIGHT = "graph bucket seen for the first time (captured when it recurs)"
RARE = "graph bucket not seen often enough yet to capture"
NOT_WORTH = "graph not worth capturing yet (the bucket's recurrence does not repay a capture)"
CAPTURE_NEXT = "graph captured after this batch ran eagerly"
BOUND = "the graph memory bound is reached (no more captures)"


@dataclass
class GraphStats:
    """The CUDA graphs of one wrapped module (`autoragged.graph_stats`).

    graphs: kept now; kept_bytes: their bytes (each graph's allocator growth across its capture, an
    estimate); budget_bytes: the memory budget they must fit (None: a count `cap` was given, or nothing was
    captured yet); cap: the count cap given to `wrap(graph_cap=)`, or None; captures: capture attempts;
    capture_ms: host ms they took in all; failed: buckets whose capture failed; evictions: graphs dropped to
    fit the cap or budget; declined: batches that ran eagerly because a capture would not have paid;
    capture_cost: per kind, the capture's cost as a multiple of the eager arm's ms the policy uses now."""

    graphs: int = 0
    kept_bytes: int = 0
    budget_bytes: int | None = None
    cap: int | None = None
    captures: int = 0
    capture_ms: float = 0.0
    failed: int = 0
    evictions: int = 0
    declined: int = 0
    capture_cost: dict[str, float] = field(default_factory=dict)


def _memory(device) -> tuple[int, int]:
    """(allocated, reserved) bytes of PyTorch's caching allocator on `device`: host counters, no sync."""
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


def _budget_bytes(device, fraction: float) -> int:
    """`fraction` of what graphs could obtain: free device memory and what the allocator caches unused."""
    free = torch.cuda.mem_get_info(device)[0]
    allocated, reserved = _memory(device)
    return int(fraction * (free + reserved - allocated))


def _new_pool():
    return torch.cuda.graph_pool_handle()


_clock = time.perf_counter


class GraphCache:
    """The captured graphs of one wrapped module (see the module docstring).

    cap: keep at most this many graphs, or None: as many as fit `memory_fraction` of the device memory
    obtainable at the first capture; min_seen: a bucket is captured at its min_seen-th sight at the
    earliest (1: at once, whatever it costs: how the benchmarks and the tuner measure graph arms)."""

    def __init__(self, cap: int | None = None, min_seen: int = 2, memory_fraction: float = GRAPH_MEMORY_FRACTION):
        self.cap, self.min_seen, self.memory_fraction = cap, min_seen, memory_fraction
        self.budget_bytes: int | None = None  # set at the first capture when cap is None
        self.limit_bytes: int | None = None  # a bound on kept bytes set from outside (`autoragged.warmup`)
        self.graphs: OrderedDict[tuple, object] = OrderedDict()
        self.failed: dict[tuple, str] = {}
        # bucket -> [its decayed count of lookups, the lookup it was last counted at, its sightings]
        self.seen: dict[tuple, list] = {}
        self.lookups = 0
        self.pool = None
        self.captures = 0  # capture attempts so far (a call that captured is not a timing sample)
        self.capture_ms = 0.0
        self.evictions = 0
        self.declined = 0
        self.kept_bytes = 0
        self.costs: dict[str, deque[float]] = {}  # kind -> capture ms / eager ms of its recent captures
        self.kinds: set[str] = set()  # kinds captured once (that capture, compiles and all, is not a sample)
        self.deferred: tuple | None = None  # a capture to make once the batch's eager run is queued
        self.evicted_note = ""  # evictions of a capture made inside a lookup, for the batch's decision record
        self._ptrs: tuple[int, ...] | None = None
        # bumped whenever a graph leaves the cache (evicted, cleared, dropped for moved parameters): a caller
        # that kept a weak reference to a graph with the generation it saw may replay it without a lookup
        # while the generation holds (the dispatcher's trusted mask shapes)
        self.generation = 0

    def clear(self) -> None:
        """Drop every graph (the buckets' recurrence counts stay: they describe the stream, not the graphs)."""
        self._drop_all()
        self._ptrs = None

    def _drop_all(self) -> None:
        self.graphs.clear()
        self.kept_bytes = 0
        self.deferred = None
        self.pool = None  # PyTorch asserts when capturing into a pool whose graphs were all freed
        self.generation += 1

    def _check_params(self, params: list[torch.Tensor]) -> None:
        """Drop the graphs if any of the module's parameters (`Runtime._parameters`) moved to new storage."""
        ptrs = tuple(map(_data_ptr, params))
        if self._ptrs is not None and ptrs != self._ptrs and self.graphs:
            log.info("autoragged: parameters moved to new storage; dropping %d CUDA graphs", len(self.graphs))
            self._drop_all()
        self._ptrs = ptrs

    # -- recurrence and the capture's price ----------------------------------------------------------------
    def touch(self, key) -> list:
        """Count one lookup of bucket `key` (every lookup, replays included); returns its entry in `seen`."""
        t = self.lookups = self.lookups + 1
        entry = self.seen.get(key)
        if entry is None:
            if len(self.seen) >= _MAX_SEEN:
                self._prune(t)
            entry = self.seen[key] = [1.0, t, 1]
        else:
            entry[0] = entry[0] * _DECAY ** (t - entry[1]) + 1.0
            entry[1] = t
            entry[2] += 1
        return entry

    def _prune(self, t: int) -> None:
        """Forget the buckets whose counts faded below one lookup (then the older half, if that is not enough)."""
        kept = {k: e for k, e in self.seen.items() if k in self.graphs or e[0] * _DECAY ** (t - e[1]) >= 1.0}
        if len(kept) >= _MAX_SEEN // 2:
            kept = dict(sorted(kept.items(), key=lambda ke: ke[1][1])[-(_MAX_SEEN // 2) :])
        self.seen = kept

    def expected_replays(self, entry: list) -> float:
        """How often the bucket of `entry` (just counted) should come again: its share of the lookups before
        this one, times the horizon (see the module docstring)."""
        t = self.lookups
        total = (1.0 - _DECAY**t) / (1.0 - _DECAY)  # every lookup so far, decayed as the entries are
        share = (entry[0] - 1.0) / max(total - 1.0, 1.0)
        return share * min(max(t, _HORIZON_MIN), _HORIZON_MAX)

    def capture_cost_ms(self, kind: str, eager_ms: float) -> float:
        """The estimated host ms of capturing a graph of `kind` for a batch whose eager arm takes `eager_ms`."""
        ratios = self.costs.get(kind)
        ratio = min(ratios) if ratios else _CAPTURE_PRIOR["rows" if kind.endswith("+rows") else "single"]
        return ratio * eager_ms

    def worth(self, entry: list, kind: str, eager_ms: float, graph_ms: float, instead_ms: float | None = None) -> bool:
        """Whether capturing the bucket of `entry` pays: expected replays x ms saved >= the capture's ms. The
        saving is over the eager arm's ms, or over `instead_ms` where the batch has something else to run
        without a capture (a kept graph standing in); the capture's cost scales with the eager arm's ms."""
        saving = (eager_ms if instead_ms is None else instead_ms) - graph_ms
        if not saving > 0:
            return False
        replays = self.expected_replays(entry)
        cost = self.capture_cost_ms(kind, eager_ms)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("autoragged: graph bucket of %s: %.1f replays x %.3f ms saved vs %.1f ms to capture",
                      kind, replays, saving, cost)  # fmt: skip
        return replays * saving >= cost

    # -- lookups and captures --------------------------------------------------------------------------------
    def _get(self, key, make, device=None, kind="single", costs: tuple[float, ...] | None = None, min_seen=None):
        """(graph, note): a graph for `key`, or None with the reason it runs eagerly this time.

        costs: (ms of the best eager arm, ms of this graph[, ms of what runs instead]) as the runtime predicts
        them; given, the capture must pay (`worth`) and happens after the batch ran (`deferred`, then
        `capture_deferred`);
        None (the tuner, the benchmarks' forced arms): captured now, at the min_seen-th sight. kind: the
        capture's cost class (a string, or a callable that makes it). min_seen: this lookup's own (default: the
        cache's)."""
        entry = self.touch(key)
        graph = self.graphs.get(key)
        if graph is not None:
            self.graphs.move_to_end(key)
            return graph, None
        if key in self.failed:
            return None, f"graph capture failed earlier: {self.failed[key]}"
        if entry[2] < (self.min_seen if min_seen is None else min_seen):
            return None, FIRST_SIGHT if entry[2] == 1 else RARE
        if self.limit_bytes is not None and self.kept_bytes >= self.limit_bytes:
            return None, BOUND
        kind = kind() if callable(kind) else kind
        if costs is not None:
            if self.min_seen > 1 and not self.worth(entry, kind, *costs):
                self.declined += 1
                return None, NOT_WORTH
            self.deferred = (key, make, device, kind, costs[0])
            return None, CAPTURE_NEXT
        graph, note = self._capture(key, make, device, kind, None)
        if graph is not None and note:  # captured now and replayed: the batch's record names the evictions
            self.evicted_note = f"; {note} evicted ({'graph cap' if self.cap is not None else 'memory budget'})"
        return graph, (None if graph is not None else note)

    def capture_deferred(self) -> str:
        """Capture what `_get` deferred (the batch's eager run is queued by now); returns what the batch's
        decision record should add: evictions, or the failure."""
        key, make, device, kind, eager_ms = self.deferred
        self.deferred = None
        if key in self.graphs or key in self.failed:
            return ""
        graph, note = self._capture(key, make, device, kind, eager_ms)
        if graph is None:
            return f"; {note}"
        if note:
            return f"; {note} evicted ({'graph cap' if self.cap is not None else 'memory budget'})"
        return ""

    def _capture(self, key, make, device, kind: str, eager_ms: float | None):
        """(graph, "n graph(s)" evicted to keep it, or "") or (None, why the capture failed)."""
        if self.pool is None:
            self.pool = _new_pool()
        if self.cap is None and self.budget_bytes is None and device is not None:
            self.budget_bytes = _budget_bytes(device, self.memory_fraction)
        self.captures += 1
        before = _memory(device) if device is not None else (0, 0)
        t0 = _clock()
        try:
            # static buffers as plain tensors whatever mode the caller is in, so that replays may copy into
            # them under no_grad, inference_mode or neither (graph arms never run with autograd on)
            with torch.inference_mode(False), torch.no_grad():
                graph = make()
        except Exception as e:  # noqa: BLE001 - any capture failure means: run eagerly, say why
            torch.cuda.synchronize()
            reason = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__
            self.failed[key] = reason
            log.warning("autoragged: CUDA graph capture failed for bucket %s, running eagerly: %s", key, reason)
            return None, f"graph capture failed: {reason}"
        ms = (_clock() - t0) * 1e3
        after = _memory(device) if device is not None else (0, 0)
        graph.key, graph.capture_ms = key, ms
        graph.nbytes = max(after[0] - before[0], after[1] - before[1], 0)
        self.capture_ms += ms
        if kind not in self.kinds:
            self.kinds.add(kind)
        elif eager_ms is not None and eager_ms > 0 and math.isfinite(eager_ms):
            self.costs.setdefault(kind, deque(maxlen=_COST_SAMPLES)).append(ms / eager_ms)
        self.graphs[key] = graph
        self.kept_bytes += graph.nbytes
        evicted = self._evict()
        log.debug("autoragged: captured %s in %.1f ms (%d bytes); %d kept, %d bytes", kind, ms, graph.nbytes,
                  len(self.graphs), self.kept_bytes)  # fmt: skip
        return graph, (f"{evicted} graph{'s' if evicted > 1 else ''}" if evicted else "")

    def _over(self) -> bool:
        if self.cap is not None:
            return len(self.graphs) > self.cap
        return len(self.graphs) > _MIN_KEEP and self.budget_bytes is not None and self.kept_bytes > self.budget_bytes

    def _evict(self) -> int:
        """Drop least recently used graphs until the rest fit the cap or the budget; returns how many."""
        n = 0
        while len(self.graphs) > 1 and self._over():
            _, old = self.graphs.popitem(last=False)
            self.kept_bytes -= getattr(old, "nbytes", 0)
            n += 1
        if n:
            self.evictions += n
            self.generation += 1
        return n

    def stats(self) -> GraphStats:
        kinds = {k: min(v) for k, v in self.costs.items() if v}
        return GraphStats(len(self.graphs), self.kept_bytes, self.budget_bytes, self.cap, self.captures,
                          self.capture_ms, len(self.failed), self.evictions, self.declined, kinds)  # fmt: skip

    def ragged(
        self, runtime, module, config, causal, stats, rows_needed, dtype, device, io="padded", costs=None, inputs=None,
        min_seen=None,
    ):  # fmt: skip
        """The ragged graph of a batch of host lengths (`stats`, `rows_needed` values rows): io "padded" (it packs
        the caller's padded input, or with `inputs` "ids" / "ids_tt" (`Call.graph_inputs`) runs the body's
        embedding step itself: `run_padded_ids`) or "values" (a RaggedTensor's values). min_seen: the sight
        of the bucket it is captured at the earliest (default: the cache's)."""
        self._check_params(runtime._parameters(module))
        key = ("ragged", *ragged_bucket(rows_needed, stats.batch, stats.max_len), config, causal, io, inputs)

        def kind() -> str:
            timed = config.backend == "cublas" and (key[1], *runtime.body.memo, dtype, device) not in _ROW_CHOICE
            return f"ragged/{io}/{config.backend}" + ("+rows" if timed else "")

        make = lambda: self._ragged_rows(runtime, module, config, causal, key[1:], dtype, device)  # noqa: E731
        return self._get(key, make, device, kind, costs, min_seen)

    def _ragged_rows(self, runtime, module, config, causal, key, dtype, device) -> _RaggedGraph:
        """The ragged graph of bucket `key` (rows, batch, max_len, ...); with cuBLAS linears, of the bucket's
        rows or one more, whichever replays faster (see _ROW_CHOICE)."""
        make = lambda rows: _RaggedGraph(runtime, module, config, causal, (rows, *key[1:]), dtype, device, self.pool)  # noqa: E731
        if config.backend != "cublas":
            return make(key[0])
        memo = (key[0], *runtime.body.memo, dtype, device)
        rows = _ROW_CHOICE.get(memo)
        if rows is not None:
            return make(rows)
        best = make(key[0])
        try:
            second = make(key[0] + 1)
        except Exception as e:  # noqa: BLE001 - the second graph is an option (it may not fit in memory, say)
            torch.cuda.synchronize()  # capture time, after a failed capture (as GraphCache._get does)
            log.info("autoragged: ragged graph of %d rows kept without trying %d: %s: %s", key[0], key[0] + 1,
                     type(e).__name__, str(e).splitlines()[0][:160] if str(e) else "")  # fmt: skip
        else:
            ms = replay_ms([best, second])
            best = second if ms[1] < ms[0] * (1 - _ROW_MARGIN) else best
            log.debug("autoragged: ragged graph of %d rows replayed in %.3f ms, of %d in %.3f ms: %d rows",
                      key[0], ms[0], key[0] + 1, ms[1], best.rows)  # fmt: skip
        if len(_ROW_CHOICE) >= 4096:
            _ROW_CHOICE.pop(next(iter(_ROW_CHOICE)))
        _ROW_CHOICE[memo] = best.rows
        return best

    def ragged_mask(
        self, runtime, module, config, causal, batch, seq_len, dtype, device, tile_rows=None, costs=None, inputs=None,
        trusted=False,
    ):  # fmt: skip
        """The ragged graph of a mask-only (batch, seq_len) batch whose lengths are not read, with room for
        batch rows of `mask_width(seq_len)` (2 rungs an octave: the layers' work stops at the counted rows).
        `config` must name Triton linears (see io="mask"); `tile_rows`, the real rows its batches are expected
        to fill, picks the linears' tiles at capture and, where CUDA graphs take conditional nodes and the
        runtime's `mask_rungs` is on, the rungs of its cuBLAS branches (`_buckets.mask_rungs`, capture.py's
        `_Rungs`): a batch whose rows fit one runs cuBLAS linears on the rung's rows.
        `inputs`: None (it packs the caller's embeddings), or "ids" / "ids_tt" (`Call.graph_inputs`): it runs
        the body's embedding step itself (`run_mask_ids`). `trusted`: the lookup of a shape judged to win on
        this arm (runtime/unread.py), whose recurrence its verdict established already: captured at the first
        sight of the key, where a batch would otherwise read its mask once more."""
        if config.backend != "triton":
            raise ValueError(f"the mask graph's linears must be Triton kernels (they stop at the live rows): {config}")
        self._check_params(runtime._parameters(module))
        width = mask_width(seq_len)
        rungs = mask_rungs(tile_rows or 0, batch * width) if runtime.mask_rungs else ()
        if rungs and _cuda_if.why_not(device) is not None:  # (checked once a device: driver, NVRTC)
            log.info("autoragged: the mask graphs keep their Triton linears alone: %s", _cuda_if.why_not(device))
            runtime.mask_rungs, rungs = False, ()
        base = ("ragged", batch * width, batch, width, config, causal, "mask", inputs)
        # a kept graph that serves the batch: of this width or a wider one (up to 2x: the layers stop at the
        # counted rows, the spare columns cost the embedding step's few microseconds), with cuBLAS branches one
        # whose rungs hold the expected tokens. Captured per width alone, a stream whose batches straddled two
        # widths captured the narrower one mid-stream, 83-111 ms with its branches (HF bert-base, MNLI and MRPC
        # B=64 at width 96 beside 128: 3.2 ms a batch against 1.6-2.0 with lengths=; H100, 2026-11-26)
        key = self.mask_serving(batch, width, tile_rows or 0, bool(rungs), base)
        if key is None:
            # a new graph: as wide as the widest length bucket this batch size's mask-only batches have reached (up
            # to 2x, and within the rows that keep the branches), so that it serves them too. SQuAD B=32's stream met
            # width 512 after its warm-up had captured 368: another capture, 164 ms of a 64-batch stream (HF
            # bert-base; H100, 2026-11-26)
            own = width
            widths = (mask_width(k[1]) for k in getattr(runtime, "mask_shapes", ()) if k[0] == batch)
            wide = max((w for w in widths if w <= 2 * width), default=width)
            if wide > width and (not rungs or mask_rungs(tile_rows or 0, batch * wide)):
                width = wide
            # and a rung wider where its batch size's longest batches fill it (`widen_mask`); its cuBLAS branches
            # reach the rows of the width before (their rungs over the spare rows were branches that batches
            # rarely take, each one more conditional node a replay evaluates)
            reach = batch * width
            width = widen_mask(getattr(runtime, "mask_tops", {}).get(batch), width, own, batch)
            base = ("ragged", batch * width, batch, width, config, causal, "mask", inputs)
            tokens = None
            if rungs:
                # a new graph for the tokens' bucket (`mask_tokens`, 2 per octave), rungs centred on its geometric
                # middle. Keyed by the bucket alone, a stream whose batches straddled two buckets captured a second
                # graph mid-stream (HF bert-base, MNLI B=128: 4.2 ms a batch against 2.5; H200, 2026-11-26)
                tokens = mask_tokens(tile_rows or 0)
                rungs = mask_rungs(int(tokens / 2**0.25), reach)
            key = (*base, tokens)
        else:
            rungs = ()  # (a kept graph: nothing to make)
        pool = self.pool

        def make():
            # (each branch's rows: its rung's or one more, `branch_rows`; timed when the graph is made, not looked up)
            rows = tuple(branch_rows(runtime, high, key[1], dtype, device) for _, high in rungs)
            return _RaggedGraph(runtime, module, config, causal, key[1:], dtype, device, pool, tile_rows, rungs, rows)

        kind = "ragged/mask/rungs" if rungs else "ragged/mask/triton"
        return self._get(key, make, device, kind, costs, 1 if trusted else None)

    def mask_serving(self, batch: int, width: int, tokens: int, rungs: bool, base: tuple | None = None):
        """The key of a kept ragged graph fed the mask that serves a batch of `batch` rows, `width` columns (its
        `mask_width`) and about `tokens` real tokens, or None: one of `width` to 2x `width` columns (the narrowest;
        of key `base` first, where given: its config and inputs), which with `rungs` (cuBLAS branches wanted)
        must have rungs that hold `tokens`. Without `base`, any causality, config and inputs (`autoragged.warmup`
        asks whether traffic would capture)."""
        best = None
        for key, graph in self.graphs.items():
            if key[0] != "ragged" or key[6] != "mask" or key[2] != batch or not width <= key[3] <= 2 * width:
                continue
            if base is not None and (key[5] != base[5] or key[7] != base[7]):
                continue
            if rungs and (graph.rungs is None or not graph.rungs.holds(tokens)):
                continue
            rank = (key[3], base is None or key[:8] != base)
            if best is None or rank < best[0]:
                best = (rank, key)
        return best[1] if best is not None else None

    def padded(self, runtime, module, batch, seq_len, dtype, device, io="lengths", costs=None):
        self._check_params(runtime._parameters(module))
        key = ("padded", *padded_bucket(batch, seq_len), io)
        return self._get(key, lambda: _PaddedGraph(runtime, module, key, dtype, device, self.pool), device,
                         f"padded/{io}", costs)  # fmt: skip
