"""The dispatcher's host cost per batch: a wrapped encoder forced to the padded arm against the plain encoder.

    python benchmarks/dispatch_overhead.py                 # 20,000 calls a row
    python benchmarks/dispatch_overhead.py --quick         # 3,000 calls a row
    python benchmarks/dispatch_overhead.py --smoke         # on the CPU: checks the script

A one-layer encoder (d_model 512, 8 heads, ff 2048, fp16: its padded forward is a few launches) is called on
batches of CoRa lengths (CoLA and RACE, B = 32 and 128; new lengths every call, 256 draws cycled, padded to the
dataset's longest), each call alone after a synchronisation, its host time taken (the launches, not the GPU's
work). Columns, median host us:
  plain     the encoder itself, model(x, src_key_padding_mask=mask)
  padded    autoragged.wrap(model, db=<a temporary database>, policy="padded"): the same arm, so padded - plain is
            the dispatcher's cost: reading the call, the batch's statistics, the decision and its record
  auto      autoragged.wrap(model, db=<another>): whichever arm the policy picks, as a user gets it (the arms it
            ran are listed)
Inputs: "lengths=" (host ints) and "mask" (a mask alone on the device: read, a device-to-host copy, at a shape's
first sight and wherever the arm that runs needs the lengths; the padded arm's batches are counted on the device).
Appends a line to benchmarks/results/dispatch_overhead.jsonl.
"""

from __future__ import annotations

import copy
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import autoragged  # noqa: E402
from autoragged.workloads import CORA, sample_cora  # noqa: E402
from benchmarks._common import arms_ran, device_of, header, parser, record, sync, table  # noqa: E402
from benchmarks.cora_table import TINY, encoder  # noqa: E402

ONE_LAYER = {"layers": 1, "d_model": 512, "heads": 8, "ff": 2048}
DRAWS = 256


def host_us(fn, inputs: list, calls: int, device) -> list[float]:
    """Host microseconds of each of `calls` calls of fn(input), inputs cycled, each after a synchronisation."""
    times = []
    for i in range(calls):
        sync(device)
        t0 = time.perf_counter_ns()
        fn(inputs[i % len(inputs)])
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return times


def inputs_of(dataset: str, batch: int, width: int, dtype, device, rng) -> list[tuple]:
    """DRAWS (x, mask, lengths) batches of the dataset's longest length, x zeros (the values do not matter)."""
    L = CORA[dataset].max
    x = torch.zeros(batch, L, width, device=device, dtype=dtype)
    out = []
    for _ in range(DRAWS):
        lengths = sample_cora(dataset, batch, rng)
        mask = (torch.arange(L)[None, :] >= torch.tensor(lengths)[:, None]).to(device)
        out.append((x, mask, lengths))
    return out


def callers(models: dict) -> dict:
    """{(column, input): fn((x, mask, lengths))}."""
    plain = models["plain"]
    out = {("plain", "mask"): lambda b: plain(b[0], src_key_padding_mask=b[1])}
    for col in ("padded", "auto"):
        m = models[col]
        out[(col, "mask")] = lambda b, m=m: m(b[0], src_key_padding_mask=b[1])
        out[(col, "lengths=")] = lambda b, m=m: m(b[0], lengths=b[2])
    return out


def bench(models: dict, args, device) -> list[dict]:
    layer = models["plain"].layers[0]
    width, dtype = layer.self_attn.embed_dim, layer.linear1.weight.dtype
    rng = np.random.default_rng(0)
    rows = []
    for batch in args.batch_sizes:
        for dataset in args.datasets:
            inputs = inputs_of(dataset, batch, width, dtype, device, rng)
            for mode in ("lengths=", "mask"):
                row = {"dataset": dataset, "batch": batch, "input": mode}
                for (col, how), fn in callers(models).items():
                    if how == mode or col == "plain":
                        host_us(fn, inputs, args.calls // 10, device)  # warm: kernels, caches, the policy's timings
                        row[col] = statistics.median(host_us(fn, inputs, args.calls, device))
                row["overhead"] = row["padded"] - row["plain"]
                row["auto_arms"] = arms_ran(models["auto"], args.calls)
                rows.append(row)
                print(f"  B={batch} {dataset} {mode}: plain {row['plain']:.1f} us, padded {row['padded']:.1f}, "
                      f"auto {row['auto']:.1f}", flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--calls", type=int, default=20000, help="timed calls per row and column (default 20000)")
    args = p.parse_args(argv)
    args.calls = 200 if args.smoke else 3000 if args.quick else args.calls
    args.batch_sizes, args.datasets = ((2,), ("CoLA", "MRPC")) if args.smoke else ((32, 128), ("CoLA", "RACE"))
    device = device_of(args, "benchmarks/dispatch_overhead.py")
    header("The dispatcher's host cost per batch" + (", smoke: tiny, CPU" if args.smoke else ""))
    plain = encoder({**TINY, "layers": 1} if args.smoke else ONE_LAYER, device)
    with tempfile.TemporaryDirectory() as tmp:
        models = {
            "plain": plain,
            "padded": autoragged.wrap(copy.deepcopy(plain), db=pathlib.Path(tmp, "padded.sqlite"), policy="padded"),
            "auto": autoragged.wrap(copy.deepcopy(plain), db=pathlib.Path(tmp, "auto.sqlite")),
        }
        with torch.inference_mode():
            rows = bench(models, args, device)
        autoragged.flush()
    print("\n## host microseconds per call (median); overhead = padded - plain\n")
    print(table(rows, [("batch", "B", "d"), ("dataset", "lengths", ""), ("input", "input", ""),
                       ("plain", "plain", ".1f"), ("padded", "padded", ".1f"), ("overhead", "overhead", ".1f"),
                       ("auto", "auto", ".1f")]))  # fmt: skip
    record("dispatch_overhead", args, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
