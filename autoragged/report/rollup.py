"""Decisions added up: what the tuning database keeps of the decisions it no longer keeps one by one.

The runtime records one decision per batch; a server at 1k batches/s would write ~38 GB a day. The recorder
keeps the newest `AUTORAGGED_DB_KEEP_DECISIONS` (default 20,000) per device and module signature as rows and
adds the older ones up (`TuningDB.prune_decisions(keep, rollup)`, in its batched flush):

    decision_totals   per (device, signature, hour, arm, arm label, reason, forced): batches, first/last time,
                      timed batches and the sum/min/max of their latencies, the sums behind the report's MAPE
                      and its time-saved estimate
    decision_buckets  per (device, signature, day, planner bucket, arm label), timed planned batches only: how
                      many (and how many explored), the sum/min/max of their latencies: measured regret

These are exactly what `python -m autoragged.report` computes, so its numbers are the same whether a
decision is still a row or already added up; it adds up the rows it reads with this same `rollup`. Measurements
are kept as they are (the runtime times one batch in `sample_every`). Reasons are added up with their decimal
numbers left out ("... scaled by 1.07" and "... scaled by 0.93" are one reason), and the report shows them so.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable
from typing import Any

from ..kernels.config import KernelConfig
from ..planning.planner import bucket_key
from ..tuning_db import BucketTotals, Decision, DecisionTotals, Measurement, config_key

__all__ = [
    "rollup", "arm_label", "label_of", "is_padded", "reason_class", "forced", "exploring", "predicted_of", "PERIOD_S",
    "BUCKET_PERIOD_S",
]  # fmt: skip

PERIOD_S = 3600.0  # decision_totals: an hour (how finely `report --since` splits decisions no longer kept)
BUCKET_PERIOD_S = 86400.0  # decision_buckets: a day (timed batches are 1 in `sample_every`; buckets are many)
_DECIMAL = re.compile(r"\d+\.\d+")


def arm_label(arm: str, config: dict[str, Any] | None) -> str:
    """The label a decision's arm has in `Decision.predicted_ms`: "padded", or "ragged:" + KernelConfig.short()."""
    if not config:
        return arm
    try:
        items = tuple(sorted(config.items()))
    except TypeError:  # unorderable keys: no caching
        return _config_label(arm, config)
    try:
        return _cached_label(arm, items)
    except TypeError:  # unhashable values
        return _config_label(arm, config)


def label_of(record: Decision | Measurement) -> str:
    """The arm label of a decision's or measurement's arm and config (`arm_label`)."""
    return arm_label(record.arm, record.config)


def is_padded(arm: str) -> bool:
    """Whether an arm kind is a padded one ("padded", "padded_graph")."""
    return arm == "padded" or arm.startswith("padded_")


@functools.lru_cache(maxsize=1024)
def _cached_label(arm: str, items: tuple) -> str:  # every decision is labelled, several times by a report
    return _config_label(arm, dict(items))


def _config_label(arm: str, config: dict[str, Any]) -> str:
    try:
        return f"{arm}:{KernelConfig.from_dict(config).short()}"
    except (TypeError, ValueError):  # a config written by another autoragged version
        return f"{arm}:{config_key(config)}"


@functools.lru_cache(maxsize=4096)
def reason_class(reason: str) -> str:
    """`reason` with its decimal numbers as "#": the reasons decisions are added up (and reported) by."""
    return _DECIMAL.sub("#", reason)


def forced(d: Decision) -> bool:
    """Forced by the policy or by a feature the ragged arm lacks: nothing was predicted."""
    return not d.predicted_ms


def exploring(d: Decision) -> bool:
    """A batch run to time an arm, not because it was predicted best ("trying it"; "exploring it": warm-up's, policy
    rule 5; "exploring" in older records)."""
    return d.reason.startswith(("trying it", "exploring"))


def predicted_of(d: Decision, label: str) -> float | None:
    """The prediction for the arm that ran: keyed by its kind ("padded", "ragged", "ragged_graph"), or by its label
    in records of older versions."""
    predicted = d.predicted_ms
    return predicted.get(d.arm, predicted.get(label))


def _totals(d: Decision, label: str) -> DecisionTotals:
    """The totals of the one decision `d`."""
    period = math.floor(d.time / PERIOD_S) * PERIOD_S
    t = DecisionTotals(d.device, d.signature, period, d.arm, label, reason_class(d.reason), forced(d), 1, d.time,
                       d.time)  # fmt: skip
    ms, predicted = d.measured_ms, d.predicted_ms
    chosen, padded = predicted_of(d, label), predicted.get("padded")
    if ms is not None:
        t.sampled, t.measured_sum, t.measured_min, t.measured_max = 1, ms, ms, ms
        if ms > 0 and chosen is not None:
            t.ape_batches, t.ape_sum = 1, abs(chosen - ms) / ms
    ragged = [v for k, v in predicted.items() if k == "ragged" or k.startswith("ragged:")]
    if chosen is not None and padded is not None and ragged:
        t.saved_batches, t.chosen_ms, t.padded_ms, t.ragged_ms = 1, chosen, padded, min(ragged)
    return t


def rollup(decisions: Iterable[Decision]) -> tuple[list[DecisionTotals], list[BucketTotals]]:
    """The totals of `decisions` (see the module docstring): one record per key, in first-seen order."""
    totals: dict[tuple, DecisionTotals] = {}
    buckets: dict[tuple, BucketTotals] = {}
    for d in decisions:
        label = arm_label(d.arm, d.config)
        t = _totals(d, label)
        key = (t.device, t.signature, t.period, t.arm, t.label, t.reason, t.forced)
        if key in totals:
            totals[key].merge(t)
        else:
            totals[key] = t
        ms = d.measured_ms
        if ms is None or ms <= 0 or t.forced:
            continue  # regret compares the planner's timed choices only
        day = math.floor(d.time / BUCKET_PERIOD_S) * BUCKET_PERIOD_S
        b = BucketTotals(d.device, d.signature, day, str(bucket_key(d.stats)), label, 1, int(exploring(d)), ms, ms,
                         ms, d.time, d.time)  # fmt: skip
        bkey = (b.device, b.signature, b.period, b.bucket, b.label)
        if bkey in buckets:
            buckets[bkey].merge(b)
        else:
            buckets[bkey] = b
    return list(totals.values()), list(buckets.values())
