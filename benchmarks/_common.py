"""Shared plumbing of the benchmarks of record: the environment header, the CoRa rows, timing, tables, and the
one JSON line each run appends to benchmarks/results/<script>.jsonl.

A line: {"script", "revision" (git short hash, "-dirty" when the tree differs), "time" (UTC), "env" (device and
versions), "argv", "args", "rows", and whatever summary the script adds}.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import time
from collections import Counter

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
QUICK_ROWS = (("CoLA", "MNLI", "RACE"), (32, 128))
SMOKE_ROWS = (("CoLA", "MRPC"), (2,))
WARM, TIMED = 4, 16  # the serving protocol's batches per row: warm-up, then timed twice


# -- environment and the results line -------------------------------------------------------------------------
def revision() -> str:
    """$AUTORAGGED_REVISION where set, else the checkout's short git revision, with "-dirty" when files differ from
    it (the results aside), else "unknown"."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60)
        return done.stdout.strip()

    if os.environ.get("AUTORAGGED_REVISION"):  # a copied tree whose git knows another HEAD (a lent GPU's)
        return os.environ["AUTORAGGED_REVISION"]
    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--", ".", ":(exclude)benchmarks/results")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("AUTORAGGED_REVISION", "unknown")
    return head + ("-dirty" if changed else "")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({os.cpu_count()} cores)",
        "torch": torch.__version__,
        "triton": _version("triton") or _version("pytorch-triton"),
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
    }


def header(title: str) -> dict:
    """Print the title, the revision, device and versions; returns the environment."""
    env = environment()
    print(f"# {title}")
    print(" | ".join([f"revision {revision()}", *(f"{k} {v}" for k, v in env.items() if v is not None)]), flush=True)
    return env


def record(script: str, args: argparse.Namespace, rows: list[dict], **extra) -> pathlib.Path:
    """Append this run's line to <args.results or benchmarks/results>/<script>.jsonl; returns the file."""
    line = {
        "script": script,
        "revision": revision(),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "env": environment(),
        "argv": sys.argv[1:],
        "args": vars(args),
        "rows": rows,
        **extra,
    }
    path = pathlib.Path(getattr(args, "results", None) or RESULTS) / f"{script}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(line, default=str) + "\n")
    print(f"appended a line to {path}")
    return path


# -- arguments and rows ---------------------------------------------------------------------------------------
def parser(doc: str) -> argparse.ArgumentParser:
    """The argument parser of a benchmark of record: its docstring as help, --quick, --smoke and --results."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a short GPU run (see above)")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: checks the script in seconds")
    p.add_argument("--results", help="folder of the JSONL file (default benchmarks/results)")
    return p


def add_row_arguments(p: argparse.ArgumentParser) -> None:
    from autoragged.workloads import CORA

    p.add_argument("--datasets", nargs="+", choices=list(CORA), help="default: all eight, in CoRa's order")
    p.add_argument("--batch-sizes", nargs="+", type=int, help="default: 32 64 128")


def cora_rows(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(dataset, batch size) in order: --datasets x --batch-sizes, else the quick, smoke or full 24 rows."""
    from autoragged.workloads import CORA, CORA_BATCH_SIZES

    names, sizes = list(CORA), CORA_BATCH_SIZES
    if args.smoke:
        names, sizes = SMOKE_ROWS
    elif args.quick:
        names, sizes = QUICK_ROWS
    return [(name, batch) for name in args.datasets or names for batch in args.batch_sizes or sizes]


def row_seed(dataset: str, batch: int) -> int:
    return sum(map(ord, dataset)) * 1000 + batch


def row_batches(dataset: str, batch: int, make, *args) -> tuple[list, list]:
    """(WARM warm-up batches, TIMED timed batches) of a row of the serving protocol: make(lengths, generator,
    *args) for each PyCoRa draw, seeded by the row."""
    from autoragged.workloads import sample_cora

    rng = np.random.default_rng(row_seed(dataset, batch))
    g = torch.Generator().manual_seed(row_seed(dataset, batch))
    made = [make(sample_cora(dataset, batch, rng), g, *args) for _ in range(WARM + TIMED)]
    return made[:WARM], made[WARM:]


def require_cuda(script: str) -> torch.device:
    """The GPU; without one, exit 2."""
    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU (none found); where it has --smoke, that checks it on the CPU.",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    return torch.device("cuda")


def device_of(args: argparse.Namespace, script: str) -> torch.device:
    """The CPU for --smoke, else the GPU (exit 2 without one)."""
    if not args.smoke:
        return require_cuda(script)
    torch.set_num_threads(1)  # a tiny encoder's call on 2 shared cores: 170 ms with 2 threads, 0.8 ms with one
    return torch.device("cpu")


# -- timing ---------------------------------------------------------------------------------------------------
def compiled(model, smoke: bool):
    """The compile column's model: torch.compile(model), inductor, default mode, automatic dynamic shapes (the eager
    backend with --smoke: inductor's C++ build takes minutes on a CPU). Its compiles run in this process, one at a
    time (`compile_threads` 1): inductor otherwise starts a pool of compile workers at its first compile, and the
    columns timed after the compile column are disturbed (the BERT-base shape's RACE rows in stream_table.py: auto /
    min(forced) 0.74-1.09 with that column before them, 0.96-1.03 without; RESULTS.md). The compiled code is the same;
    compile_s, reported apart, is the serial compile's."""
    if smoke:
        return torch.compile(model, backend="eager")
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1
    return torch.compile(model, backend="inductor")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def latency_ms(fn, device: torch.device, warmup: int, reps: int) -> tuple[float, float]:
    """(ms of the first call, median ms of `reps` calls after `warmup` - 1 more): each call alone between
    synchronisations, so a batch's latency with its host work."""
    times = []
    for _ in range(max(warmup, 1) + reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times[0], sorted(times[-reps:])[reps // 2]


def pass_ms(fn, batches: list, device: torch.device) -> float:
    """ms per batch of `fn` over `batches` queued back to back: one synchronisation before, one at the end."""
    sync(device)
    t0 = time.perf_counter()
    for b in batches:
        fn(b)
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / len(batches)


def serve_row(fn, warm: list, timed: list, device: torch.device) -> dict:
    """The serving protocol's row for one model: the `warm` batches (their seconds), then `timed` back to back
    (the first pass), then the same batches again (the second pass), in ms per batch."""
    sync(device)
    t0 = time.perf_counter()
    for b in warm:
        fn(b)
    sync(device)
    warm_s = time.perf_counter() - t0
    return {"warm_s": warm_s, "first": pass_ms(fn, timed, device), "second": pass_ms(fn, timed, device)}


# -- reporting ------------------------------------------------------------------------------------------------
def arms_ran(model, n: int) -> dict[str, int]:
    """How often each arm ran in the last `n` decisions of a wrapped model."""
    import autoragged

    return dict(Counter(d.arm for d in autoragged.recent_decisions(model, n)))


def reasons_of(model, n: int) -> dict[str, int]:
    """How often each reason (its first 80 characters, arm first) came in the last `n` decisions of a wrapped
    model: what the JSONL line keeps to say why a row ran as it did."""
    import autoragged

    return dict(Counter(f"{d.arm}: {d.reason[:80]}" for d in autoragged.recent_decisions(model, n)))


def geomean(values) -> float | None:
    values = [v for v in values if v]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A markdown table; columns are (key, title, format)."""
    head = "| " + " | ".join(t for _, t, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = []
    for r in rows:
        cells = ["-" if r.get(k) is None else format(r[k], fmt) for k, _, fmt in columns]
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, rule, *body])
