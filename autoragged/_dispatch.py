"""`autoragged.wrap()`: swap each encoder module for a dispatching one that picks an arm per batch.

The swap changes the instance's class to a subclass of its own (`DispatchingTransformerEncoder` /
`DispatchingTransformerEncoderLayer`): same object, same parameters, same `state_dict` keys, same
hooks, `isinstance` still true; `unwrap()` puts the class back. The per-module state lives in the
instance attribute `_autoragged` (a plain object, not a submodule).

One batch (`_Runtime.run`):
 1. lengths: `lengths=` or a RaggedTensor input (no device sync), or the key padding mask (one small
    device->host copy), or "all real" when there is neither. A mask-only batch of a (B, L) shape that an
    arm needing no lengths keeps winning (the copy's cost counted against the others) skips the copy and
    runs that arm on the mask (padded, or the ragged graph fed the mask); its stats reach the record
    later, without a sync. Once that arm's graph is captured, the shape's batches take a short path from
    the support checks to the replay (`_replay_unread`);
 2. `BatchStats` on the host;
 3. the arm: forced by the policy, forced to padded by anything the ragged arm does not support (the
    reason is recorded), or chosen by the planner;
 4. the arm runs; padded positions of the output are zero on both arms;
 5. a decision record goes into a ring buffer (and to the recorder); every `sample_every`-th batch is
    timed with CUDA events, harvested later without blocking, and fed back to the planner.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
import weakref
from collections import deque
from pathlib import Path

import torch
from torch import nn

from .kernels._config import KernelConfig
from .tuning_db import BatchStats, Decision, Measurement, ModuleSignature, default_path

from ._buckets import LADDER_VERSION
from ._costmodel import PADDED, PADDED_GRAPH, AnalyticPrior, Arm
from ._device import device_key
from ._epoch import param_epoch
from ._layout import Layout, as_lengths
from ._planner import GRAPH_BACKENDS, Plan, Planner, default_ragged_config, graph_config
from ._ragged import RaggedTensor, _from_padded, _to_padded, _zero_pads, mask_lengths
from ._recorder import RECORDER
from .nn import activation_kind, encoder_values, support_error

__all__ = ["wrap", "unwrap", "recent_decisions", "flush", "POLICIES"]

log = logging.getLogger("autoragged")
POLICIES = ("auto", "padded", "ragged")
_RING = 10_000
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_SUMMARY_EVERY = 1000  # batches between the INFO summary lines of a module
# Mask-only batches: reading lengths from a mask costs a device->host copy and a sync. Once an arm that
# needs no lengths (padded, padded graph, the ragged graph fed the mask) won a (B, L) shape _TRUST times in
# a row, counting that cost against the others, batches of the shape skip the read (every _RECHECK-th
# still reads, to notice a change) and run that arm on the mask itself: nothing synchronises.
# The verdicts come from predictions; on the GPU they are checked by timing: the judged batches that read
# lengths and the first _PROBES of a trusted shape run fed the mask are timed with CUDA events (harvested
# later, never blocking), and a shape whose unread arm measured slower than its read path plus the read is
# not trusted again (the mask graph can lose where the model says it wins: H100, Wiki512 B=64, 2026-11-23).
_TRUST = 3
_RECHECK = 16
_MAX_SHAPES = 4096
_PROBES = 3


def _shape_entry(streak: int = 0, arm: Arm = PADDED, predicted: dict | None = None, tokens: int = 0) -> list:
    """A mask_shapes entry (see _Runtime.__init__): a shape judged `streak` times in a row for `arm`."""
    return [streak, arm, 0, predicted or {}, tokens, {"read": [], "unread": [], "left": _PROBES, "lost": False}, None]


# -- the dispatching classes ----------------------------------------------------------------------
class DispatchingTransformerEncoder(nn.TransformerEncoder):
    """An `nn.TransformerEncoder` whose forward picks padded or ragged per batch (see `autoragged.wrap`).

    forward(src, mask=None, src_key_padding_mask=None, is_causal=None, *, lengths=None): `src` may also
    be a RaggedTensor (then the result is one); `lengths` are host ints (B) that make the mask optional.
    """

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None, *, lengths=None):
        return self._autoragged.run(self, src, mask, src_key_padding_mask, is_causal, lengths)


class DispatchingTransformerEncoderLayer(nn.TransformerEncoderLayer):
    """An `nn.TransformerEncoderLayer` whose forward picks padded or ragged per batch."""

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False, *, lengths=None):
        return self._autoragged.run(self, src, src_mask, src_key_padding_mask, is_causal, lengths)


_DISPATCHING = {
    nn.TransformerEncoder: DispatchingTransformerEncoder,
    nn.TransformerEncoderLayer: DispatchingTransformerEncoderLayer,
}
_BASE = {v: k for k, v in _DISPATCHING.items()}


def _layer_dict(module: nn.Module):
    """The `_modules` dict of an encoder's layer list (None for a layer): `del layers[i]` replaces it."""
    layers = module._modules.get("layers") if isinstance(module, nn.TransformerEncoder) else None
    return layers._modules if layers is not None else None


def signature_of(module: nn.Module) -> ModuleSignature:
    """The cost-relevant shape of an encoder or encoder layer ("unknown" parts for exotic layers)."""
    if isinstance(module, nn.TransformerEncoder):
        layers, final_norm, kind = list(module.layers), module.norm is not None, "encoder"
    else:
        layers, final_norm, kind = [module], False, "encoder_layer"
    first = layers[0]
    mha = getattr(first, "self_attn", None)
    if not isinstance(mha, nn.MultiheadAttention) or not isinstance(getattr(first, "linear1", None), nn.Linear):
        return ModuleSignature(kind, len(layers), 0, 0, 0, "unknown", False, "unknown", final_norm=final_norm)
    return ModuleSignature(
        kind=kind,
        layers=len(layers),
        d_model=mha.embed_dim,
        heads=mha.num_heads,
        ff=first.linear1.out_features,
        activation=activation_kind(first),
        norm_first=bool(first.norm_first),
        dtype=str(first.linear1.weight.dtype).replace("torch.", ""),
        bias=first.linear1.bias is not None,
        final_norm=final_norm,
        nested=bool(getattr(module, "use_nested_tensor", False)),
    )


# -- per-module runtime state ---------------------------------------------------------------------
class _Record:
    """A decision on its way out: cheap to make on the hot path, a `Decision` when read.

    The stats of a batch whose lengths were not read on the hot path arrive later: `defer` copies the
    per-row pad counts to the host without waiting, and the first read of `stats` (the recorder's thread,
    a harvest, `recent_decisions`) waits for that copy. The wait makes no CUDA call: the pinned slot was
    filled with -1 (never a pad count) before the copy, and the copy is done when no -1 is left. A CUDA
    call from the recorder's thread (an event sync) while any thread captures a CUDA graph in PyTorch's
    default global mode invalidates that capture (seen on the H100: a user's capture failed)."""

    __slots__ = ("time", "_stats", "_pending", "arm", "predicted_ms", "reason", "measured_ms", "device", "signature")

    def __init__(self, stats, arm, predicted_ms, reason, device, signature):
        self.time = time.time()
        self._stats = stats
        self._pending = None
        self.arm = arm
        self.predicted_ms = predicted_ms
        self.reason = reason
        self.measured_ms = None
        self.device = device
        self.signature = signature

    def defer(self, pads: torch.Tensor, width: int, L: int, ring: _PadsRing | None) -> None:
        """Stats of a (B, L) batch from `pads` (B,) int32, each row's pad count over `width` >= L columns,
        read when needed (a CUDA `pads` goes through `ring`, without waiting)."""
        if pads.is_cuda:
            host, event = ring.put(pads, self)
            self._pending = (host, event, width, L)
        else:
            self._pending = (pads, None, width, L)

    @property
    def stats(self) -> BatchStats:
        if self._pending is not None:
            with _RESOLVE:  # the recorder's thread and the hot path (a ring slot's reuse) may both get here
                pending = self._pending
                if pending is not None:
                    host, event, width, L = pending
                    pads = host.tolist()
                    if event is not None:
                        pads = _wait_for_copy(host, pads, event)
                    self._stats = BatchStats.from_lengths(tuple(width - p for p in pads), padded_len=L)
                    self._pending = None
        return self._stats

    def decision(self) -> Decision:
        config = None if self.arm.config is None else self.arm.config.to_dict()
        return Decision(
            self.time, self.device.key, self.signature, self.stats, self.arm.kind, config,
            dict(self.predicted_ms), self.reason, self.measured_ms,
        )  # fmt: skip


_RESOLVE = threading.Lock()
_COPY_TIMEOUT_S = 30.0


def _wait_for_copy(host: torch.Tensor, values: list[int], event) -> list[int]:
    """The pad counts once the device->host copy into `host` (pre-filled with -1) has landed, polling the
    pinned memory. Only a copy still missing after _COPY_TIMEOUT_S falls back to the event (which raises
    the device's error, if that is why)."""
    deadline = None
    while -1 in values:
        now = time.monotonic()
        deadline = deadline or now + _COPY_TIMEOUT_S
        if now > deadline:
            event.synchronize()
            return host.tolist()
        time.sleep(50e-6)
        values = host.tolist()
    return values


class _PadsRing:
    """Pinned host slots for the pad counts of batches whose lengths were not read: one non-blocking copy
    and one event per batch, no allocation. Once per round of `slots` batches, before slot 0 is reused,
    the counts of records nobody has read yet move off the ring in one clone (after the round's last copy
    has landed: long done, unless the host ran a round ahead of the device); records read earlier resolve
    themselves. Resolving one old record per batch instead (its copy-out and BatchStats) made `put` take
    53 us per batch under cProfile on the H100 host (2026-11-23).
    A slot reads -1 until its copy lands (a pad count is never -1: `_Record.stats` polls, no CUDA call): the
    whole buffer is filled with -1 when made and at each round's release, and each batch B's slot views
    are made once, not per batch (a fill and a view per batch were two more PyTorch calls on the hot path)."""

    def __init__(self, device: torch.device, slots: int = 64):
        self.device, self.slots, self.width, self.i = device, slots, 0, 0
        self.host = None
        self.views: dict[int, list[torch.Tensor]] = {}
        self.events = [torch.cuda.Event() for _ in range(slots)]
        self.owners: list[_Record | None] = [None] * slots

    def put(self, pads: torch.Tensor, record: _Record):
        from ._graphs import record_event

        B = pads.shape[0]
        if B > self.width:  # records still pending keep views of the old buffer, which is never written again
            self.width = max(B, 2 * self.width)
            # a plain tensor whatever mode this call is in: a buffer made under inference_mode is an inference
            # tensor, and the copies and fills of later calls under no_grad would raise
            with torch.inference_mode(False):
                self.host = torch.full((self.slots, self.width), -1, dtype=torch.int32).pin_memory()
            self.views = {}
            self.owners = [None] * self.slots
        self.i = i = (self.i + 1) % self.slots
        if i == 0:
            self._release()
        views = self.views.get(B)
        if views is None:
            views = self.views[B] = list(self.host[:, :B].unbind(0))
        view = views[i]
        view.copy_(pads, non_blocking=True)
        record_event(self.events[i], self.device.index)
        self.owners[i] = record
        return view, self.events[i]

    def _release(self) -> None:
        """Move the counts of the round's unread records into a copy of the buffer, then mark every slot
        not landed (-1) again: all slots are free."""
        from ._graphs import event_done

        pending = [(j, r) for j, r in enumerate(self.owners) if r is not None and r._pending is not None]
        self.owners = [None] * self.slots
        event_done(self.events[(self.i - 1) % self.slots])  # the newest copy; copies land in stream order
        if pending:
            snapshot = self.host.clone()
            with _RESOLVE:
                for j, record in pending:
                    if record._pending is not None:
                        host, _, width, L = record._pending
                        record._pending = (snapshot[j, : host.shape[0]], None, width, L)
        self.host.fill_(-1)


class _Runtime:
    def __init__(self, module: nn.Module, policy: str, db_path: Path | None, sample_every: int, explore: bool,
                 validate_lengths: bool, config, graphs: bool = True, graph_cap: int = 16):  # fmt: skip
        self.policy = policy
        self.graphs_enabled = graphs
        self.graph_cap = graph_cap
        self.graphs = None  # GraphCache, made on the first graph arm
        self.graph_min_seen = 2  # capture a bucket when it is asked for the second time
        self._probe, self._probe_epoch = None, -1
        self._params, self._params_epoch = [], -1
        self.db_path = db_path
        self.sample_every = sample_every
        self.explore = explore
        self.validate_lengths = validate_lengths
        self.forced_config = config
        self.base = _BASE[type(module)] if type(module) in _BASE else type(module)
        if isinstance(module, nn.TransformerEncoder):
            self.layers, self.norm = list(module.layers), module.norm
        else:
            self.layers, self.norm = [module], None
        self.batch_first = bool(getattr(getattr(self.layers[0], "self_attn", None), "batch_first", False))
        self.static_reason = support_error(module)
        self.has_dropout = any(m.p > 0 for layer in self.layers for m in layer.modules() if isinstance(m, nn.Dropout))
        # the hook dicts of every submodule the ragged arm bypasses (registering a hook mutates these)
        watched = [m for m in module.modules() if m is not module]
        self.hook_dicts = [m._forward_hooks for m in watched] + [m._forward_pre_hooks for m in watched]
        self.sig = signature_of(module)
        self.sig_key = self.sig.key
        # the structure all of the above was derived from: a change re-binds the module (`_restructured`)
        self._bound_epoch, self._bound_modules = param_epoch(), tuple(module.modules())
        self._bound_layers = _layer_dict(module)
        self._bound_count = len(self._bound_layers) if self._bound_layers is not None else 0
        self.ring: deque[_Record] = deque(maxlen=_RING)
        self.planners: dict[torch.device, Planner] = {}
        self.pending: deque = deque()
        self.count = 0
        # (B, L) -> [no-lengths verdicts in a row, the arm, batches since trusted, the last predictions,
        #           the last judged batch's tokens (the mask graph's linears pick their tiles for them),
        #           the probe: {"read": ms of timed read-path runs, "unread": ms of timed unread runs,
        #           "left": unread runs still to time, "lost": the unread arm measured slower},
        #           the graph the arm replays once captured, for `_replay_unread`: None, or (a weak reference
        #           to it, the GraphCache generation it was seen in, the record's reason, the device key)]
        self.mask_shapes: dict[tuple[int, int], list] = {}
        # host ms of reading lengths from a mask, the recent ones: their minimum is the read's own cost
        self.sync_samples: deque[float] = deque(maxlen=16)
        self.pads_ring: _PadsRing | None = None

    # -- pickling / deepcopy: options travel, caches and timers do not ------------------------
    def __getstate__(self):
        state = self.__dict__.copy()
        state.update(ring=deque(maxlen=_RING), planners={}, pending=deque(), graphs=None, mask_shapes={},
                     pads_ring=None, sync_samples=deque(maxlen=16))  # fmt: skip
        return state

    def _restructured(self, module) -> bool:
        """True if the module's structure changed since this runtime was bound to it (a layer replaced,
        added, removed, a norm or a submodule swapped): then the module is bound to a fresh runtime (its
        layers, support check, signature, hooks watched, graphs and planners made anew; the decision
        history kept), which takes the call. The layers the ragged arms run would otherwise be the old ones.
        Called when the registration epoch moved or the encoder's layer dict changed (see `run`)."""
        modules = tuple(module.modules())
        layers = _layer_dict(module)
        if modules == self._bound_modules:
            self._bound_epoch, self._bound_layers = param_epoch(), layers
            self._bound_count = len(layers) if layers is not None else 0
            return False
        self._harvest(wait=True)  # sampled batches still in flight get their timings recorded
        fresh = _Runtime(module, self.policy, self.db_path, self.sample_every, self.explore, self.validate_lengths,
                         self.forced_config, self.graphs_enabled, self.graph_cap)  # fmt: skip
        fresh.graph_min_seen, fresh.ring = self.graph_min_seen, self.ring
        module._autoragged = fresh
        log.info("autoragged: %s changed structure; bound anew (%s)", type(module).__name__, fresh.sig_key)
        return True

    # -- the hot path -------------------------------------------------------------------------
    def run(self, module, src, attn_mask, kpm, is_causal, lengths):
        layers = self._bound_layers
        if self._bound_epoch != param_epoch() or (layers is not None and (
            module._modules.get("layers") is None or module._modules["layers"]._modules is not layers
            or len(layers) != self._bound_count
        )):  # fmt: skip
            if self._restructured(module):
                return module._autoragged.run(module, src, attn_mask, kpm, is_causal, lengths)
        # a mask alone, of a trusted shape whose graph is kept: `_replay_unread`
        if lengths is None and attn_mask is None and not is_causal and isinstance(kpm, torch.Tensor):
            shape = self.mask_shapes.get(kpm.shape)
            if shape is not None and shape[6] is not None:
                out = self._replay_unread(module, src, kpm, shape)
                if out is not None:
                    return out
        ragged_in = isinstance(src, RaggedTensor)
        x = src.values if ragged_in else src
        if not ragged_in and not (isinstance(x, torch.Tensor) and not x.is_nested and x.dim() == 3):
            # unbatched or nested input: the original module handles it, and we record that we let it
            self._record(_Record(BatchStats.from_lengths(()), PADDED, {}, "input is not a batched (B, L, D) tensor",
                                 device_key(self._param().device), self.sig_key))  # fmt: skip
            return self.base.forward(module, src, attn_mask, kpm, is_causal)
        reason = self.static_reason or self._dynamic_reason(module, x, attn_mask, kpm, is_causal)
        mask_only = False
        if ragged_in:
            lens, L = src.lengths, src.max_len
        else:
            B, L = (x.shape[0], x.shape[1]) if self.batch_first else (x.shape[1], x.shape[0])
            # (a causal batch reads its lengths: the unread arms run the mask alone)
            mask_only = (
                lengths is None and kpm is not None and attn_mask is None and not is_causal and not reason
                and self.policy == "auto"
            )  # fmt: skip
            if mask_only:
                shape = self.mask_shapes.get((B, L))
                if shape is not None and shape[0] >= _TRUST and kpm.shape == (B, L):
                    shape[2] += 1
                    if shape[2] % _RECHECK:
                        return self._run_unread(module, x, kpm, B, L, shape)
                t0 = time.perf_counter()
            lens, not_prefix = self._lengths(kpm, lengths, B, L)
            if mask_only:
                ms = (time.perf_counter() - t0) * 1e3
                self.sync_samples.append(ms)
            if not_prefix is not None and not reason:
                reason = f"key padding mask row {not_prefix} is not right-padded"
        stats = BatchStats.from_lengths(lens, padded_len=L)
        if stats.max_len > L:
            i = lens.index(stats.max_len)
            raise ValueError(f"lengths[{i}] = {lens[i]} exceeds the padded length {L}")
        plan = self._plan(x.device, stats, reason)
        arm, why = plan.arm, plan.reason
        free = self.policy == "auto" and not reason  # the planner chose: its timings may teach it
        probe = None
        if mask_only and free:
            shape = self._judge_shape(B, L, plan.predicted_ms, self._mask_graph_arm(x.device, stats), stats.total)
            if shape[0] > 0 and not shape[5]["lost"] and len(shape[5]["read"]) < _PROBES:
                probe = (shape[5], B, L, "read")  # a verdict for the unread arm: time the read path too
        self.count += 1
        sampled = self.sample_every > 0 and self.count % self.sample_every == 0 and x.is_cuda
        if sampled and self.explore and free:
            alt = self.planners[x.device].explore(stats, arm)
            if alt is not None:
                arm, why = alt, f"exploring (the planner chose {plan.arm.label})"
        # a probe times the read path as the shape runs it: the planner's arm, not an explored one
        probe = probe if probe is not None and x.is_cuda and self.sample_every > 0 and arm == plan.arm else None
        sampled = sampled or probe is not None
        if ragged_in and arm.ragged and arm.config.align != src.align:
            # a RaggedTensor runs on its own layout (FFD bins are often align 16): no repack, and its graph
            # is captured for that alignment
            arm = Arm(arm.kind, arm.config.replace(align=src.align))
        if sampled:
            captures = self.graphs.captures if self.graphs is not None else 0
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        out, note = self._execute(module, arm, src, x, ragged_in, attn_mask, kpm, is_causal, lens, L, stats)
        # the record is made once the arm's work is queued: a launch-bound batch's latency is the host time
        # before its last launch, and bookkeeping after it overlaps the GPU's work
        record = _Record(stats, arm, plan.predicted_ms, why, device_key(x.device), self.sig_key)
        if sampled and self.graphs is not None and self.graphs.captures != captures:
            sampled = False  # this call captured a graph: its time is not the arm's latency
        if note:  # a graph arm ran eagerly this time: record what really ran, and why
            record.arm = Arm(arm.kind[: -len("_graph")], arm.config)
            record.reason = f"{why}; {note}"
            probe = None  # not how the shape runs once its graph is captured
        if sampled:
            end.record()
            self.ring.append(record)
            self.pending.append((start, end, record, x.device, free, probe))
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

    @property
    def sync_ms(self) -> float:
        """The read's own cost: the least of the recent reads' host times. A read also waits for the work
        queued before it (the first one for compiles and captures: 30-100 ms on the H100 host), which is
        not the read's doing; an average of those had every shape skip its reads."""
        return min(self.sync_samples) if self.sync_samples else 0.0

    def _mask_graph_arm(self, device: torch.device, stats: BatchStats) -> Arm | None:
        """The ragged graph arm that can run a mask without its lengths (Triton linears: they stop at the
        rows the graph counts on the device), or None where graphs do not run. Fed the mask or the lengths
        it does the same work, so the batch's own prediction for it holds for either."""
        if not (self.graphs_enabled and device.type == "cuda"):
            return None
        return Arm("ragged_graph", graph_config(self.sig.d_model // max(self.sig.heads, 1), stats.max_len, "triton"))

    def _judge_shape(self, B: int, L: int, predicted: dict[str, float], mask_arm: Arm | None = None, tokens=0):
        """Would an arm that needs no lengths (the padded arms, or `mask_arm` fed the mask) have won this
        mask-only batch of `tokens` real tokens, counting the read's cost against the arms that need them?"""
        unread = {k: v for k, v in predicted.items() if k in ("padded", "padded_graph")}
        mask_label = mask_arm.label if mask_arm is not None else None
        # the arms the read path may run (the planner never runs the mask arm on read lengths: Arm.mask_only)
        needs_lengths = [v for k, v in predicted.items() if k not in unread and k != mask_label]
        if mask_label in predicted:
            unread[mask_label] = predicted[mask_label]
        if len(self.mask_shapes) >= _MAX_SHAPES and (B, L) not in self.mask_shapes:
            self.mask_shapes.clear()
        entry = self.mask_shapes.get((B, L)) or self.mask_shapes.setdefault((B, L), _shape_entry())
        best = min(unread, key=unread.get) if unread else None
        wins = best is not None and (not needs_lengths or unread[best] <= min(needs_lengths) + self.sync_ms)
        if wins and not entry[5]["lost"]:
            entry[0] += 1
            arm = {"padded": PADDED, "padded_graph": PADDED_GRAPH}.get(best, mask_arm)
            if arm != entry[1]:  # another arm: its timings start afresh, and its graph is not the one kept
                entry[5].update(read=[], unread=[], left=_PROBES)
                entry[6] = None
            entry[1] = arm
            entry[3], entry[4] = predicted, tokens
        else:
            entry[0] = 0
        return entry

    def _run_unread(self, module, x, kpm, B: int, L: int, shape: list):
        """A mask-only batch of a shape (its `mask_shapes` entry) where an arm that needs no lengths wins: run
        it on the mask, lengths never read. The record carries the predictions of the shape's last judged
        batch (of `tokens`). The shape's first `_PROBES` runs that replay (not capture) are timed for
        `_probe_result`. Once the arm's graph replays untimed, the entry keeps it for `_replay_unread`."""
        arm, predicted, tokens, probe = shape[1], shape[3], shape[4], shape[5]
        self.count += 1
        why = f"{arm.kind} fed the mask wins on this (B, L) even counting the mask read; lengths not read"
        timed = probe["left"] > 0 and x.is_cuda and self.sample_every > 0
        if timed:
            captures = self.graphs.captures if self.graphs is not None else 0
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        out, pads, width, note, graph = self._execute_unread(module, x, kpm, B, L, arm, tokens)
        if timed and note is None and (self.graphs.captures if self.graphs is not None else 0) == captures:
            end.record()
            probe["left"] -= 1
            self.pending.append((start, end, None, x.device, False, (probe, B, L, "unread")))
        if note is not None:
            arm, why = PADDED, f"{why}; {note}"
        record = _Record(None, arm, predicted, why, device_key(x.device), self.sig_key)
        if pads.is_cuda and (self.pads_ring is None or self.pads_ring.device != pads.device):
            self.pads_ring = _PadsRing(pads.device)
        if graph is not None and not timed:
            shape[6] = (weakref.ref(graph), self.graphs.generation, why, record.device)
        return self._unread_done(record, pads, width, B, L, out)

    def _replay_unread(self, module, x, kpm, shape: list):
        """The hot path of a trusted mask-only shape whose arm's graph is captured (`shape[6]`): the fewest
        steps before the replay, because a short batch's latency is the host time before its replay plus
        the GPU's. None when this batch must take the general path instead: the shape is not trusted, it is
        due a read or a timing, something differs (`_dynamic_reason`, the input's shape), or the graph left
        the cache."""
        ref, generation, why, device = shape[6]
        graphs = self.graphs
        if (
            shape[0] < _TRUST or (shape[2] + 1) % _RECHECK == 0 or (shape[5]["left"] > 0 and self.sample_every > 0)
            or graphs is None or graphs.generation != generation or not self.graphs_enabled or self.policy != "auto"
            or not isinstance(x, torch.Tensor) or x.is_nested or x.dim() != 3
        ):  # fmt: skip
            return None
        B, L = kpm.shape
        if (x.shape[0], x.shape[1]) != ((B, L) if self.batch_first else (L, B)):
            return None
        if self.static_reason or self._dynamic_reason(module, x, None, kpm, None) is not None:
            return None
        graphs._check_params(self._parameters(module))
        graph = ref()
        if graph is None or graphs.generation != generation:  # parameters moved: the graphs are gone
            return None
        shape[2] += 1
        self.count += 1
        out = graph.run_mask(x, kpm)
        graphs.graphs.move_to_end(graph.key)  # most recently used
        return self._unread_done(_Record(None, shape[1], shape[3], why, device, self.sig_key), graph.pads,
                                 graph.width, B, L, out)  # fmt: skip

    def _unread_done(self, record: _Record, pads: torch.Tensor, width: int, B: int, L: int, out):
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

    def _execute_unread(self, module, x, kpm, B: int, L: int, arm: Arm, tokens: int = 0):
        """(output, per-row pad counts, the columns they count over, None, the graph or None) of an arm run
        on the mask itself (a padded arm, or the ragged graph fed the mask, its tiles picked for `tokens`
        rows when > 0); the note says why it ran eagerly padded instead."""
        note = None
        if not arm.graph:
            pass
        elif not self.graphs_enabled:
            note = "graphs are off (wrap(graphs=False))"
        elif self._graph_cache(x) is None:
            note = "CUDA graphs need a GPU"
        else:
            if arm.ragged:
                graph, note = self.graphs.ragged_mask(
                    self, module, arm.config, False, B, L, x.dtype, x.device, tokens or None
                )
            else:
                graph, note = self.graphs.padded(self, module, B, L, x.dtype, x.device, io="mask")
            if graph is not None:
                return graph.run_mask(x, kpm), graph.pads, graph.width, None, graph
        out = self.base.forward(module, x, None, kpm, None)
        out = _zero_pads(out, kpm, self.batch_first)
        return out, kpm.sum(1, dtype=torch.int32), L, note, None

    def _probe_result(self, probe: dict, B: int, L: int, kind: str, ms: float) -> None:
        """One timed run of (B, L), `kind` "read" or "unread": once a read run and two unread ones are in,
        a shape whose unread arm took longer than its read path plus the read's cost loses its trust
        (the predictions said otherwise)."""
        probe[kind].append(ms)
        if len(probe["unread"]) < 2 or not probe["read"] or probe["lost"]:
            return
        unread, read = min(probe["unread"]), min(probe["read"])
        if unread > read + self.sync_ms:
            probe["lost"] = True
            entry = self.mask_shapes.get((B, L))
            if entry is not None and entry[5] is probe:
                entry[0] = 0
            log.info(
                "autoragged %s: B=%d L=%d fed the mask took %.3f ms, reading lengths %.3f + %.3f ms: reading them",
                self.sig_key, B, L, unread, read, self.sync_ms,
            )  # fmt: skip

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
        """The first layer's linear1 weight: its dtype and device stand for the module's. Cached, and
        re-read when any parameter was re-registered (module attribute lookups cost microseconds)."""
        if self._probe_epoch != param_epoch():
            self._probe, self._probe_epoch = self.layers[0].linear1.weight, param_epoch()
        return self._probe

    def _record(self, record: _Record, measurement: Measurement | None = None) -> None:
        if measurement is None:
            self.ring.append(record)
        if self.db_path is not None:
            RECORDER.add(self.db_path, record.device, record, measurement)

    def _parameters(self, module) -> list[nn.Parameter]:
        """The module's parameters, re-listed only when a parameter or module was registered anywhere
        (`param_epoch`). Read on every batch: their requires_grad flags by the autograd check (a frozen model
        called with grad mode on walked its module tree per batch before, 143 us on the CoRa encoder on a CPU
        host, against 8 us for the flags of the kept list), their storage by the graph cache."""
        if self._params_epoch != param_epoch():
            self._params, self._params_epoch = list(module.parameters()), param_epoch()
        return self._params

    def _dynamic_reason(self, module, x, attn_mask, kpm, is_causal) -> str | None:
        p = self._param()
        device = x.device
        if x.dtype != p.dtype or device != p.device:
            return f"input {x.dtype} on {device} differs from the parameters ({p.dtype} on {p.device})"
        if attn_mask is not None and not is_causal:
            return "attn_mask other than key padding (pass is_causal=True with a causal mask)"
        if is_causal and attn_mask is None:
            return "is_causal without attn_mask"
        if kpm is not None and kpm.dtype != torch.bool:
            return "key padding mask is not bool"
        if torch.is_grad_enabled() and (x.requires_grad or any(map(_REQUIRES_GRAD, self._parameters(module)))):
            return "autograd is on (no backward kernels yet)"
        if module.training and self.has_dropout:
            return "training mode with dropout"
        if torch.is_autocast_enabled(device.type):
            return "autocast"
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return "global forward hooks"
        if any(self.hook_dicts):
            return "forward hooks on submodules"
        return None

    def _lengths(self, kpm, lengths, B, L) -> tuple[tuple[int, ...], int | None]:
        """(host lengths, first non-prefix mask row or None)."""
        if lengths is not None:
            lens = as_lengths(lengths)
            if len(lens) != B:
                raise ValueError(f"got {len(lens)} lengths for a batch of {B}")
            if kpm is not None and self.validate_lengths and kpm.dtype == torch.bool:
                from_mask, _ = mask_lengths(kpm, batch=B, seq_len=L)
                if from_mask != lens:
                    i = next(i for i, (a, b) in enumerate(zip(lens, from_mask)) if a != b)
                    raise ValueError(
                        f"lengths[{i}] = {lens[i]} but src_key_padding_mask row {i} has {from_mask[i]} real tokens "
                        "(wrap(..., validate_lengths=False) skips this check and its device sync)"
                    )
            return lens, None
        if kpm is not None:
            mask = kpm if kpm.dtype == torch.bool else torch.isneginf(kpm)
            return mask_lengths(mask, batch=B, seq_len=L)
        return (L,) * B, None

    def _plan(self, device: torch.device, stats: BatchStats, reason: str | None) -> Plan:
        if reason:
            return Plan(PADDED, {}, reason)
        if self.policy == "padded":
            return Plan(PADDED, {}, "policy=padded")
        if self.policy == "ragged":
            config = self.forced_config or default_ragged_config(self.sig.d_model // self.sig.heads, stats.max_len)
            return Plan(Arm("ragged", config), {}, "policy=ragged")
        planner = self.planners.get(device)
        if planner is None:
            planner = self.planners[device] = self._make_planner(device)
        return planner.plan(stats)

    def _make_planner(self, device: torch.device) -> Planner:
        from ._learned import load_planner_inputs

        key = device_key(device)
        learned = load_planner_inputs(self.db_path, key, self.sig)
        head_dim = self.sig.d_model // max(self.sig.heads, 1)
        model, shortlist = learned if learned is not None else (AnalyticPrior(key), None)
        graphs = self.graphs_enabled and device.type == "cuda"

        def candidates(stats: BatchStats) -> list[Arm]:
            arms = shortlist(stats) if shortlist else [Arm("ragged", default_ragged_config(head_dim, stats.max_len))]
            if graphs:  # replayed as graphs, with the configs the tuner measures graphs with
                arms = [*arms, *(Arm("ragged_graph", graph_config(head_dim, stats.max_len, b)) for b in GRAPH_BACKENDS)]
                arms.append(PADDED_GRAPH)
            return arms

        return Planner(self.sig, model, candidates)

    def _execute(self, module, arm, src, x, ragged_in, attn_mask, kpm, is_causal, lens, L, stats):
        """Run `arm`; returns (output, note) where note says why a graph arm ran eagerly (else None)."""
        seq_axis = 1 if self.batch_first else 0
        causal = bool(is_causal) and attn_mask is not None
        note = None
        if arm.graph:
            out, note = self._execute_graph(module, arm, src, x, ragged_in, attn_mask, causal, lens, L, stats, seq_axis)
            if note is None:
                return out, None
        if arm.ragged:
            if ragged_in:
                values = encoder_values(self.layers, self.norm, x, src.layout, arm.config, causal)
                return src.with_values(values), note
            rt = _from_padded(x, lens, arm.config.align, seq_axis)
            values = encoder_values(self.layers, self.norm, rt.values, rt.layout, arm.config, causal)
            return _to_padded(RaggedTensor(values, rt.layout), 0.0, L, seq_axis), note
        return self._execute_padded(
            module, src, x, ragged_in, attn_mask, kpm, is_causal, lens, L, stats, seq_axis
        ), note

    def _execute_graph(self, module, arm, src, x, ragged_in, attn_mask, causal, lens, L, stats, seq_axis):
        """(output, None) from a replayed graph, or (None, why it must run eagerly)."""
        if self._graph_cache(x) is None:
            return None, "CUDA graphs need a GPU"
        if arm.ragged:
            align = arm.config.align
            rows = stats.total if align == 1 else Layout.make(lens, align).rows
            if ragged_in and not src.layout.same_as(Layout.make(lens, align)):
                return None, f"the input's layout (align {src.align}) is not the graph's (align {align})"
            io = "values" if ragged_in else "padded"
            graph, note = self.graphs.ragged(self, module, arm.config, causal, stats, rows, x.dtype, x.device, io)
            if graph is None:
                return None, note
            # no inference_mode here: the static buffers are plain tensors (GraphCache._get), and entering
            # the context costs tens of microseconds of host time on a launch-bound batch
            if ragged_in:
                return src.with_values(graph.run_values(x, lens)), None
            return graph.run_padded(x, lens), None  # reads x, writes a fresh output: no copies in or out
        if attn_mask is not None:
            return None, "the padded graph takes no attn_mask"
        padded = _to_padded(src, 0.0, L, seq_axis) if ragged_in else x
        graph, note = self.graphs.padded(self, module, stats.batch, L, x.dtype, x.device)
        if graph is None:
            return None, note
        out = graph.run(padded, lens)
        return (_from_padded(out, lens, src.align, seq_axis) if ragged_in else out), None

    def _graph_cache(self, x: torch.Tensor):
        """The module's GraphCache (made on first use), or None for an input off the GPU."""
        if not x.is_cuda:
            return None
        if self.graphs is None:
            from ._graphs import GraphCache

            self.graphs = GraphCache(cap=self.graph_cap, min_seen=self.graph_min_seen)
        return self.graphs

    def _execute_padded(self, module, src, x, ragged_in, attn_mask, kpm, is_causal, lens, L, stats, seq_axis):
        padded_in = _to_padded(src, 0.0, L, seq_axis) if ragged_in else src
        has_pads = stats.total < stats.batch * L
        pad_mask = (
            kpm if (kpm is not None and not ragged_in) else (self._pad_mask(lens, L, x.device) if has_pads else None)
        )
        out = self.base.forward(module, padded_in, attn_mask, pad_mask, is_causal)
        if has_pads and pad_mask is not None:
            mask = pad_mask.bool() if pad_mask.dtype == torch.bool else torch.isneginf(pad_mask)
            out = _zero_pads(out, mask, self.batch_first)
        if ragged_in:
            return _from_padded(out, lens, src.align, seq_axis)
        return out

    @staticmethod
    def _pad_mask(lens: tuple[int, ...], L: int, device: torch.device) -> torch.Tensor:
        """(B, L) bool, True = pad, built on the device from host lengths (no sync)."""
        dev_lengths = Layout.make(lens, 1).device_meta(device)[1]
        return torch.arange(L, device=device, dtype=torch.int32)[None, :] >= dev_lengths[:, None]

    def _harvest(self, wait: bool = False) -> None:
        """Read the timings of sampled batches whose end event has completed; waits only if `wait`."""
        while self.pending:
            start, end, record, device, free, probe = self.pending[0]
            if wait:
                end.synchronize()
            elif not end.query():
                return
            self.pending.popleft()
            ms = start.elapsed_time(end)
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


# -- public API -----------------------------------------------------------------------------------
def _resolve_db(db) -> Path | None:
    if db is False:
        return None
    if db is None:
        return default_path()
    path = Path(db).expanduser().resolve()
    RECORDER.open_db(path)  # an explicit path that cannot be used is an error now, not a warning later
    return path


def _targets(model: nn.Module) -> list[nn.Module]:
    """Encoders, and encoder layers not inside an encoder, in module order."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        base = _BASE.get(type(module), type(module))
        if base is nn.TransformerEncoder:
            found.append(module)
            inside.update(id(m) for m in module.modules())
        elif base is nn.TransformerEncoderLayer:
            found.append(module)
    return found


def wrap(
    model: nn.Module,
    *,
    db: str | Path | None | bool = None,
    policy: str = "auto",
    sample_every: int = 32,
    explore: bool = True,
    validate_lengths: bool = True,
    config: KernelConfig | None = None,
    graphs: bool = True,
    graph_cap: int = 16,
) -> nn.Module:
    """Make every `nn.TransformerEncoder` (and every `nn.TransformerEncoderLayer` outside one) in `model`
    choose, per batch, between its own padded forward and our ragged kernels. Returns `model` (changed
    in place: same object, parameters and state_dict; `unwrap` undoes it).

    db:        the tuning database (default `$AUTORAGGED_DB` or ~/.cache/autoragged/tuning.sqlite) where
               decisions and sampled latencies are recorded and the calibrated cost model is read;
               False records nothing and uses the analytic prior.
    policy:    "auto" (cost model), "padded" or "ragged" (forced, for benchmarks and debugging; batches
               the ragged arm cannot run still go padded, with the reason recorded).
    sample_every: time every n-th batch with CUDA events (0: never); the planner learns from these. Also
                  timed (unless 0): a mask-only shape's judged batches and its first unread replays, so a
                  shape that skips the lengths read and measures slower goes back to reading them.
    explore:   on sampled batches, try an arm that has too few measurements for that batch's bucket.
    validate_lengths: when both `lengths=` and a key padding mask are given, check they agree (one
               device->host copy); set False to trust `lengths` and skip the copy.
    config:    with policy="ragged", the `KernelConfig` to force (default: the untuned default).
    graphs:    on CUDA, also consider each arm replayed as a CUDA graph of its shape bucket (captured
               when a bucket recurs, at most `graph_cap` kept per module, least recently used out).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap expects an nn.Module, got {type(model).__name__}")
    if not isinstance(sample_every, int) or sample_every < 0:
        raise ValueError(f"sample_every must be an int >= 0, got {sample_every!r}")
    targets = _targets(model)
    if not targets:
        raise ValueError(
            f"wrap found no nn.TransformerEncoder or nn.TransformerEncoderLayer in {type(model).__name__}; "
            "autoragged wraps PyTorch's encoder modules (their exact classes, not subclasses)"
        )
    db_path = _resolve_db(db)
    for module in targets:
        for inner in module.modules():  # layers wrapped on their own earlier now run inside the encoder
            if inner is not module and hasattr(inner, "_autoragged"):
                _unwrap_one(inner)
        if hasattr(module, "_autoragged"):
            _unwrap_one(module)
        module.__class__ = _DISPATCHING[type(module)]
        module._autoragged = _Runtime(
            module, policy, db_path, sample_every, explore, validate_lengths, config, graphs, graph_cap
        )
        reason = module._autoragged.static_reason
        if reason:
            log.info("autoragged: %s always runs padded: %s", type(module).__name__, reason)
    return model


def _unwrap_one(module: nn.Module) -> None:
    runtime = module.__dict__.pop("_autoragged", None)
    if runtime is not None:
        runtime._harvest(wait=True)  # sampled batches still in flight get their timings recorded
    module.__class__ = _BASE.get(type(module), type(module))


def unwrap(model: nn.Module) -> nn.Module:
    """Put the original classes back (recorded decisions are flushed). Returns `model`."""
    for module in list(model.modules()):
        if hasattr(module, "_autoragged"):
            _unwrap_one(module)
    flush()
    return model


def recent_decisions(model: nn.Module, n: int = 100) -> list[Decision]:
    """The latest `n` decisions of every wrapped module in `model`, oldest first."""
    records = [r for m in model.modules() if hasattr(m, "_autoragged") for r in m._autoragged.ring]
    records.sort(key=lambda r: r.time)
    return [r.decision() for r in records[-n:]] if n > 0 else []


def flush() -> int:
    """Write recorded decisions and latencies to the tuning database now; returns rows written."""
    return RECORDER.flush()
