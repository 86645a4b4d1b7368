"""Checks of a stored cost model payload before the runtime uses it: the models table is read on every
process start, from a file that may be shared, so a payload is input like any other.

A payload passes when every field has its type, every index is in range, the tree arrays form trees (no
cycle, every node reached once from a root), the stored depth is the trees' depth, every threshold and leaf
value is finite, the shortlist holds valid `KernelConfig`s, and the sizes are within the caps below. Anything
else raises `PayloadError` (a ValueError) naming the field and what is wrong with it; the runtime then
decides with the analytic prior (`load.load_planner_inputs`).

The caps bound the time a forward can spend in the trees (`Forest.residual` steps `depth` times over every
tree of the batch's arms). `python -m autoragged.tune` fits 150 trees of depth at most 6 per forest
(`learned._fit_trees`: max_iter=150, max_depth=6, at most 31 leaves), about 8,700 nodes, and a payload of
two forests is about 0.9 MB of JSON (50 bytes a node, fit on 5,000 rows). The caps leave
4x the trees, 2.7x the depth, 11x the nodes and 18x the bytes, so a refit with other settings still loads;
at the caps one prediction takes about 11x a tuned model's (0.55 ms for 4 arms on a 2-core CPU), paid
once per decision-cache bucket, never per batch.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = [
    "PayloadError", "MAX_TREES", "MAX_NODES", "MAX_DEPTH", "MAX_PAYLOAD_BYTES", "check_forest", "check_candidates",
    "check_device", "require", "TREE_FIELDS",
]  # fmt: skip

MAX_TREES = 600  # per forest
MAX_NODES = 100_000  # per forest
MAX_DEPTH = 16
MAX_PAYLOAD_BYTES = 16 * 2**20  # the JSON text of one models row

TREE_FIELDS = ("feature", "threshold", "left", "right", "value", "leaf")
_DEVICE_FIELDS = {"name": str, "capability": str, "sm_count": int, "memory_mb": int, "driver": str, "torch": str,
                  "triton": str}  # fmt: skip


class PayloadError(ValueError):
    """A stored cost model payload that the runtime must not use; the message says which field and why."""


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def require(payload: Any, name: str, kind: type | tuple[type, ...], where: str = "payload") -> Any:
    """payload[name], which must be present and of `kind` (a bool is no int or float here)."""
    if not isinstance(payload, dict):
        raise PayloadError(f"{where} is a JSON {_type_name(payload)}, not an object")
    if name not in payload:
        raise PayloadError(f"{where} has no field {name!r}")
    value = payload[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        expected = " or ".join(k.__name__ for k in kinds)
        raise PayloadError(f"{where}.{name} is a {_type_name(value)}, not a {expected}")
    return value


def _array(value: Any, name: str, kinds: str, what: str) -> np.ndarray:
    """A flat JSON list as a numpy array whose dtype kind is one of `kinds` ("i" ints, "f" floats, "b" bools)."""
    if not isinstance(value, list):
        raise PayloadError(f"{name} is a {_type_name(value)}, not a list of {what}")
    if not value:
        return np.zeros(0, dtype=np.float64 if "f" in kinds else bool if kinds == "b" else np.int64)
    try:
        array = np.asarray(value)
    except (ValueError, OverflowError) as e:  # ragged nesting, ints beyond 64 bits
        raise PayloadError(f"{name} is not a flat list of {what} ({e})") from None
    if array.ndim != 1 or array.dtype.kind not in kinds:
        raise PayloadError(f"{name} is not a flat list of {what} (numpy reads it as {array.dtype}, {array.ndim}-D)")
    return array


def _ints(value: Any, name: str) -> np.ndarray:
    array = _array(value, name, "iu", "integers")
    if array.dtype.kind == "u" and array.size and array.max() > np.iinfo(np.int64).max:
        raise PayloadError(f"{name} holds integers beyond 64 bits")
    return array.astype(np.int64)


def _finite_floats(value: Any, name: str) -> np.ndarray:
    array = _array(value, name, "iuf", "numbers").astype(np.float64)
    bad = ~np.isfinite(array)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise PayloadError(f"{name}[{i}] is {array[i]}: thresholds and leaf values must be finite")
    return array


def _check_structure(trees: dict[str, np.ndarray], roots: np.ndarray, where: str) -> int:
    """The depth of the forest whose inner nodes point at `left`/`right` children; PayloadError unless every
    node is a root or the child of exactly one inner node, and every node is reached from a root (no cycles)."""
    n = len(trees["leaf"])
    inner = ~trees["leaf"]
    for side in ("left", "right"):
        child = trees[side][inner]
        if child.size and (child.min() < 0 or child.max() >= n):
            raise PayloadError(f"{where}: a {side} child index is out of range (the forest has {n} nodes)")
    kids = np.concatenate([trees["left"][inner], trees["right"][inner]])
    if roots.size and (roots.min() < 0 or roots.max() >= n):
        raise PayloadError(f"{where}: a root index is out of range (the forest has {n} nodes)")
    parents = np.bincount(np.concatenate([roots, kids]), minlength=n)
    if (parents != 1).any():
        node = int(np.flatnonzero(parents != 1)[0])
        raise PayloadError(
            f"{where}: the arrays do not form trees (node {node} is a root or child {parents[node]} times, not once)"
        )
    frontier, reached, depth = roots, 0, 0
    while frontier.size:  # one level per step; each node is reached once (one parent each), so this ends
        reached += frontier.size
        frontier = frontier[inner[frontier]]
        if not frontier.size:
            break
        depth += 1
        if depth > MAX_DEPTH:
            raise PayloadError(f"{where}: the trees are deeper than {MAX_DEPTH} levels")
        frontier = np.concatenate([trees["left"][frontier], trees["right"][frontier]])
    if reached != n:
        raise PayloadError(f"{where}: {n - reached} nodes are not reached from any root (a cycle or a stray node)")
    return depth


def check_forest(payload: Any, n_features: int, where: str = "payload") -> tuple[float, dict, np.ndarray, int]:
    """(baseline, tree arrays, roots, depth) of a forest payload, validated (see the module docstring)."""
    baseline = require(payload, "baseline", (int, float), where)
    if not math.isfinite(baseline):
        raise PayloadError(f"{where}.baseline is {baseline}: it must be finite")
    depth = require(payload, "depth", int, where)
    if not 0 <= depth <= MAX_DEPTH:
        raise PayloadError(f"{where}.depth is {depth}: it must be in [0, {MAX_DEPTH}]")
    roots = _ints(require(payload, "roots", list, where), f"{where}.roots")
    if len(roots) > MAX_TREES:
        raise PayloadError(f"{where} has {len(roots)} trees; at most {MAX_TREES} are loaded")
    raw = require(payload, "trees", dict, where)
    trees: dict[str, np.ndarray] = {}
    for name in TREE_FIELDS:
        value = require(raw, name, list, f"{where}.trees")
        if len(value) > MAX_NODES:
            raise PayloadError(f"{where}.trees.{name} has {len(value)} nodes; at most {MAX_NODES} are loaded")
        label = f"{where}.trees.{name}"
        if name == "leaf":
            trees[name] = _array(value, label, "b", "booleans")
        elif name in ("threshold", "value"):
            trees[name] = _finite_floats(value, label)
        else:
            trees[name] = _ints(value, label)
    n = len(trees["leaf"])
    if any(len(v) != n for v in trees.values()):
        lengths = ", ".join(f"{k} {len(v)}" for k, v in trees.items())
        raise PayloadError(f"{where}: tree arrays of unequal length ({lengths})")
    feature = trees["feature"]
    if feature.size and (feature.min() < 0 or feature.max() >= n_features):
        raise PayloadError(f"{where}: a feature index is out of range (this feature version has {n_features})")
    actual = _check_structure(trees, roots, where)
    if actual != depth:
        raise PayloadError(f"{where}.depth is {depth} but the trees are {actual} levels deep")
    return float(baseline), trees, roots, depth


def check_candidates(candidates: Any) -> dict[str, list[dict]]:
    """The shortlist: signature key -> [{"max_len_le": int, "configs": [KernelConfig dict, ...]}, ...]."""
    from ..kernels.config import KernelConfig

    if not isinstance(candidates, dict):
        raise PayloadError(f"payload.candidates is a {_type_name(candidates)}, not an object")
    for sig, table in candidates.items():
        where = f"payload.candidates[{sig!r}]"
        if not isinstance(table, list):
            raise PayloadError(f"{where} is a {_type_name(table)}, not a list")
        for i, entry in enumerate(table):
            require(entry, "max_len_le", int, f"{where}[{i}]")
            for j, config in enumerate(require(entry, "configs", list, f"{where}[{i}]")):
                if not isinstance(config, dict):
                    raise PayloadError(f"{where}[{i}].configs[{j}] is a {_type_name(config)}, not an object")
                try:
                    KernelConfig.from_dict(config)
                except (TypeError, ValueError) as e:
                    raise PayloadError(f"{where}[{i}].configs[{j}] is not a valid KernelConfig: {e}") from None
    return candidates


def check_device(device: Any) -> dict[str, Any]:
    """The payload's device dict: the `DeviceKey` fields with their types."""
    for name, kind in _DEVICE_FIELDS.items():
        require(device, name, kind, "payload.device")
    extra = set(device) - set(_DEVICE_FIELDS)
    if extra:
        raise PayloadError(f"payload.device has unknown fields {sorted(extra)}")
    return device
