"""The policy: which arm runs a batch, and so whether a mask that came alone is read.

Per shape (`ShapeKey`: the batch size, the padded length's rung, and whether only a device mask came) the
runtime keeps a `ShapeState`, and one rule decides:

1. An arm's cost is the cost model's prediction times how far the model was off for that arm: the median timed /
   predicted ratio of its recent timings on this shape; until it has some, of its timings on the module's other
   shapes (`Scales`); else of the other arms' on this shape; else, in training, of every arm's on the module (whose
   ratios start from the device's recorded training costs). A batch that compiled a kernel or ran beside a graph's
   warm-up is no timing. The cost is never below the median host time of the arm's timed calls here, or, with no
   timing here, the least of its calls anywhere: a host-bound arm's cost does not shrink with the tokens (HF's
   padded forward took up to 0.7 s at its first call on a new shape).
2. The cheapest arm that is ready runs. A graph is ready once captured; a graph that would be the cheapest is asked
   of the background worker (graphs/worker.py), and runs once it is there.
3. Once the running arm has MIN_SAMPLES timings, an arm not timed yet that costs within TRY_WITHIN of it is tried
   for up to MIN_SAMPLES batches (a graph among them is asked for at once, so that it is there for its trial): the
   trial ends early once the arm's timings price it beyond TRY_WITHIN. Every RETRY_EVERY batches of the shape, the
   other arms' timings are forgotten: those priced within TRY_WITHIN again are tried anew.
4. The running arm is timed until it has MIN_SAMPLES timings, then every `sample_every`-th batch of the shape.
5. Exploring (`autoragged.warmup`), a ready arm with no timing on the shape, none on its way, runs at once whatever
   its cost: warm-up pays the trials traffic would otherwise meet on the shape.

The eager ragged arm needs the batch's lengths: on a shape whose mask came alone it reads them (a device->host
copy, a sync), and its timings, taken from before the read, include what the read costs the stream. So a mask is
read exactly where reading and running eagerly is measured (or predicted) to beat running without lengths, and
at its batch size's first batch (nothing to predict it with: `new_shape`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from ..tuning_db import BatchStats

__all__ = ["ShapeKey", "ShapeState", "Scales", "Choice", "choose", "new_shape", "started", "observe", "TRY_WITHIN",
           "MIN_SAMPLES", "WINDOW"]  # fmt: skip

# An arm predicted within this factor of the running one is worth timing: the prior leaves out host time, and a
# stream pays every arm it tries (HF's padded forward took 549 ms at its first run on a new shape against 11.5).
TRY_WITHIN = 1.3
MIN_SAMPLES = 3  # timings before an arm's cost is its own: the median of three outlasts one delayed batch
RETRY_EVERY = 512  # batches of a shape between fresh timings of its runner-up: devices and streams drift
WINDOW = 8  # timings kept per arm


class ShapeKey(NamedTuple):
    """A shape: `batch` rows, padded to a length whose graph rung is `width`; `mask_only`: only a device mask came
    (the lengths are unknown until read); `train`: autograd records the batch (its arms' costs include the
    backward); `autocast`: it runs under autocast (the linears in its lower precision)."""

    batch: int
    width: int
    mask_only: bool
    train: bool = False
    autocast: bool = False


@dataclass
class ShapeState:
    """What the runtime knows of one shape. timed: each arm kind's recent timed / predicted ms; host_ms: its recent
    host ms (rule 1); stats: of the latest batch read (an unread batch is predicted with them; `new_shape` gives a
    mask-only shape's first ones); unread: the latest unread batch's record, its stats on their way; trying,
    tries_left: the arm on trial (rule 3); retry_at: the batch count of the next fresh trial; explored: batches run
    by rule 5."""

    batches: int = 0
    timed: dict[str, deque] = field(default_factory=dict)
    host_ms: dict[str, deque] = field(default_factory=dict)
    stats: BatchStats | None = None
    unread: object = None
    trying: str | None = None
    tries_left: int = 0
    retry_at: int = RETRY_EVERY
    explored: int = 0


@dataclass
class Scales:
    """What a module's timed batches say of each arm kind on shapes not timed yet: the recent timed / predicted
    ratios, and the least host time a call took (the prior leaves host time out: the eager arm's launches took ten
    times its GPU work on bert-base's short rows).

    shared: an arm timed nowhere takes the pooled ratio of the arms that were. Set for training, whose timings hold
    the backward the forward-only prior leaves out, every arm's alike; inference arms differ in host time."""

    ratios: dict[str, deque] = field(default_factory=dict)
    host_ms: dict[str, float] = field(default_factory=dict)
    shared: bool = False

    def pooled(self) -> float | None:
        """The median scale over every arm's recent ratios where `shared`, else None."""
        if not self.shared:
            return None
        every = [r for ratios in self.ratios.values() for r in ratios]
        return statistics.median(every) if every else None

    def seed(self, ratios: dict[str, list[float]]) -> None:
        """Start each arm kind's ratios from earlier measurements (oldest first): new timings push them out."""
        for kind, values in ratios.items():
            if values and kind not in self.ratios:
                self.ratios[kind] = deque(values[-WINDOW:], maxlen=WINDOW)

    def observe(self, kind: str, ms: float, predicted: float, host_ms: float) -> None:
        if 0 < predicted < math.inf:
            self.ratios.setdefault(kind, deque(maxlen=WINDOW)).append(ms / predicted)
        self.host_ms[kind] = min(host_ms, self.host_ms.get(kind, math.inf))

    def estimate(self, kind: str, predicted: float, shape_scale: float) -> float:
        ratios = self.ratios.get(kind)
        scaled = predicted * (statistics.median(ratios) if ratios else shape_scale)
        return max(scaled, self.host_ms.get(kind, 0.0))


EXPLORING = "exploring it (no timing on this shape yet)"


class Choice(NamedTuple):
    """The arm kind that runs, whether its batch is timed, the graph-arm kind whose capture is wanted (or None),
    and why this arm (for the decision record)."""

    kind: str
    timed: bool
    want: str | None
    why: str


def costs(state: ShapeState, predicted: dict[str, float], scales: Scales | None = None) -> dict[str, float]:
    """Each arm's cost for this batch: predicted, and scaled by its timings here or as rule 1 says."""
    median = statistics.median
    ratios = [median(state.timed[k]) for k in predicted if state.timed.get(k)]
    pooled = scales.pooled() if scales is not None else None
    shape = median(ratios) if ratios else (pooled or 1.0)
    out = {}
    for k, p in predicted.items():
        timed, host = state.timed.get(k), state.host_ms.get(k)
        if timed or scales is None:
            out[k] = p * (median(timed) if timed else shape)
        else:
            out[k] = scales.estimate(k, p, shape)
        if host:
            out[k] = max(out[k], median(host))
    return out


def choose(state: ShapeState, predicted: dict[str, float], ready: set[str], sample_every: int,
           scales: Scales | None = None, explore: bool = False) -> Choice:  # fmt: skip
    """The arm for the shape's next batch (rules 2-5). `predicted`: ms per candidate kind (inf: never); `ready`:
    the candidates that can run now (the padded arm always is); `scales`: the module's (rule 1); `explore`: rule 5."""
    state.batches += 1
    cost = costs(state, predicted, scales)
    best = min(cost, key=cost.__getitem__)
    run = min((k for k in cost if k in ready), key=cost.__getitem__)
    close = sorted((k for k in cost if k != run and cost[k] <= TRY_WITHIN * cost[run]), key=cost.__getitem__)
    untried = [k for k in close if not state.timed.get(k)]
    want = best if best not in ready else next((k for k in untried if k not in ready), None)
    want = want if want is not None and cost[want] < math.inf else None
    why = "timed on this device" if state.timed.get(run) else "predicted"
    timed = len(state.timed.get(run, ())) < MIN_SAMPLES
    trying = state.trying if state.trying != run else None  # (timed the cheapest, it runs: no trial)
    if trying in ready and trying in cost and cost[trying] <= TRY_WITHIN * cost[run]:
        run, why, timed = trying, f"trying it (the running arm is {run})", True
        state.tries_left -= 1
        if state.tries_left <= 0:
            state.trying = None
    elif not timed:
        state.trying = None
        trial = _trial(state, run, [k for k in untried if k in ready], [k for k in close if k in ready])
        if trial is not None:
            run, why, timed = trial, f"trying it (the running arm is {run})", True
            state.trying, state.tries_left = trial, MIN_SAMPLES - 1
    if not timed and sample_every > 0 and state.batches % sample_every == 0:
        timed = True
    if explore and sample_every > 0:
        new = [k for k in ready if cost[k] < math.inf and not state.timed.get(k) and not state.host_ms.get(k)]
        if new and run not in new:
            run, why, timed = min(new, key=cost.__getitem__), EXPLORING, True
            state.explored += 1
    return Choice(run, timed and sample_every > 0, want, why)


def _trial(state: ShapeState, run: str, untried: list[str], close: list[str]) -> str | None:
    """The arm to try now (the cheapest first), or None (rule 3)."""
    if untried:
        return untried[0]
    if state.batches >= state.retry_at:
        state.retry_at = state.batches + RETRY_EVERY
        for kind, timings in state.timed.items():
            if kind != run:
                timings.clear()
        state.host_ms = {kind: host for kind, host in state.host_ms.items() if kind == run}
        if close:
            return close[0]
    return None


def new_shape(shapes: dict[ShapeKey, ShapeState], key: ShapeKey, padded_len: int) -> ShapeState:
    """The state of a shape at its first batch. A mask-only shape starts from the latest stats of its batch size's
    nearest width, scaled to fit `padded_len`: its first batch is predicted like the shape's later ones, not read
    (a read is a sync of the stream: MNLI B=64's first 96-wide batch took 1.8 ms of host time against 0.09)."""
    state = ShapeState()
    if key.mask_only:
        known = [(abs(k.width - key.width), s.stats) for k, s in shapes.items()
                 if s.stats is not None and k._replace(width=key.width) == key]  # fmt: skip
        if known:
            state.stats = _fit(min(known, key=lambda pair: pair[0])[1], padded_len)
    return state


def _fit(stats: BatchStats, padded_len: int) -> BatchStats:
    """`stats` of a batch padded to `padded_len`, every length scaled down by one factor where the longest exceeds
    it."""
    f = min(1.0, padded_len / stats.max_len) if stats.max_len else 1.0
    B, total = stats.batch, round(stats.total * f)
    return BatchStats(batch=B, max_len=min(stats.max_len, padded_len), total=total, sum_sq=round(stats.sum_sq * f * f),
                      mean=stats.mean * f, std=stats.std * f,
                      pad_fraction=1.0 - total / (B * padded_len) if B and padded_len else 0.0)  # fmt: skip


def started(state: ShapeState, kind: str, host_ms: float) -> None:
    """A timed batch of `kind` on this shape took `host_ms` of host time; its timing lands later (rule 1)."""
    state.host_ms.setdefault(kind, deque(maxlen=WINDOW)).append(host_ms)


def observe(state: ShapeState, kind: str, ms: float, predicted: float) -> None:
    """A timing of `kind` on a batch of this shape that the cost model predicted at `predicted` ms (a batch
    without a usable prediction teaches nothing)."""
    if not 0 < predicted < math.inf:
        return
    samples = state.timed.get(kind)
    if samples is None:
        samples = state.timed[kind] = deque(maxlen=WINDOW)
    samples.append(ms / predicted)
