"""How `python -m autoragged.report` prints: the Summary (report/results.py) as terminal tables
(`render_text`) or one HTML page (`render_html`, with the pictures of report/plots.py)."""

from __future__ import annotations

import base64
import datetime as dt
import html
import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..tuning_db import KEEP_ENV_VAR

if TYPE_CHECKING:
    from .results import DeviceSummary, ModuleSummary, Summary, TimeSaved

__all__ = ["render_text", "render_html", "read_metric"]


def read_metric(metrics: dict[str, Any], name: str, kind: type = float) -> Any:
    """metrics[name] when it is a finite number (kind float), an int (kind int) or a str (kind str), else None:
    the metrics of a model written by another version, or by hand, may hold anything."""
    value = metrics.get(name)
    if isinstance(value, bool):
        return None
    if kind is float:
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
    return value if isinstance(value, kind) else None


# The report is built once as blocks (headings, paragraphs, tables, figure slots) and rendered either as
# terminal text or as HTML, so both show the same tables.


def _when(t: float) -> str:
    return dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def _ms(x: float) -> str:
    return f"{x:.3f} ms" if abs(x) < 1e4 else f"{x / 1e3:.2f} s"


def _count_of(n: int, what: str) -> str:
    """`1 batch`, `3 batches`, `2 models`."""
    return f"{n} {what}" if n == 1 else f"{n} {what}{'es' if what.endswith(('s', 'ch')) else 's'}"


def _header_blocks(s: Summary) -> list[tuple]:
    window = f"since {_when(s.since)}" if s.since is not None else "all time"
    scope = f"device {s.device}" if s.device else "all devices"
    blocks: list[tuple] = [
        ("h", 1, "autoragged decision report"),
        ("p", f"database {s.path}; {window}; {scope}: {_count_of(s.decisions, 'decision')}; "
              f"generated {_when(s.generated)}."),
        ("p", "Time saved is a cost-model ESTIMATE (predicted latencies), not a measurement. MAPE and regret "
              "are measured, on the sampled batches only."),
    ]  # fmt: skip
    blocks += [("p", f"{line[0].upper()}{line[1:]}.") for line in s.skipped]  # damaged rows, left out
    if not s.devices:
        blocks.append(("p", f"No decisions, measurements or cost models match ({window}; {scope})."))
    return blocks


def _calibration_blocks(dev: DeviceSummary) -> list[tuple]:
    c = dev.calibration
    if c is None:
        return [("p", "Not calibrated: the runtime decides with the analytic prior (python -m autoragged.tune "
                      "calibrates this device).")]  # fmt: skip
    applies = "all signatures" if c.signature == "*" else c.signature
    used = "" if c.current else f" (feature version {c.feature_version}: this autoragged ignores it; re-run tune)"
    if c.current and not c.adopted:
        used = (" (not adopted: it picked worse than the analytic prior on held-out batches; the runtime decides "
                "with the prior)")  # fmt: skip
    rows = [
        ("cost model", f"#{c.model_id} {c.kind}, for {applies}{used}"),
        ("calibrated", f"{_when(c.created)} ({_count_of(dev.models, 'model')} stored)"),
        ("decision accuracy (held out)", _pct(c.accuracy)),
        ("mean regret (held out)", _pct(c.mean_regret, 2)),
        ("p95 regret (held out)", _pct(c.p95_regret, 2)),
        ("latency MAPE (held out)", _pct(c.mape)),
        ("held out", c.holdout or "-"),
        ("fit rows", "-" if c.rows is None else str(c.rows)),
    ]
    for name, label, digits in (("accuracy_within_noise", "accuracy, ties within measurement noise (held out)", 1),
                                ("mean_regret_all_arms", "mean regret against every arm, mask-only too (held out)", 2),
                                ("prior_accuracy", "analytic prior's accuracy (held out)", 1),
                                ("prior_mean_regret", "analytic prior's mean regret (held out)", 2),
                                ("reference_accuracy", "always the reference arm: accuracy", 1),
                                ("reference_mean_regret", "always the reference arm: mean regret", 2)):  # fmt: skip
        if read_metric(c.metrics, name) is not None:
            rows.append((label, _pct(read_metric(c.metrics, name), digits)))
    return [("table", ["calibration", "value"], rows)]


def _device_blocks(dev: DeviceSummary) -> list[tuple]:
    title = f"device {dev.key}"
    blocks: list[tuple] = [("h", 2, title)]
    blocks += _calibration_blocks(dev)
    by_source = ", ".join(f"{src or '?'} {n}" for src, n in dev.measurements_by_source.items())
    blocks.append(("p", f"measurements: {dev.measurements}" + (f" ({by_source})" if by_source else "")
                        + f"; decisions: {dev.decisions}."))  # fmt: skip
    blocks.append(("fig", f"lat|{dev.key}", f"latency by batch size and arm on {dev.key}"))
    if not dev.modules:
        blocks.append(("p", "No decisions recorded for this device in the window."))
    for module in dev.modules:
        blocks += _module_blocks(module)
    return blocks


def _saved_rows(s: TimeSaved) -> list[tuple]:
    def pct(percent: float | None, of_ms: float) -> str:
        return "-" if percent is None else f"{percent:+.1f}% of {_ms(of_ms)}"

    return [
        ("vs always padded", _ms(s.vs_padded_ms), pct(s.vs_padded_pct, s.always_padded_ms)),
        ("vs always ragged (best config per batch)", _ms(s.vs_ragged_ms), pct(s.vs_ragged_pct, s.always_ragged_ms)),
    ]


def _checks_rows(m: ModuleSummary) -> list[tuple]:
    r = m.regret
    mape = f"MAPE {_pct(m.mape)} over {_count_of(m.mape_batches, 'batch')}"
    if m.mape is None:
        mape = "no sampled batch with a prediction"
    if r.mean is None:
        regret = f"not measurable: {r.evaluated_buckets} of {r.buckets} buckets have several arms measured"
    else:
        regret = (
            f"mean {_pct(r.mean, 2)} (max {_pct(r.max, 2)}) over {_count_of(r.batches, 'batch')}; "
            f"{r.evaluated_buckets} of {r.buckets} buckets have several arms measured"
        )
    if r.exploring:
        regret += f"; {_count_of(r.exploring, 'exploration batch')} left out"
    return [
        ("sampled batches", str(m.sampled)),
        ("predicted vs measured latency", mape),
        ("regret on sampled batches", regret),
    ]


def _rolled_note(m: ModuleSummary) -> str:
    if not m.rolled_up:
        return ""
    return (f" {m.rolled_up} of them are counted in hourly totals only: the database keeps the newest decisions "
            f"of each module one by one ({KEEP_ENV_VAR}), and the pictures show those.")  # fmt: skip


def _module_blocks(m: ModuleSummary) -> list[tuple]:
    configs = [(s.label, s.batches, _pct(s.share)) for s in m.configs]
    blocks: list[tuple] = [
        ("h", 3, f"module {m.signature}"),
        ("p", f"{_count_of(m.batches, 'batch')} from {_when(m.first)} to {_when(m.last)}." + _rolled_note(m)),
        ("table", ["arm", "batches", "share"], [(s.label, s.batches, _pct(s.share)) for s in m.arms]),
        ("table", ["arm and config", "batches", "share"], configs),
    ]
    if m.fallback_reasons:
        rows = [(reason, n, _pct(n / m.batches)) for reason, n in m.fallback_reasons.items()]
        blocks.append(("table", ["padded fallback (forced, no prediction)", "batches", "share"], rows))
    if m.decided_by:
        rows = [(reason, n, _pct(n / m.batches)) for reason, n in m.decided_by.items()]
        blocks.append(("table", ["decided by", "batches", "share"], rows))
    blocks.append(("table", ["measured on sampled batches", "value"], _checks_rows(m)))
    g = m.graphs
    if g.captures or g.failed:
        rows = [("captures asked of the background worker", g.captures),
                ("batches whose graph could not be captured (they run eagerly)", g.failed)]  # fmt: skip
        blocks.append(("table", ["CUDA graphs", "count"], rows))
    s = m.saved
    if s.batches and s.relative_only:
        title = (f"estimated time saved (relative only: the analytic prior on a CPU, {_count_of(s.batches, 'batch')} "
                 "with both arms predicted)")  # fmt: skip
        shares = (("vs always padded", s.vs_padded_pct), ("vs always ragged (best config per batch)", s.vs_ragged_pct))
        rows = [(label, "-" if pct is None else f"{pct:+.1f}%") for label, pct in shares]
        blocks.append(("table", [title, "% of the time"], rows))
        blocks.append(("p", "On a CPU the analytic prior's latencies are not calibrated: on a 2-core CPU they ran "
                            "about 100x the measured ones, and it predicts from a module's shape alone, so every "
                            "model of one shape gets the same numbers. Only the share of time saved is shown; "
                            "python -m autoragged.tune calibrates this CPU."))  # fmt: skip
    elif s.batches:
        title = f"estimated time saved (cost-model estimate, {_count_of(s.batches, 'batch')} with both arms predicted)"
        blocks.append(("table", [title, "ms", "%"], _saved_rows(s)))
    else:
        blocks.append(("p", "Estimated time saved: no batch had both a padded and a ragged prediction."))
    key = f"{m.device}|{m.signature}"
    blocks.append(("fig", f"map|{key}", f"decision map of {m.signature} (mean length against padding fraction)"))
    blocks.append(("fig", f"pvm|{key}", f"predicted vs measured latency of {m.signature} (sampled batches)"))
    return blocks


def _blocks(s: Summary) -> list[tuple]:
    blocks = _header_blocks(s)
    for dev in s.devices:
        blocks += _device_blocks(dev)
    return blocks


_NUMBER = re.compile(r"[+-]?[\d.,]+( ms| s|%)?( of .*)?")


def _text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [list(map(str, headers))] + [list(map(str, r)) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_NUMBER.fullmatch(r[i]) for r in cells[1:]) for i in range(len(headers))]

    def line(row: list[str]) -> str:  # numbers right-aligned, words left
        padded = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)]
        return "| " + " | ".join(padded) + " |"

    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells[1:])])


def render_text(s: Summary) -> str:
    """The terminal report (markdown-ish: headings and pipe tables)."""
    out = []
    for block in _blocks(s):
        if block[0] == "h":
            out.append(f"{'#' * block[1]} {block[2]}")
        elif block[0] == "p":
            out.append(block[1])
        elif block[0] == "table":
            out.append(_text_table(block[1], block[2]))
    return "\n\n".join(out) + "\n"


_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
table { border-collapse: collapse; margin: 0.8em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f2f2f2; }
figure { margin: 1em 0; } figcaption { color: #555; font-size: 0.9em; }
h2 { border-top: 2px solid #888; padding-top: 0.6em; margin-top: 2em; }
.missing { color: #777; font-style: italic; }
"""


def render_html(s: Summary, images: dict[str, bytes | str]) -> str:
    """One self-contained HTML page: the tables of `render_text` and the PNGs of `images` (by figure key); a figure
    whose entry is a str, or that has none, is one line saying why there is no picture."""
    esc = html.escape
    parts = [f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>autoragged decision report</title>"
             f"<style>{_CSS}</style></head><body>"]  # fmt: skip
    for block in _blocks(s):
        kind = block[0]
        if kind == "h":
            parts.append(f"<h{block[1]}>{esc(block[2])}</h{block[1]}>")
        elif kind == "p":
            parts.append(f"<p>{esc(block[1])}</p>")
        elif kind == "table":
            head = "".join(f"<th>{esc(str(h))}</th>" for h in block[1])
            body = "".join("<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in row) + "</tr>" for row in block[2])
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif kind == "fig":
            png = images.get(block[1], "there is nothing to draw")
            if isinstance(png, str):  # one line saying why, in place of an empty picture
                parts.append(f"<p class='missing'>No {esc(block[2])}: {esc(png)}.</p>")
            else:
                data = base64.b64encode(png).decode("ascii")
                parts.append(f"<figure><img src=\"data:image/png;base64,{data}\" alt=\"{esc(block[2])}\">"
                             f"<figcaption>{esc(block[2])}</figcaption></figure>")  # fmt: skip
    parts.append("</body></html>\n")
    return "\n".join(parts)
