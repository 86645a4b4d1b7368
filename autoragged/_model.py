"""The learned cost model: fit offline with scikit-learn, decided from plain arrays at run time.

Target: log(measured ms) - log(prior ms), the residual over the analytic prior, so the trees learn where
this GPU departs from the physics (launch-bound regimes, tile quantisation, kernel efficiency) and,
outside what was measured, predictions fall back to the prior's scaling instead of a flat tree value.

Model: `HistGradientBoostingRegressor` on the physics-informed features of `_costmodel.features`,
exported to JSON arrays (feature, threshold, children, leaf values per node; no pickle) and evaluated
with numpy, all trees and arms at once. scikit-learn is imported only to fit.

Evaluation (`fit_cost_model`): leave one length-distribution family out at a time; on each held-out
batch the model's argmin over the arms measured on that batch is compared with the measured best:
decision accuracy (the choice is the best arm or within 1% of it: a tie at noise level), the same
accuracy counting as right a choice whose measured p10 is within the best arm's p90 (the label itself
is within its measurement noise), mean and p95 regret (chosen / best - 1) and MAPE of the latency
predictions.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels._config import KernelConfig
from tuning_db.records import BatchStats, DeviceKey, Measurement, ModuleSignature

from ._buckets import LADDER_VERSION
from ._costmodel import FEATURE_NAMES, FEATURE_VERSION, KINDS, AnalyticPrior, Arm, features

__all__ = ["CompiledModel", "fit_cost_model", "evaluate_choices", "KIND", "TIE"]

KIND = "gbt-arrays"
TIE = 0.01  # two arms within 1% of each other are a tie at the noise level of our timings
_FIELDS = ("feature", "threshold", "left", "right", "value", "leaf")


def arm_of(m: Measurement) -> Arm:
    if m.arm not in KINDS:
        raise ValueError(f"measurement of an unknown arm {m.arm!r} (known: {KINDS})")
    return Arm(m.arm, KernelConfig.from_dict(m.config) if m.config else None)


class CompiledModel:
    """ms = prior_ms * exp(sum of tree outputs + baseline), from arrays (see the module docstring)."""

    name = "learned"

    def __init__(self, device: DeviceKey, baseline: float, trees: dict[str, np.ndarray], roots: np.ndarray,
                 depth: int, candidates: dict[str, list[dict]], metrics: dict | None = None):  # fmt: skip
        self.device = device
        self.prior = AnalyticPrior(device)
        self.baseline = float(baseline)
        self.feature = trees["feature"].astype(np.int64)
        self.threshold = trees["threshold"].astype(np.float64)
        self.left = trees["left"].astype(np.int64)
        self.right = trees["right"].astype(np.int64)
        self.value = trees["value"].astype(np.float64)
        self.leaf = trees["leaf"].astype(bool)
        self.roots = roots.astype(np.int64)
        self.depth = int(depth)
        self.candidates = candidates
        self.metrics = metrics or {}

    # -- prediction -------------------------------------------------------------------------------
    def residual(self, X: np.ndarray) -> np.ndarray:
        """The trees' log-residual for feature rows X (n, F): all rows and trees step down together."""
        idx = np.broadcast_to(self.roots, (X.shape[0], self.roots.shape[0])).copy()
        rows = np.arange(X.shape[0])[:, None]
        for _ in range(self.depth):
            leaf = self.leaf[idx]
            if leaf.all():
                break
            go_left = X[rows, self.feature[idx]] <= self.threshold[idx]
            idx = np.where(leaf, idx, np.where(go_left, self.left[idx], self.right[idx]))
        return self.baseline + self.value[idx].sum(axis=1)

    def predict_ms(self, sig: ModuleSignature, stats: BatchStats, arms: list[Arm]) -> np.ndarray:
        X = features(sig, stats, arms)
        return self.prior.predict_ms(sig, stats, arms) * np.exp(self.residual(X))

    def candidates_for(self, sig: ModuleSignature) -> Callable[[BatchStats], list[Arm]]:
        """The tuner's shortlist of ragged configs for `sig` by max_len bucket (or the all-signature one)."""
        table = self.candidates.get(sig.key) or self.candidates.get("*") or []
        buckets = [(entry["max_len_le"], [Arm("ragged", KernelConfig.from_dict(c)) for c in entry["configs"]])
                   for entry in table]  # fmt: skip
        head_dim = sig.d_model // max(sig.heads, 1)

        def candidates(stats: BatchStats) -> list[Arm]:
            for limit, arms in buckets:
                if stats.max_len <= limit and arms:
                    return arms
            from ._planner import default_ragged_config

            return [Arm("ragged", default_ragged_config(head_dim, stats.max_len))]

        return candidates

    # -- (de)serialisation: strict JSON, validated on load -----------------------------------------
    def to_payload(self) -> dict[str, Any]:
        return {
            "kind": KIND,
            "feature_version": FEATURE_VERSION,
            "feature_names": list(FEATURE_NAMES),
            "device": self.device.to_dict(),
            "baseline": self.baseline,
            "depth": self.depth,
            "roots": self.roots.tolist(),
            "trees": {name: getattr(self, name).tolist() for name in _FIELDS},
            "candidates": self.candidates,
        }

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> CompiledModel:
        """Rebuild from a stored payload; a ValueError says what is malformed (a shared file is input)."""
        if not isinstance(payload, dict) or payload.get("kind") != KIND:
            raise ValueError(
                f"not a {KIND} cost model payload (kind={payload.get('kind') if isinstance(payload, dict) else None!r})"
            )
        if payload.get("feature_names") != list(FEATURE_NAMES):
            raise ValueError("the cost model was fit on other features; refit it (python -m autoragged.tune --refit)")
        try:
            trees = {name: np.asarray(payload["trees"][name]) for name in _FIELDS}
            roots = np.asarray(payload["roots"], dtype=np.int64)
            n = len(trees["feature"])
            if any(len(v) != n for v in trees.values()) or (roots.size and (roots.min() < 0 or roots.max() >= n)):
                raise ValueError("tree arrays of unequal length or roots out of range")
            for child in ("left", "right"):
                inner = ~trees["leaf"].astype(bool)
                if inner.any() and (trees[child][inner].min() < 0 or trees[child][inner].max() >= n):
                    raise ValueError(f"{child} child index out of range")
            if inner.any() and trees["feature"][inner].max() >= len(FEATURE_NAMES):
                raise ValueError("feature index out of range")
            return cls(DeviceKey(**payload["device"]), float(payload["baseline"]), trees, roots,
                       int(payload["depth"]), dict(payload.get("candidates", {})))  # fmt: skip
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed cost model payload: {e!r}") from None


# -- fitting --------------------------------------------------------------------------------------
@dataclass
class _Rows:
    X: np.ndarray
    y: np.ndarray  # log residual over the prior
    prior: np.ndarray
    ms: np.ndarray
    p10: np.ndarray
    p90: np.ndarray
    group: list[str]  # the batch a row was measured on ("" for traffic samples)
    family: list[str]
    arm: list[str]


def _rows(measurements: Sequence[Measurement], device: DeviceKey) -> _Rows:
    prior = AnalyticPrior(device)
    X, y, p, ms, p10, p90, group, family, arm = [], [], [], [], [], [], [], [], []
    for m in measurements:
        if not (m.median_ms > 0 and math.isfinite(m.median_ms)):
            continue
        a = arm_of(m)
        if a.graph and m.extra.get("ladder") != LADDER_VERSION:
            continue  # a graph measured on buckets of another ladder: its work was not what features() says
        sig = ModuleSignature.from_key(m.signature)
        X.append(features(sig, m.stats, [a])[0])
        p_ms = float(prior.predict_ms(sig, m.stats, [a])[0])
        p.append(p_ms)
        ms.append(m.median_ms)
        p10.append(min(m.p10_ms, m.median_ms))
        p90.append(max(m.p90_ms, m.median_ms))
        y.append(math.log(m.median_ms) - math.log(p_ms))
        group.append(str(m.extra.get("batch_id", "")))
        family.append(m.distribution or "traffic")
        arm.append(a.label)
    arrays = [np.asarray(v) for v in (X, y, p, ms, p10, p90)]
    return _Rows(*arrays, group, family, arm)


def _fit_trees(X: np.ndarray, y: np.ndarray, seed: int = 0):
    try:
        from sklearn.ensemble import HistGradientBoostingRegressor
    except ImportError as e:  # pragma: no cover - scikit-learn is a dependency
        raise ImportError("fitting the cost model needs scikit-learn: pip install scikit-learn") from e
    model = HistGradientBoostingRegressor(
        max_iter=150, max_depth=6, learning_rate=0.1, min_samples_leaf=8, l2_regularization=1.0, random_state=seed
    )
    return model.fit(X, y)


def _compile(fitted, device: DeviceKey, candidates: dict) -> CompiledModel:
    cols = {name: [] for name in _FIELDS}
    roots, offset, depth = [], 0, 0
    for (tree,) in fitted._predictors:
        nodes = tree.nodes
        roots.append(offset)
        cols["feature"].append(nodes["feature_idx"].astype(np.int64))
        cols["threshold"].append(nodes["num_threshold"].astype(np.float64))
        cols["left"].append(nodes["left"].astype(np.int64) + offset)
        cols["right"].append(nodes["right"].astype(np.int64) + offset)
        cols["value"].append(nodes["value"].astype(np.float64))
        cols["leaf"].append(nodes["is_leaf"].astype(bool))
        depth = max(depth, int(nodes["depth"].max()))
        offset += len(nodes)
    trees = {k: np.concatenate(v) if v else np.zeros(0) for k, v in cols.items()}
    baseline = float(np.ravel(fitted._baseline_prediction)[0])
    return CompiledModel(device, baseline, trees, np.asarray(roots), depth, candidates)


def evaluate_choices(
    predicted: np.ndarray,
    measured: np.ndarray,
    groups: Sequence[str],
    p10: np.ndarray | None = None,
    p90: np.ndarray | None = None,
) -> dict[str, float]:
    """Decision quality over batches measured on several arms: accuracy (and, given each measurement's
    p10 / p90, accuracy within the measurement noise), regret, and MAPE."""
    by_group: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        if g:
            by_group[g].append(i)
    correct, within_noise, regrets = [], [], []
    for idx in by_group.values():
        if len(idx) < 2:
            continue
        idx = np.asarray(idx)
        b, c = idx[np.argmin(measured[idx])], idx[np.argmin(predicted[idx])]
        best, chosen = measured[b], measured[c]
        regrets.append(chosen / best - 1.0)
        correct.append(chosen <= best * (1 + TIE))
        within_noise.append(correct[-1] or (p10 is not None and p90 is not None and p10[c] <= p90[b]))
    mape = float(np.mean(np.abs(predicted - measured) / measured)) if len(measured) else float("nan")
    if not regrets:
        return {
            "batches": 0,
            "accuracy": float("nan"),
            "accuracy_within_noise": float("nan"),
            "mean_regret": float("nan"),
            "p95_regret": float("nan"),
            "mape": mape,
        }
    r = np.asarray(regrets)
    return {
        "batches": len(regrets),
        "accuracy": float(np.mean(correct)),
        "accuracy_within_noise": float(np.mean(within_noise)),
        "mean_regret": float(r.mean()),
        "p95_regret": float(np.quantile(r, 0.95)),
        "mape": mape,
    }


def _shortlist(measurements: Sequence[Measurement], top: int = 3) -> dict[str, list[dict]]:
    """Per signature and max_len bucket (powers of two), the ragged configs worth predicting: the default
    config first, then configs measured head to head against it on the same batches that beat it on most
    of them by a median of at least 3% (best first). Conservative on purpose: the model ranks what is
    here, and a config that only won on average over other batch sizes is not offered."""
    from ._planner import default_ragged_config

    per_batch: dict[tuple[str, str], list[Measurement]] = defaultdict(list)
    for m in measurements:
        if m.arm == "ragged" and m.config and m.extra.get("batch_id"):  # eager: configs compared alone
            per_batch[(m.signature, str(m.extra["batch_id"]))].append(m)
    ratios: dict[tuple[str, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    configs: dict[str, dict] = {}
    defaults: dict[tuple[str, int], dict] = {}
    for (sig_key, _), ms in per_batch.items():
        sig = ModuleSignature.from_key(sig_key)
        default = default_ragged_config(sig.d_model // max(sig.heads, 1), ms[0].stats.max_len)
        base = next((m for m in ms if KernelConfig.from_dict(m.config) == default), None)
        bucket = 1 << max(0, math.ceil(math.log2(max(ms[0].stats.max_len, 1))))
        defaults[(sig_key, bucket)] = default.to_dict()
        if base is None:
            continue
        for m in ms:
            label = KernelConfig.from_dict(m.config).short()
            if m is not base:
                configs[label] = m.config
                ratios[(sig_key, bucket)][label].append(m.median_ms / base.median_ms)
    out: dict[str, list[dict]] = defaultdict(list)
    for (sig_key, bucket), default in sorted(defaults.items()):
        by_label = ratios.get((sig_key, bucket), {})
        winners = [
            (float(np.median(r)), label) for label, r in by_label.items()
            if len(r) >= 2 and float(np.median(r)) <= 0.97 and np.mean(np.asarray(r) < 1.0) > 0.5
        ]  # fmt: skip
        chosen = [default] + [configs[label] for _, label in sorted(winners)[: top - 1]]
        out[sig_key].append({"max_len_le": bucket, "configs": chosen})
    return dict(out)


def fit_cost_model(measurements: Sequence[Measurement], device: DeviceKey, seed: int = 0) -> CompiledModel:
    """Fit on every measurement of `device`, evaluate leaving one length family out at a time (or 25% of
    the batches when only one family was measured), and return the compiled model with `.metrics`."""
    rows = _rows(measurements, device)
    if len(rows.y) < 20:
        raise ValueError(f"only {len(rows.y)} usable measurements for {device.key}; run the tuner longer")
    families = sorted({f for f, g in zip(rows.family, rows.group) if g})
    predicted = np.full(len(rows.y), np.nan)
    if len(families) >= 2:
        holdout = "leave one length family out"
        for fam in families:
            test = np.array([f == fam for f in rows.family])
            fitted = _compile(_fit_trees(rows.X[~test], rows.y[~test], seed), device, {})
            predicted[test] = rows.prior[test] * np.exp(fitted.residual(rows.X[test]))
    else:
        holdout = "25% of the batches held out"
        rng = np.random.default_rng(seed)
        groups = sorted({g for g in rows.group if g})
        held = set(rng.choice(groups, size=max(1, len(groups) // 4), replace=False)) if groups else set()
        test = np.array([g in held for g in rows.group])
        fitted = _compile(_fit_trees(rows.X[~test], rows.y[~test], seed), device, {})
        predicted[test] = rows.prior[test] * np.exp(fitted.residual(rows.X[test]))
    evaluated = ~np.isnan(predicted)
    metrics = evaluate_choices(
        predicted[evaluated], rows.ms[evaluated], [g for g, e in zip(rows.group, evaluated) if e],
        rows.p10[evaluated], rows.p90[evaluated],
    )  # fmt: skip
    prior_metrics = evaluate_choices(
        rows.prior[evaluated], rows.ms[evaluated], [g for g, e in zip(rows.group, evaluated) if e]
    )
    metrics.update(
        holdout=holdout, families=families, rows=int(len(rows.y)),
        prior_accuracy=prior_metrics["accuracy"], prior_mean_regret=prior_metrics["mean_regret"],
    )  # fmt: skip
    model = _compile(_fit_trees(rows.X, rows.y, seed), device, _shortlist(measurements))
    model.metrics = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
    return model
