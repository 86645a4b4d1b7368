"""Soak: what a long run leaves in the tuning database and in resident memory (CPU; no GPU needed).

    python benchmarks/soak.py                                  # 100,000 batches
    python benchmarks/soak.py --batches 1000000 --every 50000
    python benchmarks/soak.py --keep all --batches 20000       # no retention: the growth it bounds
    python benchmarks/soak.py --quick                          # 20,000 batches
    python benchmarks/soak.py --smoke                          # 2,000 batches: checks the script

Every batch is a real forward of a wrapped CPU encoder (nn.TransformerEncoder: 1 layer, d_model 64, 2 heads, ff
128; `autoragged.wrap(model, db=path)`) on one of 64 pre-made inputs (batch 1-16, lengths 1-64, `lengths=`), the
runtime's recorder flushing in its thread as in production. Every --every batches, after autoragged.flush():
resident memory after malloc_trim (glibc keeps freed pages otherwise), the database file and its WAL, the rows of
each table, and the seconds so far. The retention is the library's ($AUTORAGGED_DB_KEEP_DECISIONS, 20,000
decisions per device and module by default), or --keep. Prints a table and appends a line to
benchmarks/results/soak.jsonl; its summary has the growth per 10k batches over the run's second half, once the
retention has filled.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import pathlib
import sqlite3
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from autoragged.tuning_db import KEEP_ENV_VAR, TuningDB  # noqa: E402
from torch import nn  # noqa: E402

import autoragged  # noqa: E402
from benchmarks._common import header, parser, record, table  # noqa: E402

_LIBC = ctypes.CDLL("libc.so.6") if sys.platform.startswith("linux") else None


def rss_mb() -> float:
    """Resident memory after giving freed heap pages back (malloc_trim), MB."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def file_mb(path: pathlib.Path) -> float:
    return path.stat().st_size / 2**20 if path.exists() else 0.0


def table_rows(path: pathlib.Path) -> dict[str, int]:
    """{table: rows} of every table in the database (read-only)."""
    conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
    try:
        names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        return {t: conn.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in names}
    finally:
        conn.close()


def encoder() -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 2, 128, batch_first=True, dropout=0.0)
    return nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()


def inputs(n: int, seed: int = 0, max_batch: int = 16, max_len: int = 64) -> list[tuple[torch.Tensor, list[int]]]:
    """Small: a forward a batch must stay ~2 ms on a CPU."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        batch = int(torch.randint(1, max_batch + 1, (1,), generator=g))
        lengths = torch.randint(1, max_len + 1, (batch,), generator=g).tolist()
        out.append((torch.randn(batch, max(lengths), 64, generator=g), lengths))
    return out


def sample(path: pathlib.Path, batches: int, t0: float) -> dict:
    wal = pathlib.Path(f"{path}-wal")
    return dict(batches=batches, seconds=time.perf_counter() - t0, rss_mb=rss_mb(), db_mb=file_mb(path),
                wal_mb=file_mb(wal), **table_rows(path))  # fmt: skip


def soak(path: pathlib.Path, args) -> list[dict]:
    """Run the batches, a sample every `args.every`; the samples."""
    model = autoragged.wrap(encoder(), db=path)
    batches = inputs(64)
    t0 = time.perf_counter()
    samples = [sample(path, 0, t0)]
    with torch.no_grad():
        for i in range(args.batches):
            x, lengths = batches[i % len(batches)]
            model(x, lengths=lengths)
            if (i + 1) % args.every == 0 or i + 1 == args.batches:
                autoragged.flush()
                samples.append(sample(path, i + 1, t0))
                print(f"  {i + 1:,} batches: RSS {samples[-1]['rss_mb']:.1f} MB, DB {samples[-1]['db_mb']:.2f} MB",
                      flush=True)  # fmt: skip
    autoragged.unwrap(model)
    return samples


def growth_per_10k(samples: list[dict], key: str) -> float:
    """Change of `key` per 10k batches over the second half of the run (at least the last two samples)."""
    half = [s for s in samples if s["batches"] >= samples[-1]["batches"] / 2]
    first, last = (half if len(half) > 1 else samples[-2:])[0], samples[-1]
    return (last[key] - first[key]) / (last["batches"] - first["batches"]) * 1e4


def _keep(text: str) -> str:
    if text != "all" and not (text.isdigit() and int(text) >= 0):
        raise argparse.ArgumentTypeError(f"--keep must be an int >= 0 or 'all', got {text}")
    return text


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--batches", type=int, default=100_000)
    p.add_argument("--every", type=int, help="batches between samples (default: a tenth of --batches)")
    p.add_argument("--keep", type=_keep, help="decisions kept per module, or 'all' (default: the library's)")
    p.add_argument("--db", help="database file (default: a fresh temporary one)")
    args = p.parse_args(argv)
    args.batches = 2_000 if args.smoke else 20_000 if args.quick else args.batches
    args.every = args.every or max(1, args.batches // 10)
    if args.keep is not None:
        os.environ[KEEP_ENV_VAR] = args.keep  # the recorder reads it at each flush
    torch.set_num_threads(1)  # a tiny encoder's call on 2 shared cores: 170 ms with 2 threads, 0.8 ms with one
    header(f"soak: {args.batches:,} batches, keeping {os.environ.get(KEEP_ENV_VAR, 'the default')} decisions a module")
    path = pathlib.Path(args.db) if args.db else pathlib.Path(tempfile.mkdtemp()) / "soak.sqlite"
    TuningDB.open(path).close()
    samples = soak(path, args)
    tables = [k for k in samples[-1] if k not in ("batches", "seconds", "rss_mb", "db_mb", "wal_mb")]
    print("\n" + table(samples, [("batches", "batches", ","), ("seconds", "s", ".0f"), ("rss_mb", "RSS MB", ".1f"),
                                 ("db_mb", "DB MB", ".2f"), ("wal_mb", "WAL MB", ".2f")]
                       + [(t, t, ",") for t in tables]))  # fmt: skip
    summary = {"rss_mb_per_10k": growth_per_10k(samples, "rss_mb"), "db_mb_per_10k": growth_per_10k(samples, "db_mb")}
    rss, db = summary["rss_mb_per_10k"], summary["db_mb_per_10k"]
    print(f"\nsecond half, per 10k batches: RSS {rss:+.3f} MB, DB {db:+.3f} MB")
    record("soak", args, samples, summary=summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
