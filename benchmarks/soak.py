"""Soak: what a long run leaves in the tuning database and in resident memory (CPU; no GPU needed).

    python benchmarks/soak.py                                   # 1,000,000 batches through the recorder
    python benchmarks/soak.py --mode wrapped --batches 100000   # a real forward per batch
    AUTORAGGED_DB_KEEP_DECISIONS=all python benchmarks/soak.py --batches 100000   # no retention: the old growth

Two modes:
- recorder (default): the decisions of a wrapped CPU encoder (nn.TransformerEncoder: 1 layer, d_model 64, 2
  heads, ff 128), taken from 512 real forwards on random lengths (batch 1-64, lengths 1-512), are replayed with a
  simulated clock (`--rate` batches per second) into the runtime's recorder, one timed batch in 32 with a latency
  near its prediction (as `sample_every=32` times on a GPU), and flushed every 4096 batches (the recorder's
  high-water mark) through the same code as its thread: insert, prune to the retention, add up.
  Why not a real forward per batch: a forward of this tiny encoder took 1.8 ms on the 2-core CPU box
  (2026-11-24, shared), so 1M of them would take half an hour, and the forward writes nothing the recorder
  does not see: the database only ever gets the recorder's rows.
- wrapped: every batch is a real forward of the wrapped encoder (`autoragged.wrap(model, db=path)`) on one of 64
  pre-made inputs (batch 1-16, lengths 1-64), the recorder thread flushing as in production: checks that the
  runtime keeps nothing per batch either.
  The ragged arm runs its PyTorch reference on CPU (the Triton interpreter takes seconds a batch).

Every `--every` batches: resident memory after malloc_trim (glibc; the allocator keeps freed pages otherwise),
the database file and its WAL, rows per table, and the seconds so far. Prints a table and writes
benchmarks/results/soak[_<mode>].json (with --out, there). The retention is the library's
(`$AUTORAGGED_DB_KEEP_DECISIONS`, default 20,000 decisions per device and module), or `--keep`.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import pathlib
import random
import sqlite3
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from autoragged.tuning_db import Decision, TuningDB, keep_decisions  # noqa: E402
from torch import nn  # noqa: E402

import autoragged  # noqa: E402
from autoragged import _ragged, _recorder, ops  # noqa: E402
from autoragged._device import device_key  # noqa: E402
from autoragged._rollup import arm_label  # noqa: E402
from benchmarks._common import environment, header, table, write_json  # noqa: E402

_LIBC = ctypes.CDLL("libc.so.6") if sys.platform.startswith("linux") else None
TABLES = ("decisions", "decision_totals", "decision_buckets", "measurements")


def rss_mb() -> float:
    """Resident memory after giving freed heap pages back (malloc_trim), MB."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def file_mb(path: pathlib.Path) -> float:
    return path.stat().st_size / 2**20 if path.exists() else 0.0


def rows(path: pathlib.Path) -> dict[str, int]:
    conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
    try:
        return {t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLES}
    finally:
        conn.close()


def encoder() -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 2, 128, batch_first=True, dropout=0.0)
    return nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()


def inputs(n: int, seed: int = 0, max_batch: int = 64, max_len: int = 512) -> list[tuple[torch.Tensor, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        batch = int(torch.randint(1, max_batch + 1, (1,), generator=g))
        lengths = torch.randint(1, max_len + 1, (batch,), generator=g).tolist()
        out.append((torch.randn(batch, max(lengths), 64, generator=g), lengths))
    return out


def template_decisions(n: int) -> list[Decision]:
    """The decisions a wrapped encoder made on `n` random batches (recorded nowhere)."""
    model = autoragged.wrap(encoder(), db=False)
    with torch.no_grad():
        for x, lengths in inputs(n, seed=1):
            model(x, lengths=lengths)
    return autoragged.recent_decisions(model, n)


class Sampler:
    """Every `every` batches: a row of the table."""

    def __init__(self, path: pathlib.Path, every: int):
        self.path, self.every, self.t0, self.samples = path, every, time.perf_counter(), []

    def __call__(self, batches: int) -> None:
        if batches == 0:
            self.t0 = time.perf_counter()  # the clock starts with the batches, not with the set-up
        wal = pathlib.Path(f"{self.path}-wal")
        sample = dict(batches=batches, seconds=time.perf_counter() - self.t0, rss_mb=rss_mb(),
                      db_mb=file_mb(self.path), wal_mb=file_mb(wal), **rows(self.path))  # fmt: skip
        self.samples.append(sample)
        print(table([sample], COLUMNS).splitlines()[-1] if len(self.samples) > 1 else table([sample], COLUMNS))
        sys.stdout.flush()


COLUMNS = [("batches", "batches", ","), ("seconds", "s", ".0f"), ("rss_mb", "RSS MB", ".1f"),
           ("db_mb", "DB MB", ".2f"), ("wal_mb", "WAL MB", ".2f"), ("decisions", "decision rows", ","),
           ("decision_totals", "totals rows", ","), ("decision_buckets", "bucket rows", ","),
           ("measurements", "measurements", ",")]  # fmt: skip


def run_recorder(path: pathlib.Path, args, sample: Sampler) -> None:
    templates = template_decisions(512)
    device = device_key("cpu")
    rec = _recorder.Recorder(interval_s=1e9, high_water=1 << 62, keep_decisions=args.keep)
    rng = random.Random(0)
    start = time.time() - args.batches / args.rate  # the run ends now
    sample(0)
    for i in range(args.batches):
        t = templates[i % len(templates)]
        measured = None
        label = arm_label(t.arm, t.config)
        if rng.random() < 1 / 32 and label in t.predicted_ms:  # sample_every=32: timed, near its prediction
            measured = t.predicted_ms[label] * rng.uniform(0.8, 1.25)
        rec.add(path, device, Decision(start + i / args.rate, t.device, t.signature, t.stats, t.arm, t.config,
                                       t.predicted_ms, t.reason, measured))  # fmt: skip
        if (i + 1) % 4096 == 0:
            rec.flush()
        if (i + 1) % args.every == 0:
            rec.flush()
            sample(i + 1)
    rec.flush()


def run_wrapped(path: pathlib.Path, args, sample: Sampler) -> None:
    _recorder.RECORDER.keep_decisions = args.keep
    model = autoragged.wrap(encoder(), db=path)
    batches = inputs(64, max_batch=16, max_len=64)  # small: a forward per batch must stay ~2 ms on CPU
    sample(0)
    with torch.no_grad():
        for i in range(args.batches):
            x, lengths = batches[i % len(batches)]
            model(x, lengths=lengths)
            if (i + 1) % args.every == 0:
                autoragged.flush()
                sample(i + 1)
    autoragged.unwrap(model)


def growth_per_10k(samples: list[dict], key: str) -> float | None:
    """Change of `key` per 10k batches over the second half of the run (after the retention has filled)."""
    half = [s for s in samples if s["batches"] >= samples[-1]["batches"] / 2]
    if len(half) < 2 or half[-1]["batches"] == half[0]["batches"]:
        return None
    return (half[-1][key] - half[0][key]) / (half[-1]["batches"] - half[0]["batches"]) * 1e4


def _keep(text: str) -> int | str:
    if text == "all":
        return text
    keep = int(text)
    if keep < 0:
        raise argparse.ArgumentTypeError(f"--keep must be >= 0 or 'all', got {text}")
    return keep


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=1_000_000)
    p.add_argument("--every", type=int, default=50_000, help="batches between samples")
    p.add_argument("--mode", choices=("recorder", "wrapped"), default="recorder")
    p.add_argument("--rate", type=float, default=20.0,
                   help="recorder mode: simulated batches per second (times of the decisions; default 20: 1M "
                        "batches span ~14 hours, so hourly totals roll over)")  # fmt: skip
    p.add_argument(
        "--keep",
        type=_keep,
        default=None,
        help="decisions kept per module, or 'all' (default: the library's, $AUTORAGGED_DB_KEEP_DECISIONS)",
    )
    p.add_argument("--db", help="database file (default: a fresh temporary one)")
    p.add_argument("--out", help="JSON path (default benchmarks/results/soak[_wrapped].json)")
    args = p.parse_args(argv)
    if args.keep is None:
        args.keep = keep_decisions()
        args.keep = "all" if args.keep is None else args.keep
    torch.set_num_threads(1)
    ops.use_triton = _ragged.use_triton = lambda t: False  # CPU: the reference path (see the docstring)
    env = environment()
    header(f"soak: {args.batches:,} batches, {args.mode} mode, keeping {args.keep} decisions per module", env)
    path = pathlib.Path(args.db) if args.db else pathlib.Path(tempfile.mkdtemp()) / "soak.sqlite"
    TuningDB.open(path).close()
    sample = Sampler(path, args.every)
    (run_recorder if args.mode == "recorder" else run_wrapped)(path, args, sample)
    if sample.samples[-1]["batches"] != args.batches:
        sample(args.batches)
    s = sample.samples
    summary = {
        "batches": args.batches, "seconds": s[-1]["seconds"], "rss_mb_start": s[0]["rss_mb"],
        "rss_mb_first_sample": s[1]["rss_mb"], "rss_mb_end": s[-1]["rss_mb"], "db_mb_start": s[0]["db_mb"],
        "db_mb_first_sample": s[1]["db_mb"], "db_mb_end": s[-1]["db_mb"], "wal_mb_end": s[-1]["wal_mb"],
        "rss_mb_per_10k_second_half": growth_per_10k(s, "rss_mb"),
        "db_mb_per_10k_second_half": growth_per_10k(s, "db_mb"),
    }  # fmt: skip
    print(f"\nsecond half, per 10k batches: RSS {summary['rss_mb_per_10k_second_half']:+.3f} MB, "
          f"DB {summary['db_mb_per_10k_second_half']:+.3f} MB; {summary['seconds']:.0f} s in all")  # fmt: skip
    name = "soak.json" if args.mode == "recorder" else "soak_wrapped.json"
    out = write_json(name, {"env": env, "args": vars(args), "summary": summary, "samples": s}, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
