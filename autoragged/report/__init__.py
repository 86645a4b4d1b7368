"""`python -m autoragged.report`: what the runtime decided, why, and whether it was right.

Per wrapped module (device and `ModuleSignature`): batches seen, the share of each arm and kernel config,
why batches fell back to padded, predicted against measured latency on sampled batches, the time the
cost model estimates the choices saved, and the regret measured on sampled batches. Per device: the
calibration (the newest cost model and its held-out metrics) and the measurement counts.

    python -m autoragged.report                      # terminal tables
    python -m autoragged.report --since 2h --html report.html

In a notebook, `summary()` returns the same numbers as dataclasses (the CLI prints from it):

    s = autoragged.report.summary(since="7d")
    s.devices[0].modules[0].saved.vs_padded_pct

Cost: the decisions and measurements in the window are read into Python in full, as dataclasses (10^5
decisions take 2.2 s and 160 MB on a 2-core CPU, most of it decoding rows). The runtime keeps the
newest `AUTORAGGED_DB_KEEP_DECISIONS` decisions per module as rows (default 20,000) and adds older ones up
(rollup.py); the report adds the rows it reads up the same way and merges the stored totals, so its numbers
cover every batch while it reads at most that many rows per module. For decisions known from totals only,
`--since` counts from the start of the hour (day, for regret) it falls in. `--since` and `--device` narrow
the scan in SQL. matplotlib is needed for `--html` only and is imported when it is used.

A damaged or hostile row (unreadable JSON, wrong types, NULLs, an arm this autoragged does not know) is left
out, and the report says so in one line per table ("skipped 3 of 120 decisions rows: unreadable predicted_ms
JSON (ids 4, 9, 12)"); only a file that is no tuning database at all is refused, by name.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import re
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..planning.costmodel import FEATURE_VERSION, KINDS
from ..runtime.core import CAPTURING, NO_GRAPH
from ..tuning_db import (
    BucketTotals,
    DatabaseError,
    Decision,
    DecisionTotals,
    DeviceKey,
    Measurement,
    ModelRecord,
    Skipped,
    TuningDB,
    default_path,
)  # fmt: skip
from .render import read_metric, render_html, render_text
from .results import (
    Calibration,
    DeviceSummary,
    GraphEvents,
    ModuleSummary,
    Regret,
    Share,
    Summary,
    TimeSaved,
)  # fmt: skip
from .rollup import arm_label, is_padded, rollup

__all__ = [
    "main",
    "summary",
    "write_html",
    "parse_since",
    "arm_label",
    "render_text",
    "render_html",
    "Summary",
    "DeviceSummary",
    "Calibration",
    "ModuleSummary",
    "GraphEvents",
    "Share",
    "TimeSaved",
    "Regret",
    "Records",
]

log = logging.getLogger("autoragged")

EMPTY_MESSAGE = (
    "no decisions recorded yet in {path}; wrap a model with autoragged.wrap(...) and run it, "
    "or calibrate with python -m autoragged.tune"
)
SINCE_FORMS = (
    "an ISO date or datetime (YYYY-MM-DD, YYYY-MM-DDTHH:MM, YYYY-MM-DD HH:MM:SS+00:00; local time unless an "
    "offset is given) or an age: a number and s, m, h, d or w (45s, 30m, 2h, 7d, 2w)"
)
_AGE = re.compile(r"(\d+(?:\.\d*)?)\s*([smhdw])", re.IGNORECASE)
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_PRIOR = "cost model (prior)"  # the reason of a decision the analytic prior predicted (`Planner.predict`)


# ------------------------------------------------------------------------------------------ helpers


def _on_cpu(device: str) -> bool:
    """Whether a device key (`DeviceKey.key`) is a CPU's."""
    return "|cccpu|" in device


def parse_since(value: Any, *, now: float | None = None) -> float | None:
    """A point in time as unix seconds. Accepts None, unix seconds, a datetime or date (naive = local
    time), a timedelta (that long before now), or a string: ISO date/datetime or an age like 30m, 2h, 7d."""
    now = time.time() if now is None else now
    if value is None:
        return None
    if isinstance(value, bool):
        pass  # True is an int to Python, not a time to anyone
    elif isinstance(value, (int, float)):
        return float(value)
    elif isinstance(value, dt.datetime):
        return value.timestamp()
    elif isinstance(value, dt.date):
        return dt.datetime.combine(value, dt.time()).timestamp()
    elif isinstance(value, dt.timedelta):
        return now - value.total_seconds()
    elif isinstance(value, str):
        text = value.strip()
        age = _AGE.fullmatch(text)
        if age:
            return now - float(age[1]) * _UNIT_S[age[2].lower()]
        if text.endswith(("Z", "z")):  # fromisoformat reads "Z" only from Python 3.11 on
            text = text[:-1] + "+00:00"
        try:
            return dt.datetime.fromisoformat(text).timestamp()
        except ValueError:
            pass
    raise ValueError(f"cannot read {value!r} as a time; use {SINCE_FORMS}")


def _since_arg(text: str) -> float:
    try:
        return parse_since(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; use {SINCE_FORMS}") from None


def _matches(query: str, keys: Sequence[str]) -> list[str]:
    if query in keys:
        return [query]
    return [k for k in keys if query.lower() in k.lower()]


def _resolve_device(db: TuningDB, query: str, since: float | None) -> str:
    """The one device key equal to `query`, or containing it (case-insensitive); ValueError otherwise."""
    registered = db.devices(skipped=Skipped()) + db.models(payload=False, skipped=Skipped())
    keys = list(dict.fromkeys(getattr(r, "key", None) or r.device for r in registered))
    hits = _matches(query, keys)
    if not hits:  # rows written by hand need not have a registered device: look at the rows themselves
        keys += [k for k in db.device_keys(since=since) if k not in keys]
        hits = _matches(query, keys)
    if len(hits) == 1:
        return hits[0]
    listing = "".join(f"\n  {k}" for k in (hits or keys)) or " (none)"
    if not hits:
        raise ValueError(f"no device in {db.path} matches {query!r}; the devices there are:{listing}")
    raise ValueError(f"{query!r} matches {len(hits)} devices; pass more of the key (or all of it):{listing}")


# ------------------------------------------------------------------------------------------ loading


@dataclass
class Records:
    """What one report reads from the database (once: the summary and the pictures both use it)."""

    path: Path
    generated: float
    since: float | None
    device: str | None
    counts: dict[str, int]
    registered: list[DeviceKey]
    models: list[ModelRecord]
    decisions: list[Decision]
    measurements: list[Measurement]
    totals: list[DecisionTotals] = field(default_factory=list)  # decisions no longer kept as rows, added up
    buckets: list[BucketTotals] = field(default_factory=list)
    skipped: Skipped = field(default_factory=Skipped)


def _known_arm(record: Decision | Measurement) -> str | None:
    """The problem with a row whose arm this autoragged does not know (a reader's `check`), or None."""
    return None if record.arm in KINDS else "unknown arm kind"


def _load(db: TuningDB, device: str | DeviceKey | None, since: Any) -> Records:
    """Read the window. Raises ValueError for a bad `since` or a device filter that matches no / several keys."""
    since_s = parse_since(since)
    key = None
    if device is not None:
        key = device.key if isinstance(device, DeviceKey) else _resolve_device(db, device, since_s)
    skipped = Skipped()  # damaged rows are left out and counted: the report shows everything else
    return Records(
        path=db.path,
        generated=time.time(),
        since=since_s,
        device=key,
        counts=db.counts(),
        registered=db.devices(skipped=skipped),
        models=db.models(key, payload=False, skipped=skipped),
        decisions=db.decisions(device=key, since=since_s, skipped=skipped, check=_known_arm),
        measurements=db.measurements(device=key, since=since_s, skipped=skipped, check=_known_arm),
        totals=db.decision_totals(device=key, since=since_s, skipped=skipped),
        buckets=db.decision_buckets(device=key, since=since_s, skipped=skipped),
        skipped=skipped,
    )


def _open_existing(path: str | os.PathLike[str] | None) -> TuningDB:
    """Open a database that must already exist (TuningDB.open would create a missing one)."""
    db_path = default_path() if path is None else Path(os.path.abspath(Path(path).expanduser()))
    if not db_path.exists():
        raise FileNotFoundError(
            f"no tuning database at {db_path}; wrap a model with autoragged.wrap(...) and run it, or calibrate "
            "with python -m autoragged.tune (or pass --db / set AUTORAGGED_DB to an existing file)"
        )
    return TuningDB.open(db_path, readonly=True)


def _read(db: TuningDB | str | os.PathLike[str] | None, device: Any, since: Any) -> Records:
    if isinstance(db, TuningDB):
        return _load(db, device, since)
    with _open_existing(db) as opened:
        return _load(opened, device, since)


# --------------------------------------------------------------------------------------- summarizing


def _most_first(counter: Counter[str]) -> list[tuple[str, int]]:
    """Most frequent first, ties by name: the same order however the rows and totals were added up."""
    return sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))


def _shares(counter: Counter[str], total: int) -> list[Share]:
    return [Share(label, n, n / total) for label, n in _most_first(counter)]


def _time_saved(totals: Iterable[DecisionTotals]) -> TimeSaved:
    s = TimeSaved()
    for t in totals:
        s.batches += t.saved_batches
        s.chosen_ms += t.chosen_ms
        s.always_padded_ms += t.padded_ms
        s.always_ragged_ms += t.ragged_ms
    s.vs_padded_ms = s.always_padded_ms - s.chosen_ms
    s.vs_ragged_ms = s.always_ragged_ms - s.chosen_ms
    s.vs_padded_pct = 100 * s.vs_padded_ms / s.always_padded_ms if s.always_padded_ms > 0 else None
    s.vs_ragged_pct = 100 * s.vs_ragged_ms / s.always_ragged_ms if s.always_ragged_ms > 0 else None
    return s


def _regret(buckets: Iterable[BucketTotals]) -> Regret:
    """From the timed planner batches per bucket and label: each label's mean latency in its bucket, and the
    regret of every (not exploring) batch against its bucket's best mean."""
    by_bucket: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0, 0.0]))
    for b in buckets:  # per bucket and label: [timed batches, exploring ones, sum of their ms]
        cell = by_bucket[b.bucket][b.label]
        cell[0] += b.sampled
        cell[1] += b.exploring
        cell[2] += b.measured_sum
    regret_sum, counted, worst, exploring, evaluated = 0.0, 0, None, 0, 0
    for cells in by_bucket.values():
        exploring += sum(c[1] for c in cells.values())
        if len(cells) < 2:
            continue
        evaluated += 1
        means = {label: c[2] / c[0] for label, c in cells.items()}
        best = min(means.values())
        for label, (n, explored, _) in cells.items():
            if n > explored:
                r = means[label] / best - 1.0
                regret_sum += (n - explored) * r
                counted += n - explored
                worst = r if worst is None else max(worst, r)
    return Regret(
        buckets=len(by_bucket),
        evaluated_buckets=evaluated,
        batches=counted,
        mean=regret_sum / counted if counted else None,
        max=worst,
        exploring=exploring,
    )


def _graph_events(totals: Iterable[DecisionTotals]) -> GraphEvents:
    g = GraphEvents()
    for t in totals:
        reason = t.reason
        if "graph" not in reason:
            continue
        g.captures += t.batches if CAPTURING in reason else 0
        g.failed += t.batches if NO_GRAPH in reason else 0
    return g


def _module(device: str, signature: str, totals: list[DecisionTotals], buckets: list[BucketTotals],
            rolled_up: int) -> ModuleSummary:  # fmt: skip
    n = sum(t.batches for t in totals)
    arms, configs, fallbacks, decided = Counter(), Counter(), Counter(), Counter()
    for t in totals:
        arms[t.arm] += t.batches
        configs[t.label] += t.batches
        (fallbacks if t.forced and is_padded(t.arm) else decided)[t.reason] += t.batches
    ape_batches = sum(t.ape_batches for t in totals)
    saved = _time_saved(totals)
    saved.relative_only = _on_cpu(device) and any(_PRIOR in reason for reason in decided)
    return ModuleSummary(
        device=device,
        signature=signature,
        batches=n,
        first=min(t.first for t in totals),
        last=max(t.last for t in totals),
        arms=_shares(arms, n),
        configs=_shares(configs, n),
        fallback_reasons=dict(_most_first(fallbacks)),
        decided_by=dict(_most_first(decided)),
        sampled=sum(t.sampled for t in totals),
        mape=sum(t.ape_sum for t in totals) / ape_batches if ape_batches else None,
        mape_batches=ape_batches,
        saved=saved,
        regret=_regret(buckets),
        rolled_up=rolled_up,
        graphs=_graph_events(totals),
    )


def _calibration(model: ModelRecord) -> Calibration:
    m = model.metrics
    return Calibration(
        model_id=model.id,
        kind=model.kind,
        signature=model.signature,
        feature_version=model.feature_version,
        current=model.feature_version == FEATURE_VERSION,
        created=model.created,
        accuracy=read_metric(m, "accuracy"),
        mean_regret=read_metric(m, "mean_regret"),
        p95_regret=read_metric(m, "p95_regret"),
        mape=read_metric(m, "mape"),
        holdout=read_metric(m, "holdout", str),
        rows=read_metric(m, "rows", int),
        metrics=m,
        adopted=m.get("adopted") is not False,  # models stored before the tuner judged them were used
    )


def _calibrated_by(models: list[ModelRecord]) -> ModelRecord | None:
    """The model the runtime reads: the newest of this autoragged's feature version; else the newest of all
    (shown as ignored)."""
    current = [m for m in models if m.feature_version == FEATURE_VERSION]
    return max(current or models, key=lambda m: (m.created, m.id)) if models else None


def _device_order(rec: Records) -> list[str]:
    present = {d.device for d in rec.decisions} | {m.device for m in rec.measurements} | {m.device for m in rec.models}
    present |= {t.device for t in rec.totals}
    registered = [d.key for d in rec.registered if d.key in present]
    return registered + sorted(present - set(registered))


def _by_module(rec: Records) -> dict[str, dict[str, tuple[list, list, int]]]:
    """device -> signature -> (totals, bucket totals, batches known from stored totals only): the rows read,
    added up as the database adds up the rows it prunes, beside what it already added up."""
    out: dict[str, dict[str, tuple[list, list, int]]] = defaultdict(dict)

    def entry(device: str, signature: str) -> tuple[list, list, int]:
        return out[device].setdefault(signature, ([], [], 0))

    totals, buckets = rollup(rec.decisions)
    for t in [*totals, *rec.totals]:
        entry(t.device, t.signature)[0].append(t)
    for b in [*buckets, *rec.buckets]:
        entry(b.device, b.signature)[1].append(b)
    for t in rec.totals:
        ts, bs, rolled = entry(t.device, t.signature)
        out[t.device][t.signature] = (ts, bs, rolled + t.batches)
    return out


def _summarize(rec: Records) -> Summary:
    names = {d.key: d.name for d in rec.registered}
    decisions = _by_module(rec)
    sources: dict[str, Counter[str]] = defaultdict(Counter)
    for m in rec.measurements:
        sources[m.device][m.source] += 1
    models: dict[str, list[ModelRecord]] = defaultdict(list)
    for m in rec.models:
        models[m.device].append(m)
    devices = []
    for key in _device_order(rec):
        modules = [_module(key, sig, *parts) for sig, parts in decisions[key].items() if parts[0]]
        modules.sort(key=lambda m: (-m.batches, m.signature))
        newest = _calibrated_by(models[key])
        devices.append(
            DeviceSummary(
                key=key,
                name=names.get(key),
                decisions=sum(m.batches for m in modules),
                measurements=sum(sources[key].values()),
                measurements_by_source=dict(sources[key].most_common()),
                models=len(models[key]),
                calibration=None if newest is None else _calibration(newest),
                modules=modules,
            )
        )
    return Summary(
        path=str(rec.path),
        generated=rec.generated,
        since=rec.since,
        device=rec.device,
        counts=rec.counts,
        decisions=sum(d.decisions for d in devices),
        devices=devices,
        skipped=rec.skipped.lines(),
    )


def summary(
    db: TuningDB | str | os.PathLike[str] | None = None,
    *,
    device: str | DeviceKey | None = None,
    since: float | str | dt.datetime | dt.timedelta | None = None,
) -> Summary:
    """The report's numbers as dataclasses (what `python -m autoragged.report` prints).

    db: an open TuningDB (left open), or the path of an existing database (default: `default_path()`);
        a missing file raises FileNotFoundError and is not created.
    device: a device key, or a unique (case-insensitive) substring of one; ValueError when none or several match.
    since: only decisions and measurements from then on: unix seconds, datetime, timedelta (that long ago),
        or a string (ISO date/datetime, or an age such as "30m", "2h", "7d").
    Reads every decision and measurement in the window into Python (see the module docstring).
    Raises DatabaseError for a file that is not a tuning database.
    """
    return _summarize(_read(db, device, since))


def _write_html(rec: Records, s: Summary, path: str | os.PathLike[str]) -> Path:
    from .plots import images  # matplotlib, imported when a page is drawn

    out = Path(path).expanduser()
    page = render_html(s, images(rec, s))
    out.write_text(page, encoding="utf-8")
    return out


def write_html(
    path: str | os.PathLike[str],
    db: TuningDB | str | os.PathLike[str] | None = None,
    *,
    device: str | DeviceKey | None = None,
    since: Any = None,
) -> Summary:
    """Write the report as one self-contained HTML file (tables and base64 PNGs) and return its Summary.
    Needs matplotlib (ImportError naming `pip install matplotlib` otherwise); arguments as in `summary`."""
    from .plots import require_matplotlib

    require_matplotlib()
    rec = _read(db, device, since)
    s = _summarize(rec)
    _write_html(rec, s, path)
    return s


# ------------------------------------------------------------------------------------------ the CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m autoragged.report",
        description="What the autoragged runtime decided and whether it was right, from the tuning database:\n"
        "per wrapped module the arms and kernel configs chosen, why batches fell back to padded, predicted vs\n"
        "measured latency, estimated time saved and measured regret; per device the calibration.",
        epilog="examples:\n  python -m autoragged.report                         # all decisions, terminal tables\n"
        "  python -m autoragged.report --since 2h --device H100   # the last two hours on the H100\n"
        "  python -m autoragged.report --since 7d --html report.html   # the last week, + pictures (needs matplotlib)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--db", help="tuning database (default $AUTORAGGED_DB or ~/.cache/autoragged/tuning.sqlite)")
    p.add_argument("--device", metavar="KEY", help="only this device: its key, or a unique substring of it")
    p.add_argument("--since", metavar="TIME", type=_since_arg, help="only decisions and measurements from TIME on: "
                   "an ISO date/datetime (YYYY-MM-DD, YYYY-MM-DDTHH:MM) or an age (30m, 2h, 7d)")  # fmt: skip
    p.add_argument("--html", metavar="PATH", help="also write a self-contained HTML report with pictures")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 report printed (or nothing recorded yet), 1 no database file / HTML not writable,
    2 usage error, unreadable database, or matplotlib missing for --html."""
    from ..tune import setup_logging  # the same handler as the tuner's (replaced, not stacked)

    args = _parser().parse_args(argv)
    setup_logging(args.verbose)
    if args.html:
        from .plots import require_matplotlib

        try:
            require_matplotlib()
        except ImportError as e:
            log.error("--html: %s", e)
            return 2
    try:
        with _open_existing(args.db) as db:
            rec = _load(db, args.device, args.since)
    except FileNotFoundError as e:
        log.error("%s", e)
        return 1
    except (DatabaseError, ValueError) as e:
        log.error("%s", e)
        return 2
    except Exception as e:  # noqa: BLE001 - whatever the file holds: name it, no traceback
        log.error("cannot read %s: %s: %s (python -m autoragged.report -v shows where)", args.db or default_path(),
                  type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))  # fmt: skip
        return 2
    try:
        s = _summarize(rec)
        text = render_text(s)
    except Exception as e:  # noqa: BLE001 - a row no check foresaw: say which file, not a traceback
        log.error("cannot report on %s: %s: %s (python -m autoragged.report -v shows where)", rec.path,
                  type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))  # fmt: skip
        return 2
    if s.empty:
        print(EMPTY_MESSAGE.format(path=s.path))
        return 0
    print(text, end="")
    if args.html:
        try:
            out = _write_html(rec, s, args.html)
        except OSError as e:
            log.error("cannot write the HTML report to %s: %s", args.html, e)
            return 1
        log.info("wrote %s", out)
    return 0
