"""`python -m autoragged.tune`: calibrate this machine for autoragged.

For each module signature it draws batches from many length distributions (the CoRa Beta recipe,
log-normal, bimodal short + long, uniform, all equal) at batch sizes from 1 to 256, measures the padded
arm, the eager ragged arm (the default config and configs an optuna study proposes for the batch's max_len
bucket) and, on a GPU, the ragged graph (Triton linears), exactly as the runtime runs them, and records
everything in the tuning database. Then it fits the cost model on every measurement of this device (traffic
samples included), evaluates it on length families held out of the fit, stores it, and prints the metrics.
The wrapped models of later processes load it on their first batch, unless it picked worse than the analytic
prior on those held-out batches: then it is stored marked as not adopted, the printout says so, and they keep
the prior.

A machine too slow or busy to measure what a fit needs (`learned.MIN_ROWS` measurements) within the budget
measures on, for up to twice the budget; if it still has too few, wrapped models keep the analytic prior, the
tuner says so in one line and exits 0.

With --train it calibrates training instead: each batch's forward and backward (the model in train mode, a loss
of its output) on the padded arm and the eager ragged arm, recorded as training costs. A wrapped model in
training prices its arms by these from its first batch (the newest of each arm, with its own timings pushing them
out), where it would otherwise start from the forward-only prediction alike for both. No cost model is fit.

Ctrl-C stops between batches: what was measured is committed, and a rerun resumes the same plan.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import logging
import math
import sys
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

__all__ = ["main", "SIGNATURES", "setup_logging"]

log = logging.getLogger("autoragged")


@dataclass(frozen=True)
class _Named:
    name: str
    layers: int
    d_model: int
    heads: int
    ff: int
    activation: str
    dtype: str


# The CoRa encoder of record and BERT-base / BERT-large shaped encoders, as PyTorch users build them
# (nn.TransformerEncoder with its default nested-tensor fast path), fp16 on GPU.
SIGNATURES = {
    "cora": _Named("cora", 6, 512, 8, 2048, "relu", "float16"),
    "bert-base": _Named("bert-base", 12, 768, 12, 3072, "gelu", "float16"),
    "bert-large": _Named("bert-large", 24, 1024, 16, 4096, "gelu", "float16"),
    "cpu-small": _Named("cpu-small", 2, 128, 4, 256, "relu", "float32"),
}
# HuggingFace models of the shapes in `workloads.HF_SHAPES` (random weights, sdpa), fp16 on GPU: "hf-bert-base" ...
HF_PREFIX = "hf-"
# optuna's search space for the ragged arm (compiles stay bounded: ~100 distinct kernels at most)
SPACE = {
    "block_m": [32, 64, 128],
    "block_n": [32, 64],
    "num_warps": [4, 8],
    "num_stages": [2, 3],
    "align": [1, 16],
    "backend": ["cublas", "triton"],
}


def _default_signatures(quick: bool, on_gpu: bool) -> list[str]:
    """The built-in models calibrated when neither --signatures nor --model is given."""
    if not on_gpu:
        return ["cpu-small"]
    return ["cora"] if quick else ["cora", "bert-base", "hf-bert-base"]


def _parser() -> argparse.ArgumentParser:
    gpu, quick, cpu = (" ".join(_default_signatures(q, g)) for q, g in ((False, True), (True, True), (False, False)))
    p = argparse.ArgumentParser(
        prog="python -m autoragged.tune",
        description="Calibrate this GPU (or CPU) for autoragged: measure both arms over many length "
        "distributions, search kernel configs with optuna, fit the cost model, store it in the tuning database.",
        epilog="examples:\n  python -m autoragged.tune --quick            # about a minute (two at most when busy)\n"
        f"  python -m autoragged.tune --budget 10        # ten minutes (on a GPU: {gpu}; on a CPU: {cpu})\n"
        "  python -m autoragged.tune --refit            # refit from what is recorded (incl. traffic)\n"
        "  python -m autoragged.tune --model mypkg.models:make_encoder --budget 5\n"
        "  python -m autoragged.tune --train --model hf-bert-base --budget 5   # training costs (forward + backward)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--budget", type=float, default=10.0, metavar="MINUTES",
                   help="total time, fitting included: measuring stops early enough (default 10); a machine too "
                   "slow or busy to measure the 20 measurements a fit needs in it measures on for up to twice "
                   "the budget, then keeps the analytic prior and says so")  # fmt: skip
    p.add_argument("--quick", action="store_true",
                   help=f"a budget of one minute: one signature ({quick} on a GPU), fewer configs")  # fmt: skip
    p.add_argument("--refit", action="store_true", help="only refit the cost model from recorded measurements")
    p.add_argument("--train", action="store_true",
                   help="calibrate training instead: time each batch's forward and backward on the padded and the "
                   "eager ragged arm (the model in train mode) and record them; a wrapped model in training starts "
                   "its arms' prices from these (no cost model is fit)")  # fmt: skip
    p.add_argument("--model", metavar="SPEC", help="calibrate for your own model: MODULE:FACTORY (FACTORY() returns "
                   "an nn.Module holding nn.TransformerEncoder(s), an HF encoder or decoder; its device and dtype are "
                   "used as they are), or an HF config: a config.json path or one of the built-in shapes "
                   f"({', '.join(_hf_shapes())}), built with random weights (nothing is downloaded)")  # fmt: skip
    p.add_argument("--signatures", nargs="+", choices=_signature_names(), help="built-in models to calibrate "
                   f"(default: {gpu} on a GPU, {quick} with --quick; {cpu} on a CPU)")  # fmt: skip
    p.add_argument("--db", help="tuning database (default $AUTORAGGED_DB or ~/.cache/autoragged/tuning.sqlite)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0, help="seed of the batch plan (a rerun with it resumes)")
    p.add_argument("--max-batches", type=int, metavar="N", help="stop after measuring N batches (and the budget)")
    p.add_argument("--trials", type=int, help="optuna configs tried per batch (default 2 on GPU, 0 on CPU)")
    p.add_argument("-v", "--verbose", action="store_true", help="log every batch")
    return p


def setup_logging(verbose: bool) -> None:
    """The CLI's handler on the "autoragged" logger (replaced, not stacked, when main runs again)."""
    for old in [h for h in log.handlers if getattr(h, "_autoragged_cli", False)]:
        log.removeHandler(old)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler._autoragged_cli = True
    log.addHandler(handler)
    log.setLevel(logging.DEBUG if verbose else logging.INFO)


def _hf_shapes() -> list[str]:
    from .workloads import HF_SHAPES, LLM_SHAPES

    return sorted(HF_SHAPES) + sorted(LLM_SHAPES)


def _signature_names() -> list[str]:
    return sorted(SIGNATURES) + [HF_PREFIX + n for n in _hf_shapes()]


def _user_encoders(spec: str, device):
    """The modules of the user's model to calibrate: `package.module:factory`, or an HF config (a built-in
    shape name or a config.json path: random weights, fp16 on a GPU, fp32 on a CPU)."""
    import os

    if spec in _hf_shapes() or os.path.exists(spec):
        return [_hf_model(spec, device)]
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise SystemExit(f"--model must look like package.module:factory, got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"--model {spec}: cannot load it ({e})") from None
    import torch

    model = factory()
    if not isinstance(model, torch.nn.Module):
        raise SystemExit(f"--model {spec}: the factory returned a {type(model).__name__}, not an nn.Module")
    from .wrapper import find_targets

    encoders = [m for _, m in find_targets(model)[0] if not isinstance(m, torch.nn.TransformerEncoderLayer)]
    if not encoders:
        raise SystemExit(f"--model {spec}: no nn.TransformerEncoder or HF encoder in the model")
    return [e.eval() for e in encoders]


def _hf_model(name: str, device):
    import torch

    from .measure import build_hf

    try:
        return build_hf(name, device, torch.float16 if device.type == "cuda" else torch.float32)
    except (ImportError, ValueError, OSError) as e:
        raise SystemExit(f"--model {name}: {e}") from None


class _PlanItem(NamedTuple):
    """One batch of the plan: its `index` in the plan, the `slot` of the signature it measures, the length
    `family` it draws `batch` lengths of at most `max_len` from, and the `seed` of that draw."""

    index: int
    slot: int
    family: str
    batch: int
    max_len: int
    seed: int


def _plan(names: list[str], quick: bool, on_gpu: bool, seed: int):
    """The deterministic, endless batch plan of `_PlanItem`s.

    Two of three batches have B and max_len log-uniform over the whole range; every third is a large
    batch (B from 16 up, max_len from 128 up). Large batches take most of a long job's time, and with
    log-uniform draws alone 3% of a calibration's batches are above 16K tokens, too few for the model to rank
    the arms there."""
    from .workloads import FAMILIES

    families = list(FAMILIES)
    max_batch = (128 if quick else 256) if on_gpu else 32
    max_len = 512 if on_gpu else 128
    rng = np.random.default_rng(seed)
    for i in itertools.count():
        slot = i % len(names)
        family = families[(i // len(names)) % len(families)]
        large = (i // len(names)) % 3 == 2  # every signature and family gets its share
        low_b, low_len = (math.log2(min(16, max_batch)), math.log2(max_len // 4)) if large else (0.0, 3.0)
        batch = int(round(2 ** rng.uniform(low_b, math.log2(max_batch))))
        length = int(round(2 ** rng.uniform(low_len, math.log2(max_len))))
        yield _PlanItem(i, slot, family, batch, length, seed * 1_000_003 + i)


def _suggest(trial):
    from .kernels.config import KernelConfig

    return KernelConfig(**{k: trial.suggest_categorical(k, v) for k, v in SPACE.items()})


def _measure_item(ctx, runner, item: _PlanItem, trials, batch_id):
    """Measure the plan's batch `item` of `runner`'s signature on the padded arm, the default ragged config and
    `trials` optuna proposals."""
    import torch

    from .kernels import ragged_attention as k_attn
    from .measure import time_close_calls
    from .planning.buckets import LADDER_VERSION, mask_width
    from .planning.costmodel import PADDED, Arm
    from .planning.planner import default_ragged_config, graph_config
    from .tuning_db import BatchStats
    from .workloads import sample

    sig, family = runner.sig, item.family
    rng = np.random.default_rng(item.seed)
    lengths = tuple(sample(family, item.batch, item.max_len, rng))
    stats = BatchStats.from_lengths(lengths)
    run = runner.batch_runner(lengths, stats, seed=item.seed)
    head_dim = sig.d_model // sig.heads
    default = Arm("ragged", default_ragged_config(head_dim, stats.max_len))
    arms = [PADDED, default]
    if ctx.device.type == "cuda":  # the ragged graph (captured at its first run, outside the timing)
        arms = runner.arms([*arms, Arm("ragged_graph", graph_config(head_dim, mask_width(stats.max_len)))])
    told = []
    if trials:
        study = ctx.study(sig, stats.max_len)
        for _ in range(trials):
            trial = study.ask()
            config = _suggest(trial)
            if not k_attn.prune(config, head_dim=head_dim, max_len=stats.max_len) or config == default.config:
                study.tell(trial, state=ctx.optuna.trial.TrialState.PRUNED)
                continue
            arms.append(Arm("ragged", config))
            told.append((trial, len(arms) - 1))
    # small batches take microseconds and their timings are noisy (host jitter): more repetitions there, and
    # twice as many again for the arms the first round could not tell from the fastest; on a GPU, arms over
    # 1.5x the fastest after a screen of 3 calls keep those 3 (time_close_calls)
    on_gpu = ctx.device.type == "cuda"
    reps = (15 if stats.batch * stats.max_len <= 16384 else 7) if on_gpu else 3
    fns = [lambda a=a: run(a) for a in arms]
    timings = time_close_calls(
        fns, ctx.device, reps=reps, extra_reps=2 * reps if on_gpu else 0, screen_reps=3 if on_gpu else 0
    )
    for trial, i in told:
        study.tell(trial, timings[i].median_ms / timings[1].median_ms)
    if ctx.device.type == "cuda" and stats.batch * stats.max_len > 65536:
        torch.cuda.empty_cache()  # big batches: give the memory back before the next signature's batch
    for a in arms:  # the kernel_configs table: each distinct config once per run
        if a.config is not None and a.config not in ctx.registered:
            ctx.db.register_config(a.kind, a.config.to_dict())
            ctx.registered.add(a.config)
    return [
        _measurement(
            ctx,
            sig,
            a.kind,
            a.config,
            stats,
            t,
            family,
            {"batch_id": batch_id, **({"ladder": LADDER_VERSION} if a.graph else {})},
        )
        for a, t in zip(arms, timings)
    ]


def _measurement(ctx, sig, kind: str, config, stats, timing, family: str, extra: dict):
    """The tuning database's row of one arm's `timing` on a plan batch."""
    from .tuning_db import Measurement

    return Measurement(ctx.key.key, sig.key, kind, None if config is None else config.to_dict(), stats,
                       timing.median_ms, timing.p10_ms, timing.p90_ms, timing.reps, time.time(), source="tune",
                       distribution=family, extra=extra)  # fmt: skip


def _measure_train_item(ctx, runner, item: _PlanItem, batch_id: str):
    """Time the plan's batch `item` as a training step (forward and backward) on the padded arm and the eager
    ragged arm, each stored with the forward-only prediction the runtime prices it with (`Scales.seed`)."""
    from .measure import time_close_calls
    from .planning.planner import default_ragged_config
    from .tuning_db import BatchStats
    from .workloads import sample

    sig = runner.sig
    rng = np.random.default_rng(item.seed)
    lengths = tuple(sample(item.family, item.batch, item.max_len, rng))
    stats = BatchStats.from_lengths(lengths)
    step = runner.train_step_runner(lengths, seed=item.seed)
    kinds = ("padded", "ragged")
    on_gpu = ctx.device.type == "cuda"
    timings = time_close_calls([lambda k=k: step(k) for k in kinds], ctx.device, reps=7 if on_gpu else 3,
                               extra_reps=0)  # fmt: skip
    predicted = runner.runtime.predicted_ms(ctx.device, stats)
    config = default_ragged_config(sig.d_model // sig.heads, stats.max_len)
    return [
        _measurement(
            ctx,
            sig,
            kind,
            None if kind == "padded" else config,
            stats,
            t,
            item.family,
            {"batch_id": batch_id, "train": True, "predicted": predicted[kind]},
        )
        for kind, t in zip(kinds, timings)
    ]


def _print_training(db, key) -> None:
    """What a wrapped model in training will start from: per module and arm, its recorded training costs (the
    tuner's and traffic's) over the forward-only prediction each was priced against."""
    groups: dict[tuple[str, str], list[float]] = {}
    for m in db.measurements(device=key.key):
        if m.extra.get("train"):
            ratio = m.median_ms / m.extra["predicted"] if m.extra.get("predicted") else None
            groups.setdefault((m.signature, m.arm), []).append(ratio)
    print(f"\ntraining costs for {key.key} (forward and backward; a wrapped model in training starts its prices "
          "from the newest of each arm)")  # fmt: skip
    print("  | module | arm | batches | measured / predicted forward, median |")
    print("  |---|---|---|---|")
    for (signature, arm), ratios in sorted(groups.items()):
        known = [r for r in ratios if r is not None]
        median = f"{float(np.median(known)):.2f}" if known else "-"
        print(f"  | {signature} | {arm} | {len(ratios)} | {median} |")


class _Context:
    def __init__(self, db, device, key):
        self.db, self.device, self.key = db, device, key
        self._studies = {}
        self.registered: set = set()
        self.optuna = None

    def study(self, sig, max_len):
        if self.optuna is None:
            import optuna

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            self.optuna = optuna
        bucket = 1 << max(4, math.ceil(math.log2(max(max_len, 1))))
        name = f"autoragged|{self.key.key}|{sig.key}|max_len<={bucket}"
        if name not in self._studies:
            self._studies[name] = self.optuna.create_study(
                study_name=name, storage=self._storage(), load_if_exists=True, direction="minimize",
                sampler=self.optuna.samplers.TPESampler(seed=hash(name) % 2**31, n_startup_trials=6),
            )  # fmt: skip
        return self._studies[name]

    def _storage(self):
        """optuna's storage in the tuning database's own file, connected by path: the URL alone would name
        another file on SQLAlchemy < 2 when the path holds ?, #, % or spaces (see TuningDB.optuna_storage_url)."""
        url, kwargs = self.db.optuna_storage_url(), self.db.optuna_engine_kwargs()
        return self.optuna.storages.RDBStorage(url, engine_kwargs=kwargs)


# What fitting and evaluating the model takes, by the measurements it is fit on: a refit of 4,172 measurements
# takes 65-72 s on one thread of a busy 2-core CPU (`learned._one_thread`), the 46-92 of a `--quick` run 5-7 s.
_FIT_FIXED_S = 10.0
_FIT_S_PER_ROW = 0.012
# A machine too slow or too busy to measure the fit's MIN_ROWS measurements in the budget measures on until it
# has them, up to this many times the budget in all; past that the runtime keeps the analytic prior.
_HARD_CAP = 2.0


def _fit_seconds(rows: int) -> float:
    return _FIT_FIXED_S + _FIT_S_PER_ROW * rows


def _time_to_measure(total_s: float, setup_s: float, elapsed_s: float, rows: int, slowest_s: float) -> bool:
    """Whether another batch fits in a budget of `total_s`: `setup_s` went to setting up and `elapsed_s` to
    measuring; the slowest batch so far and the fit of `rows` measurements (at least 8% of the budget or 45 s,
    whichever is less, and at most half of it) must still fit after it."""
    reserve = min(max(min(45.0, 0.08 * total_s), _fit_seconds(rows)), 0.5 * total_s)
    return total_s - setup_s - elapsed_s - reserve > slowest_s


def _time_to_overrun(total_s: float, setup_s: float, elapsed_s: float, rows: int, slowest_s: float) -> bool:
    """Past the budget: whether another batch is worth measuring, because the fit has fewer than MIN_ROWS
    measurements, and fits with the fit before the hard cap (_HARD_CAP times the budget)."""
    from .planning.learned import MIN_ROWS

    used_s = setup_s + elapsed_s + slowest_s + _fit_seconds(rows)
    return rows < MIN_ROWS and used_s <= _HARD_CAP * total_s


def _measure(args, db, device, key) -> tuple[int, bool, bool]:
    """Measure until the budget is spent; returns (batches measured now, interrupted, stopped by --max-batches)."""
    import torch
    from tqdm import tqdm

    from .measure import ArmRunner, build_encoder

    on_gpu = device.type == "cuda"
    if args.model:
        encoders = _user_encoders(args.model, device)
        names = [f"user{i}" for i in range(len(encoders))]
    else:
        names = args.signatures or _default_signatures(args.quick, on_gpu)
        encoders = []
        for name in names:
            if name.startswith(HF_PREFIX):
                encoders.append(_hf_model(name[len(HF_PREFIX) :], device))
                continue
            n = SIGNATURES[name]
            from .tuning_db import ModuleSignature

            sig = ModuleSignature(
                "encoder", n.layers, n.d_model, n.heads, n.ff, n.activation, False, n.dtype, nested=True
            )
            encoders.append(build_encoder(sig, device))
    runners = [ArmRunner(e.to(device)) for e in encoders]
    sigs = [r.sig for r in runners]
    trials = args.trials if args.trials is not None else ((1 if args.quick else 2) if on_gpu else 0)
    ctx = _Context(db, device, key)
    plan_name = f"v3|seed{args.seed}|{'quick' if args.quick else 'full'}|{'+'.join(s.key for s in sigs)}"
    plan_name = f"train|{plan_name}" if args.train else plan_name
    done = db.done_items(key.key, plan_name)
    rows = len(db.measurements(device=key.key))  # the fit takes every measurement of this device
    total_s = args.budget * 60 if not args.quick else min(args.budget * 60, 60.0)
    setup_s = time.monotonic() - args.started  # setting up (imports, model builds) counts too
    budget_s = total_s - setup_s - min(45.0, 0.08 * total_s)  # the bar's length: the fit's reserve grows
    start = time.monotonic()
    measured, skipped, slowest, overrun, capped = 0, 0, 0.0, False, False
    # a bar on terminals only (disable=None): logs of non-interactive runs get the summary lines instead
    bar = tqdm(
        total=round(budget_s), unit="s", desc="calibrating", file=sys.stderr, dynamic_ncols=True, disable=None,
        mininterval=1.0, bar_format="{desc}: {percentage:3.0f}%|{bar}| {n}/{total} s {postfix}",
    )  # fmt: skip
    try:
        for planned in _plan(names, args.quick, on_gpu, args.seed):
            slot, family, batch, max_len = planned.slot, planned.family, planned.batch, planned.max_len
            elapsed = time.monotonic() - start
            if args.max_batches is not None and measured >= args.max_batches:
                capped = True
                break
            if not _time_to_measure(total_s, setup_s, elapsed, rows, slowest):
                if args.train or not _time_to_overrun(total_s, setup_s, elapsed, rows, slowest):
                    break  # (training costs need no fit: the budget is the budget)
                if not overrun:
                    overrun = True
                    log.info("the budget is spent with %d measurements, fewer than a fit needs: measuring on, "
                             "for at most %.0f s in all", rows, _HARD_CAP * total_s)  # fmt: skip
            item = str(planned.index)
            if item in done:
                skipped += 1
                continue
            sig = sigs[slot]
            began = time.monotonic()
            try:
                if args.train:
                    new = _measure_train_item(ctx, runners[slot], planned, f"{plan_name}|{item}")
                else:
                    new = _measure_item(ctx, runners[slot], planned, trials, f"{plan_name}|{item}")
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                log.info(
                    "batch %s (%s, B=%d, max_len=%d) did not fit in memory; skipped", item, sig.key, batch, max_len
                )
                db.mark_done(key.key, plan_name, [item])
                continue
            db.add_measurements(new)  # one transaction per batch: an interrupt loses at most the batch in hand
            db.mark_done(key.key, plan_name, [item])
            measured, rows = measured + 1, rows + len(new)
            slowest = max(slowest, time.monotonic() - began)
            log.debug("%s %s B=%d max_len=%d: %s", sig.key, family, batch, max_len,
                      ", ".join(f"{r.arm}={r.median_ms:.3f}" for r in new))  # fmt: skip
            bar.set_postfix_str(f"{measured} batches", refresh=False)
            bar.update(min(round(time.monotonic() - start), bar.total) - bar.n)
    except KeyboardInterrupt:
        bar.close()
        log.info("interrupted after %d batches; what was measured is recorded and a rerun resumes", measured)
        return measured, True, False
    bar.update(bar.total - bar.n)
    bar.close()
    if skipped:
        log.info("resumed: %d batches of this plan were measured by an earlier run", skipped)
    return measured, False, capped


def _fit_and_store(db, key, refit: bool, max_batches: int | None = None) -> int:
    """Fit, store and print the cost model. Too few measurements: an error for a refit (1); after measuring
    (a slow or busy machine, or `max_batches`, the --max-batches that stopped the measuring), one line saying the
    runtime keeps the analytic prior, and success (0). A fit that loses to the prior held out is stored, marked as
    not adopted (the runtime then keeps the prior), and the printout says so in one line."""
    from .planning.costmodel import FEATURE_VERSION
    from .planning.learned import KIND, MIN_ROWS, TooFewMeasurements, beats_prior, fit_cost_model

    rows = [m for m in db.measurements(device=key.key) if not m.extra.get("train")]  # forward costs only
    if not rows and refit:
        log.error("no measurements for %s in %s; run the tuner without --refit first", key.key, db.path)
        return 1
    t0 = time.perf_counter()
    try:
        model = fit_cost_model(rows, key)
    except TooFewMeasurements as e:
        if refit:
            log.error("%s", e)
            return 1
        why = "this machine measured slowly; rerun `python -m autoragged.tune` when it is less busy"
        if max_batches is not None:
            why = f"--max-batches {max_batches} stopped the measuring; rerun with more batches"
        log.warning("kept the analytic prior: %d usable measurements, fewer than the %d a fit needs (%s)",
                    e.rows, MIN_ROWS, why)  # fmt: skip
        return 0
    except ValueError as e:
        log.error("%s", e)
        return 1
    metrics = dict(model.metrics, fit_seconds=round(time.perf_counter() - t0, 2))
    metrics["adopted"] = beats_prior(metrics)
    model_id = db.save_model(device=key.key, feature_version=FEATURE_VERSION, kind=KIND, payload=model.to_payload(),
                             metrics=metrics, signature="*")  # fmt: skip
    _print_fit(model_id, key, metrics)
    return 0


def _print_fit(model_id: int, key, metrics: dict) -> None:
    """The stored fit's held-out numbers, each row saying in words what it counts, and whether it is adopted."""
    pct = lambda v, digits=1: "n/a" if v is None else f"{v:.{digits}%}"  # noqa: E731
    print(f"\ncost model #{model_id} for {key.key}")
    print(f"  fit on {metrics['rows']} measurements; tested on {metrics['batches']} batches left out of the fit "
          f"({metrics['holdout']}: {', '.join(metrics['families'])}),")  # fmt: skip
    print("  picking among the arms a wrapped model chooses from:")
    ref = metrics.get("reference", "")
    rows = [
        ("picked the fastest arm (or one within 1% of it)", pct(metrics["accuracy"]),
         pct(metrics["prior_accuracy"]), pct(metrics.get("reference_accuracy"))),
        ("... or one whose timings overlap the fastest's (p10 below its p90)",
         pct(metrics.get("accuracy_within_noise")), "-", "-"),
        ("mean regret: how much slower than the fastest arm its pick ran", pct(metrics["mean_regret"], 2),
         pct(metrics["prior_mean_regret"], 2), pct(metrics.get("reference_mean_regret"), 2)),
        ("p95 regret: 95% of its picks ran at most this much slower", pct(metrics["p95_regret"], 2), "-",
         pct(metrics.get("reference_p95_regret"), 2)),
    ]  # fmt: skip
    if metrics.get("mean_regret_all_arms") != metrics["mean_regret"]:  # (`learned.against_every_arm`)
        rows.append(("mean regret against every arm measured on the batch",
                     pct(metrics.get("mean_regret_all_arms"), 2), "-", "-"))  # fmt: skip
    rows.append(("latency error (MAPE): mean of |predicted - measured| / measured", pct(metrics["mape"]), "-", "-"))
    print(f"  | held out | learned model | analytic prior | always {ref} |")
    print("  |---|---|---|---|")
    for row in rows:
        print(f"  | {' | '.join(row)} |")
    if metrics["batches"] == 0:
        print("  (no batch was measured on several arms: decision metrics need the tuner's own batches)")
    regrets = f"mean regret {pct(metrics['mean_regret'], 2)} against the prior's {pct(metrics['prior_mean_regret'], 2)}"
    if metrics["adopted"]:
        print(f"  adopted: wrapped models decide with it ({regrets})")
    else:
        print(f"  not adopted: it picked worse than the analytic prior held out ({regrets}); stored as #{model_id} "
              "for the record, wrapped models keep deciding with the analytic prior")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = _parser().parse_args(argv)
    setup_logging(args.verbose)
    if args.budget <= 0:
        log.error("--budget must be positive, got %s", args.budget)
        return 2
    if args.train and args.refit:
        log.error("--train measures training costs and --refit only refits the forward cost model: pass one")
        return 2
    import torch

    from .tuning_db import DatabaseError, TuningDB

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        log.error("--device cuda but no CUDA GPU is available")
        return 2
    try:
        with TuningDB.open(args.db) as db:
            return _run(args, db, device, started)
    except DatabaseError as e:  # damaged, read-only, locked past the timeout, ...: one line, like every usage error
        log.error("%s", e)
        return 2


def _run(args, db, device, started: float) -> int:
    from .planning.device import device_key

    key = device_key(device)
    db.register_device(key)
    log.info("device: %s\ndatabase: %s", key.key, db.path)
    capped = False
    if not args.refit:
        t0 = time.monotonic()
        args.started = started
        measured, interrupted, capped = _measure(args, db, device, key)
        log.info("measured %d batches in %.0f s", measured, time.monotonic() - t0)
        if interrupted:
            return 130
        if args.train:
            _print_training(db, key)
            return 0
    return _fit_and_store(db, key, args.refit, args.max_batches if capped else None)


if __name__ == "__main__":
    raise SystemExit(main())
