"""The pictures of `python -m autoragged.report --html`: the arm chosen per batch, predicted against measured
latency, latency by batch size. matplotlib draws them (Figure and the Agg canvas, no pyplot: the caller's
backend and figures stay untouched); it is imported only here, when a page is drawn."""

from __future__ import annotations

import io
import math
import statistics
from collections import defaultdict

from ._report_render import _shown
from ._rollup import forced as _forced
from .report import _MAX_MAP_POINTS, Summary, _is_padded, _label, _Records, _require_matplotlib
from .tuning_db import Decision

__all__ = ["images"]


_KIND_COLOURS = {"padded": "tab:blue", "ragged": "tab:orange", "padded_graph": "tab:cyan", "ragged_graph": "tab:red"}
_CONFIG_COLOURS = ["tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"]


def _png(fig, canvas_cls) -> bytes:
    canvas_cls(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight", metadata={"Software": None})
    return buf.getvalue()


def _plain_log_ticks(ax, *axes: str) -> None:
    """Tick labels 4, 6, 10 rather than 4x10^0 on log axes (minor ones only on an axis spanning < 10x).
    Call after the data and limits are set."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for name in axes:
        lo, hi = getattr(ax, f"get_{name}lim")()
        axis = getattr(ax, f"{name}axis")
        axis.set_major_formatter(plain)
        axis.set_minor_formatter(plain if 0 < lo and hi < 10 * lo else NullFormatter())


def _decision_map(Figure, decisions: list[Decision]):
    points = [d for d in decisions if d.stats.batch > 0]
    if not points:
        return None
    step = max(1, len(points) // _MAX_MAP_POINTS)
    groups: dict[str, list[Decision]] = defaultdict(list)
    for d in points[::step]:
        groups["padded (forced)" if _forced(d) and _is_padded(d.arm) else _shown(_label(d), d.device)].append(d)
    colours = {"padded": "tab:blue", "padded (forced)": "tab:gray", "padded_graph": "tab:cyan"}
    others = sorted(g for g in groups if g not in colours)
    colours.update({g: _CONFIG_COLOURS[i % len(_CONFIG_COLOURS)] for i, g in enumerate(others)})
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    for label in [g for g in colours if g in groups and g not in others] + others:
        ds = groups[label]
        ax.scatter([d.stats.mean for d in ds], [d.stats.pad_fraction for d in ds], s=14, alpha=0.7,
                   color=colours[label], label=f"{label} ({len(ds)})")  # fmt: skip
    means = [d.stats.mean for d in points]
    if min(means) > 0 and max(means) / min(means) > 20:
        ax.set_xscale("log")
    ax.set_xlabel("mean length (tokens)")
    ax.set_ylabel("padding fraction")
    ax.set_ylim(-0.02, 1.02)
    sub = f" (every {step}th batch)" if step > 1 else ""
    ax.set_title(f"arm chosen per batch{sub}")
    ax.legend(fontsize=8, loc="best")
    return fig


def _predicted_vs_measured(Figure, decisions: list[Decision]):
    pairs = [
        (d.predicted_ms[_label(d)], d.measured_ms, d.arm)
        for d in decisions
        if d.measured_ms is not None and d.measured_ms > 0 and d.predicted_ms.get(_label(d), 0) > 0
    ]
    if not pairs:
        return None
    fig = Figure(figsize=(5.5, 5))
    ax = fig.add_subplot()
    for kind in sorted({p[2] for p in pairs}):
        xs, ys = zip(*[(p, m) for p, m, k in pairs if k == kind])
        ax.scatter(xs, ys, s=16, alpha=0.7, color=_KIND_COLOURS.get(kind, "tab:gray"), label=f"{kind} ({len(xs)})")
    lo = min(min(p, m) for p, m, _ in pairs) / 1.3
    hi = max(max(p, m) for p, m, _ in pairs) * 1.3
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=1, linestyle="--", label="y = x")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    _plain_log_ticks(ax, "x", "y")
    ax.set_xlabel("predicted latency (ms)")
    ax.set_ylabel("measured latency (ms)")
    ax.set_title("chosen arm: predicted vs measured")
    ax.legend(fontsize=8)
    return fig


def _latency_points(rec: _Records, device: str) -> dict[str, list[tuple[int, float, str, str]]]:
    """signature -> (batch, ms, arm kind, source): sampled decisions and tune measurements (runtime
    measurements are the sampled decisions again, so they are left out)."""
    out: dict[str, list[tuple[int, float, str, str]]] = defaultdict(list)
    for d in rec.decisions:
        if d.device == device and d.measured_ms is not None and d.measured_ms > 0 and d.stats.batch > 0:
            out[d.signature].append((d.stats.batch, d.measured_ms, d.arm, "sampled"))
    for m in rec.measurements:
        if m.device == device and m.source != "runtime" and m.median_ms > 0 and m.stats.batch > 0:
            out[m.signature].append((m.stats.batch, m.median_ms, m.arm, m.source or "tune"))
    return out


def _latency_by_batch(Figure, points: dict[str, list[tuple[int, float, str, str]]]):
    if not points:
        return None
    sigs = sorted(points, key=lambda s: -len(points[s]))
    cols = min(len(sigs), 2)
    rows = math.ceil(len(sigs) / cols)
    fig = Figure(figsize=(6 * cols, 4 * rows))
    for i, sig in enumerate(sigs):
        ax = fig.add_subplot(rows, cols, i + 1)
        for kind in sorted({p[2] for p in points[sig]}):
            colour = _KIND_COLOURS.get(kind, "tab:gray")
            for source, marker in (("sampled", "o"), ("tune", ".")):
                xs = [(b, ms) for b, ms, k, src in points[sig] if k == kind and (src == "sampled") is (marker == "o")]
                if xs:
                    ax.scatter(*zip(*xs), s=18 if marker == "o" else 10, marker=marker, alpha=0.5, color=colour,
                               label=f"{kind}, {source} ({len(xs)})")  # fmt: skip
            by_batch: dict[int, list[float]] = defaultdict(list)
            for b, ms, k, _ in points[sig]:
                if k == kind:
                    by_batch[b].append(ms)
            xs = sorted(by_batch)
            ax.plot(xs, [statistics.median(by_batch[b]) for b in xs], color=colour, linewidth=1.2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("latency (ms; line: median)")
        ax.set_title(sig, fontsize=9)
        ax.legend(fontsize=7)
        _plain_log_ticks(ax, "x", "y")
    fig.tight_layout()
    return fig


def images(rec: _Records, s: Summary) -> dict[str, bytes]:
    """The PNGs of the report, keyed like its figure blocks."""
    Figure, canvas = _require_matplotlib()
    by_module: dict[tuple[str, str], list[Decision]] = defaultdict(list)
    for d in rec.decisions:
        by_module[(d.device, d.signature)].append(d)
    figures = {}
    for dev in s.devices:
        figures[f"lat|{dev.key}"] = _latency_by_batch(Figure, _latency_points(rec, dev.key))
        for m in dev.modules:
            decisions = by_module[(m.device, m.signature)]
            figures[f"map|{m.device}|{m.signature}"] = _decision_map(Figure, decisions)
            figures[f"pvm|{m.device}|{m.signature}"] = _predicted_vs_measured(Figure, decisions)
    return {key: _png(fig, canvas) for key, fig in figures.items() if fig is not None}
