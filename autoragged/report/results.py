"""What `python -m autoragged.report` returns: the report's results as dataclasses (`autoragged.report.summary`),
apart from how they are read from a tuning database (report/__init__.py) and printed (render.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Share", "TimeSaved", "Regret", "GraphEvents", "ModuleSummary", "Calibration", "DeviceSummary", "Summary"]


@dataclass
class Share:
    """How many of a module's batches went one way. label: an arm ("padded", "ragged") or an arm label
    ("padded", "ragged:m64n64k64w4s2a1-cublas"); batches: count; share: batches / module batches (0..1)."""

    label: str
    batches: int
    share: float


@dataclass
class TimeSaved:
    """What the choices saved, ESTIMATED BY THE COST MODEL (predicted latencies, not measurements).

    Over the `batches` decisions whose predicted_ms holds the chosen arm, "padded" and at least one eager
    ragged label ("ragged:<config>"): chosen_ms = sum of predicted[chosen]; always_padded_ms = sum of
    predicted["padded"] (the module as written, eager); always_ragged_ms = sum of the best predicted eager
    ragged config per batch (graph-replayed arms are not baselines); vs_*_ms = always_*_ms - chosen_ms
    (ms, positive = the choices were faster); vs_*_pct = 100 * vs_*_ms / always_*_ms (percent, None when
    there is nothing to divide by). relative_only: the predictions include the analytic prior's on a CPU, whose
    absolute scale is not calibrated (there they ran about 100x the measured latencies, and are the same for
    every model of one shape): only the percentages mean something, not the milliseconds.
    """

    batches: int = 0
    chosen_ms: float = 0.0
    always_padded_ms: float = 0.0
    always_ragged_ms: float = 0.0
    vs_padded_ms: float = 0.0
    vs_padded_pct: float | None = None
    vs_ragged_ms: float = 0.0
    vs_ragged_pct: float | None = None
    relative_only: bool = False


@dataclass
class Regret:
    """Regret measured on sampled batches (Decision.measured_ms), grouped as the planner groups batches.

    Sampled batches the planner decided (predicted_ms not empty) are grouped by `planning.planner.bucket_key(stats)`
    and arm label; a bucket is evaluated when it has measured means for two labels or more. A batch's
    regret = measured mean of its label / best measured mean of its bucket - 1 (a fraction: 0.1 = 10%
    slower than the best arm measured there).

    buckets: buckets with a sampled planner batch; evaluated_buckets: those with several labels measured;
    batches: batches whose regret counts (planner choices in evaluated buckets); mean, max: of their
    regrets (fractions; None when no batch counts); exploring: sampled batches that ran an arm to time it
    ("trying it": not the arm predicted best): their latencies go into the bucket means, their regret does
    not (it measures what trials cost, not the decisions).
    """

    buckets: int = 0
    evaluated_buckets: int = 0
    batches: int = 0
    mean: float | None = None
    max: float | None = None
    exploring: int = 0


@dataclass
class GraphEvents:
    """CUDA-graph captures of one module, from its decisions' reasons. captures: batches that asked the background
    worker for their graph (each capture is asked once); failed: batches whose graph could not be captured (they
    ran eagerly)."""

    captures: int = 0
    failed: int = 0


@dataclass
class ModuleSummary:
    """The decisions of one wrapped module kind (one `ModuleSignature.key`) on one device.

    batches: decisions recorded (one per forward); first, last: their time range (unix seconds);
    arms: share per arm ("padded", "ragged"); configs: share per arm label (each ragged KernelConfig apart);
    fallback_reasons: reason -> batches for padded batches forced without a prediction (policy or a
    feature the ragged arm does not support), most frequent first; decided_by: reason -> batches for all
    other batches ("predicted: cost model (prior)", "timed on this device", "trying it (...)", "policy=ragged");
    sampled: batches with a measured latency; mape, mape_batches: mean |predicted - measured| / measured
    (a fraction) over sampled batches whose chosen arm had a prediction, and their count;
    saved: time saved, a cost-model estimate; regret: measured regret on sampled batches; rolled_up: batches
    no longer kept one by one, known from the database's hourly totals (rollup.py; the window then starts at
    the hour of `since`); the pictures show the batches still kept.
    """

    device: str
    signature: str
    batches: int
    first: float
    last: float
    arms: list[Share]
    configs: list[Share]
    fallback_reasons: dict[str, int]
    decided_by: dict[str, int]
    sampled: int
    mape: float | None
    mape_batches: int
    saved: TimeSaved
    regret: Regret
    rolled_up: int = 0
    graphs: GraphEvents = field(default_factory=GraphEvents)


@dataclass
class Calibration:
    """The newest cost model stored for a device (what `python -m autoragged.tune` fit).

    model_id, kind, signature ("*" = all signatures), feature_version; current: whether this autoragged's
    runtime reads it (same feature version); adopted: False when the tuner found it picked worse than the
    analytic prior on held-out batches (stored for the record; the runtime decides with the prior);
    created: unix seconds; accuracy: share of held-out batches
    where the model picked the fastest arm (0..1); mean_regret, p95_regret: latency of its pick / best - 1
    on held-out batches (fractions); mape: held-out latency error (fraction); holdout: how rows were held
    out; rows: measurements fit on; metrics: everything the tuner stored. A metric not stored is None.
    """

    model_id: int
    kind: str
    signature: str
    feature_version: int
    current: bool
    created: float
    accuracy: float | None
    mean_regret: float | None
    p95_regret: float | None
    mape: float | None
    holdout: str | None
    rows: int | None
    metrics: dict[str, Any]
    adopted: bool = True


@dataclass
class DeviceSummary:
    """One device key (`DeviceKey.key`). name: the GPU/CPU name when the device is registered, else None;
    decisions: batches in the window (all modules); measurements: measured rows in the window, and per
    source ("tune", "runtime"); models: cost models stored for it (any time); calibration: the newest
    one or None (the runtime then uses the analytic prior); modules: per signature, most batches first."""

    key: str
    name: str | None
    decisions: int
    measurements: int
    measurements_by_source: dict[str, int]
    models: int
    calibration: Calibration | None
    modules: list[ModuleSummary]


@dataclass
class Summary:
    """A report over one tuning database.

    path: the database file; generated: unix seconds; since: the window's start (unix seconds, None = all
    time; applies to decisions and measurements, not to the calibration shown, which is the newest);
    device: the device key the report is limited to (None = all); counts: rows per table in the whole
    file, unfiltered; decisions: decisions in the window; devices: those with decisions, measurements or
    a cost model, registered ones first; skipped: one line per table of the rows left out because they
    could not be read (damaged or hostile), e.g. "skipped 3 of 120 decisions rows: unreadable predicted_ms
    JSON (ids 4, 9, 12)".
    """

    path: str
    generated: float
    since: float | None
    device: str | None
    counts: dict[str, int]
    decisions: int
    devices: list[DeviceSummary] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        """Nothing recorded at all in the file (no decisions, cost models or measurements)."""
        return not any(self.counts.get(t, 0) for t in ("decisions", "decision_totals", "models", "measurements"))
