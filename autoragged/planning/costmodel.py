"""What each arm costs: arms, physics-informed work counts, features, and the analytic prior.

An arm is "padded" (the original module) or "ragged" with a `KernelConfig` (attention tiles, the
layout's alignment, the linears' backend). The work counts are the physics the learned model builds
on: FLOPs of the linear and attention parts and the bytes the elementwise passes move, for the rows
each arm really computes (the padded rectangle, or the real rows plus alignment and tile waste).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..kernels.config import KernelConfig
from ..tuning_db.records import BatchStats, DeviceKey, ModuleSignature
from .buckets import padded_bucket, ragged_bucket

__all__ = [
    "Arm",
    "KINDS",
    "PADDED",
    "PADDED_GRAPH",
    "Work",
    "work",
    "features",
    "FEATURE_NAMES",
    "FEATURE_VERSION",
    "AnalyticPrior",
]


# The arm kinds a measurement may name. The runtime runs "padded", "ragged" and "ragged_graph"; "padded_graph" (the
# padded forward captured as a graph) is priced only so that the rows of older databases still parse.
KINDS = ("padded", "ragged", "padded_graph", "ragged_graph")


@dataclass(frozen=True)
class Arm:
    """One way to run a batch. kind: one of KINDS ("_graph": replayed as a CUDA graph); config: the ragged
    arms' knobs (None for the padded ones)."""

    kind: str
    config: KernelConfig | None = None

    @property
    def label(self) -> str:
        return self.kind if self.config is None else f"{self.kind}:{self.config.short()}"

    @property
    def ragged(self) -> bool:
        return self.kind.startswith("ragged")

    @property
    def graph(self) -> bool:
        return self.kind.endswith("_graph")


PADDED = Arm("padded")
PADDED_GRAPH = Arm("padded_graph")


@dataclass(frozen=True)
class Work:
    rows: float  # rows every linear computes
    linear_flops: float
    attention_flops: float
    bytes: float  # bytes moved by the elementwise/norm passes and the pack/unpack copies


def work(sig: ModuleSignature, stats: BatchStats, arm: Arm) -> Work:
    """FLOPs and bytes of one forward of `sig` on a batch with `stats` through `arm` (all layers)."""
    B, L, D, F = stats.batch, stats.max_len, sig.d_model, sig.ff
    elt = 4 if sig.dtype == "float32" else 2
    if arm.kind == "padded_graph":  # the captured padded forward (no nested conversion) on its bucket
        Lb = padded_bucket(B, L)[1]
        rows, attn, copies = float(B * Lb), float(B * Lb * Lb), 2.0 * B * L * D * elt
    elif not arm.ragged or arm.config is None:
        # PyTorch's nested-tensor fast path computes the linears on real tokens only (and converts in/out)
        nested = sig.nested and stats.total < B * L
        rows = float(stats.total if nested else B * L)
        attn = float(B * L * L)
        copies = 2.0 * B * L * D * elt if nested else 0.0
    else:
        c = arm.config
        rows = stats.total + B * (c.align - 1) / 2  # alignment gaps, on average half an align each
        if arm.graph and c.backend == "cublas":  # (older rows) cuBLAS linears compute the bucket's spare rows too
            rows = float(ragged_bucket(int(rows), B, L)[0])
        # each component's queries round up to block_m and its keys to block_n
        attn = stats.sum_sq + (c.block_m + c.block_n) / 2 * stats.total + c.block_m * c.block_n / 4 * B
        copies = 2.0 * B * L * D * elt  # pack in, unpack out (the padded side of each copy)
    linear = 2 * rows * (4 * D * D + 2 * D * F) * sig.layers
    attention = 4 * attn * D * sig.layers  # QK^T and PV over all heads
    passes = 12  # residual adds, norms, activation, q/k/v/out reads beyond the matmuls (per layer)
    return Work(rows, linear, attention, rows * D * elt * passes * sig.layers + copies)


FEATURE_VERSION = 9  # bumped whenever the features or the prior change: a stored model is residuals over them
FEATURE_NAMES = (
    "log2_batch", "log2_max_len", "log2_total", "pad_fraction", "cv",
    "log2_rows", "log2_linear_gflop", "log2_attention_gflop", "log2_mbytes",
    "log2_d_model", "log2_ff", "heads", "layers", "dtype_bytes", "padded_nested",
    "ragged", "block_m", "block_n", "num_warps", "num_stages", "align", "cublas", "graph",
    # the batch as a bucketed arm would run it, on every row: the trees compare arms on one batch directly
    "log2_padded_bucket_rows", "log2_ragged_bucket_rows", "bucket_rows_ratio", "log2_sum_sq",
    "log2_padded_bucket_attention",
    # the ragged bucket's spare rows over the real rows: the trees cannot take the difference of log2_rows and
    # log2_ragged_bucket_rows themselves (held out on an H100 calibration: decision accuracy 74.7% -> 77.8%)
    "graph_spare_rows",
)  # fmt: skip


def features(sig: ModuleSignature, stats: BatchStats, arms: list[Arm]) -> np.ndarray:
    """(len(arms), len(FEATURE_NAMES)) float64 feature rows: batch shape, the arm's work, model dims,
    and the arm's knobs (zeros for padded)."""
    out = np.zeros((len(arms), len(FEATURE_NAMES)))
    cv = stats.std / stats.mean if stats.mean else 0.0
    common = [
        math.log2(max(stats.batch, 1)), math.log2(max(stats.max_len, 1)), math.log2(max(stats.total, 1)),
        stats.pad_fraction, cv,
    ]  # fmt: skip
    dims = [
        math.log2(max(sig.d_model, 1)), math.log2(max(sig.ff, 1)), sig.heads, sig.layers,
        4 if sig.dtype == "float32" else 2, float(sig.nested),
    ]  # fmt: skip
    padded_rows = stats.batch * padded_bucket(stats.batch, stats.max_len)[1]
    ragged_rows = ragged_bucket(stats.total, stats.batch, stats.max_len)[0]
    buckets = [
        math.log2(max(padded_rows, 1)), math.log2(max(ragged_rows, 1)), padded_rows / max(ragged_rows, 1),
        math.log2(max(stats.sum_sq, 1)), math.log2(max(padded_rows * padded_bucket(stats.batch, stats.max_len)[1], 1)),
        ragged_rows / max(stats.total, 1) - 1.0,
    ]  # fmt: skip
    for i, arm in enumerate(arms):
        w = work(sig, stats, arm)
        c = arm.config
        knobs = [0.0] * 7 if c is None else [
            1.0, c.block_m, c.block_n, c.num_warps, c.num_stages, c.align, float(c.backend == "cublas")
        ]  # fmt: skip
        knobs.append(float(arm.graph))
        out[i] = common + [
            math.log2(max(w.rows, 1)), math.log2(max(w.linear_flops / 1e9, 1e-9)),
            math.log2(max(w.attention_flops / 1e9, 1e-9)), math.log2(max(w.bytes / 1e6, 1e-9)),
        ] + dims + knobs + buckets  # fmt: skip
    return out


class AnalyticPrior:
    """Latency = launches + FLOPs / rate + bytes / bandwidth, with rough per-device-kind rates.

    Used until a calibration for this device exists (and always as the baseline the learned model
    corrects). On CUDA the rates scale with the SM count from H100-measured values (benchmarks/kernels.py:
    ~400 TFLOP/s fp16 linears at large T, ~200 ragged attention, ~100 padded SDPA with a mask); launch
    costs are per layer of eager PyTorch or of our ragged chain.
    """

    name = "prior"

    def __init__(self, device: DeviceKey):
        if device.capability == "cpu":
            cores = max(device.sm_count, 1)
            self.linear_rate = 2e10 * cores
            self.ragged_attention_rate = self.padded_attention_rate = 1e10 * cores
            self.bandwidth = 1e10
            self.padded_launch_ms = self.ragged_launch_ms = 0.02
            self.fixed_ragged_ms = 0.05
            self.graph_ms = 0.05
            self.padded_graph_layer_ms = self.ragged_graph_layer_ms = self.triton_graph_layer_ms = 0.0
            self.triton_linear_share = 1.0
        else:
            scale = device.sm_count / 132
            self.linear_rate = 4e14 * scale
            self.ragged_attention_rate = 2e14 * scale
            self.padded_attention_rate = 1e14 * scale
            self.bandwidth = 2.5e12
            self.padded_launch_ms = 0.08
            self.ragged_launch_ms = 0.07
            self.fixed_ragged_ms = 0.03
            # A replayed graph costs a fixed part (the copies in and out, the replay call) and a part per
            # layer: its kernels run back to back, a few microseconds each, however small the batch. The
            # per-layer parts are what the rest of the prior leaves of the latency of batches of at most 64
            # tokens on an H100, fit by least squares over 6-, 12- and 24-layer encoders: 0.049 ms for the
            # Triton ragged graph the runtime captures; 0.051 and 0.032 price the padded graph and the
            # cuBLAS-linear ragged graph that older databases' rows name.
            self.graph_ms = 0.02
            self.padded_graph_layer_ms = 0.051
            self.ragged_graph_layer_ms = 0.032
            self.triton_graph_layer_ms = 0.049
            # our Triton linear's rate against cuBLAS's, default tiles: geomean 0.70x at 400-16K rows on an H100
            # (benchmarks/diagnostics/linear_tiles.py). Stored models are residuals over this prior: changing it
            # needs a FEATURE_VERSION bump, or their Triton-arm predictions shift silently.
            self.triton_linear_share = 0.7

    def predict_ms(self, sig: ModuleSignature, stats: BatchStats, arms: list[Arm]) -> np.ndarray:
        out = np.empty(len(arms))
        for i, arm in enumerate(arms):
            w = work(sig, stats, arm)
            ragged = arm.ragged
            triton = ragged and arm.config is not None and arm.config.backend == "triton"
            if arm.graph:
                per_layer = self.padded_graph_layer_ms
                if ragged:
                    per_layer = self.triton_graph_layer_ms if triton else self.ragged_graph_layer_ms
                launch = self.graph_ms + sig.layers * per_layer
            else:
                launch = sig.layers * (self.ragged_launch_ms if ragged else self.padded_launch_ms)
                launch += self.fixed_ragged_ms if ragged else 0.0
            attn_rate = self.ragged_attention_rate if ragged else self.padded_attention_rate
            linear_rate = self.linear_rate * (self.triton_linear_share if triton else 1.0)
            seconds = w.linear_flops / linear_rate + w.attention_flops / attn_rate + w.bytes / self.bandwidth
            out[i] = launch + 1e3 * seconds
        return out
