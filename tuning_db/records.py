"""The plain dataclasses the tuning database stores, exactly: no torch, no numpy.

The runtime (`autoragged`) builds them on the hot path, so constructors here are cheap and do no I/O.
Kernel configs cross this boundary as plain dicts (`KernelConfig.to_dict()`): this package may not
import `kernels`, and a dict is what the database stores anyway.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import operator
from dataclasses import dataclass, field
from typing import Any

# math.sumprod (Python 3.12) is exact for ints and the fastest; map(mul) keeps the loop in C before it
_sumprod = getattr(math, "sumprod", lambda a, b: sum(map(operator.mul, a, b)))

__all__ = [
    "BatchStats", "DeviceKey", "ModuleSignature", "Decision", "Measurement", "DecisionTotals", "BucketTotals",
    "config_key", "SUMMED_TOTALS", "MIN_TOTALS", "MAX_TOTALS",
]  # fmt: skip


@dataclass(slots=True)
class BatchStats:
    """Length statistics of one batch (host arithmetic only).

    batch: B; max_len: longest component; total: sum of lengths; sum_sq: sum of squared lengths
    (attention work); mean, std: of the lengths; pad_fraction: share of a (B, max_len) rectangle that is
    padding (0 when B or max_len is 0).
    """

    batch: int
    max_len: int
    total: int
    sum_sq: int
    mean: float
    std: float
    pad_fraction: float

    # not frozen: a frozen dataclass sets each field through object.__setattr__, ~2 us per batch here
    @classmethod
    def from_lengths(cls, lengths: tuple[int, ...], padded_len: int | None = None) -> BatchStats:
        """Stats of host `lengths`; `padded_len` is the rectangle's length (default: max of lengths)."""
        B = len(lengths)
        if B == 0:
            return cls(0, 0, 0, 0, 0.0, 0.0, 0.0)
        total = sum(lengths)
        sum_sq = _sumprod(lengths, lengths)
        max_len = max(lengths)
        L = max_len if padded_len is None else padded_len
        mean = total / B
        var = max(sum_sq / B - mean * mean, 0.0)
        area = B * L
        return cls(B, max_len, total, sum_sq, mean, math.sqrt(var), 1.0 - total / area if area else 0.0)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class DeviceKey:
    """What a calibration is valid for: the GPU (or CPU) and the software that compiles our kernels."""

    name: str
    capability: str  # "9.0" for Hopper; "cpu" on CPU
    sm_count: int
    memory_mb: int
    driver: str
    torch: str
    triton: str

    @property
    def key(self) -> str:
        """A stable id, e.g. `NVIDIA H100 80GB HBM3|cc9.0|132sm|torch 2.11.0|triton 3.6.0`."""
        return f"{self.name}|cc{self.capability}|{self.sm_count}sm|torch {self.torch}|triton {self.triton}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ModuleSignature:
    """What a wrapped module computes, as far as cost is concerned (shapes and options, not weights)."""

    kind: str  # "encoder" or "encoder_layer"
    layers: int
    d_model: int
    heads: int
    ff: int
    activation: str  # "relu" | "gelu" | other (unsupported by the ragged arm)
    norm_first: bool
    dtype: str  # "float16", "bfloat16", "float32"
    bias: bool = True
    final_norm: bool = False
    nested: bool = False  # PyTorch's own padded forward converts to nested tensors (its encoder fast path)

    @property
    def key(self) -> str:
        """A stable id, e.g. `encoder:6x512/8h/ff2048:relu:post:float16:nested`."""
        norm = "pre" if self.norm_first else "post"
        extra = ("" if self.bias else ":nobias") + (":final_norm" if self.final_norm else "")
        extra += ":nested" if self.nested else ""
        return (
            f"{self.kind}:{self.layers}x{self.d_model}/{self.heads}h/ff{self.ff}:{self.activation}:{norm}:{self.dtype}"
            + extra
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_key(cls, key: str) -> ModuleSignature:
        """Parse `key` back (the database stores keys); ValueError names what does not parse."""
        parts = key.split(":")
        try:
            kind, shape, activation, norm, dtype, *extra = parts
            layers, rest = shape.split("x", 1)
            d_model, heads, ff = rest.split("/")
            if not heads.endswith("h") or not ff.startswith("ff") or norm not in ("pre", "post"):
                raise ValueError
            if any(e not in ("nobias", "final_norm", "nested") for e in extra):
                raise ValueError
            return cls(
                kind, int(layers), int(d_model), int(heads[:-1]), int(ff[2:]), activation, norm == "pre", dtype,
                bias="nobias" not in extra, final_norm="final_norm" in extra, nested="nested" in extra,
            )  # fmt: skip
        except ValueError:
            raise ValueError(
                f"not a module signature key: {key!r} (expected e.g. 'encoder:6x512/8h/ff2048:relu:post:float16')"
            ) from None


def config_key(config: dict[str, Any] | None) -> str:
    """A stable id of a kernel config dict ("" for the padded arm): canonical JSON, hashed."""
    if not config:
        return ""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


@dataclass
class Decision:
    """One batch's choice, as the runtime made it.

    time: unix seconds; device, signature: keys (`DeviceKey.key`, `ModuleSignature.key`); arm: "padded",
    "ragged" or "ragged_graph" (replayed as a CUDA graph; older rows may name "padded_graph"); config: the
    ragged arm's KernelConfig as a dict (None for padded); predicted_ms: predicted latency per arm kind;
    reason: why this arm (e.g. "predicted: cost model (prior)", "policy=padded", "autocast");
    measured_ms: filled in later when the batch was sampled for timing.
    """

    time: float
    device: str
    signature: str
    stats: BatchStats
    arm: str
    config: dict[str, Any] | None
    predicted_ms: dict[str, float]
    reason: str
    measured_ms: float | None = None


@dataclass
class Measurement:
    """A timed run of one arm on one batch.

    source: "tune" (the calibrator) or "runtime" (sampled from traffic); distribution: the name of the
    length distribution the batch was drawn from ("" for traffic).
    """

    device: str
    signature: str
    arm: str
    config: dict[str, Any] | None
    stats: BatchStats
    median_ms: float
    p10_ms: float
    p90_ms: float
    reps: int
    time: float
    source: str = "tune"
    distribution: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# Rolled-up decisions: what the database keeps of the decisions it no longer keeps one by one (`TuningDB.
# prune_decisions`). Counts and sums add up, minima and maxima combine, so totals merge in any order.
SUMMED_TOTALS = ("batches", "sampled", "measured_sum", "ape_batches", "ape_sum", "saved_batches", "chosen_ms",
                 "padded_ms", "ragged_ms", "exploring")  # fmt: skip
MIN_TOTALS = ("first", "measured_min")
MAX_TOTALS = ("last", "measured_max")


def _merge(into: Any, other: Any) -> None:
    for name in SUMMED_TOTALS:
        if hasattr(into, name):
            setattr(into, name, getattr(into, name) + getattr(other, name))
    for names, pick in ((MIN_TOTALS, min), (MAX_TOTALS, max)):
        for name in names:
            a, b = getattr(into, name), getattr(other, name)
            setattr(into, name, b if a is None else a if b is None else pick(a, b))


@dataclass(slots=True)
class DecisionTotals:
    """The decisions of one (device, signature, period, arm, label, reason, forced), added up.

    period: unix seconds at the start of the hour they were made in; label: the arm label their predictions
    are keyed by ("padded", "ragged:m64n64k64w4s2a1-cublas"); reason: the decision's reason with its decimal
    numbers left out (a scale factor would make every reason new); forced: nothing was predicted (policy, or
    a feature the ragged arm lacks). batches: how many; first, last: their time range (unix seconds);
    sampled: how many were timed, measured_sum/min/max their latencies (ms); ape_batches, ape_sum: timed ones
    whose arm had a prediction, and the sum of |predicted - measured| / measured; saved_batches: those with the
    chosen arm's, the padded arm's and an eager ragged arm's predictions, and chosen_ms, padded_ms, ragged_ms
    the sums of these predictions (ragged: the best eager ragged config of each batch)."""

    device: str
    signature: str
    period: float
    arm: str
    label: str
    reason: str
    forced: bool
    batches: int = 0
    first: float | None = None
    last: float | None = None
    sampled: int = 0
    measured_sum: float = 0.0
    measured_min: float | None = None
    measured_max: float | None = None
    ape_batches: int = 0
    ape_sum: float = 0.0
    saved_batches: int = 0
    chosen_ms: float = 0.0
    padded_ms: float = 0.0
    ragged_ms: float = 0.0

    KEY = ("device", "signature", "period", "arm", "label", "reason", "forced")

    def merge(self, other: DecisionTotals) -> None:
        """Add `other` (of any key) into these totals."""
        _merge(self, other)


@dataclass(slots=True)
class BucketTotals:
    """The timed, planned decisions of one (device, signature, period, bucket, label), added up: what measured
    regret needs (the mean latency of each arm label in each planner bucket).

    period: unix seconds at the start of the day; bucket: the planner's bucket key of the batch, as text;
    sampled: timed decisions; exploring: those that ran another arm than the planner's choice on purpose;
    measured_sum/min/max: their latencies (ms); first, last: their time range (unix seconds)."""

    device: str
    signature: str
    period: float
    bucket: str
    label: str
    sampled: int = 0
    exploring: int = 0
    measured_sum: float = 0.0
    measured_min: float | None = None
    measured_max: float | None = None
    first: float | None = None
    last: float | None = None

    KEY = ("device", "signature", "period", "bucket", "label")

    def merge(self, other: BucketTotals) -> None:
        """Add `other` (of any key) into these totals."""
        _merge(self, other)
