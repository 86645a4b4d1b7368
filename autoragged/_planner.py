"""The per-module planner: which arm runs a batch, decided in microseconds.

plan(stats) looks the batch up in a decision cache keyed by bucketed statistics (B, max_len and total
tokens in ~9% log steps: the buckets the cost changes across, never the exact total); on a miss it
asks the cost model (the learned one for this device if the tuning database has it, else the
analytic prior) for every candidate arm and takes the argmin over the arms that run with the lengths
known: every arm but the `Arm.mask_only` one, whose prediction the plan still carries for the
dispatcher's mask-only verdicts. Latencies measured on sampled batches (`observe`, their median) override
the model's predictions for their bucket, and scale those of the arms not measured there yet, so a wrong
prior corrects itself; `explore` names an arm that has too few measurements in a bucket, for a sampled
batch to try.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ._costmodel import PADDED, Arm
from .kernels import ragged_attention as k_attn
from .kernels._config import KernelConfig
from .tuning_db.records import BatchStats, ModuleSignature

__all__ = ["Plan", "Planner", "default_ragged_config", "graph_config", "GRAPH_BACKENDS", "bucket_key"]

# The planner explores (runs on a sampled batch, to time it) only arms predicted within this factor of its
# choice: a stream of new batches pays each explored arm's first run on a new shape, and the padded forward of
# HF bert-base took 70-83 ms there (cuBLAS's first calls on its row count, among others) where the arm chosen
# ran in 1-4 (CoLA B=32, MNLI B=128 after `warmup()`, H200, 2026-11-26, `benchmarks/stream_table.py
# --fresh-process --models bert-base`); warm, HF's padded forward takes 6-11x the graph arm's time on those rows.
# Within 2x, the prior (which has HF's padded forward at 1.2-2.4x the best ragged arm on bert-base's 24 CoRa rows,
# where it measures 1.3-6.1x in the latency table) had the planner run it on long rows too: in the timed stream of
# bert-base RACE B=64, after a 24-batch warm-up (the first sampled batch is the 32nd), its first run there took 549
# ms and a later one 60, against 11.5 ms a batch for the stream (H100, 2026-11-26, `benchmarks/verdict_trace.py`,
# `vt_long64_h100.json`).
_EXPLORE_WITHIN = 1.3
_CACHE_SIZE = 4096
# A bucket's measured latency of an arm is the median of its last _WINDOW samples, once it has min_samples:
# a sampled call can be far off its arm's latency. On the H100 host (benchmarks/sampling.py, 2026-11-23)
# the padded arm's first two samples in a bucket were 262 ms (the first call of a shape) and 5.5 ms, and
# one ragged graph's five ranged over 0.41-0.98 ms (timings of synchronised calls carry the host's delays,
# which only add time). The rule before, a running mean from two samples on, took such a pair at face
# value. The window follows drift (clocks, other tenants).
_WINDOW = 8


@dataclass(frozen=True)
class Plan:
    """arm: the chosen arm; predicted_ms: arm label -> ms; reason: why; eager, eager_ms: the best arm that is
    not a graph (what runs where the chosen graph is not captured) and its ms, where the planner chose;
    mask_arm: the arm among the candidates that runs a mask unread (`Arm.mask_only`), or None. A plan is
    cached per bucket of (B, max_len, tokens), and the arms' attention tiles follow max_len: a batch must
    take the mask arm's label from its plan, not rebuild it from its own max_len (a CoLA B=128 batch of 34
    tokens found the plan of one of 32, whose arms have 32 x 32 tiles, and no prediction for its own)."""

    arm: Arm
    predicted_ms: dict[str, float]
    reason: str
    eager: Arm | None = None
    eager_ms: float = 0.0
    mask_arm: Arm | None = None


@functools.lru_cache(maxsize=4096)  # a plan's candidates, per bucket: made afresh, 150 of a plan's 260 us on a CPU
def default_ragged_config(head_dim: int, max_len: int) -> KernelConfig:
    """The ragged arm's config before any tuning: the attention kernel's default tiles, packed layout,
    cuBLAS linears (cuBLAS beat our Triton linear at large T on the H100, benchmarks/kernels.py)."""
    return k_attn.default_config(head_dim, max_len).replace(backend="cublas", align=1)


# The ragged graph arm comes with either linear backend: cuBLAS computes the graph's whole row bucket,
# our Triton linears stop at the rows the batch fills (a count only the device holds), which is also what
# lets a graph run a mask whose lengths were never read.
GRAPH_BACKENDS = ("cublas", "triton")


@functools.lru_cache(maxsize=4096)
def graph_config(head_dim: int, max_len: int, backend: str) -> KernelConfig:
    """The config of the ragged graph arm with linears of `backend` (one of GRAPH_BACKENDS)."""
    return default_ragged_config(head_dim, max_len).replace(backend=backend)


def _log_bucket(x: int) -> int:
    return -1 if x <= 0 else int(math.log2(x) * 8)


def bucket_key(stats: BatchStats) -> tuple[int, int, int]:
    return (stats.batch, _log_bucket(stats.max_len), _log_bucket(stats.total))


class Planner:
    """Chooses arms for one wrapped module (one `ModuleSignature`).

    model: an object with `name` and `predict_ms(sig, stats, arms) -> array`, or a zero-argument
           callable returning one (called once, lazily: the learned model is read on first use);
    candidates: stats -> the ragged arms worth predicting (the tuner's shortlist, or the default).
    """

    def __init__(
        self,
        sig: ModuleSignature,
        model: object | Callable[[], object],
        candidates: Callable[[BatchStats], list[Arm]] | None = None,
        *,
        min_samples: int = 3,
    ):
        self.sig = sig
        self._model_source = model
        self._model: object | None = None if callable(model) and not hasattr(model, "predict_ms") else model
        head_dim = sig.d_model // sig.heads
        self.candidates = candidates or (lambda s: [Arm("ragged", default_ragged_config(head_dim, s.max_len))])
        self.min_samples = min_samples
        self._cache: OrderedDict[tuple[int, int, int], Plan] = OrderedDict()
        self._measured: dict[tuple[int, int, int], dict[str, deque[float]]] = {}
        self._arms: dict[tuple[int, int, int], list[Arm]] = {}

    @property
    def model(self):
        if self._model is None:
            self._model = self._model_source()
        return self._model

    def plan(self, stats: BatchStats) -> Plan:
        key = bucket_key(stats)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        arms = [PADDED, *self.candidates(stats)]
        predicted = np.array(self.model.predict_ms(self.sig, stats, arms), dtype=float)
        reason = f"cost model ({self.model.name})"
        unusable = ~(np.isfinite(predicted) & (predicted > 0))
        if unusable.any():
            predicted, note = self._replace_unusable(stats, arms, predicted, unusable)
            reason += note
        measured = self._measured.get(key)
        if measured:
            ratios, unmeasured = [], []
            for i, arm in enumerate(arms):
                m = measured.get(arm.label)
                if m is not None and len(m) >= self.min_samples:
                    ms = statistics.median(m)
                    if np.isfinite(predicted[i]):
                        ratios.append(ms / max(predicted[i], 1e-9))
                    predicted[i] = ms
                else:
                    unmeasured.append(i)
            choosable = sum(not a.mask_only for a in arms)
            used = len(ratios)
            if used >= choosable:
                reason = "measured on this device"
            elif used:
                # The arms not measured yet keep the model's ranking at the level the measured ones set: a
                # model off by a factor for this bucket (the analytic prior leaves out most host time) would
                # otherwise make every arm it has not seen look faster than the ones it has.
                scale = statistics.median(ratios)
                predicted[unmeasured] *= scale
                reason += f" and {used} of {choosable} arms measured on this device (the rest scaled by {scale:.2f})"
        best = int(np.argmin([np.inf if a.mask_only else p for a, p in zip(arms, predicted)]))
        if not np.isfinite(predicted[best]):  # no arm has a usable prediction: the module as written
            best, reason = 0, reason + "; no arm has a finite prediction: padded"
        eager = int(np.argmin([np.inf if a.graph else p for a, p in zip(arms, predicted)]))
        if not np.isfinite(predicted[eager]):
            eager = 0
        finite = {a.label: round(float(p), 4) for a, p in zip(arms, predicted) if np.isfinite(p)}
        mask = next((a for a in arms if a.mask_only and a.label in finite), None)
        plan = Plan(arms[best], finite, reason, arms[eager], finite.get(arms[eager].label, 0.0), mask)
        self._arms[key] = arms
        self._cache[key] = plan
        if len(self._cache) > _CACHE_SIZE:
            old, _ = self._cache.popitem(last=False)
            self._arms.pop(old, None)
        return plan

    def _replace_unusable(self, stats, arms, predicted, unusable) -> tuple[np.ndarray, str]:
        """Predictions that are NaN, infinite or not positive (a stored model's leaves can sum to an overflow)
        are no ranking: such arms take the analytic prior's prediction where the model has one (`.prior`), else
        inf (never chosen). Returns the predictions and what to add to the plan's reason."""
        labels = ", ".join(a.label for a, bad in zip(arms, unusable) if bad)
        prior = getattr(self.model, "prior", None)
        if prior is not None:
            with np.errstate(all="ignore"):
                fallback = np.array(prior.predict_ms(self.sig, stats, arms), dtype=float)
            predicted = np.where(unusable, fallback, predicted)
        predicted = np.where(np.isfinite(predicted) & (predicted > 0), predicted, np.inf)
        how = "the prior's" if prior is not None else "none"
        return predicted, f"; the model's prediction for {labels} was not finite ({how} used)"

    def unproven(self, stats: BatchStats, arm: Arm) -> bool:
        """True where the plan for this bucket chose `arm` on a prediction scaled by other arms' timings: some
        arm of the bucket is timed, `arm` has fewer than `min_samples` timings. The runtime then times its
        batches until it has them, instead of every `sample_every`-th: a prior that leaves out most host time
        made the eager ragged arm look fastest once the graph and padded arms were timed, and it ran 85 of 420
        back-to-back calls at 6-8 ms against the graph's 1.5 (bert-base, MNLI B=64, `lengths=`, H200,
        2026-11-26, `benchmarks/hf_table.py --host-profile`)."""
        measured = self._measured.get(bucket_key(stats))
        return bool(measured) and len(measured.get(arm.label, ())) < self.min_samples

    def explore(self, stats: BatchStats, chosen: Arm) -> Arm | None:
        """An arm the planner may choose in this bucket with fewer than `min_samples` measurements (other
        than `chosen`, which is measured anyway when its batch is sampled) and predicted within _EXPLORE_WITHIN
        of `chosen`, or None."""
        key = bucket_key(stats)
        measured = self._measured.get(key, {})
        predicted = self.plan(stats).predicted_ms  # (cached: the plan `chosen` came from, or one the timings redid)
        bound = predicted.get(chosen.label, math.inf) * _EXPLORE_WITHIN
        for arm in self._arms.get(key, ()):
            if arm != chosen and not arm.mask_only and len(measured.get(arm.label, ())) < self.min_samples:
                if predicted.get(arm.label, 0.0) <= bound:
                    return arm
        return None

    def observe(self, stats: BatchStats, arm: Arm, ms: float) -> None:
        """A measured latency of `arm` on a batch of this bucket (the last _WINDOW are kept, see there)."""
        key = bucket_key(stats)
        arms = self._measured.setdefault(key, {})
        samples = arms.get(arm.label)
        if samples is None:
            samples = arms[arm.label] = deque(maxlen=_WINDOW)
        samples.append(ms)
        self._cache.pop(key, None)
