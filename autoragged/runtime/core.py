"""The per-module runtime: one batch goes lengths -> stats -> plan -> arm -> record, for every model family.

A family adapter (`autoragged/adapters/`) binds a wrapped module to a `Runtime` and turns each of the
module's own calls into a `Call` (adapters/base.py): the batch's shape, its key padding mask or host lengths,
how to run the padded arm, what the ragged arm packs and how its result becomes the module's output. The
module's `Body` (what its layers compute on packed rows, its signature, what it supports) comes from the
adapter too. Everything else is here, written once:

 1. lengths: `lengths=` or a RaggedTensor input (no device sync), or the key padding mask (one small
    device->host copy), or "all real" when there is neither. A mask-only batch of a shape (B and the padded
    graph's length bucket, so the batches one unread graph runs share it) that an arm needing no lengths
    keeps winning (the read's cost counted against the others: the copy, and where the host runs ahead of
    the GPU the host time from the read to the next launch, while the drained GPU idles) skips the copy and
    runs that arm on the mask (padded, or the ragged graph fed the mask); its stats reach the record
    later, without a sync. The shape is judged again, one batch behind, from the stats of one of its unread
    batches once they have reached the host (`_one_behind`): no read is needed to notice a change. Once that
    arm's graph is captured, the shape's batches take a short path from the support checks to the replay
    (`_replay_unread`). That part of the runtime is runtime/unread.py (`UnreadShapes`);
 2. `BatchStats` on the host;
 3. the arm: forced by the policy, forced to padded by anything the ragged arm does not support (the
    reason is recorded), or chosen by the planner;
 4. the arm runs; padded positions of the ragged arms' output are zero;
 5. a decision record goes into a ring buffer (and to the recorder); every `sample_every`-th batch is
    timed (CUDA events on a GPU, harvested later without blocking; the host clock on a CPU, where ops
    are synchronous) and fed back to the planner.
"""

from __future__ import annotations

import logging
import operator
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .._buckets import LADDER_VERSION, cublas_rows
from .._costmodel import PADDED, PADDED_GRAPH, AnalyticPrior, Arm
from .._device import device_key
from .._epoch import param_epoch
from .._layout import HostLengths, Layout, as_lengths
from .._planner import GRAPH_BACKENDS, Plan, Planner, default_ragged_config, graph_config
from .._ragged import RaggedTensor, _from_padded, _to_padded, mask_lengths
from .._recorder import RECORDER
from ..kernels._config import KernelConfig
from ..tuning_db import BatchStats, Measurement
from .capture import mask_rungs_supported
from .records import PadsRing, Record, timers
from .unread import (  # noqa: F401 - the constants are read here by tests and tools
    _MAX_SHAPES,
    _PROBES,
    _READ,
    _RECHECK,
    _REJUDGE,
    _STAND_IN_SIGHTS,
    _TRUST,
    _TRUST_RECHECK,
    _WAITED_MS,
    STOOD_IN,
    UnreadShapes,
    _shape_entry,
)

__all__ = ["Runtime", "Options", "POLICIES", "CAPTURE_RULES", "MASK_READS", "pad_mask"]

log = logging.getLogger("autoragged")
POLICIES = ("auto", "padded", "ragged")
_RING = 10_000
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_SUMMARY_EVERY = 1000  # batches between the INFO summary lines of a module


@dataclass(frozen=True)
class Options:
    """What `wrap()` was asked for (see its docstring); a module re-bound after a structure change keeps them."""

    policy: str = "auto"
    db_path: Path | None = None
    sample_every: int = 32
    explore: bool = True
    validate_lengths: bool = True
    config: KernelConfig | None = None
    graphs: bool = True
    graph_cap: int | None = None
    capture: str = "second_sight"
    mask_reads: str = "one_behind"


# "second_sight" first: the default. "pays" captures a bucket only when its recurrence repays the capture; on the
# benchmark of record it declined captures the lengths= calls needed (H100, 2026-11-24, cora_table --quick:
# MNLI B=128 2.54 ms against 0.77, RACE B=32 2.67 against 1.35; `cora_table_capture_ablation.json`)
CAPTURE_RULES = ("second_sight", "pays")
MASK_READS = ("one_behind", "recheck")


def pad_mask(lens: tuple[int, ...], L: int, device: torch.device) -> torch.Tensor:
    """(B, L) bool, True = pad, built on the device from host lengths (no sync)."""
    dev_lengths = Layout.make(lens, 1).device_meta(device)[1]
    return torch.arange(L, device=device, dtype=torch.int32)[None, :] >= dev_lengths[:, None]


class Runtime(UnreadShapes):
    """The runtime state of one wrapped module (held by the module as `_autoragged`)."""

    def __init__(self, module: nn.Module, adapter, options: Options):
        self.adapter, self.options = adapter, options
        self.policy = options.policy
        self.graphs_enabled = options.graphs
        self.graph_cap = options.graph_cap
        self.graphs = None  # GraphCache, made on the first graph arm
        self.graph_min_seen = 2  # capture a bucket at its second sight at the earliest
        # False: capture a bucket at its second sight, at once, cost or not (the rule before the capture policy)
        self.capture_policy = options.capture == "pays"
        self.mask_reads = options.mask_reads  # "one_behind", or "recheck" (the rule before: see _TRUST_RECHECK)
        # the ragged graph fed the mask holds cuBLAS branches on rungs of rows (runtime/capture.py, `_Rungs`)
        self.mask_rungs = mask_rungs_supported()
        self.recording = True  # decisions and timings go to the database (`autoragged.warmup` turns it off)
        self._probe, self._probe_epoch = None, -1
        self._params, self._params_epoch = [], -1
        self.db_path = options.db_path
        self.sample_every = options.sample_every
        self.explore = options.explore
        self.validate_lengths = options.validate_lengths
        self.forced_config = options.config
        self.body = body = adapter.bind(module)
        self.static_reason = body.static_reason
        self.sig = body.sig
        self.sig_key = body.sig.key
        self.batch_first = body.batch_first
        # the structure all of the above was derived from: a change re-binds the module (`_restructured`)
        self._bound_epoch = param_epoch()
        self.ring: deque[Record] = deque(maxlen=_RING)
        self.planners: dict[torch.device, Planner] = {}
        self.pending: deque = deque()
        self.count = 0
        # `_shape_key(B, L)` -> [no-lengths verdicts in a row, the arm, unread batches since the last verdict,
        #           the last predictions, the last judged batch's tokens (the mask graph's linears pick their
        #           tiles for them), the probe: {"read": ms of timed read-path runs, "unread": ms of timed
        #           unread runs, "left": unread runs still to time, "lost": the unread arm measured slower,
        #           "confirmed": it measured faster, "paid": ms the shape's reads cost (`read_cost_ms` each),
        #           "explored": trusted to be timed, not predicted to win (see unread._EXPLORE), "weighed":
        #           a stream weighed exploring it (once)},
        #           the graph the arm replays once captured, for `_replay_unread`: None, or (a weak reference
        #           to it, the GraphCache generation it was seen in, the record's reason, the device key),
        #           the record of the first unread batch since the last verdict (`_one_behind`) or None,
        #           the rows of the shape's mask graph (B x mask width; 0: not known: `_mask_graph_ms`),
        #           (B, mask width) or None: the shape's bucket, for `mask_lost` and `mask_won`]
        self.mask_shapes: dict[tuple[int, int], list] = {}
        # (B, mask width) buckets whose mask graph a shape's probes measured slower / faster than its read path
        self.mask_lost: set[tuple[int, int]] = set()
        self.mask_won: set[tuple[int, int]] = set()
        # B -> [the widest padded length L of its mask-only batches, how many batches had it, how many came]:
        # how wide a new mask graph is made (`GraphCache.ragged_mask`, `widen_mask`)
        self.mask_tops: dict[int, list[int]] = {}
        # ms of reading lengths from a mask, the recent reads' own (`_read_timed`): their minimum is its cost
        self.sync_samples: deque[float] = deque(maxlen=16)
        self.read_events: list | None = None  # [start, end, device, a read between them] (`_read_begin`)
        self.read_seen = False  # a read was made on a GPU: the first one's time is left out (`_read_timed`)
        # host ms from a read's end to the arm's work queued (the decision; a replay's launch), the recent ones
        self.prelaunch: deque[float] = deque(maxlen=16)
        self.pipelined = False  # the last read (or one-behind verdict) found the GPU still busy: the host is ahead
        self.pads_ring: PadsRing | None = None

    def preload(self) -> None:
        """Make the planner of the module's device now: the device key, the database opened and the calibrated
        cost model decoded, which the first batch would pay otherwise (`wrap` calls this). A failure here is
        left for that first batch to raise."""
        if self.policy != "auto" or self.static_reason:
            return
        try:
            device = self._param().device
            if device not in self.planners:
                self.planners[device] = self._make_planner(device)
        except Exception as e:  # noqa: BLE001 - the lazy path makes the planner again, and says what is wrong
            log.debug("autoragged %s: no planner made at wrap: %s", self.sig_key, e)

    # -- pickling / deepcopy: options travel, caches and timers do not ------------------------
    def __getstate__(self):
        """A copy (deepcopy, pickle) re-binds to its module on its first call: the body holds the modules."""
        state = self.__dict__.copy()
        state.update(ring=deque(maxlen=_RING), planners={}, pending=deque(), graphs=None, mask_shapes={},
                     mask_lost=set(), mask_won=set(), mask_tops={}, pads_ring=None, sync_samples=deque(maxlen=16),
                     read_events=None, read_seen=False, prelaunch=deque(maxlen=16), pipelined=False, body=None,
                     _bound_epoch=-1,
                     _probe=None, _probe_epoch=-1, _params=[], _params_epoch=-1)  # fmt: skip
        return state

    def _restructured(self, module) -> bool:
        """True if the module's structure changed since this runtime was bound to it (a layer replaced,
        added, removed, a norm or a submodule swapped): then the module is bound to a fresh runtime (its
        body, support check, signature, hooks watched, graphs and planners made anew; the decision history
        kept), which takes the call. The layers the ragged arms run would otherwise be the old ones.
        Called when the registration epoch moved or the body saw its layer list change (see `run`)."""
        if self.body is not None and not self.body.restructured(module):
            self._bound_epoch = param_epoch()
            return False
        self._harvest(wait=True)  # sampled batches still in flight get their timings recorded
        fresh = Runtime(module, self.adapter, self.options)
        fresh.graph_min_seen, fresh.ring = self.graph_min_seen, self.ring
        fresh.capture_policy, fresh.mask_reads, fresh.recording = self.capture_policy, self.mask_reads, self.recording
        module._autoragged = fresh
        if self.body is not None:
            log.info("autoragged: %s changed structure; bound anew (%s)", type(module).__name__, fresh.sig_key)
        return True

    # -- the hot path -------------------------------------------------------------------------
    def ready(self, module) -> Runtime:
        """The runtime to run `module`'s next call: this one, or a fresh one bound to its new structure. An
        adapter's forward calls this before it reads the call (the call reads the body)."""
        if (self._bound_epoch != param_epoch() or self.body.layers_moved(module)) and self._restructured(module):
            return module._autoragged
        return self

    def run(self, module, call):
        """The output of `module` on `call` (an adapter's Call, read with this runtime's body after `ready`),
        through the arm this batch gets."""
        kpm = call.kpm
        # a mask alone, of a trusted shape whose graph is kept: `_replay_unread`
        if call.lengths is None and not call.causal and kpm is not None and call.reason is None:
            self._saw_mask(call.B, call.L)
            shape = self.mask_shapes.get(self._shape_key(call.B, call.L))
            if shape is not None and shape[6] is not None:
                out = self._replay_unread(module, call, shape)
                if out is not None:
                    return out
        passthrough = call.passthrough
        if passthrough is None and call.B == 0 and call.ragged_in is None:
            passthrough = "an empty batch (B = 0): the original module's own behaviour"
        if passthrough is not None:
            # an input the wrapper does not run: the original module handles it, and we record that we let it
            self._record(Record(BatchStats.from_lengths(()), PADDED, {}, passthrough,
                                device_key(self._param().device), self.sig_key))  # fmt: skip
            return call.original(module)
        reason = self.static_reason or self._dynamic_reason(module, call)
        ragged_in = call.ragged_in
        B, L = call.B, call.L
        mask_only = False
        not_prefix = None
        if ragged_in is not None:
            lens = ragged_in.lengths
        else:
            # (a causal batch reads its lengths: the unread arms run the mask alone)
            mask_only = (
                call.lengths is None and kpm is not None and not call.causal and not reason and self.policy == "auto"
            )
            if mask_only:
                shape = self.mask_shapes.get(self._shape_key(B, L))
                if shape is None:
                    shape = self._adopt(B, L)
                trusted = shape is not None and shape[0] >= self.trust and kpm.shape == (B, L)
                if trusted and self._read_known(shape, kpm):
                    shape[2] += 1
                    if shape[2] < _RECHECK:
                        self._one_behind(call.device, shape)
                        if shape[0] >= self.trust:
                            # judged again and still trusted, its graph kept: the hot path's steps replay it (the
                            # general path's cost 0.25 ms of host time a judged batch, on a short row the GPU's
                            # idle time: CoRa, CoLA B=32, 0.45 ms of GPU time a judged batch against 0.24; H100,
                            # 2026-11-26, `vt2_cora_short_h100.json`)
                            out = self._replay_unread(module, call, shape) if shape[6] is not None else None
                            if out is None:
                                out = self._run_unread(module, call, shape)
                            if out is not _READ:
                                return out
                if not (self.graphs_enabled and kpm.is_cuda and call.graph_inputs() is not None):
                    # queue what every ragged arm needs before the read blocks the host; not where the graph arms
                    # compute it themselves: the read would wait for it, and an eager arm launches it after
                    call.prefetch()
                read_events = self._read_begin(kpm)
                t0 = time.perf_counter()
            lens, not_prefix = self._lengths(kpm, call.lengths, B, L)
            if mask_only:
                t_read = time.perf_counter()
                self._read_timed((t_read - t0) * 1e3, kpm.is_cuda, read_events)
            if not_prefix is not None and not reason and not call.any_padding:
                reason = f"key padding mask row {not_prefix} is not right-padded{call.padding_note}"
        stats = BatchStats.from_lengths(lens, padded_len=L)
        if stats.max_len > L:
            i = lens.index(stats.max_len)
            raise ValueError(f"lengths[{i}] = {lens[i]} exceeds the padded length {L}")
        if stats.total == 0 and L > 0 and B > 0:
            reason = call.no_tokens()  # raises where the family's own forward would fail on it
        elif not reason and ragged_in is None and 0 in lens:
            reason = call.empty_row(lens.index(0))
        plan = self._plan(call.device, stats, reason)
        arm, why = plan.arm, plan.reason
        free = self.policy == "auto" and not reason  # the planner chose: its timings may teach it
        probe = None
        cuda = call.device.type == "cuda"
        if mask_only and free:
            mask_arm = self._mask_graph_arm(call.device, plan)
            shape = self._judge_shape(B, L, plan.predicted_ms, mask_arm, stats.total, self._explores(call.device))
            timings = shape[5]
            if (shape[0] > 0 or timings["unread"]) and not timings["lost"] and len(timings["read"]) < _PROBES:
                # a verdict for the unread arm, or its timings waiting for the read path's: time the read path
                probe = (timings, B, L, "read")
        self.count += 1
        sampled = self.sample_every > 0 and self.count % self.sample_every == 0
        if sampled and self.explore and free:
            alt = self.planners[call.device].explore(stats, arm)
            if alt is not None:
                arm, why = alt, f"exploring (the planner chose {plan.arm.label})"
        # a probe times the read path as the shape runs it: the planner's arm, not an explored one
        probe = probe if probe is not None and cuda and self.sample_every > 0 and arm == plan.arm else None
        sampled = sampled or probe is not None
        if not sampled and free and self.sample_every > 0 and arm == plan.arm and not arm.graph:
            # an eager arm chosen on a prediction the bucket's other timings scaled: timed until it has its own
            # (not a graph arm: timing a short replay costs it a share of its time, and the prior's error is
            # the eager arms' host time)
            sampled = self.planners[call.device].unproven(stats, arm)
        if ragged_in is not None and arm.ragged and arm.config.align != ragged_in.align:
            # a RaggedTensor runs on its own layout (FFD bins are often align 16): no repack, and its graph
            # is captured for that alignment
            arm = Arm(arm.kind, arm.config.replace(align=ragged_in.align))
        if sampled:
            captures = self.graphs.captures if self.graphs is not None else 0
            start, end = timers(call.device)
            start.record()
            host0 = time.perf_counter()
        policy_plan = plan if self.capture_policy else None
        stand_in = None  # (not for an explored arm: its run is to time it)
        if mask_only and free and arm == plan.arm and arm.graph and arm.ragged and not arm.mask_only:
            stand_in = self._stand_in(module, call, shape)
            if stand_in is not None:
                stand_in = (*stand_in, self._stand_in_costs(plan, arm, shape))
        if mask_only:
            t_exec = time.perf_counter()
        out, note = self._execute(module, call, arm, lens, stats, not_prefix, policy_plan, stand_in)
        if sampled:
            host_ms = (time.perf_counter() - host0) * 1e3
        if mask_only:  # the drained GPU idled until the replay was queued (an eager arm: its first kernel)
            t_queued = time.perf_counter() if arm.graph and (note is None or note is STOOD_IN) else t_exec
            self.prelaunch.append((t_queued - t_read) * 1e3)
        graphs = self.graphs
        stood_in = note is STOOD_IN
        if graphs is not None and graphs.deferred is not None:  # the batch's run is queued: capture now
            extra = graphs.capture_deferred()
            note = note and note + extra
        # the record is made once the arm's work is queued: a launch-bound batch's latency is the host time
        # before its last launch, and bookkeeping after it overlaps the GPU's work
        record = Record(stats, arm, plan.predicted_ms, why, device_key(call.device), self.sig_key)
        if sampled and graphs is not None and graphs.captures != captures:
            sampled = False  # this call captured a graph: its time is not the arm's latency
        if note:  # a graph arm ran eagerly this time, or the shape's mask graph: record what really ran, and why
            record.arm = shape[1] if stood_in else self._fallback(arm, policy_plan, call) if arm.graph else arm
            record.reason = f"{why}; {note}"
            probe = None  # not how the shape runs once its graph is captured
        if graphs is not None and graphs.evicted_note:  # captured in this call, evicting others to keep it
            record.reason += graphs.evicted_note
            graphs.evicted_note = ""
        if sampled:
            end.record()
            self.ring.append(record)
            self.pending.append((start, end, host_ms, record, call.device, free, probe))
        else:
            self._record(record)
        if self.pending:
            self._harvest()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("autoragged %s: B=%d max_len=%d total=%d -> %s (%s)", self.sig_key, stats.batch,
                      stats.max_len, stats.total, record.arm.label, record.reason)  # fmt: skip
        if self.count % _SUMMARY_EVERY == 0 and log.isEnabledFor(logging.INFO):
            self._log_summary()
        return out

    def _fallback(self, arm: Arm, plan: Plan | None, call) -> Arm:
        """The arm that runs where the graph arm `arm` cannot (not captured, or it cannot take the call): the
        plan's best eager arm where the planner chose, else `arm` run eagerly."""
        fallback = Arm(arm.kind[: -len("_graph")], arm.config)
        if plan is not None and plan.eager is not None:
            fallback = plan.eager
        ragged_in = call.ragged_in
        if ragged_in is not None and fallback.ragged and fallback.config.align != ragged_in.align:
            fallback = Arm(fallback.kind, fallback.config.replace(align=ragged_in.align))
        return fallback

    def _unread_done(self, record: Record, pads: torch.Tensor, width: int, B: int, L: int, out):
        """After an unread batch's work is queued: its record (stats deferred), harvest, logs; returns out."""
        record.defer(pads, width, L, self.pads_ring)
        self._record(record)
        if self.pending:
            self._harvest()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("autoragged %s: B=%d L=%d (lengths not read) -> %s", self.sig_key, B, L, record.arm.label)
        if self.count % _SUMMARY_EVERY == 0 and log.isEnabledFor(logging.INFO):
            self._log_summary()
        return out

    def _log_summary(self) -> None:
        """One INFO line about the last _SUMMARY_EVERY batches of this module."""
        last = list(self.ring)[-_SUMMARY_EVERY:]
        counts: dict[str, int] = {}
        for r in last:
            counts[r.arm.kind] = counts.get(r.arm.kind, 0) + 1
        shares = ", ".join(f"{k} {v / len(last):.0%}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
        timed = [r.measured_ms for r in last if r.measured_ms is not None]
        extra = f"; median sampled latency {sorted(timed)[len(timed) // 2]:.3f} ms" if timed else ""
        log.info("autoragged %s: %d batches so far; last %d: %s%s", self.sig_key, self.count, len(last), shares, extra)

    def _param(self) -> torch.Tensor:
        """A parameter whose dtype and device stand for the module's (the body names it). Cached, and
        re-read when any parameter was re-registered (module attribute lookups cost microseconds)."""
        if self._probe_epoch != param_epoch():
            self._probe, self._probe_epoch = self.body.probe(), param_epoch()
        return self._probe

    def _record(self, record: Record, measurement: Measurement | None = None) -> None:
        if measurement is None:
            self.ring.append(record)
        if self.db_path is not None and self.recording:
            RECORDER.add(self.db_path, record.device, record, measurement)

    def _parameters(self, module) -> list[nn.Parameter]:
        """The module's parameters, re-listed only when a parameter or module was registered anywhere
        (`param_epoch`). Read on every batch: their requires_grad flags by the autograd check (a frozen model
        called with grad mode on walked its module tree per batch before, 143 us on the CoRa encoder on a CPU
        host, against 8 us for the flags of the kept list), their storage by the graph cache."""
        if self._params_epoch != param_epoch():
            self._params, self._params_epoch = list(module.parameters()), param_epoch()
        return self._params

    def _dynamic_reason(self, module, call) -> str | None:
        """Why this call must run padded (the call's own reason first), or None."""
        if call.reason is not None:
            return call.reason
        p = self._param()
        if call.dtype != p.dtype or call.device != p.device:
            return f"input {call.dtype} on {call.device} differs from the parameters ({p.dtype} on {p.device})"
        if torch.is_grad_enabled() and (call.requires_grad or any(map(_REQUIRES_GRAD, self._parameters(module)))):
            return "autograd is on (no backward kernels yet)"
        if module.training and self.body.has_dropout:
            return "training mode with dropout"
        if torch.is_autocast_enabled(call.device.type):
            return "autocast"
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return "global forward hooks"
        if self.body.hooked():
            return "forward hooks on submodules"
        return None

    def _lengths(self, kpm, lengths, B, L) -> tuple[tuple[int, ...], int | None]:
        """(host lengths, first non-prefix mask row or None)."""
        if lengths is not None:
            lens = as_lengths(lengths)
            if len(lens) != B:
                raise ValueError(f"got {len(lens)} lengths for a batch of {B}")
            checked = self.validate_lengths and not isinstance(lengths, HostLengths)
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
            if kpm.dtype.is_floating_point:  # PyTorch's float convention: -inf = pad, added to the scores
                self._check_float_mask(kpm)
                kpm = torch.isneginf(kpm)
            return mask_lengths(kpm, batch=B, seq_len=L)
        return (L,) * B, None

    def _check_float_mask(self, kpm: torch.Tensor) -> None:
        """Warn (once per module) about a float key padding mask holding values other than 0 and -inf: an
        HF-style mask (1.0 = keep) passed to a PyTorch encoder, which adds it to the attention scores (rows
        of pads only then give NaN). A second device->host copy, on a path that runs padded anyway."""
        if getattr(self, "_float_mask_warned", False):
            return
        if not bool(((kpm == 0) | torch.isneginf(kpm)).all()):
            self._float_mask_warned = True
            log.warning(
                "autoragged %s: the float key padding mask holds values other than 0 and -inf; PyTorch adds a float "
                "mask to the attention scores (-inf = pad), so a 1 = keep mask is not a padding mask. Pass a bool "
                "mask, True = pad (e.g. attention_mask == 0)", self.sig_key,
            )  # fmt: skip

    def _plan(self, device: torch.device, stats: BatchStats, reason: str | None) -> Plan:
        if reason:
            return Plan(PADDED, {}, reason)
        if self.policy == "padded":
            return Plan(PADDED, {}, "policy=padded")
        if self.policy == "ragged":
            config = self.forced_config or default_ragged_config(self.body.head_dim, stats.max_len)
            return Plan(Arm("ragged", config), {}, "policy=ragged")
        planner = self.planners.get(device)
        if planner is None:
            planner = self.planners[device] = self._make_planner(device)
        return planner.plan(stats)

    def _make_planner(self, device: torch.device) -> Planner:
        from .._learned import load_planner_inputs

        key = device_key(device)
        learned = load_planner_inputs(self.db_path, key, self.sig)
        head_dim = self.body.head_dim
        model, shortlist = learned if learned is not None else (AnalyticPrior(key), None)
        graphs = self.graphs_enabled and device.type == "cuda"
        padded_graph = graphs and self.body.padded_forward is not None
        backends = GRAPH_BACKENDS if self.body.fused else ("cublas",)

        def candidates(stats: BatchStats) -> list[Arm]:
            arms = shortlist(stats) if shortlist else [Arm("ragged", default_ragged_config(head_dim, stats.max_len))]
            if graphs:  # replayed as graphs, with the configs the tuner measures graphs with
                arms = [*arms, *(Arm("ragged_graph", graph_config(head_dim, stats.max_len, b)) for b in backends)]
                if padded_graph:
                    arms.append(PADDED_GRAPH)
            return arms

        return Planner(self.sig, model, candidates)

    def _execute(
        self, module, call, arm: Arm, lens, stats: BatchStats, not_prefix, plan: Plan | None = None, stand_in=None
    ):  # fmt: skip
        """Run `arm`; returns (output, note) where note says why a graph arm ran eagerly (else None): then
        `_fallback(arm, plan, call)` ran. With the `plan` the arm came from, a graph is captured only where the
        capture pays, after the batch's eager run (`GraphCache._get`). stand_in: (the mask graph kept for the
        call's shape, its graph inputs) or None (`_stand_in`): a ragged graph arm whose bucket is not captured
        yet replays it instead until the bucket's `_STAND_IN_SIGHTS`-th sight (note `STOOD_IN`)."""
        note = None
        if arm.graph:
            costs = None
            if plan is not None and plan.eager is not None and arm.label in plan.predicted_ms:
                costs = (plan.eager_ms, plan.predicted_ms[arm.label])
            if stand_in is not None and stand_in[2] is not None:
                costs = stand_in[2]  # the capture pays only by what it saves over the stand-in's replays
            min_seen = max(_STAND_IN_SIGHTS, self.graphs.min_seen) if stand_in is not None else None
            out, note = self._execute_graph(module, call, arm, lens, stats, not_prefix, costs, min_seen)
            if note is None:
                return out, None
            from .graphs import CAPTURE_NEXT, FIRST_SIGHT, NOT_WORTH, RARE

            # (a capture deferred by this lookup still follows: it is made once the stand-in's replay is queued)
            if stand_in is not None and note in (FIRST_SIGHT, RARE, NOT_WORTH, CAPTURE_NEXT):
                graph, inputs, _ = stand_in
                out = (
                    graph.run_mask(call.x, call.kpm)
                    if inputs is None
                    else graph.run_mask_ids(inputs[1], inputs[2], call.kpm)
                )
                return call.finish(out), STOOD_IN
            arm = self._fallback(arm, plan, call)
        if not arm.ragged:
            return call.padded(module, lens, stats), note
        body, ragged_in, config = self.body, call.ragged_in, arm.config
        hidden = [] if call.wants_hidden else None
        if ragged_in is not None:
            values = body.values(ragged_in.values, ragged_in.layout, config, call.causal, hidden)
            return call.finish(ragged_in.with_values(values), hidden), note
        seq_axis = 1 if self.batch_first else 0
        x = call.x
        if not_prefix is not None:  # any padding pattern: packed and unpacked by the mask
            rt = _pack_by_mask(x, call.kpm, lens, seq_axis, self.body.first_column)
        else:
            rt = _from_padded(x, lens, config.align, seq_axis, _eager_rows(config, x, call.causal, stats.total))
        values = body.values(rt.values, rt.layout, config, call.causal, hidden)
        unpack = (
            (lambda v: _unpack_by_mask(v, rt, call.kpm, seq_axis))
            if not_prefix is not None
            else (lambda v: _to_padded(RaggedTensor(v, rt.layout), 0.0, call.L, seq_axis))
        )
        if hidden is not None:
            hidden = [unpack(h) for h in hidden]
        return call.finish(unpack(values), hidden), note

    def _stand_in_costs(self, plan: Plan, arm: Arm, shape: list):
        """(eager arm's ms, `arm`'s ms, the stand-in's ms) as predicted, for `GraphCache.worth`, or None where a
        prediction is missing. A bucket with a stand-in is captured only where the capture repays itself out of
        what the graph saves over the stand-in's replays, not over an eager run: the cuBLAS graph of a RACE B=32
        bucket, read batches of a mask shape, was captured at its 8th sight inside a stream of new batches (30
        ms, against 1.3 a batch; CoRa, H200, 2026-11-26), for a saving of a fraction of a millisecond a replay."""
        mine, stand_in = plan.predicted_ms.get(arm.label), shape[3]
        if plan.eager is None or mine is None or shape[1].label not in stand_in:
            return None
        return plan.eager_ms, mine, self._mask_graph_ms(stand_in, shape[1], shape[8])

    def _execute_graph(self, module, call, arm: Arm, lens, stats: BatchStats, not_prefix, costs=None, min_seen=None):
        """(output, None) from a replayed graph, or (None, why it must run eagerly). min_seen: the sight of a
        ragged graph's bucket it is captured at the earliest (default: the cache's)."""
        device = call.device
        if self._graph_cache(device) is None:
            return None, "CUDA graphs need a GPU"
        if call.eager_only is not None:
            return None, call.eager_only
        ragged_in = call.ragged_in
        if arm.ragged:
            if not_prefix is not None:
                return None, "the padding is not on the right (the graph packs by lengths)"
            align = arm.config.align
            rows = stats.total if align == 1 else Layout.make(lens, align).rows
            if ragged_in is not None and not ragged_in.layout.same_as(Layout.make(lens, align)):
                return None, f"the input's layout (align {ragged_in.align}) is not the graph's (align {align})"
            io = "values" if ragged_in is not None else "padded"
            inputs = call.graph_inputs() if ragged_in is None else None  # the embeddings inside the graph
            dtype = self._param().dtype
            graph, note = self.graphs.ragged(
                self, module, arm.config, call.causal, stats, rows, dtype, device, io, costs,
                inputs[0] if inputs is not None else None, min_seen,
            )  # fmt: skip
            if graph is None:
                return None, note
            # no inference_mode here: the static buffers are plain tensors (GraphCache._get), and entering
            # the context costs tens of microseconds of host time on a launch-bound batch
            if ragged_in is not None:
                return call.finish(ragged_in.with_values(graph.run_values(ragged_in.values, lens))), None
            if inputs is not None:
                return call.finish(graph.run_padded_ids(inputs[1], inputs[2], lens)), None
            return call.finish(graph.run_padded(call.x, lens)), None  # reads x, writes a fresh output
        if call.causal:
            return None, "the padded graph takes no attn_mask"
        seq_axis = 1 if self.batch_first else 0
        padded = _to_padded(ragged_in, 0.0, call.L, seq_axis) if ragged_in is not None else call.x
        graph, note = self.graphs.padded(self, module, stats.batch, call.L, padded.dtype, device, costs=costs)
        if graph is None:
            return None, note
        out = graph.run(padded, lens)
        if ragged_in is not None:
            out = _from_padded(out, lens, ragged_in.align, seq_axis)
        return call.finish_padded(out), None

    def _graph_cache(self, device: torch.device):
        """The module's GraphCache (made on first use), or None off the GPU."""
        if device.type != "cuda":
            return None
        if self.graphs is None:
            from .graphs import GraphCache

            self.graphs = GraphCache(cap=self.graph_cap, min_seen=self.graph_min_seen)
        return self.graphs

    def _harvest(self, wait: bool = False) -> None:
        """Read the timings of sampled batches whose end event has completed; waits only if `wait`.

        A batch's latency is the longer of its GPU time (events) and the host time its arm took to queue the
        work: with the host ahead of a busy GPU (a stream of `lengths=` calls, nothing synchronising), the
        events see the GPU's time alone, and an eager arm whose launches took 6-9 ms of host time measured under
        a graph replay's 1.1 ms (bert-base, CoLA B=128, H100, 2026-11-24): the planner then chose it."""
        while self.pending:
            start, end, host_ms, record, device, free, probe = self.pending[0]
            if wait:
                end.synchronize()
            elif not end.query():
                return
            self.pending.popleft()
            ms = max(start.elapsed_time(end), host_ms)
            if probe is not None:
                self._probe_result(*probe, ms)
            if record is None:  # a timed unread run: its record went out when it ran
                continue
            record.measured_ms = ms
            if free and device in self.planners:
                self.planners[device].observe(record.stats, record.arm, ms)
            config = None if record.arm.config is None else record.arm.config.to_dict()
            measurement = Measurement(
                record.device.key, record.signature, record.arm.kind, config, record.stats,
                ms, ms, ms, 1, record.time, source="runtime",
                extra={"ladder": LADDER_VERSION} if record.arm.graph else {},
            )  # fmt: skip
            self._record(record, measurement)


def _eager_rows(config: KernelConfig, x: torch.Tensor, causal: bool, total: int) -> int | None:
    """The values rows of an eager ragged run of `total` tokens: with cuBLAS linears on the GPU, a rung of
    rows (`cublas_rows`: cuBLAS's first call on a row count costs milliseconds of host time, and a stream
    brings a new count every batch); else None, the packed rows. Causal (decoder) runs keep their packed rows:
    their eager arm maps each packed row to a position and a cache slot, not tried with spare rows."""
    return cublas_rows(total) if config.backend == "cublas" and x.is_cuda and not causal else None


def _mask_rows(kpm: torch.Tensor, layout: Layout) -> torch.Tensor:
    """(B * L,) int64: the values row of each padded position (real tokens in order from their component's
    offset; pads point at the spare row `layout.rows`). A layout with query rows (`Layout.with_query_rows`)
    also maps a non-empty row's column 0, where it is a pad, to its component's query row."""
    real = ~kpm
    offsets = layout.device_meta(kpm.device)[0][:-1].to(torch.int64)
    rank = real.to(torch.int64).cumsum(1) - 1 + offsets[:, None]
    rows = torch.where(real, rank, layout.rows)
    keys = layout.key_lengths
    if keys is not None:
        query_row = torch.where(kpm[:, 0] & (keys > 0), offsets + keys, rows[:, 0])
        rows = torch.cat([query_row[:, None], rows[:, 1:]], 1)
    return rows.reshape(-1)


def _pack_by_mask(x: torch.Tensor, kpm: torch.Tensor, lens: tuple[int, ...], seq_axis: int, first_column: bool):
    """x's real tokens (kpm False, any pattern) packed back to back, align 1, as a RaggedTensor; no device
    sync. first_column: each non-empty row also packs column 0 as a query-only row (where column 0 is real,
    that row is zeros and unread)."""
    layout = Layout.with_query_rows(lens, x.device) if first_column else Layout.make(lens, 1)
    src = x if seq_axis == 1 else x.transpose(0, 1)
    B, L = kpm.shape
    flat = src.reshape(B * L, *src.shape[2:])
    make = flat.new_zeros if first_column else flat.new_empty
    values = make((layout.rows + 1, *src.shape[2:]))
    values.index_copy_(0, _mask_rows(kpm, layout), flat)  # pads all land on the spare row
    return RaggedTensor(values[: layout.rows], layout)


def _unpack_by_mask(values: torch.Tensor, rt: RaggedTensor, kpm: torch.Tensor, seq_axis: int) -> torch.Tensor:
    """The inverse of `_pack_by_mask`: values back at their padded positions (a query row's at column 0),
    zeros at the other pads."""
    B, L = kpm.shape
    spare = torch.cat([values[: rt.layout.rows], values.new_zeros((1, *values.shape[1:]))])
    out = spare.index_select(0, _mask_rows(kpm, rt.layout)).view(B, L, *values.shape[1:])
    return out if seq_axis == 1 else out.transpose(0, 1)
