"""What each arm is predicted to cost a batch.

`Planner.predict(stats, width)` asks the cost model (the learned one for this device where the tuning database has
it, else the analytic prior) for the three arm kinds a batch may take: the padded arm (the module as written), the
eager ragged arm (our kernels, cuBLAS linears; the tuner's best config for the batch where it shortlisted several)
and the ragged graph (Triton linears that stop at the batch's rows, captured for the shape's width). Predictions
are cached per bucket of the batch's statistics (B, max_len and total tokens in ~9% log steps: the cost changes
across those, never key on the exact total, or every new batch would miss) and width. The policy
(runtime/policy.py) turns predictions and timings into a choice.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from ..kernels import ragged_attention as k_attn
from ..kernels.config import KernelConfig
from ..tuning_db.records import BatchStats, ModuleSignature
from .costmodel import PADDED, Arm

__all__ = ["Predictions", "Planner", "default_ragged_config", "graph_config", "bucket_key"]

_CACHE_SIZE = 4096


@functools.lru_cache(maxsize=4096)
def default_ragged_config(head_dim: int, max_len: int) -> KernelConfig:
    """The eager ragged arm's config before any tuning: the attention kernel's default tiles, packed layout,
    cuBLAS linears."""
    return k_attn.default_config(head_dim, max_len).replace(backend="cublas", align=1)


@functools.lru_cache(maxsize=4096)
def graph_config(head_dim: int, max_len: int, backend: str = "triton") -> KernelConfig:
    """The ragged graph's config: Triton linears, which stop at the rows a batch fills (only the device knows
    them), so one graph serves every batch that fits it."""
    return default_ragged_config(head_dim, max_len).replace(backend=backend)


def _log_bucket(x: int) -> int:
    return -1 if x <= 0 else int(math.log2(x) * 8)


def bucket_key(stats: BatchStats) -> tuple[int, int, int]:
    return (stats.batch, _log_bucket(stats.max_len), _log_bucket(stats.total))


class Predictions(NamedTuple):
    """arms: kind -> the Arm (its config); ms: kind -> predicted ms (inf: no usable prediction); note: what the
    decision record should say of them."""

    arms: dict[str, Arm]
    ms: dict[str, float]
    note: str


class Planner:
    """Predictions for one wrapped module (one `ModuleSignature`).

    model: an object with `name` and `predict_ms(sig, stats, arms) -> array` (a learned model also has `prior`);
    shortlist: stats -> the eager ragged configs worth predicting (the tuner's), or None (the default config)."""

    def __init__(self, sig: ModuleSignature, model, shortlist: Callable[[BatchStats], list[Arm]] | None = None):
        self.sig, self.model = sig, model
        self.head_dim = sig.d_model // max(sig.heads, 1)
        self.shortlist = shortlist
        self._cache: OrderedDict[tuple, Predictions] = OrderedDict()

    def predict(self, stats: BatchStats, width: int, padded: BatchStats | None = None) -> Predictions:
        """Each arm kind's config and predicted ms for a batch of `stats` (its sequences), the graph `width` wide.
        `padded`: what the padded arm computes where that is not `stats` padded to its longest (a packed row of
        several sequences: the original module attends over the whole row)."""
        key = (*bucket_key(stats), width, None if padded is None else bucket_key(padded))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        eager = (
            self.shortlist(stats)
            if self.shortlist
            else [Arm("ragged", default_ragged_config(self.head_dim, stats.max_len))]
        )
        graph = Arm("ragged_graph", graph_config(self.head_dim, width))
        arms = [PADDED, *eager, graph]
        ms = np.array(self.model.predict_ms(self.sig, stats, arms), dtype=float)
        if padded is not None:
            ms[0] = float(self.model.predict_ms(self.sig, padded, [PADDED])[0])
        note = f"cost model ({self.model.name})"
        bad = ~(np.isfinite(ms) & (ms > 0))
        if bad.any():
            ms, extra = self._replace(stats, arms, ms, bad)
            note += extra
        best_eager = 1 + int(np.argmin(ms[1:-1]))
        out = Predictions(
            {"padded": PADDED, "ragged": arms[best_eager], "ragged_graph": graph},
            {"padded": float(ms[0]), "ragged": float(ms[best_eager]), "ragged_graph": float(ms[-1])},
            note,
        )
        self._cache[key] = out
        if len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        return out

    def _replace(self, stats, arms, ms, bad) -> tuple[np.ndarray, str]:
        """Predictions that are NaN, infinite or not positive (a stored model's leaves can sum to an overflow):
        the analytic prior's where the model has one (`.prior`), else inf (never chosen)."""
        labels = ", ".join(a.label for a, b in zip(arms, bad) if b)
        prior = getattr(self.model, "prior", None)
        if prior is not None:
            with np.errstate(all="ignore"):
                ms = np.where(bad, np.array(prior.predict_ms(self.sig, stats, arms), dtype=float), ms)
        ms = np.where(np.isfinite(ms) & (ms > 0), ms, np.inf)
        return ms, f"; the model's prediction for {labels} was not finite ({'the prior' if prior else 'none'} used)"
