"""The benchmark of record: the CoRa encoder on the 24 CoRa rows, against what a PyTorch user runs instead.

    python benchmarks/cora_table.py                     # 24 rows, every column
    python benchmarks/cora_table.py --quick             # 6 rows: CoLA, MNLI, RACE at B=32 and 128
    python benchmarks/cora_table.py --columns fast auto auto_lengths --datasets RACE
    python benchmarks/cora_table.py --smoke             # a tiny encoder on the CPU: checks the script

Workload: the eight CoRa length distributions (PyCoRa's Beta recipe, a fixed seed per row) at batch 32, 64 and
128; the CoRa encoder (nn.TransformerEncoder: 6 layers, d_model 512, 8 heads, ff 2048, relu, post-norm,
batch_first), fp16, inference mode, called as PyTorch code calls it: model(x, src_key_padding_mask=mask), True
= pad. Each row runs --batches batches; each column calls a batch --warmup times, then --reps times, each call
alone between synchronisations (a batch's latency, host work included); a cell is the median over the row's
batches of the median call, in ms. Each column's model serves every row in order.

Columns (ms per batch)
  nofast        the encoder with PyTorch's fast path off (torch.backends.mha.set_fastpath_enabled(False))
  fast          the encoder as built: PyTorch's fast path with nested tensors
  compile       torch.compile(model): default mode, automatic dynamic shapes, compiling in this process
                (_common.compiled); compile_s, its first calls' time beyond their median call, is reported apart
  auto          autoragged.wrap(model, db=--db), called with the mask
  auto_lengths  the same wrapped model called with lengths= (host ints: no device-to-host copy)
  ragged        autoragged.wrap(model, policy="ragged"): the eager ragged arm, forced
Ratios: best / auto, best the fastest of nofast, fast and compile (> 1: auto is faster); auto / ragged.
auto_err: the largest |auto - fast| on real tokens. Appends a line to benchmarks/results/cora_table.jsonl.
"""

from __future__ import annotations

import contextlib
import copy
import pathlib
import sys
from collections import Counter
from dataclasses import dataclass

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import autoragged  # noqa: E402
from autoragged.workloads import CORA_MODEL, sample_cora  # noqa: E402
from benchmarks._common import (  # noqa: E402
    add_row_arguments,
    arms_ran,
    compiled,
    cora_rows,
    device_of,
    geomean,
    header,
    latency_ms,
    parser,
    record,
    row_seed,
    table,
)

COLUMNS = ["nofast", "fast", "compile", "auto", "auto_lengths", "ragged"]
PYTORCH = ("nofast", "fast", "compile")
TINY = {"layers": 2, "d_model": 64, "heads": 2, "ff": 128}


def encoder(dims: dict, device, activation: str = "relu") -> torch.nn.TransformerEncoder:
    """An eval-mode post-norm nn.TransformerEncoder of `dims` (layers, d_model, heads, ff), fp16 on a GPU."""
    torch.manual_seed(0)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    layer = torch.nn.TransformerEncoderLayer(
        dims["d_model"], dims["heads"], dims["ff"], dropout=0.0, activation=activation, batch_first=True
    )
    return torch.nn.TransformerEncoder(layer, dims["layers"]).to(device, dtype).eval()


@dataclass
class Batch:
    x: torch.Tensor  # (B, L, D) random, L the longest length
    mask: torch.Tensor  # (B, L) bool key padding mask, True = pad
    lengths: list[int]


def encoder_batch(lengths: list[int], g: torch.Generator, width: int, dtype, device) -> Batch:
    L = max(lengths)
    x = torch.randn(len(lengths), L, width, generator=g).to(device, dtype)
    mask = torch.arange(L)[None, :] >= torch.tensor(lengths)[:, None]
    return Batch(x, mask.to(device), lengths)


@contextlib.contextmanager
def fastpath(enabled: bool):
    torch.backends.mha.set_fastpath_enabled(enabled)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(True)


def build(args, device) -> dict:
    """{column: model} for the columns asked for (auto_lengths runs on auto's model)."""
    plain = encoder(TINY if args.smoke else CORA_MODEL, device)
    models = {"plain": plain}
    if {"auto", "auto_lengths"} & set(args.columns):
        models["auto"] = autoragged.wrap(copy.deepcopy(plain), db=args.db or False)
    if "ragged" in args.columns:
        models["ragged"] = autoragged.wrap(copy.deepcopy(plain), db=False, policy="ragged", sample_every=0)
    if "compile" in args.columns:
        models["compile"] = compiled(plain, args.smoke)
    return models


def calls(models: dict, b: Batch) -> dict:
    """{column: a call of its model on the batch}."""
    plain, x, mask, lengths = models["plain"], b.x, b.mask, b.lengths
    return {
        "nofast": lambda: plain(x, src_key_padding_mask=mask),
        "fast": lambda: plain(x, src_key_padding_mask=mask),
        "compile": lambda: models["compile"](x, src_key_padding_mask=mask),
        "auto": lambda: models["auto"](x, src_key_padding_mask=mask),
        "auto_lengths": lambda: models["auto"](x, lengths=lengths),
        "ragged": lambda: models["ragged"](x, src_key_padding_mask=mask),
    }


WRAPPED = {"auto": "auto", "auto_lengths": "auto", "ragged": "ragged"}  # column -> its model


def bench_batch(lengths, seed, args, models, device) -> dict:
    """One batch: {"times": {column: (first call ms, median call ms)}, "arms": {wrapped column: {arm: calls}},
    "err": auto's largest |auto - fast| on real tokens, or None}."""
    layer = models["plain"].layers[0]
    b = encoder_batch(lengths, torch.Generator().manual_seed(seed), layer.self_attn.embed_dim,
                      layer.linear1.weight.dtype, device)  # fmt: skip
    fns = calls(models, b)
    out = {"times": {}, "arms": {}, "err": None}
    for col in args.columns:
        with fastpath(col != "nofast"):
            out["times"][col] = latency_ms(fns[col], device, args.warmup, args.reps)
        if col in WRAPPED:
            out["arms"][col] = arms_ran(models[WRAPPED[col]], max(args.warmup, 1) + args.reps)
    if "auto" in models:
        real = ~b.mask
        out["err"] = (fns["auto"]()[real].float() - fns["fast"]()[real].float()).abs().max().item()
    return out


def bench_row(dataset, batch, args, models, device) -> dict:
    rng = np.random.default_rng(row_seed(dataset, batch))
    draws = [sample_cora(dataset, batch, rng) for _ in range(args.batches)]
    cells = [bench_batch(lengths, i, args, models, device) for i, lengths in enumerate(draws)]
    row = {"dataset": dataset, "batch": batch, "tokens": float(np.mean([sum(d) for d in draws]))}
    for col in args.columns:
        row[col] = float(np.median([c["times"][col][1] for c in cells]))
    if "compile" in row:  # compiling: the first calls' time beyond their batches' median call
        row["compile_s"] = sum(c["times"]["compile"][0] - c["times"]["compile"][1] for c in cells) / 1e3
    if "auto" in models:
        row["auto_err"] = max(c["err"] for c in cells)
    for col in cells[0]["arms"]:
        row[f"{col}_arms"] = dict(sum((Counter(c["arms"][col]) for c in cells), Counter()))
    best = [row[c] for c in PYTORCH if c in row]
    if best and "auto" in row:
        row["best_over_auto"] = min(best) / row["auto"]
    if "ragged" in row and "auto" in row:
        row["auto_over_ragged"] = row["auto"] / row["ragged"]
    return row


def report(rows: list[dict], columns: list[str]) -> dict:
    cols = [("dataset", "dataset", ""), ("batch", "B", "d")] + [(c, c, ".3f") for c in columns]
    cols += [("best_over_auto", "best PyTorch / auto", ".2f"), ("auto_over_ragged", "auto / ragged", ".2f"),
             ("compile_s", "compile s", ".1f"), ("auto_err", "auto err", ".1e")]  # fmt: skip
    print("\n## CoRa encoder, ms per batch (median call)\n")
    print(table(rows, cols))
    ratios = [r["best_over_auto"] for r in rows if r.get("best_over_auto")]
    summary = {
        "geomean_best_over_auto": geomean(ratios),
        "min_best_over_auto": min(ratios, default=None),
        "compile_s": sum(r.get("compile_s", 0.0) for r in rows),
    }
    if ratios:
        print(f"\nbest PyTorch / auto: geomean {summary['geomean_best_over_auto']:.2f}x, worst row "
              f"{summary['min_best_over_auto']:.2f}x; torch.compile compiled {summary['compile_s']:.1f} s")  # fmt: skip
    return summary


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    add_row_arguments(p)
    p.add_argument("--columns", nargs="+", choices=COLUMNS, default=COLUMNS)
    p.add_argument("--batches", type=int, default=3, help="batches per row (default 3)")
    p.add_argument("--reps", type=int, default=10, help="timed calls per batch and column (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    p.add_argument("--db", help="the tuning database of auto (default: none, the analytic prior)")
    args = p.parse_args(argv)
    if args.smoke:
        args.batches, args.reps, args.warmup = 1, 2, 1
    device = device_of(args, "benchmarks/cora_table.py")
    header("CoRa encoder (6 x d512, 8 heads, ff 2048, fp16, inference)" + (", smoke: tiny, CPU" if args.smoke else ""))
    models = build(args, device)
    rows = []
    with torch.inference_mode():
        for dataset, batch in cora_rows(args):
            rows.append(bench_row(dataset, batch, args, models, device))
            shown = " ".join(f"{c}={rows[-1][c]:.3f}" for c in args.columns)
            print(f"  {dataset:8s} B={batch:3d} {shown}", flush=True)
    summary = report(rows, args.columns)
    record("cora_table", args, rows, summary=summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
