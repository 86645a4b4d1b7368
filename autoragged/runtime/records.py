"""Decision records on their way out, and the pinned ring that brings the stats of unread batches to the host.

A record is cheap to make on the hot path; its `BatchStats` may arrive later (a mask-only batch whose
lengths were never read: the device counts its pads into a pinned host slot, which a mask graph's replay
writes itself and the padded arm's count reaches by a non-blocking copy).
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

import torch

from ..graphs.capture import event_done, record_event
from ..graphs.worker import worker
from ..tuning_db import BatchStats, Decision

__all__ = ["Record", "Pending", "PadsRing", "PadsSlot", "Timers", "TimerPair", "quiet_mark"]


class Record:
    """A decision on its way out: cheap to make on the hot path, a `Decision` when read.

    An unread batch's pad counts reach a pinned slot later (`defer`); the first read of `stats` polls the slot, -1
    until they land, and makes no CUDA call (an event sync from the recorder's thread broke a user's capture in
    PyTorch's default global mode)."""

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

    def defer(self, pads: torch.Tensor | PadsSlot, width: int, L: int, ring: PadsRing | None) -> None:
        """Stats of a (B, L) batch from each row's pad count over `width` >= L columns, read when needed: `pads` a
        slot of `ring` that the queued work writes (a mask graph's replay), a (B,) int32 CUDA tensor (copied into
        a slot without waiting) or a CPU one."""
        if isinstance(pads, torch.Tensor) and not pads.is_cuda:
            self._pending = Pending(pads, None, width, L)
            return
        if isinstance(pads, torch.Tensor):
            slot = ring.take(pads.shape[0])
            slot.host.copy_(pads, non_blocking=True)
            ring.sent(slot)
        else:
            slot = pads
        ring.owners[slot.index] = self
        self._pending = Pending(slot.host, slot.event, width, L)

    @property
    def stats(self) -> BatchStats:
        if self._pending is not None:
            with _RESOLVE:  # the recorder's thread and the hot path (a ring slot's reuse) may both get here
                pending = self._pending
                if pending is not None:
                    pads = pending.host.tolist()
                    if pending.event is not None:
                        pads = _wait_for_copy(pending.host, pads, pending.event)
                    self._stats, self._pending = pending.stats(pads), None
        return self._stats

    def peek(self) -> BatchStats | None:
        """The stats if they are on the host already, else None: never waits, makes no CUDA call and takes no
        lock (the hot path predicts a batch not read with its shape's latest stats, `Runtime._stats`). A
        pinned slot's copy has landed when it holds no -1 (each count is written whole); a slot is only ever
        replaced by a copy of itself, on the hot path's own thread (`PadsRing._free`)."""
        pending = self._pending
        if pending is None:
            return self._stats
        pads = pending.host.tolist()
        return None if -1 in pads else pending.stats(pads)

    def decision(self) -> Decision:
        config = None if self.arm.config is None else self.arm.config.to_dict()
        return Decision(
            self.time, self.device.key, self.signature, self.stats, self.arm.kind, config,
            dict(self.predicted_ms), self.reason, self.measured_ms,
        )  # fmt: skip


class Pending(NamedTuple):
    """An unread batch's pad counts on their way: the host view they land in (-1 until then), the event after the
    work that writes them (None: a CPU tensor, or a snapshot), and the width they count over of a batch padded to
    `padded_len`."""

    host: torch.Tensor
    event: object
    width: int
    padded_len: int

    def stats(self, pads: list[int]) -> BatchStats:
        return BatchStats.from_lengths(tuple(self.width - p for p in pads), padded_len=self.padded_len)


_RESOLVE = threading.Lock()
_COPY_TIMEOUT_S = 30.0


def _wait_for_copy(host: torch.Tensor, values: list[int], event) -> list[int]:
    """The pad counts once they have landed in `host` (pre-filled with -1), polling the pinned memory. Only
    counts still missing after _COPY_TIMEOUT_S fall back to the event (which raises the device's error, if that
    is why)."""
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


class PadsSlot(NamedTuple):
    """One batch's place in a `PadsRing`: the slot's index, its (B,) int32 pinned view (-1 until the counts land)
    and the event recorded after the work that writes it."""

    index: int
    host: torch.Tensor
    event: torch.cuda.Event


class PadsRing:
    """Pinned host slots for the pad counts of batches whose lengths were not read: a mask graph's replay writes
    its batch's slot itself (kernels/masked_pack.py `post_pads`: a copy after each replay cost 5-20 us a batch), the
    padded arm's counts come by one non-blocking copy. A slot reads -1 until its counts land. A slot is taken again a
    round of `slots` batches later, once its last batch's counts have landed: a query, and a wait only where the host
    runs a whole round ahead of the device (a wait for the batch just queued drains the stream: calls of 1-181 ms
    where the median was 0.1-11, `benchmarks/stream_table.py` on an H100). A record nobody has read yet takes a copy
    of its counts."""

    def __init__(self, device: torch.device, slots: int = 64):
        self.device, self.slots, self.width, self.i = device, slots, 0, 0
        self.host = None
        self.views: dict[int, list[torch.Tensor]] = {}
        self.events = [torch.cuda.Event() for _ in range(slots)]
        self.owners: list[Record | None] = [None] * slots
        self.retired: list[torch.Tensor] = []

    def take(self, B: int) -> PadsSlot:
        """The next slot, for a batch of B rows; `sent` once the work that writes it is queued."""
        if B > self.width:  # no slot of the old buffer is handed out again; pending records keep views of it
            if self.host is not None:  # and a queued replay may still write it: never freed (a few KiB each)
                self.retired.append(self.host)
            self.width = max(B, 2 * self.width)
            # a plain tensor whatever mode this call is in: a buffer made under inference_mode is an inference
            # tensor, and the copies and fills of later calls under no_grad would raise
            with torch.inference_mode(False):
                self.host = torch.full((self.slots, self.width), -1, dtype=torch.int32).pin_memory()
            self.views = {}
            self.owners = [None] * self.slots
        self.i = i = (self.i + 1) % self.slots
        self._free(i)
        views = self.views.get(B)
        if views is None:
            views = self.views[B] = list(self.host[:, :B].unbind(0))
        return PadsSlot(i, views[i], self.events[i])

    def sent(self, slot: PadsSlot) -> None:
        """The work that writes `slot` is queued: its event follows it."""
        record_event(slot.event, self.device.index)

    def _free(self, i: int) -> None:
        """Free slot `i` for its next batch: once its last batch's counts have landed, a record still waiting for
        them takes a copy, and the slot reads -1 (not landed) again."""
        owner, self.owners[i] = self.owners[i], None
        event_done(self.events[i])
        if owner is not None:
            with _RESOLVE:
                waiting = owner._pending
                if waiting is not None:
                    owner._pending = waiting._replace(host=waiting.host.clone(), event=None)
        self.host[i].fill_(-1)


class _HostTimer:
    """A CUDA event's timing interface on the host clock, for CPU batches (their ops run synchronously)."""

    __slots__ = ("t",)

    def record(self) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _HostTimer) -> float:
        return (end.t - self.t) * 1e3


class TimerPair(NamedTuple):
    """A start and an end timer (CUDA events, or `_HostTimer`s on a CPU) of the `Timers` they go back to."""

    timers: Timers
    start: object
    end: object

    def give(self) -> None:
        self.timers.give(self)


class Timers:
    """Timer pairs for a device, reused: CUDA events recorded through `record_event` (a few microseconds, against
    tens for `Event.record`), or the host clock on a CPU, whose ops are synchronous."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.index = (device.index if device.index is not None else torch.cuda.current_device()) if self.cuda else -1
        self.free: list[TimerPair] = []

    def start(self) -> TimerPair:
        """A pair whose start is recorded now."""
        pair = self.take()
        self.record(pair.start)
        return pair

    def take(self) -> TimerPair:
        """A pair, neither recorded."""
        if self.free:
            return self.free.pop()
        if self.cuda:
            return TimerPair(self, torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        return TimerPair(self, _HostTimer(), _HostTimer())

    def record(self, timer) -> None:
        if self.cuda:
            record_event(timer, self.index)
        else:
            timer.record()

    def give(self, pair: TimerPair) -> None:
        if len(self.free) < 64:
            self.free.append(pair)


_COMPILES = [0]  # Triton kernels compiled (or loaded from its cache) in this process, counted by a JIT hook


def _count_compiles() -> None:
    """Chain a counter onto Triton's post-compile hook (a Triton without the hook: nothing is counted)."""
    try:
        from triton import knobs

        hooks = knobs.runtime
        before = hooks.jit_post_compile_hook
    except (ImportError, AttributeError):
        return

    def post(*args, **kwargs):
        _COMPILES[0] += 1
        return before(*args, **kwargs) if before is not None else None

    hooks.jit_post_compile_hook = post


_count_compiles()


def quiet_mark() -> tuple[int, int] | None:
    """What one-time work has happened so far (kernels compiled, background captures begun and ended), or None
    while a capture runs: a batch whose mark changed, or that began or ended during a capture, is no sample of its
    arm's cost (a compile took 0.1-1 s of a batch's time; a capture competes with the caller for the host)."""
    return None if worker.busy else (_COMPILES[0], worker.changes)
