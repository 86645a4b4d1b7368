"""The per-module runtime: one batch goes lengths -> stats -> choice -> arm -> record, for every model family.

A family adapter (autoragged/models/) binds a wrapped module to a `Runtime` and turns each of the module's own
calls into a `Call` (models/base.py): the batch's shape, its key padding mask or host lengths, how to run the
padded arm, what the ragged arm packs and how its result becomes the module's output. Everything else is here:

1. lengths: `lengths=`, a RaggedTensor or a mask on the host (no sync); a mask alone on the device is read (one
   small device->host copy) only where the arm that runs needs lengths, or where neither its shape nor another
   width of its batch size has any known yet;
2. stats: `BatchStats` on the host (a batch not read: the latest known of its shape, `policy.new_shape`);
3. the arm: forced by the policy or by anything the ragged arm cannot run (the reason is recorded), else
   `policy.choose` (runtime/policy.py) among the padded arm, the eager ragged arm and the ragged graph;
4. the arm runs; the padded positions of the ragged arms' output are zeros;
5. a record goes into a ring buffer and to the recorder; timed batches get CUDA events (the host clock on a CPU),
   harvested later without waiting, and teach the policy.
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from ..graphs.cache import GraphCache
from ..graphs.capture import GraphKey, RaggedGraph
from ..kernels.config import KernelConfig
from ..planning.buckets import LADDER_VERSION, cublas_rows, mask_width
from ..planning.costmodel import PADDED, AnalyticPrior, Arm
from ..planning.device import device_key
from ..planning.planner import Planner, default_ragged_config, graph_config
from ..ragged.layout import HostLengths, as_lengths
from ..ragged.tensor import (
    RaggedTensor,
    mask_lengths,
    pack_by_mask,
    padded_from_ragged,
    ragged_from_padded,
    unpack_by_mask,
)
from ..tuning_db import BatchStats, Measurement
from . import policy
from .epoch import param_epoch
from .policy import Scales, ShapeKey, ShapeState
from .recorder import RECORDER
from .records import PadsRing, Record, TimerPair, Timers, quiet_mark

__all__ = ["Runtime", "Options", "POLICIES", "CAPTURING", "NO_GRAPH"]

log = logging.getLogger("autoragged")
POLICIES = ("auto", "padded", "ragged")
_RING = 10_000
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_SUMMARY_EVERY = 1000  # batches between the INFO summary lines of a module
_EMPTY = "an empty batch (B = 0): the original module's own behaviour"
CAPTURING = "its graph is being captured in the background"  # (the report counts these)
NO_GRAPH = "no graph"


@dataclass(frozen=True)
class Options:
    """What `wrap()` was asked for (see its docstring); a module re-bound after a structure change keeps them."""

    policy: str = "auto"
    db_path: Path | None = None
    sample_every: int = 32
    validate_lengths: bool = True
    config: KernelConfig | None = None
    graphs: bool = True
    graph_cap: int | None = None


@dataclass
class _Timed:
    """A timed batch waiting for its end event. shape: whose policy learns from it (None: a forced arm); backward:
    a training batch's backward timing (its cost is forward plus backward)."""

    pair: TimerPair
    host_ms: float
    record: Record
    kind: str
    shape: ShapeState | None
    backward: _Backward | None = None


class _Backward:
    """The backward of one timed training batch: from the gradient reaching the module's output to the first
    parameter's (the embeddings': autograd accumulates it last) being accumulated."""

    def __init__(self, timers: Timers, output: torch.Tensor, first: nn.Parameter, batch: int):
        self.pair, self.batch = timers.take(), batch
        self.started = self.ended = False
        output.register_hook(self._start)
        self._end_hook = first.register_post_accumulate_grad_hook(self._end)

    def _start(self, grad):
        if not self.started:
            self.started = True
            self.pair.timers.record(self.pair.start)

    def _end(self, param):
        if self.started and not self.ended:
            self.ended = True
            self.pair.timers.record(self.pair.end)
            self._end_hook.remove()

    def drop(self) -> None:
        """Forget a backward that never ran (the output was not back-propagated through)."""
        self._end_hook.remove()


_BACKWARD_WAIT = 16  # batches a timed training batch waits for its backward before its timing is dropped


class Runtime:
    """The runtime state of one wrapped module (held by the module as `_autoragged`)."""

    def __init__(self, module: nn.Module, adapter, options: Options):
        self.adapter, self.options, self.policy = adapter, options, options.policy
        self.db_path, self.sample_every = options.db_path, options.sample_every
        self.recording = True  # decisions and timings go to the database
        self.tag = ""  # added to every record's reason (" (warmup)" while `autoragged.warmup` runs)
        self.exploring = False  # every arm untimed on a shape runs at once (policy rule 5; set by `warmup`)
        self.body = body = adapter.bind(module)
        self.static_reason, self.sig, self.sig_key = body.static_reason, body.sig, body.sig.key
        self._bound_epoch = param_epoch()  # the structure the body was bound to: a change re-binds (`ready`)
        self._bound_dtype = body.probe().dtype  # and the parameters' dtype (`.half()` re-registers nothing)
        self._reset_state()

    def _reset_state(self) -> None:
        """The state batches build up (planners, shapes, timings, graphs): a copy starts without it."""
        self._probe, self._probe_epoch, self._params, self._params_epoch = None, -1, [], -1
        self.ring: deque[Record] = deque(maxlen=_RING)
        self.planners: dict[torch.device, Planner] = {}
        self.shapes: dict[ShapeKey, ShapeState] = {}
        self.scales = Scales()  # inference batches' measured / predicted
        self.train_scales = Scales(shared=True)  # training batches' (forward and backward) measured / predicted forward
        self.pending: deque[_Timed] = deque()
        self.graphs: GraphCache | None = None
        self.pads_ring: PadsRing | None = None
        self.timers: dict[torch.device, Timers] = {}
        self.count = 0

    def preload(self) -> None:
        """Make the planner of the module's device now (the database opened, the cost model decoded), which the
        first batch would pay otherwise. A failure here is left for that first batch to raise."""
        if self.policy != "auto" or self.static_reason:
            return
        try:
            self._planner(self.probe().device)
        except Exception as e:  # noqa: BLE001 - the lazy path makes the planner again, and says what is wrong
            log.debug("autoragged %s: no planner made at wrap: %s", self.sig_key, e)

    def __getstate__(self):
        """A copy (deepcopy, pickle) re-binds to its module on its first call: options travel, state does not."""
        blank = object.__new__(Runtime)
        blank._reset_state()
        return {**self.__dict__, **blank.__dict__, "body": None, "_bound_epoch": -1}

    def ready(self, module) -> Runtime:
        """The runtime to run `module`'s next call: this one, or a fresh one bound to its new structure (a layer
        replaced, added or removed; a norm swapped) or dtype (what the kernels take, the signature and the cost
        model depend on it), which keeps the decision history."""
        if self._bound_epoch == param_epoch() and not self.body.layers_moved(module) and not self._recast():
            return self
        if self.body is not None and not self.body.restructured(module) and not self._recast():
            self._bound_epoch = param_epoch()
            return self
        self.harvest(wait=True)
        fresh = Runtime(module, self.adapter, self.options)
        fresh.ring, fresh.recording = self.ring, self.recording
        module._autoragged = fresh
        if self.body is not None:  # (a copy binds its body here for the first time)
            log.info("autoragged: %s changed structure or dtype; bound anew (%s)", type(module).__name__,
                     fresh.sig_key)  # fmt: skip
        return fresh

    def _recast(self) -> bool:
        """Whether the parameters were cast to another dtype since the body was bound."""
        return self.probe().dtype != self._bound_dtype

    @contextlib.contextmanager
    def forcing(self, policy: str):
        """Calls inside the block run with `policy` ("padded" or "ragged") whatever the module was wrapped with
        (`autoragged.warmup`'s first runs of each arm, a packing job's bins); restored after."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        before, self.policy = self.policy, policy
        try:
            yield self
        finally:
            self.policy = before

    # -- the hot path ------------------------------------------------------------------------------------
    def run(self, module, call):
        """The output of `module` on `call` (an adapter's Call, read with this runtime's body after `ready`)."""
        passthrough = call.passthrough or (_EMPTY if call.B == 0 and call.ragged_in is None else None)
        if passthrough is not None:
            self._record(Record(BatchStats.from_lengths(()), PADDED, {}, passthrough,
                                device_key(self.probe().device), self.sig_key))  # fmt: skip
            return call.original(module)
        t0, quiet = time.perf_counter(), quiet_mark()
        device = call.device
        timer = self._start(device)
        grad = torch.is_grad_enabled() and (call.requires_grad or any(map(_REQUIRES_GRAD, self._parameters(module))))
        reason = self.static_reason or self._dynamic_reason(module, call, grad)
        lens, not_prefix = self._known_lengths(call)
        key = ShapeKey(call.B, mask_width(call.L), lens is None, grad, torch.is_autocast_enabled(device.type))
        shape = self.shapes.get(key) or self.shapes.setdefault(key, policy.new_shape(self.shapes, key, call.L))
        if lens is None and (self.policy == "ragged" or call.causal or shape.stats is None):
            lens, not_prefix = self._read(call)
        stats, reason = self._stats(call, shape, lens, not_prefix, reason)
        decision = self._decide(module, call, shape, key, stats, reason)
        arm, why, learns = decision.arm, decision.why, decision.learns
        if lens is None and arm.kind == "ragged":  # the eager arm needs the lengths: read them now
            lens, not_prefix = self._read(call)
            stats, late = self._stats(call, shape, lens, not_prefix, None)
            if late:
                arm, why, learns = PADDED, late, False
        out, pads = self._execute(module, call, arm, lens, stats, not_prefix, decision.graph)
        if arm.kind == "padded":  # what it computed: a packed row's padded arm runs the whole row
            stats = _whole_rows(call, stats) or stats
        record = Record(stats, arm, decision.predicted, why + self.tag, device_key(device), self.sig_key)
        if lens is None:
            width = decision.graph.key.width if arm.kind == "ragged_graph" else call.L
            record.defer(pads, width, call.L, self._pads_ring(device))
            shape.unread = record
        if decision.timed and timer is not None and quiet is not None and quiet == quiet_mark():
            backward = self._backward(module, timer.timers, out) if key.train else None
            learns = learns and (backward is not None) == key.train  # a training cost needs its backward
            self._time(timer, t0, record, arm.kind, shape if learns else None, backward)
        else:
            if timer is not None:
                timer.give()
            self._record(record)
        self._after(record)
        return out

    def _decide(self, module, call, shape: ShapeState, key: ShapeKey, stats: BatchStats, reason: str | None):
        """The `_Decision` for this batch: forced (a reason, a forced policy) or the policy's choice."""
        if reason:
            return _Decision(PADDED, False, reason, {}, None, False)
        if self.policy == "padded":
            return _Decision(PADDED, False, "policy=padded", {}, None, False)
        if self.policy == "ragged":
            config = self.options.config or default_ragged_config(self.body.head_dim, stats.max_len)
            return _Decision(Arm("ragged", _aligned(config, call, key)), False, "policy=ragged", {}, None, False)
        predictions = self._planner(call.device).predict(stats, key.width, _whole_rows(call, stats))
        predicted = {"padded": predictions.ms["padded"], "ragged": predictions.ms["ragged"]}
        ready = {"padded", "ragged"}
        # a graph replays no dropout mask, records no autograd and casts nothing: training and autocast run eager
        gkey = None if key.train or key.autocast or module.training else self._graph_key(call, key)
        graph, unavailable = None, None
        if gkey is not None:
            cache = self.graph_cache()
            cache.check_params(self._parameters(module))
            unavailable = cache.unavailable(gkey)
            if unavailable is None:
                predicted["ragged_graph"] = predictions.ms["ragged_graph"]
                graph = cache.lookup(gkey)
                if graph is not None:
                    ready.add("ragged_graph")
        scales = self.train_scales if key.train else self.scales
        choice = policy.choose(shape, predicted, ready, self.sample_every, scales, self.exploring)
        why = f"{choice.why}: {predictions.note}" if choice.why == "predicted" else choice.why
        if choice.want == "ragged_graph":
            self._request_graph(module, gkey, stats, call)
            why += f"; {CAPTURING}"
        elif unavailable is not None:
            why += f"; {NO_GRAPH}: {unavailable}"
        arm = predictions.arms[choice.kind]
        if choice.kind == "ragged":
            arm = Arm("ragged", _aligned(arm.config, call, key))
        graph = graph if choice.kind == "ragged_graph" else None
        return _Decision(arm, choice.timed, why, predictions.ms, graph, True)

    # -- lengths and stats -----------------------------------------------------------------------------
    def _known_lengths(self, call) -> tuple[tuple[int, ...] | None, int | None]:
        """(host lengths, first row not right-padded or None) where the call brings them without a device sync;
        (None, None) for a mask alone on the device."""
        if call.ragged_in is not None:
            return call.ragged_in.lengths, None
        kpm = call.kpm
        if call.lengths is not None or kpm is None or not _on_device(kpm):
            return self._lengths(kpm, call.lengths, call.B, call.L)
        return None, None

    def _read(self, call) -> tuple[tuple[int, ...], int | None]:
        """The lengths of a mask alone on the device (a device->host copy: a sync)."""
        return self._lengths(call.kpm, None, call.B, call.L)

    def _stats(self, call, shape: ShapeState, lens, not_prefix, reason):
        """(BatchStats, reason): of host `lens`, checked against the call (and the shape's latest stats updated),
        or, for a batch not read, the shape's latest known ones."""
        if lens is None:
            if shape.unread is not None:
                landed = shape.unread.peek()
                if landed is not None:
                    shape.stats, shape.unread = landed, None
            return shape.stats, reason
        stats = BatchStats.from_lengths(lens, padded_len=call.L)
        if stats.max_len > call.L:
            i = lens.index(stats.max_len)
            raise ValueError(f"lengths[{i}] = {lens[i]} exceeds the padded length {call.L}")
        shape.stats = stats
        if reason:
            return stats, reason
        if not_prefix is not None and not call.any_padding:
            return stats, f"key padding mask row {not_prefix} is not right-padded{call.padding_note}"
        if stats.total == 0 and call.L > 0:
            return stats, call.no_tokens()  # raises where the family's own forward would fail on it
        if call.ragged_in is None and 0 in lens:
            return stats, call.empty_row(lens.index(0))
        return stats, None

    def _lengths(self, kpm, lengths, B, L) -> tuple[tuple[int, ...], int | None]:
        """(host lengths, first non-prefix mask row or None)."""
        if lengths is not None:
            lens = as_lengths(lengths)
            if len(lens) != B:
                raise ValueError(f"got {len(lens)} lengths for a batch of {B}")
            checked = self.options.validate_lengths and not isinstance(lengths, HostLengths)
            if kpm is not None and checked and kpm.dtype == torch.bool:
                from_mask, not_prefix = mask_lengths(kpm, batch=B, seq_len=L)
                if from_mask != lens:
                    i = next(i for i, (a, b) in enumerate(zip(lens, from_mask)) if a != b)
                    raise ValueError(
                        f"lengths[{i}] = {lens[i]} but the padding mask's row {i} has {from_mask[i]} real tokens "
                        "(wrap(..., validate_lengths=False) skips this check and its device sync)"
                    )
                if not_prefix is not None:
                    raise ValueError(
                        f"lengths= says each row's real tokens come first, but the padding mask's row {not_prefix} "
                        "is not right-padded; pass the mask alone for other padding (or pad on the right)"
                    )
            return lens, None
        if kpm is not None:
            return mask_lengths(kpm, batch=B, seq_len=L)
        return (L,) * B, None

    def _dynamic_reason(self, module, call, grad: bool) -> str | None:
        """Why this call must run padded (the call's own reason first), or None. `grad`: autograd records it."""
        if call.reason is not None:
            return call.reason
        p = self.probe()
        if call.dtype != p.dtype or call.device != p.device:
            return f"input {call.dtype} on {call.device} differs from the parameters ({p.dtype} on {p.device})"
        if grad or module.training:
            reason = self.body.train_reason(module, grad)
            if reason is not None:
                return reason
        if torch.is_autocast_enabled(call.device.type):
            reason = self.body.autocast_reason(p.dtype, torch.get_autocast_dtype(call.device.type))
            if reason is not None:
                return reason
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return "global forward hooks"
        if self.body.hooked():
            return "forward hooks on submodules"
        return None

    # -- the arms ---------------------------------------------------------------------------------------
    def _graph_key(self, call, key: ShapeKey) -> GraphKey | None:
        """The graph that may run this call, or None where none can: no GPU, graphs off, a body whose linears are
        not ours (its own modules' would compute every row of the graph's capacity), a call the graph does not
        take (`Call.eager_only`), or a causal mask that was not read."""
        body = self.body
        if not (self.options.graphs and body.fused and call.device.type == "cuda") or call.eager_only is not None:
            return None
        inputs = call.graph_inputs() if call.ragged_in is None else None
        mode = inputs.mode if inputs is not None else "x"
        if call.ragged_in is not None:
            rt = call.ragged_in
            return GraphKey(call.B, mask_width(rt.max_len), "values", "x", call.causal, rt.align)
        if call.kpm is not None and call.kpm.dtype == torch.bool and body.mask_graph and not call.causal:
            return GraphKey(call.B, key.width, "mask", mode, False)
        if key.mask_only:
            return None
        return GraphKey(call.B, key.width, "lengths", mode, call.causal)

    def graph_cache(self) -> GraphCache:
        """The module's graphs (made at the first use: one cache, on the module's device)."""
        if self.graphs is None:
            self.graphs = GraphCache(cap=self.options.graph_cap)
        return self.graphs

    def _graph_make(self, module, gkey: GraphKey, tile_rows: int | None):
        """(make(pool, stream) -> the graph of `gkey`, its estimated bytes)."""
        body, p = self.body, self.probe()
        config = graph_config(body.head_dim, gkey.width).replace(align=gkey.align)

        def make(pool, stream):  # the pool is the capture's (`RaggedGraph.record`), not the warm-up's
            return RaggedGraph(body, module, gkey, config, p.dtype, p.device, stream, tile_rows)

        return make, _graph_bytes(self.sig, gkey, p.element_size())

    def _request_graph(self, module, gkey: GraphKey, stats: BatchStats, call) -> None:
        """Ask for the graph of `gkey`, twice as wide (within the longest sequence the model takes): it also serves
        the wider batches that follow, where a graph of each width was a capture each (CoLA B=128's widths of
        26-33 tokens met two)."""
        limit = getattr(self.body, "max_tokens", None)
        width = min(2 * gkey.width, mask_width(limit)) if limit else 2 * gkey.width
        gkey = gkey._replace(width=max(width, gkey.width))
        if gkey in self.graphs.pending:  # (asked for already: each batch of the shape asks until it is there)
            return
        make, nbytes = self._graph_make(module, gkey, stats.total)
        self.graphs.request(gkey, make, call.device, nbytes)

    def graph(self, module, call, stats: BatchStats):
        """The graph that runs `call`, captured now on this thread where it is not kept (the tuner and the forced
        benchmark arms measure graphs this way), or None where no graph can run it."""
        gkey = self._graph_key(call, ShapeKey(call.B, mask_width(call.L), False))
        if gkey is None:
            return None
        cache = self.graph_cache()
        cache.check_params(self._parameters(module))
        make, nbytes = self._graph_make(module, gkey, stats.total)
        return cache.capture_now(gkey, make, call.device, nbytes)

    def _execute(self, module, call, arm: Arm, lens, stats: BatchStats, not_prefix, graph=None):
        """(output, each row's pads where the lengths were not read, else None: on the device, or in the `PadsSlot`
        a mask graph stores them in)."""
        if arm.kind == "ragged_graph":
            return self._replay(call, graph, lens)
        if not arm.ragged:
            if lens is None:
                return call.padded_mask(module), call.kpm.sum(1, dtype=torch.int32)
            return call.padded(module, lens, stats), None
        return self.eager(module, call, arm.config, lens, stats, not_prefix), None

    def execute(self, module, call, arm: Arm, lens, stats: BatchStats):
        """`arm` on `call` as the runtime runs it, lengths known (the tuner and the benchmarks' forced arms; a graph
        arm's graph is captured now where it is not kept)."""
        if arm.kind == "ragged_graph":
            graph = self.graph(module, call, stats)
            if graph is None:
                raise ValueError(f"no ragged graph can run this call ({call.eager_only or 'see Runtime._graph_key'})")
            return self._replay(call, graph, lens)[0]
        return self._execute(module, call, arm, lens, stats, None)[0]

    def _replay(self, call, graph: RaggedGraph, lens):
        key, inputs = graph.key, call.graph_inputs() if graph.key.inputs != "x" else None
        ids, types = (inputs.ids, inputs.types) if inputs is not None else (None, None)
        x = call.x if key.inputs == "x" and call.ragged_in is None else None
        if key.lengths_from == "values":
            rt = call.ragged_in
            return call.finish(rt.with_values(graph.run_values(rt.values, lens))), None
        if key.lengths_from == "mask":  # an unread batch's pads: stored by the replay in a pinned slot, no copy
            slot = self._pads_ring(call.device).take(call.B) if lens is None else None
            out = graph.run_mask(x, call.kpm, ids, types, 0 if slot is None else slot.host.data_ptr())
            if slot is not None:
                self.pads_ring.sent(slot)
            return call.finish(out), slot
        return call.finish(graph.run_lengths(x, lens, ids, types)), None

    def eager(self, module, call, config: KernelConfig, lens, stats: BatchStats, not_prefix):
        """The eager ragged arm: unpad once, the body's layers on the packed rows, repad once."""
        body, ragged_in = self.body, call.ragged_in
        hidden = [] if call.wants_hidden else None
        if ragged_in is not None:
            values = body.values(ragged_in.values, ragged_in.layout, config, call.causal, hidden)
            return call.finish(ragged_in.with_values(values), hidden)
        seq_axis = 1 if body.batch_first else 0
        x = call.x
        if not_prefix is not None:  # any padding pattern: packed and unpacked by the mask
            rt = pack_by_mask(x, call.kpm, lens, seq_axis, body.first_column)
            unpack = lambda v: unpack_by_mask(v, rt, call.kpm, seq_axis)  # noqa: E731
        else:
            rt = ragged_from_padded(x, lens, config.align, seq_axis, _eager_rows(config, x, call.causal, stats.total))
            unpack = lambda v: padded_from_ragged(RaggedTensor(v, rt.layout), 0.0, call.L, seq_axis)  # noqa: E731
        values = body.values(rt.values, rt.layout, config, call.causal, hidden)
        if hidden is not None:
            hidden = [unpack(h) for h in hidden]
        return call.finish(unpack(values), hidden)

    # -- timing and records ----------------------------------------------------------------------------
    def _start(self, device: torch.device) -> TimerPair | None:
        """A timer pair whose start is recorded now (before any read, so a read's cost counts), or None where
        nothing is timed."""
        if self.sample_every <= 0:
            return None
        timers = self.timers.get(device)
        if timers is None:
            timers = self.timers[device] = Timers(device)
        return timers.start()

    def _time(self, pair: TimerPair, t0: float, record: Record, kind: str, shape, backward: _Backward | None) -> None:
        pair.timers.record(pair.end)
        host_ms = (time.perf_counter() - t0) * 1e3
        if shape is not None:
            policy.started(shape, kind, host_ms)
        self.ring.append(record)
        self.pending.append(_Timed(pair, host_ms, record, kind, shape, backward))

    def _backward(self, module, timers: Timers, out) -> _Backward | None:
        """The backward timing of a timed training batch, or None where its output or parameters take no gradient."""
        output = out
        if isinstance(out, dict):  # a ModelOutput: its first field, the last hidden state
            output = next(iter(out.values()), None)
        elif isinstance(out, (tuple, list)):
            output = out[0] if out else None
        first = next((p for p in self._parameters(module) if p.requires_grad), None)
        if not isinstance(output, torch.Tensor) or not output.requires_grad or first is None:
            return None
        return _Backward(timers, output, first, self.count)

    def harvest(self, wait: bool = False) -> None:
        """Take in the timings of timed batches whose end event has completed; waits only if `wait`. A batch's
        time is the longer of its GPU time (events, from before any read to its last launch) and the host time its
        call took: with the host ahead of a busy GPU the events see the GPU's time alone."""
        while self.pending:
            timed = self.pending[0]
            start, end = timed.pair.start, timed.pair.end
            backward = timed.backward
            if backward is not None and not backward.ended:
                if self.count - backward.batch < _BACKWARD_WAIT and not wait:
                    return
                backward.drop()  # its backward never ran: the forward alone is no training cost
                self.pending.popleft()
                timed.pair.give()
                self._record(timed.record)
                continue
            if wait:
                end.synchronize()
                if backward is not None:
                    backward.pair.end.synchronize()
            elif not end.query() or (backward is not None and not backward.pair.end.query()):
                return
            self.pending.popleft()
            ms = max(start.elapsed_time(end), timed.host_ms)
            timed.pair.give()
            if backward is not None:
                ms += backward.pair.start.elapsed_time(backward.pair.end)
                backward.pair.give()
            record = timed.record
            record.measured_ms = ms
            if timed.shape is not None:
                predicted = record.predicted_ms.get(timed.kind, math.inf)
                policy.observe(timed.shape, timed.kind, ms, predicted)
                scales = self.scales if backward is None else self.train_scales
                scales.observe(timed.kind, ms, predicted, timed.host_ms)
            config = None if record.arm.config is None else record.arm.config.to_dict()
            extra = {"ladder": LADDER_VERSION} if record.arm.graph else {}
            if backward is not None:  # with the forward-only prediction it was priced against (`Scales.seed`)
                predicted = record.predicted_ms.get(timed.kind, math.inf)
                extra = {"train": True, **({"predicted": predicted} if 0 < predicted < math.inf else {})}
            measurement = Measurement(record.device.key, record.signature, record.arm.kind, config, record.stats,
                                      ms, ms, ms, 1, record.time, source="runtime", extra=extra)  # fmt: skip
            self._record(record, measurement)

    def _after(self, record: Record) -> None:
        """After a batch's work is queued: harvest timings; record the graphs whose warm-up is done (the GPU runs the
        batch meanwhile: tens of microseconds of host time a layer, once per graph)."""
        if self.pending:
            self.harvest()
        if self.graphs is not None and self.graphs.done:
            self.graphs.record_ready()
        self.count += 1
        if log.isEnabledFor(logging.DEBUG):
            if record.peek() is None:
                log.debug("autoragged %s: lengths not read -> %s (%s)", self.sig_key, record.arm.label, record.reason)
            else:
                stats = record.stats
                log.debug("autoragged %s: B=%d max_len=%d total=%d -> %s (%s)", self.sig_key, stats.batch,
                          stats.max_len, stats.total, record.arm.label, record.reason)  # fmt: skip
        if self.count % _SUMMARY_EVERY == 0 and log.isEnabledFor(logging.INFO):
            self._log_summary()

    def _log_summary(self) -> None:
        """One INFO line about the last _SUMMARY_EVERY batches of this module."""
        last = list(self.ring)[-_SUMMARY_EVERY:]
        counts = Counter(r.arm.kind for r in last)
        shares = ", ".join(f"{k} {v / len(last):.0%}" for k, v in counts.most_common())
        log.info("autoragged %s: %d batches so far; last %d: %s", self.sig_key, self.count, len(last), shares)

    def _record(self, record: Record, measurement: Measurement | None = None) -> None:
        if measurement is None:
            self.ring.append(record)
        if self.db_path is not None and self.recording:
            RECORDER.add(self.db_path, record.device, record, measurement)

    def _pads_ring(self, device: torch.device) -> PadsRing | None:
        if device.type != "cuda":
            return None
        if self.pads_ring is None:
            self.pads_ring = PadsRing(device)
        return self.pads_ring

    # -- the module's state, cached --------------------------------------------------------------------
    def predicted_ms(self, device: torch.device, stats: BatchStats) -> dict[str, float]:
        """Each arm kind's predicted ms for a right-padded batch of `stats`, as `_decide` prices one."""
        return self._planner(device).predict(stats, mask_width(stats.max_len)).ms

    def _planner(self, device: torch.device) -> Planner:
        planner = self.planners.get(device)
        if planner is None:
            from ..planning.load import load_planner_inputs, load_training_ratios

            key = device_key(device)
            learned = load_planner_inputs(self.db_path, key, self.sig)
            model, shortlist = learned if learned is not None else (AnalyticPrior(key), None)
            planner = self.planners[device] = Planner(self.sig, model, shortlist)
            # training prices start from this device's recorded training costs (`tune --train`, earlier runs)
            self.train_scales.seed(load_training_ratios(self.db_path, key, self.sig, policy.WINDOW))
        return planner

    def probe(self) -> torch.Tensor:
        """A parameter whose dtype and device stand for the module's, re-read when any parameter was
        re-registered (module attribute lookups cost microseconds)."""
        if self._probe_epoch != param_epoch():
            self._probe, self._probe_epoch = self.body.probe(), param_epoch()
        return self._probe

    def _parameters(self, module) -> list[nn.Parameter]:
        """The module's parameters, re-listed only when a parameter or module was registered anywhere: their
        requires_grad flags are read every batch, their storage by the graph cache."""
        if self._params_epoch != param_epoch():
            self._params, self._params_epoch = list(module.parameters()), param_epoch()
        return self._params


class _Decision(NamedTuple):
    """What runs a batch: the arm, whether the batch is timed, why (for the record), the predictions (ms per kind),
    the graph to replay (a ragged graph arm), and whether the policy learns from the batch's timing."""

    arm: Arm
    timed: bool
    why: str
    predicted: dict
    graph: RaggedGraph | None
    learns: bool


def _whole_rows(call, stats: BatchStats | None) -> BatchStats | None:
    """For packed rows (several sequences a row: `stats` counts the sequences, the call its rows), the stats of
    what the padded arm computes, the original module over every whole row (each row's attention spans it all);
    else None (the padded arm pads the sequences of `stats`)."""
    if stats is None or stats.batch == call.B:
        return None
    return BatchStats.from_lengths((call.L,) * call.B)


def _on_device(mask: torch.Tensor) -> bool:
    """Whether reading `mask` on the host costs a device sync (a CPU mask is read for free)."""
    return mask.is_cuda


def _aligned(config: KernelConfig, call, key: ShapeKey) -> KernelConfig:
    """The eager arm's config for this call: a RaggedTensor runs on its own layout (token-budget bins are often
    align 16: no repack); a training batch's linears are cuBLAS's (F.linear, differentiable), so its packed rows
    take cuBLAS's rungs (`_eager_rows`)."""
    rt = call.ragged_in
    if key.train and config.backend != "cublas":
        config = config.replace(backend="cublas")
    return config if rt is None or config.align == rt.align else config.replace(align=rt.align)


def _graph_bytes(sig, key: GraphKey, element_size: int) -> int:
    """A graph's memory, estimated: its values rows times the widths the layers keep alive (the hidden state, q/k/v,
    attention, the feed-forward's inner width, a few norms' outputs)."""
    return key.rows * (10 * sig.d_model + 2 * max(sig.ff, sig.d_model)) * element_size


def _eager_rows(config: KernelConfig, x: torch.Tensor, causal: bool, total: int) -> int | None:
    """The values rows of an eager ragged run of `total` tokens: with cuBLAS linears on the GPU, a rung of rows
    (`cublas_rows`: cuBLAS's first call on a row count costs milliseconds of host time, and a stream brings a new
    count every batch); else None, the packed rows. Causal runs keep their packed rows (each maps to a position
    and a cache slot)."""
    return cublas_rows(total) if config.backend == "cublas" and x.is_cuda and not causal else None
