"""The learned cost model: fit offline with scikit-learn, decided from plain arrays at run time.

Target: log(measured ms) - log(prior ms), the residual over the analytic prior, so the trees learn where
this GPU departs from the physics (launch-bound regimes, tile quantisation, kernel efficiency) and,
outside what was measured, predictions fall back to the prior's scaling instead of a flat tree value.

Two forests of `HistGradientBoostingRegressor` trees on the physics-informed features of
`costmodel.features`: the absolute one predicts a reference arm's residual (the ragged graph where graphs
were measured, else the padded module), the relative one every arm's residual minus the reference's, fit on
arms timed side by side on the same batch. Decisions rest on the relative forest: host jitter and clock drift
move all arms of a batch together and cancel out of its ratios (held-out accuracy 78.8% -> 83.9% against one
absolute forest on an H100 calibration).
Both weigh each timing by the inverse of its p10-p90 spread (`label_weights`): a noisy median is a noisy
label. Both are exported to JSON arrays (feature, threshold, children, leaf values per node; no pickle) and
evaluated with numpy, all trees and arms at once. scikit-learn is imported only to fit.

Evaluation (`fit_cost_model`): leave one length-distribution family out at a time; on each held-out
batch the model's argmin over the arms measured on that batch is compared with the measured best of them:
decision accuracy (the choice is the best arm or within 1% of it: a tie at noise level), the same
accuracy counting as right a choice whose measured p10 is within the best arm's p90 (the label itself
is within its measurement noise), mean and p95 regret (chosen / best - 1) and MAPE of the latency
predictions; and the total time of the choices over the oracle's. A held-out batch's reference latency is
predicted too, never read from its measurements.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..kernels.config import KernelConfig
from ..tuning_db.records import BatchStats, DeviceKey, Measurement, ModuleSignature
from .buckets import LADDER_VERSION
from .costmodel import FEATURE_NAMES, FEATURE_VERSION, KINDS, PADDED, AnalyticPrior, Arm, features
from .payload import MAX_DEPTH, TREE_FIELDS, PayloadError, check_candidates, check_device, check_forest, require

__all__ = [
    "CompiledModel", "Forest", "fit_cost_model", "evaluate_choices", "against_every_arm", "held_out_predictions",
    "KIND", "TIE", "MIN_ROWS", "TooFewMeasurements", "beats_prior",
]  # fmt: skip

KIND = "gbt-arrays"
TIE = 0.01  # two arms within 1% of each other are a tie at the noise level of our timings
_FIELDS = TREE_FIELDS
MIN_ROWS = 20  # usable measurements a fit needs: fewer, and the runtime keeps the analytic prior


class TooFewMeasurements(ValueError):
    """Fewer than MIN_ROWS usable measurements of a device: there is nothing to fit yet."""

    def __init__(self, rows: int, device: str):
        self.rows = rows
        super().__init__(f"only {rows} usable measurements for {device} (a fit needs {MIN_ROWS}); run the tuner longer")


def beats_prior(metrics: dict[str, Any]) -> bool:
    """Whether a fit is adopted (the runtime decides with it rather than with the analytic prior it falls back to):
    its held-out mean regret, the time its picks cost over the fastest arm's, is not above the prior's on the same
    batches. Regret rather than accuracy: a pick that misses by 1% and one that misses by 2x are one miss each.
    A `tune --quick` fit on a 2-core CPU can lose held out (mean regret 35% against the prior's 25%).
    Without both numbers (no batch timed on several arms) nothing says the fit is worse, and it is adopted."""
    learned, prior = metrics.get("mean_regret"), metrics.get("prior_mean_regret")
    if not isinstance(learned, (int, float)) or not isinstance(prior, (int, float)):
        return True
    return learned <= prior


def arm_of(m: Measurement) -> Arm:
    if m.arm not in KINDS:
        raise ValueError(f"measurement of an unknown arm {m.arm!r} (known: {KINDS})")
    return Arm(m.arm, KernelConfig.from_dict(m.config) if m.config else None)


class Forest:
    """Boosted regression trees as flat arrays: `residual(X)` = baseline + the sum of every tree's leaf."""

    def __init__(self, baseline: float, trees: dict[str, np.ndarray], roots: np.ndarray, depth: int):
        self.baseline = float(baseline)
        self.feature = trees["feature"].astype(np.int64)
        self.threshold = trees["threshold"].astype(np.float64)
        self.left = trees["left"].astype(np.int64)
        self.right = trees["right"].astype(np.int64)
        self.value = trees["value"].astype(np.float64)
        self.leaf = trees["leaf"].astype(bool)
        self.roots = roots.astype(np.int64)
        self.depth = int(depth)
        if not 0 <= self.depth <= MAX_DEPTH:  # residual() steps `depth` times: never unbounded
            raise ValueError(f"a forest of depth {self.depth}; at most {MAX_DEPTH} is evaluated")

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

    def to_payload(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline,
            "depth": self.depth,
            "roots": self.roots.tolist(),
            "trees": {name: getattr(self, name).tolist() for name in _FIELDS},
        }

    @classmethod
    def from_payload(cls, payload: dict[str, Any], where: str = "payload") -> Forest:
        """Rebuild and validate (a shared file is input): PayloadError (a ValueError) says what is wrong."""
        baseline, trees, roots, depth = check_forest(payload, len(FEATURE_NAMES), where)
        return cls(baseline, trees, roots, depth)


# The arm every other arm's latency is predicted relative to (see CompiledModel), by what was measured:
# the ragged graph where graphs were measured (CUDA), else the padded module.
REFERENCES = ("ragged_graph", "padded")


def reference_arm(reference: str, sig: ModuleSignature, stats: BatchStats) -> Arm:
    from .buckets import mask_width
    from .planner import graph_config

    if reference == "padded":
        return PADDED
    if reference == "ragged_graph":
        return Arm("ragged_graph", graph_config(sig.d_model // max(sig.heads, 1), mask_width(stats.max_len)))
    raise ValueError(f"unknown reference arm {reference!r} (known: {REFERENCES})")


def is_reference(reference: str, arm: Arm) -> bool:
    return arm.kind == reference


class CompiledModel:
    """ms = prior_ms * exp(residual), from arrays (see the module docstring).

    With a `relative` forest (what `fit_cost_model` fits), an arm's residual is the `absolute` forest's
    residual for the batch's reference arm plus the relative forest's for the arm: the relative trees were
    fit on log(ms / reference ms) of arms timed side by side on the same batch, which host jitter and clock
    drift largely cancel out of, so the arms' ranking rests on their measured ratios rather than on two
    absolute predictions with 15% errors each. Without one (older payloads), every arm is absolute."""

    name = "learned"

    def __init__(
        self,
        device: DeviceKey,
        absolute: Forest,
        candidates: dict[str, list[dict]],
        metrics: dict | None = None,
        relative: Forest | None = None,
        reference: str | None = None,
    ):
        if (relative is None) != (reference is None):
            raise ValueError("a relative forest needs its reference arm and the other way round")
        if reference is not None and reference not in REFERENCES:
            raise ValueError(f"unknown reference arm {reference!r} (known: {REFERENCES})")
        self.device = device
        self.prior = AnalyticPrior(device)
        self.absolute = absolute
        self.relative = relative
        self.reference = reference
        self.candidates = candidates
        self.metrics = metrics or {}

    # -- prediction -------------------------------------------------------------------------------
    def residual(self, X: np.ndarray) -> np.ndarray:
        """The absolute forest's log-residual for feature rows X (n, F)."""
        return self.absolute.residual(X)

    def predict_ms(self, sig: ModuleSignature, stats: BatchStats, arms: list[Arm]) -> np.ndarray:
        """ms per arm. Finite leaves can still sum to an overflow: such an arm comes back inf or NaN (never an
        exception), and the planner treats it as unpredicted (`Planner.predict`)."""
        with np.errstate(over="ignore", invalid="ignore"):
            if self.relative is None:
                return self.prior.predict_ms(sig, stats, arms) * np.exp(self.residual(features(sig, stats, arms)))
            ref = reference_arm(self.reference, sig, stats)
            every = [*arms, ref]
            X = features(sig, stats, every)
            prior = self.prior.predict_ms(sig, stats, every)
            rel = self.relative.residual(X[:-1])
            rel[[a == ref for a in arms]] = 0.0
            return prior[:-1] * np.exp(self.absolute.residual(X[-1:])[0] + rel)

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
            from .planner import default_ragged_config

            return [Arm("ragged", default_ragged_config(head_dim, stats.max_len))]

        return candidates

    # -- (de)serialisation: strict JSON, validated on load -----------------------------------------
    def to_payload(self) -> dict[str, Any]:
        payload = {
            "kind": KIND,
            "feature_version": FEATURE_VERSION,
            "feature_names": list(FEATURE_NAMES),
            "device": self.device.to_dict(),
            **self.absolute.to_payload(),
            "candidates": self.candidates,
        }
        if self.relative is not None:
            payload["relative"] = {"reference": self.reference, **self.relative.to_payload()}
        return payload

    @classmethod
    def from_payload(cls, payload: dict[str, Any], device: DeviceKey | None = None) -> CompiledModel:
        """Rebuild from a stored payload, validated (`payload.py`: types, bounds, tree structure, finiteness,
        sizes); a PayloadError (a ValueError) says what is malformed. device: the device the runtime runs on
        (the prior's rates come from it rather than from the file); default the payload's own."""
        if not isinstance(payload, dict) or payload.get("kind") != KIND:
            raise PayloadError(
                f"not a {KIND} cost model payload (kind={payload.get('kind') if isinstance(payload, dict) else None!r})"
            )
        if require(payload, "feature_version", int) != FEATURE_VERSION or payload.get("feature_names") != list(
            FEATURE_NAMES
        ):
            raise PayloadError(
                f"the cost model was fit on other features (version {payload['feature_version']}, this autoragged "
                f"reads {FEATURE_VERSION}); refit it (python -m autoragged.tune --refit)"
            )
        try:
            absolute = Forest.from_payload(payload)
            relative, reference = None, None
            if payload.get("relative") is not None:
                relative = Forest.from_payload(payload["relative"], "payload.relative")
                reference = require(payload["relative"], "reference", str, "payload.relative")
            candidates = check_candidates(payload.get("candidates", {}))
            stored = DeviceKey(**check_device(require(payload, "device", dict)))
        except PayloadError as e:
            raise PayloadError(f"malformed cost model payload: {e}") from None
        if reference is not None and reference not in REFERENCES:
            raise PayloadError(f"unknown reference arm {reference!r} (known: {REFERENCES})")
        return cls(device or stored, absolute, dict(candidates), relative=relative, reference=reference)


@dataclass
class _Rows:
    X: np.ndarray
    y: np.ndarray  # log residual over the prior
    prior: np.ndarray
    ms: np.ndarray
    p10: np.ndarray
    p90: np.ndarray
    reps: np.ndarray  # timings behind each row's median
    group: list[str]  # the batch a row was measured on ("" for traffic samples)
    family: list[str]
    arm: list[str]
    choosable: np.ndarray  # bool: an arm the planner chooses from (every measured arm)
    refs: dict[str, np.ndarray]  # per reference name: feature rows of that reference arm on each row's batch
    is_ref: dict[str, np.ndarray]  # per reference name: whether the row was a measurement of it


def _rows(measurements: Sequence[Measurement], device: DeviceKey) -> _Rows:
    prior = AnalyticPrior(device)
    X, y, p, ms, p10, p90, reps, group, family, arm, choosable = [], [], [], [], [], [], [], [], [], [], []
    refs: dict[str, list] = {r: [] for r in REFERENCES}
    is_ref: dict[str, list] = {r: [] for r in REFERENCES}
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
        reps.append(m.reps)
        y.append(math.log(m.median_ms) - math.log(p_ms))
        group.append(str(m.extra.get("batch_id", "")))
        family.append(m.distribution or "traffic")
        arm.append(a.label)
        choosable.append(True)
        for r in REFERENCES:
            refs[r].append(features(sig, m.stats, [reference_arm(r, sig, m.stats)])[0])
            is_ref[r].append(is_reference(r, a))
    arrays = [np.asarray(v) for v in (X, y, p, ms, p10, p90, reps)]
    width = len(FEATURE_NAMES)
    return _Rows(*arrays, group, family, arm, np.asarray(choosable, dtype=bool),
                 {r: np.asarray(v).reshape(-1, width) for r, v in refs.items()},
                 {r: np.asarray(v, dtype=bool) for r, v in is_ref.items()})  # fmt: skip


def _regressor_class():
    try:
        from sklearn.ensemble import HistGradientBoostingRegressor
    except ImportError as e:  # pragma: no cover - scikit-learn is a dependency
        raise ImportError("fitting the cost model needs scikit-learn: pip install scikit-learn") from e
    return HistGradientBoostingRegressor


def _fit_trees(X: np.ndarray, y: np.ndarray, seed: int = 0, weight: np.ndarray | None = None):
    model = _regressor_class()(
        max_iter=150, max_depth=6, learning_rate=0.1, min_samples_leaf=8, l2_regularization=1.0, random_state=seed
    )
    return model.fit(X, y, sample_weight=weight)


# A timing's weight in the fit is 1 / its relative p10-p90 spread, floored at 5%: a tiny batch's timings spread
# by 16-45% of their median on an H100 while a large one's spread by 2-4%, and a noisy median is a noisy label
# (held out on an H100 calibration, mean regret 2.12% -> 1.85%). Rows of fewer than 3 timings (traffic samples)
# have no spread to speak of and get the median weight.
_SPREAD_FLOOR = 0.05


def label_weights(rows: _Rows) -> np.ndarray:
    """Each row's weight in the fit (see _SPREAD_FLOOR), normalised to a mean of 1."""
    spread = (rows.p90 - rows.p10) / rows.ms
    w = 1.0 / np.maximum(spread, _SPREAD_FLOOR)
    few = rows.reps < 3
    if few.any():
        w[few] = np.median(w[~few]) if (~few).any() else 1.0
    return w / w.mean() if len(w) else w


def _forest(fitted) -> Forest:
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
    return Forest(float(np.ravel(fitted._baseline_prediction)[0]), trees, np.asarray(roots), depth)


def _compile(fitted, device: DeviceKey, candidates: dict) -> CompiledModel:
    """An absolute-only model from one fitted regressor."""
    return CompiledModel(device, _forest(fitted), candidates)


def _pick_reference(rows: _Rows) -> str:
    """The first of REFERENCES measured on most of the batches (the tuner times it on every batch)."""
    batches = {g for g in rows.group if g}
    for r in REFERENCES:
        if len({g for g, ref in zip(rows.group, rows.is_ref[r]) if g and ref}) * 2 > len(batches):
            return r
    return REFERENCES[-1]


def _fit_pair(rows: _Rows, train: np.ndarray, reference: str, device: DeviceKey, seed: int,
              candidates: dict) -> CompiledModel:  # fmt: skip
    """Fit the absolute forest on the train rows, then the relative one on each row's log-residual minus
    its batch's reference residual: the measured one where the reference was timed on the same batch,
    else the absolute forest's prediction of it (traffic samples). Rows weigh by their timings' spread
    (`label_weights`)."""
    weight = label_weights(rows)[train]
    absolute = _forest(_fit_trees(rows.X[train], rows.y[train], seed, weight))
    ref_y: dict[str, float] = {}
    for i in np.flatnonzero(train & rows.is_ref[reference]):
        if rows.group[i]:
            ref_y[rows.group[i]] = rows.y[i]
    predicted_ref = absolute.residual(rows.refs[reference][train])
    target = np.array([
        y - ref_y.get(g, p) if g else y - p
        for y, g, p in zip(rows.y[train], [rows.group[i] for i in np.flatnonzero(train)], predicted_ref)
    ])  # fmt: skip
    relative = _forest(_fit_trees(rows.X[train], target, seed, weight))
    return CompiledModel(device, absolute, candidates, relative=relative, reference=reference)


def _predict_rows(model: CompiledModel, rows: _Rows, which: np.ndarray) -> np.ndarray:
    """The model's ms for the measured rows `which`, as `predict_ms` computes them."""
    y = model.residual(rows.X[which])
    if model.relative is not None:
        rel = model.relative.residual(rows.X[which])
        rel[rows.is_ref[model.reference][which]] = 0.0
        y = model.absolute.residual(rows.refs[model.reference][which]) + rel
    return rows.prior[which] * np.exp(y)


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


def against_every_arm(
    predicted: np.ndarray, rows: _Rows, chosen_from: np.ndarray, oracle: dict[str, float] | None = None
) -> dict[str, float]:
    """The choices among the rows `chosen_from` (each batch's argmin of `predicted` there) against the best
    of every measured arm of the batch (or `oracle`, batch -> best ms, where arms outside `rows` count too):
    mean regret and total time over the oracle's."""
    best: dict[str, float] = dict(oracle) if oracle is not None else {}
    arms: dict[str, int] = defaultdict(int)  # batch -> arms it can choose from
    choice: dict[str, tuple[float, float]] = {}  # batch -> (predicted ms, measured ms) of its choice so far
    for i, g in enumerate(rows.group):
        if not g or np.isnan(predicted[i]):
            continue
        if oracle is None:
            best[g] = min(best.get(g, math.inf), rows.ms[i])
        if chosen_from[i]:
            arms[g] += 1
            if predicted[i] < choice.get(g, (math.inf,))[0]:
                choice[g] = (predicted[i], rows.ms[i])
    batches = [g for g in choice if arms[g] >= 2]  # as evaluate_choices: a batch of one arm is no decision
    if not batches:
        return {"mean_regret_all_arms": float("nan"), "time_vs_oracle_all_arms": float("nan")}
    chosen = np.array([choice[g][1] for g in batches])
    oracle = np.array([best[g] for g in batches])
    return {
        "mean_regret_all_arms": float(np.mean(chosen / oracle - 1.0)),
        "time_vs_oracle_all_arms": float(chosen.sum() / oracle.sum()),
    }


# A config joins the shortlist only if it was timed against the default on at least 3 batches of the bucket and
# lost on none by over 5%: a config shortlisted on two wins over one 1.16x loss was then chosen for RACE at B=128,
# where it took 1.35x the default's time (benchmarks/cora_table.py).
_SHORTLIST_MIN_BATCHES = 3
_SHORTLIST_WORST = 1.05


def _shortlist(measurements: Sequence[Measurement], top: int = 3) -> dict[str, list[dict]]:
    """Per signature and max_len bucket (powers of two), the ragged configs worth predicting: the default
    config first, then configs measured head to head against it on at least 3 batches of the bucket that
    beat it on most of them by a median of at least 3% and lost on none by over 5% (best first).
    Conservative on purpose: the model ranks what is here, and a config that only won on average over
    other batch sizes is not offered."""
    from .planner import default_ragged_config

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
            if len(r) >= _SHORTLIST_MIN_BATCHES and float(np.median(r)) <= 0.97 and np.mean(np.asarray(r) < 1.0) > 0.5
            and max(r) <= _SHORTLIST_WORST
        ]  # fmt: skip
        chosen = [default] + [configs[label] for _, label in sorted(winners)[: top - 1]]
        out[sig_key].append({"max_len_le": bucket, "configs": chosen})
    return dict(out)


def held_out_predictions(rows: _Rows, device: DeviceKey, reference: str, seed: int = 0) -> tuple[np.ndarray, str]:
    """Each evaluated row's prediction by a model fit without it (NaN for rows never held out): leave one
    length family out at a time, or 25% of the batches when only one family was measured."""
    families = sorted({f for f, g in zip(rows.family, rows.group) if g})
    predicted = np.full(len(rows.y), np.nan)
    if len(families) >= 2:
        holdout = "leave one length family out"
        tests = [np.array([f == fam for f in rows.family]) for fam in families]
    else:
        holdout = "25% of the batches held out"
        rng = np.random.default_rng(seed)
        groups = sorted({g for g in rows.group if g})
        held = set(rng.choice(groups, size=max(1, len(groups) // 4), replace=False)) if groups else set()
        tests = [np.array([g in held for g in rows.group])]
    for test in tests:
        if test.any() and (~test).any():
            predicted[test] = _predict_rows(_fit_pair(rows, ~test, reference, device, seed, {}), rows, test)
    return predicted, holdout


def fit_cost_model(measurements: Sequence[Measurement], device: DeviceKey, seed: int = 0) -> CompiledModel:
    """Fit on every measurement of `device`, evaluate leaving one length family out at a time (or 25% of
    the batches when only one family was measured), and return the compiled model with `.metrics`."""
    rows = _rows(measurements, device)
    if len(rows.y) < MIN_ROWS:
        raise TooFewMeasurements(len(rows.y), device.key)
    with _one_thread():
        return _fit_and_evaluate(measurements, rows, device, seed)


# scikit-learn's trees run on OpenMP threads, beside torch's own OpenMP pool in the same process, and a tree of
# a few thousand rows gives each thread microseconds of work between barriers: on a busy 2-core CPU one thread
# refit 4,172 measurements in 65-72 s against 239 s with two, the same model to the bit. The limit reaches only
# the OpenMP runtimes loaded when it is set, so scikit-learn's is loaded first.
def _one_thread():
    from threadpoolctl import threadpool_limits  # a dependency of scikit-learn

    _regressor_class()
    return threadpool_limits(limits=1, user_api="openmp")


def _fit_and_evaluate(measurements: Sequence[Measurement], rows: _Rows, device: DeviceKey, seed: int) -> CompiledModel:
    families = sorted({f for f, g in zip(rows.family, rows.group) if g})
    reference = _pick_reference(rows)
    predicted, holdout = held_out_predictions(rows, device, reference, seed)
    evaluated = ~np.isnan(predicted) & rows.choosable  # the planner's decision: among the arms it may choose
    metrics = evaluate_choices(
        predicted[evaluated], rows.ms[evaluated], [g for g, e in zip(rows.group, evaluated) if e],
        rows.p10[evaluated], rows.p90[evaluated],
    )  # fmt: skip
    prior_metrics = evaluate_choices(
        rows.prior[evaluated], rows.ms[evaluated], [g for g, e in zip(rows.group, evaluated) if e]
    )
    # the trivial rule: always the reference arm (the ragged graph on a GPU), on the batches it was timed on
    timed_ref = {g for g, r in zip(rows.group, rows.is_ref[reference]) if g and r}
    on = evaluated & np.array([g in timed_ref for g in rows.group], dtype=bool)
    always_metrics = evaluate_choices(
        np.where(rows.is_ref[reference], 0.0, 1.0)[on], rows.ms[on], [g for g, e in zip(rows.group, on) if e]
    )
    metrics.update(against_every_arm(predicted, rows, rows.choosable))
    metrics.update(
        holdout=holdout, families=families, rows=int(len(rows.y)), reference=reference,
        prior_accuracy=prior_metrics["accuracy"], prior_mean_regret=prior_metrics["mean_regret"],
        reference_accuracy=always_metrics["accuracy"], reference_mean_regret=always_metrics["mean_regret"],
        reference_p95_regret=always_metrics["p95_regret"],
    )  # fmt: skip
    everything = np.ones(len(rows.y), dtype=bool)
    model = _fit_pair(rows, everything, reference, device, seed, _shortlist(measurements))
    model.metrics = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
    return model
