"""The pictures of `python -m autoragged.report --html`: the arm chosen per batch, predicted against measured
latency, latency by batch size. matplotlib draws them (Figure and the Agg canvas, no pyplot: the caller's
backend and figures stay untouched); it is imported only here, when a page is drawn.

Batches at the same point are one marker whose area grows with their count, the count written on it (identical
batches drew one dot the size of one); a median is drawn with the interquartile range of what it is the median
of; a picture with nothing to show is a sentence saying why."""

from __future__ import annotations

import io
import math
from collections import Counter, defaultdict
from collections.abc import Iterable

import numpy as np

from ..tuning_db import KEEP_ENV_VAR, Decision
from . import Records, Summary
from .rollup import forced, is_padded, label_of, predicted_of

__all__ = ["images", "require_matplotlib"]

_MAX_MAP_POINTS = 20_000  # decision-map scatter: more points only slow the PNG down

_KIND_COLOURS = {"padded": "tab:blue", "ragged": "tab:orange", "padded_graph": "tab:cyan", "ragged_graph": "tab:red"}
_CONFIG_COLOURS = ["tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"]


def require_matplotlib():
    """matplotlib's Figure and Agg canvas (no pyplot: the caller's backend and figures stay untouched)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            f"the HTML report draws its pictures with matplotlib, which cannot be imported ({e}); "
            "pip install matplotlib (or pip install 'autoragged[plot]'); the terminal report needs nothing more"
        ) from e
    return Figure, FigureCanvasAgg


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


_AREA = 14  # a marker's area (points^2) per batch
_MAX_BATCHES_DRAWN = 40  # ... up to this many: a point of 20,000 batches must not cover the picture
_MAX_COUNTS_WRITTEN = 30  # counts written on the most crowded points only: a label per point hides the picture


def _counted_scatter(ax, points: Iterable[tuple[float, float]], colour: str, label: str, row: int = 0) -> None:
    """One marker per distinct (x, y), its area growing with the batches there, their count written beside it in
    its colour (`row`: the how-manieth group drawn, so that counts of groups at one point do not cover each other)."""
    counts = Counter(points)
    xs, ys = zip(*counts) if counts else ((), ())
    sizes = [_AREA * min(n, _MAX_BATCHES_DRAWN) for n in counts.values()]
    ax.scatter(xs, ys, s=sizes, alpha=0.6, color=colour, edgecolors="none", label=f"{label} ({counts.total()})")
    crowded = sorted(((n, xy) for xy, n in counts.items() if n > 1), reverse=True)[:_MAX_COUNTS_WRITTEN]
    for n, xy in crowded:
        ax.annotate(str(n), xy, xytext=(7, 8 * row - 3), textcoords="offset points", fontsize=7, color=colour)


def _legend(ax, **kwargs) -> None:
    """The legend, its markers one size whatever the counts behind them."""
    legend = ax.legend(**kwargs)
    for handle in legend.legend_handles:
        if hasattr(handle, "set_sizes"):
            handle.set_sizes([_AREA * 2])


def _decision_map(Figure, decisions: list[Decision]):
    points = [d for d in decisions if d.stats.batch > 0]
    if not points:
        return (f"its decisions are counted in hourly totals only, which keep no lengths ({KEEP_ENV_VAR} keeps "
                "more one by one)") if not decisions else "all its batches were empty"  # fmt: skip
    step = max(1, len(points) // _MAX_MAP_POINTS)
    groups: dict[str, list[Decision]] = defaultdict(list)
    for d in points[::step]:
        groups["padded (forced)" if forced(d) and is_padded(d.arm) else label_of(d)].append(d)
    colours = {"padded": "tab:blue", "padded (forced)": "tab:gray", "padded_graph": "tab:cyan"}
    others = sorted(g for g in groups if g not in colours)
    colours.update({g: _CONFIG_COLOURS[i % len(_CONFIG_COLOURS)] for i, g in enumerate(others)})
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    for row, label in enumerate([g for g in colours if g in groups and g not in others] + others):
        xy = [(d.stats.mean, d.stats.pad_fraction) for d in groups[label]]
        _counted_scatter(ax, xy, colours[label], label, row)
    means = [d.stats.mean for d in points]
    if min(means) > 0 and max(means) / min(means) > 20:
        ax.set_xscale("log")
    ax.set_xlabel("mean length (tokens)")
    ax.set_ylabel("padding fraction")
    ax.set_ylim(-0.02, 1.02)
    sub = f", every {step}th batch" if step > 1 else ""
    ax.set_title(f"arm chosen per batch (marker area and number: batches at that point{sub})", fontsize=9)
    _legend(ax, fontsize=8, loc="best")
    return fig


def _significant(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def _predicted_vs_measured(Figure, decisions: list[Decision]):
    pairs = [
        (predicted_of(d, label_of(d)), d.measured_ms, d.arm)
        for d in decisions
        if d.measured_ms is not None and d.measured_ms > 0 and (predicted_of(d, label_of(d)) or 0) > 0
    ]
    if not pairs:
        timed = sum(d.measured_ms is not None for d in decisions)
        if not timed:
            return (f"none of its {len(decisions)} batches kept was timed (a wrapped model times every "
                    "sample_every-th batch: wrap(sample_every=32) by default)")  # fmt: skip
        return f"none of its {timed} timed batches had a prediction for the arm it ran (forced arms have none)"
    fig = Figure(figsize=(5.5, 5))
    ax = fig.add_subplot()
    for row, kind in enumerate(sorted({p[2] for p in pairs})):
        xy = [(_significant(p), _significant(m)) for p, m, k in pairs if k == kind]  # 4 digits: overlapping
        _counted_scatter(ax, xy, _KIND_COLOURS.get(kind, "tab:gray"), kind, row)
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
    ax.set_title("chosen arm: predicted vs measured (marker area and number: batches)", fontsize=9)
    _legend(ax, fontsize=8)
    return fig


def _latency_points(rec: Records, device: str) -> dict[str, list[tuple[int, float, str, str]]]:
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
    """Per signature: every latency by batch size (faint), and per arm kind the median of each power-of-two range
    of batch sizes (drawn at their median size) with its interquartile range as a bar. Batches of one size but
    other lengths take other times: the medians of single batch sizes of a CPU calibration went from 2 to 180 ms
    and back between neighbours; wider ranges hold more batches, and the bar shows how far apart they are."""
    if not points:
        return ("nothing was measured on this device in the window (python -m autoragged.tune measures it; a wrapped "
                "model times a sample of its batches)")  # fmt: skip
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
                    ax.scatter(*zip(*xs), s=18 if marker == "o" else 10, marker=marker, alpha=0.25, color=colour,
                               label=f"{kind}, {source} ({len(xs)})")  # fmt: skip
            by_range: dict[int, list[tuple[int, float]]] = defaultdict(list)
            for b, ms, k, _ in points[sig]:
                if k == kind:
                    by_range[int(math.log2(b))].append((b, ms))
            ranges = [by_range[r] for r in sorted(by_range)]
            xs = [float(np.median([b for b, _ in batches])) for batches in ranges]
            quartiles = [np.percentile([ms for _, ms in batches], [25, 50, 75]) for batches in ranges]
            q25, median, q75 = np.array(quartiles).T
            ax.errorbar(xs, median, yerr=[median - q25, q75 - median], color=colour, linewidth=1.2, capsize=2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size (medians over each power-of-two range)")
        ax.set_ylabel("latency (ms; line: median, bar: middle half)")
        ax.set_title(sig, fontsize=9)
        ax.legend(fontsize=7)
        _plain_log_ticks(ax, "x", "y")
    fig.tight_layout()
    return fig


def images(rec: Records, s: Summary) -> dict[str, bytes | str]:
    """The report's pictures, keyed like its figure blocks: a PNG, or where there is nothing to draw, why."""
    Figure, canvas = require_matplotlib()
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
    return {key: fig if isinstance(fig, str) else _png(fig, canvas) for key, fig in figures.items()}
