"""The CUDA graphs of one wrapped module: which are kept, which are being captured, which failed.

A graph is asked for by its `GraphKey` and made by a callable the runtime gives (graphs/capture.py); this file
knows nothing else of the module. `request` hands the warm-up run to the background worker (graphs/worker.py);
`record_ready`, called after a batch's work is queued, records the warmed graphs on the caller's thread (a capture
forbids device-wide syncs in every thread). `capture_now` does both on the caller's thread (the tuner, forced arms).

A batch replays the kept graph of its key, or the narrowest one of the same batch size, inputs and causality up to
`_SERVES` times as wide: the layers stop at the counted rows, so spare width costs little (bert-base MNLI B=128:
2.80 ms a replay on a graph 512 wide, 2.75 at its own width 128; H100), but a graph keeps the Triton tiles of the
rows it was captured for (kernels/ragged_linear.py).

What is kept: `cap` graphs where a count is given, else as many as fit `GRAPH_MEMORY_FRACTION` of the device
memory obtainable at the first capture, by each graph's estimated bytes; least recently used out. A failed capture
is remembered with its reason (its key's batches run eagerly). Replays read the parameters in place, so in-place
updates are seen; parameters given new storage drop every graph (`check_params`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .capture import GraphKey
from .worker import worker

__all__ = ["GraphCache", "GraphStats", "GRAPH_MEMORY_FRACTION", "obtainable_bytes"]

log = logging.getLogger("autoragged")

GRAPH_MEMORY_FRACTION = 0.1  # of the device memory obtainable at a module's first capture, for its graphs
_SERVES = 4  # a graph serves batches up to this many times narrower (MNLI B=64 met a width 2x did not serve)
_data_ptr = torch.Tensor.data_ptr


@dataclass
class GraphStats:
    """The CUDA graphs of one wrapped module (`autoragged.graph_stats`). graphs: kept now; kept_bytes: their
    estimated bytes; budget_bytes: what they must fit (None: a count `cap` was given, or nothing was captured);
    cap: `wrap(graph_cap=)`; captures: graphs made; capture_ms: their host time in all (on the worker's thread
    unless captured now); pending: captures asked for and not done; failed: keys whose capture failed; evictions:
    graphs dropped to fit; training: training graphs kept (graphs/train.py); training_bytes: the device memory
    their recordings took; training_refused: keys of training batches that recurred but whose activations would
    not fit beside an eager step (graphs/train.py `pool_fit`)."""

    graphs: int = 0
    kept_bytes: int = 0
    budget_bytes: int | None = None
    cap: int | None = None
    captures: int = 0
    capture_ms: float = 0.0
    pending: int = 0
    failed: int = 0
    evictions: int = 0
    training: int = 0
    training_bytes: int = 0
    training_refused: int = 0


class _Warmed(NamedTuple):
    """A warm-up run the worker finished: the graph (None if it failed), the error (or None), its host ms, the
    graph's estimated bytes, and the pool and capture stream its record goes into."""

    key: GraphKey
    graph: object
    error: BaseException | None
    ms: float
    nbytes: int
    pool: object
    stream: object


def obtainable_bytes(device) -> int:
    """What graphs could obtain of the device's memory: free, and what the caching allocator holds unused."""
    free = torch.cuda.mem_get_info(device)[0]
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class GraphCache:
    """The graphs of one wrapped module (see the module docstring)."""

    def __init__(self, cap: int | None = None, memory_fraction: float = GRAPH_MEMORY_FRACTION):
        self.cap, self.memory_fraction = cap, memory_fraction
        self.budget_bytes: int | None = None
        self.limit_bytes: int | None = None  # a bound on kept bytes set from outside (`autoragged.warmup`)
        self.graphs: OrderedDict[GraphKey, object] = OrderedDict()
        self.pending: set[GraphKey] = set()
        self.failed: dict[GraphKey, str] = {}
        self.done: deque[_Warmed] = deque()  # from the worker's thread
        self.pool = None
        self.captures, self.capture_ms, self.evictions = 0, 0.0, 0
        self.kept_bytes = 0
        self._ptrs: tuple[int, ...] | None = None
        # each key's serving graph (or None) as `lookup` found it, until the kept graphs change: the scan over them
        # took 16 us a batch with 21 graphs kept (a scratch probe on this repository's 2-core CPU)
        self._serving: dict[GraphKey, object] = {}

    # -- what the runtime asks ---------------------------------------------------------------------------
    def lookup(self, key: GraphKey):
        """The kept graph that serves `key` (the module docstring), or None."""
        try:
            graph = self._serving[key]
        except KeyError:
            graph = self.graphs.get(key)
            graph = self._serving[key] = self._wider(key) if graph is None else graph
        if graph is not None:
            self.graphs.move_to_end(graph.key)
        return graph

    def unavailable(self, key: GraphKey) -> str | None:
        """Why no graph will serve `key` soon: its capture failed, or the memory bound is reached; else None."""
        if key in self.failed:
            return f"graph capture failed earlier: {self.failed[key]}"
        if self.limit_bytes is not None and self.kept_bytes >= self.limit_bytes:
            return "the graph memory bound is reached"
        return None

    def request(self, key: GraphKey, make, device, nbytes: int) -> bool:
        """Ask the worker to make `key`'s graph with `make(pool, stream)` (its warm-up run) unless it is kept, pending
        or failed; True if asked now. `nbytes`: the graph's estimated size."""
        if key in self.graphs or key in self.pending or key in self.failed:
            return False
        if not self._fits(device, nbytes):
            self.failed[key] = f"{nbytes / 2**20:.0f} MiB does not fit the graph memory budget"
            return False
        self.pending.add(key)
        pool, stream = self._pool(), worker.stream(device)

        def job():
            t0 = time.perf_counter()
            graph = make(pool, stream)
            return graph, (time.perf_counter() - t0) * 1e3

        def done(result, error):
            graph, ms = result if result is not None else (None, 0.0)
            self.done.append(_Warmed(key, graph, error, ms, nbytes, pool, worker.stream(device, "capture")))

        worker.submit(job, done)
        return True

    def record_ready(self) -> None:
        """Record the graphs whose warm-up run is done and keep them (or remember why one failed)."""
        while self.done:
            warmed = self.done.popleft()
            key, error = warmed.key, warmed.error
            self.pending.discard(key)
            if error is None and warmed.pool is self.pool:  # (a pool dropped meanwhile: asked for again if wanted)
                t0 = time.perf_counter()
                try:
                    warmed.graph.record(warmed.pool, warmed.stream)
                except Exception as e:  # noqa: BLE001 - any failure: the key's batches run eagerly, and say why
                    error = e
                else:
                    self._keep(key, warmed.graph, warmed.ms + (time.perf_counter() - t0) * 1e3, warmed.nbytes)
            if error is not None:
                reason = (
                    f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
                    if str(error)
                    else type(error).__name__
                )
                self.failed[key] = reason
                log.warning("autoragged: CUDA graph capture failed for %s, running eagerly: %s", key, reason)

    def capture_now(self, key: GraphKey, make, device, nbytes: int):
        """The graph of `key`, captured on this thread if it is not kept (raises what the capture raised)."""
        worker.drain()  # (no two captures into one pool at once)
        graph = self.lookup(key)
        if graph is not None and graph.key == key:
            return graph
        self.record_ready()
        self._fits(device, nbytes)  # (sets the budget at a first capture; a forced graph is kept whatever its size)
        t0 = time.perf_counter()
        pool = self._pool()
        graph = make(pool, worker.stream(device))
        graph.record(pool, worker.stream(device, "capture"))
        self._keep(key, graph, (time.perf_counter() - t0) * 1e3, nbytes)
        return graph

    def check_params(self, params: list[torch.Tensor]) -> None:
        """Drop every graph if any of the module's parameters moved to new storage (`.to()`, `.data =`)."""
        ptrs = tuple(map(_data_ptr, params))
        if self._ptrs is not None and ptrs != self._ptrs and (self.graphs or self.pending):
            log.info("autoragged: parameters moved to new storage; dropping %d CUDA graphs", len(self.graphs))
            worker.drain()  # (a capture in flight read the old storage)
            self.done.clear()
            self.pending.clear()
            self.clear()
        self._ptrs = ptrs

    def clear(self) -> None:
        """Drop every graph (captures in flight are taken in as they land) and give their memory back."""
        dropped = bool(self.graphs)
        self.graphs.clear()
        self._serving.clear()
        self.kept_bytes = 0
        self.pool = None  # PyTorch asserts when capturing into a pool whose graphs were all freed
        if dropped:  # the pool of graphs all freed stays reserved until this: 0.1-1.0 GiB a drop of bert-base's
            torch.cuda.empty_cache()  # graphs (H100), and a process that dropped ~170 ran out of device memory

    def stats(self) -> GraphStats:
        return GraphStats(len(self.graphs), self.kept_bytes, self.budget_bytes, self.cap, self.captures,
                          self.capture_ms, len(self.pending), len(self.failed), self.evictions)  # fmt: skip

    # -- inside ----------------------------------------------------------------------------------------
    def _pool(self):
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return self.pool

    def _fits(self, device, nbytes: int) -> bool:
        if self.cap is None and self.budget_bytes is None:
            self.budget_bytes = int(self.memory_fraction * obtainable_bytes(device))
        return self.cap is not None or nbytes <= self.budget_bytes

    def _wider(self, key: GraphKey):
        best = None
        for k, graph in self.graphs.items():
            if k._replace(width=key.width) == key:
                if key.width <= k.width <= _SERVES * key.width and (best is None or k.width < best.key.width):
                    best = graph
        return best

    def _keep(self, key: GraphKey, graph, ms: float, nbytes: int) -> None:
        graph.key, graph.nbytes = key, nbytes
        self.captures += 1
        self.capture_ms += ms
        self.graphs[key] = graph
        self.kept_bytes += nbytes
        while len(self.graphs) > 1 and self._over():
            _, old = self.graphs.popitem(last=False)
            self.kept_bytes -= old.nbytes
            self.evictions += 1
        self._serving.clear()
        log.debug("autoragged: captured %s in %.1f ms; %d kept, ~%d MiB", key, ms, len(self.graphs),
                  self.kept_bytes >> 20)  # fmt: skip

    def _over(self) -> bool:
        if self.cap is not None:
            return len(self.graphs) > self.cap
        return self.budget_bytes is not None and self.kept_bytes > self.budget_bytes
