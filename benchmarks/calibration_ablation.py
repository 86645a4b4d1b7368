"""Where a calibration's held-out misses come from, and what one arm family is worth (CPU; reads a tuning DB).

Refits the cost model exactly as `python -m autoragged.tune` evaluates it (leave one length family out)
and prints three fits:
  - "every arm chosen": on every measurement, choosing among every arm (the planner before it left the
    `Arm.mask_only` arm to mask-only batches);
  - "planner": the same fit, choosing among the arms the planner runs with the lengths known (what tune
    prints);
  - "without X": fit without an arm family (default: the ragged graph with Triton linears);
and for each:
  - strict / tie-aware accuracy and mean regret against the oracle of the arms it chose from;
  - mean regret and total time of its choices against the oracle over *all* measured arms (what a user
    would get, the arm left out being unavailable to that fit);
  - the most common (chosen arm, measured best arm) pairs among the misses.

    python benchmarks/calibration_ablation.py ~/.cache/autoragged/tuning.sqlite
    python benchmarks/calibration_ablation.py DB --without ragged_graph:cublas

Writes benchmarks/results/calibration_ablation.json.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from autoragged.tuning_db import TuningDB  # noqa: E402

from autoragged._model import (  # noqa: E402
    TIE,
    _pick_reference,
    _rows,
    against_every_arm,
    arm_of,
    evaluate_choices,
    held_out_predictions,
)
from benchmarks._common import table, write_json  # noqa: E402


def family_of(label: str) -> str:
    """'ragged_graph:triton' / 'ragged_graph:cublas' for graph arms, else the arm kind."""
    kind = label.split(":")[0]
    if kind.startswith("ragged"):
        return f"{kind}:{'cublas' if label.endswith('-cublas') else 'triton'}"
    return kind


def analyse(measurements, device, oracle: dict[str, float], every_arm: bool = False) -> dict:
    """The held-out choices of a fit on `measurements`: among every arm if `every_arm`, else among the
    arms the planner chooses from."""
    rows = _rows(measurements, device)
    predicted, _ = held_out_predictions(rows, device, _pick_reference(rows))
    ok = ~np.isnan(predicted) & (True if every_arm else rows.choosable)
    metrics = evaluate_choices(
        predicted[ok], rows.ms[ok], [g for g, e in zip(rows.group, ok) if e], rows.p10[ok], rows.p90[ok]
    )
    by_batch: dict[str, list[int]] = collections.defaultdict(list)
    for i, g in enumerate(rows.group):
        if g and ok[i]:
            by_batch[g].append(i)
    misses: collections.Counter = collections.Counter()
    for idx in by_batch.values():
        if len(idx) < 2:
            continue
        idx = np.asarray(idx)
        b, c = idx[np.argmin(rows.ms[idx])], idx[np.argmin(predicted[idx])]
        if rows.ms[c] > rows.ms[b] * (1 + TIE):
            misses[(family_of(rows.arm[c]), family_of(rows.arm[b]))] += 1
    full = against_every_arm(np.where(ok, predicted, np.nan), rows, ok, oracle)
    return {
        **{k: metrics[k] for k in ("batches", "accuracy", "accuracy_within_noise", "mean_regret")},
        "regret_vs_full_oracle": full["mean_regret_all_arms"],
        "time_vs_full_oracle": full["time_vs_oracle_all_arms"],
        "misses": [{"chosen": c, "best": b, "batches": n} for (c, b), n in misses.most_common()],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("db", help="a tuning database written by python -m autoragged.tune")
    p.add_argument("--device", help="device key (default: the database's only device)")
    p.add_argument("--without", default="ragged_graph:triton", help="arm family to leave out (see family_of)")
    p.add_argument("--out", help="JSON path (default benchmarks/results/calibration_ablation.json)")
    args = p.parse_args(argv)
    db = TuningDB.open(args.db, readonly=True)
    devices = [d for d in db.devices() if args.device in (None, d.key)]
    if len(devices) != 1:
        raise SystemExit(f"pick one device with --device: {[d.key for d in db.devices()]}")
    device = devices[0]
    measurements = db.measurements(device=device.key)
    full = _rows(measurements, device)
    oracle: dict[str, float] = collections.defaultdict(lambda: float("inf"))
    for g, ms in zip(full.group, full.ms):
        if g:
            oracle[g] = min(oracle[g], ms)
    kept = [m for m in measurements if family_of(arm_of(m).label) != args.without]
    if len(kept) == len(measurements):
        raise SystemExit(f"no measurement of arm family {args.without!r} in {args.db}")
    results = {
        "every arm chosen": analyse(measurements, device, oracle, every_arm=True),
        "planner": analyse(measurements, device, oracle),
        f"without {args.without}": analyse(kept, device, oracle),
    }
    print(f"# calibration ablation: {device.key}, {args.db}\n")
    print(table([{"fit": k, **v} for k, v in results.items()], [
        ("fit", "fit", ""), ("batches", "held-out batches", "d"), ("accuracy", "accuracy", ".3f"),
        ("accuracy_within_noise", "within noise", ".3f"), ("mean_regret", "regret (own oracle)", ".4f"),
        ("regret_vs_full_oracle", "regret (all arms' oracle)", ".4f"), ("time_vs_full_oracle", "time / oracle", ".4f"),
    ]))  # fmt: skip
    for name, r in results.items():
        top = ", ".join(f"{m['chosen']} for {m['best']}: {m['batches']}" for m in r["misses"][:4])
        print(f"\n{name}: misses (chosen for best): {top}")
    path = write_json("calibration_ablation.json", {"db": str(args.db), "device": device.key, **results}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
