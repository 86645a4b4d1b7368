"""The benchmark of record: the CoRa / PyCoRa encoder table, with what a user would pick instead.

    python benchmarks/cora_table.py                      # 24 rows, every column but torch.compile
    python benchmarks/cora_table.py --columns all        # also torch.compile (minutes of compiling)
    python benchmarks/cora_table.py --quick              # 6 rows

Workload: the eight CoRa length distributions (PyCoRa Beta recipe, fixed seeds) at batch 32/64/128,
the 6-layer encoder (d_model 512, 8 heads, ff 2048, relu, post-norm), fp16, inference. Each row runs
--batches batches; each cell is the median over them of the per-batch median ms (CUDA events around
one call, after warm-up; the call ends with a synchronisation, so a cell is the latency of a batch,
host work included).

Columns
  padded_nofast    nn.TransformerEncoder with PyTorch's fast path off (torch.backends.mha)
  pytorch_fast     nn.TransformerEncoder as built by default: its fast path with nested tensors
  compile          torch.compile(model) on batches padded to the dataset's max length (static shapes)
  compile_ro       torch.compile(model, mode="reduce-overhead"), same static shapes
  varlen           a hand-written padding-free encoder: linears on [T, D], varlen_attn, F.layer_norm
  varlen_graph     that encoder replayed as a CUDA graph captured for the batch itself (an upper
                   bound: a real server cannot capture every batch's exact shape)
  ragged           autoragged forced to the eager ragged arm (policy="ragged")
  auto             autoragged.wrap(model) with the tuning database given by --db / AUTORAGGED_DB
  auto_lengths     the same wrapped model called with lengths= (host ints) instead of the mask
  oracle           the best of autoragged's arms on each batch (padded, ragged, ragged graph; default config)
  roofline         real-token FLOPs at the measured fp16 matmul rate
The model gets `src_key_padding_mask` (True = pad), as PyTorch code calls it; `auto` computes lengths
from it (one device->host copy per batch).
Prints a markdown table and writes benchmarks/results/cora_table.json and cora_table.png.
"""

from __future__ import annotations

import argparse
import copy
import math
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from autoragged.kernels._config import KernelConfig  # noqa: E402
from autoragged.tuning_db import BatchStats  # noqa: E402

import autoragged  # noqa: E402
from autoragged._costmodel import PADDED, PADDED_GRAPH, Arm  # noqa: E402
from autoragged._measure import ArmRunner, time_ms  # noqa: E402
from autoragged._planner import default_ragged_config  # noqa: E402
from autoragged.workloads import CORA, CORA_BATCH_SIZES, CORA_MODEL, sample_cora  # noqa: E402
from benchmarks._common import environment, header, matmul_peak_tflops, require_cuda, table, write_json  # noqa: E402

DEFAULT_COLUMNS = [
    "padded_nofast",
    "pytorch_fast",
    "varlen",
    "varlen_graph",
    "ragged",
    "auto",
    "auto_lengths",
    "oracle",
]
ALL_COLUMNS = DEFAULT_COLUMNS[:2] + ["compile", "compile_ro"] + DEFAULT_COLUMNS[2:]
FAILED: dict[str, str] = {}  # columns whose model failed to run, with the error


def build_model(device) -> torch.nn.TransformerEncoder:
    torch.manual_seed(0)
    m = CORA_MODEL
    layer = torch.nn.TransformerEncoderLayer(m["d_model"], m["heads"], m["ff"], dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, m["layers"]).to(device, torch.float16).eval()


class VarlenEncoder:
    """The padding-free encoder a user would write by hand around torch's varlen_attn."""

    def __init__(self, model: torch.nn.TransformerEncoder):
        self.layers = list(model.layers)

    def __call__(self, x, idx, cu, max_len):
        from torch.nn.attention.varlen import varlen_attn

        B, L, D = x.shape
        v = x.reshape(B * L, D).index_select(0, idx)
        for layer in self.layers:
            mha = layer.self_attn
            H = mha.num_heads
            qkv = F.linear(v, mha.in_proj_weight, mha.in_proj_bias).view(-1, 3, H, D // H)
            a = varlen_attn(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, max_len, max_len)
            v = layer.norm1(v + F.linear(a.reshape(-1, D), mha.out_proj.weight, mha.out_proj.bias))
            h = F.relu(F.linear(v, layer.linear1.weight, layer.linear1.bias))
            v = layer.norm2(v + F.linear(h, layer.linear2.weight, layer.linear2.bias))
        out = x.new_zeros(B * L, D)
        return out.index_copy_(0, idx, v).view(B, L, D)


def varlen_inputs(lengths, L, device):
    idx = torch.cat([torch.arange(n) + i * L for i, n in enumerate(lengths)]).to(device)
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device=device)
    return idx, cu, max(lengths)


def graphed(fn):
    """Capture fn() once and return a replay closure (the output buffer is the graph's)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def roofline_ms(lengths, peak_tflops: float) -> float:
    m = CORA_MODEL
    D, ff, layers = m["d_model"], m["ff"], m["layers"]
    T, sq = sum(lengths), sum(n * n for n in lengths)
    flops = layers * (2 * T * (4 * D * D + 2 * D * ff) + 4 * sq * D)
    return flops / (peak_tflops * 1e12) * 1e3


def bench_batch(name, lengths, seed, args, models, device) -> tuple[dict[str, float], str | None]:
    """Every column's median ms on one batch, and the arm auto chose."""
    D = CORA_MODEL["d_model"]
    batch, L = len(lengths), max(lengths)
    torch.manual_seed(seed)
    x = torch.randn(batch, L, D, device=device, dtype=torch.float16)
    mask = torch.arange(L, device=device)[None, :] >= torch.tensor(lengths, device=device)[:, None]
    cols = set(args.columns)
    out: dict[str, float] = {}
    chosen = None

    def t(fn):
        return time_ms(fn, device, warmup=args.warmup, reps=args.reps).median_ms

    with torch.inference_mode():
        if "padded_nofast" in cols:
            torch.backends.mha.set_fastpath_enabled(False)
            try:
                out["padded_nofast"] = t(lambda: models["plain"](x, src_key_padding_mask=mask))
            finally:
                torch.backends.mha.set_fastpath_enabled(True)
        if "pytorch_fast" in cols:
            out["pytorch_fast"] = t(lambda: models["plain"](x, src_key_padding_mask=mask))
        Lmax = CORA[name].max  # static shapes for the compiled columns: pad to the dataset's max
        xs, ms = F.pad(x, (0, 0, 0, Lmax - L)), F.pad(mask, (0, Lmax - L), value=True)
        for col in ("compile", "compile_ro"):
            if col in cols and col not in FAILED:
                try:
                    out[col] = t(lambda c=col: models[c](xs, src_key_padding_mask=ms))
                except Exception as e:  # noqa: BLE001 - a compiler failure is a result to report, not a crash
                    FAILED[col] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    print(f"  {col} failed: {FAILED[col]}", flush=True)
        if cols & {"varlen", "varlen_graph"}:
            idx, cu, max_len = varlen_inputs(lengths, L, device)
            fn = lambda: models["varlen"](x, idx, cu, max_len)  # noqa: E731
            if "varlen" in cols:
                out["varlen"] = t(fn)
            if "varlen_graph" in cols:
                out["varlen_graph"] = t(graphed(fn))
        if "ragged" in cols:
            out["ragged"] = t(lambda: models["ragged"](x, src_key_padding_mask=mask))
        if "auto" in cols:
            out["auto"] = t(lambda: models["auto"](x, src_key_padding_mask=mask))
            chosen = autoragged.recent_decisions(models["auto"], 1)[0].arm
            out["auto_calls"] = _what_ran(models["auto"], args.reps)
            # results never depend on the arm: auto's output against PyTorch's on the real tokens
            got, want = models["auto"](x, src_key_padding_mask=mask), models["plain"](x, src_key_padding_mask=mask)
            real = ~mask
            out["auto_max_err"] = (got[real].float() - want[real].float()).abs().max().item()
        if "auto_lengths" in cols:  # the same wrapped model, told the lengths on the host (no device sync)
            out["auto_lengths"] = t(lambda: models["auto"](x, lengths=lengths))
            out["auto_lengths_calls"] = _what_ran(models["auto"], args.reps)
        if "oracle" in cols:
            stats = BatchStats.from_lengths(tuple(lengths))
            cfg = default_ragged_config(D // CORA_MODEL["heads"], L)
            arms = [PADDED, Arm("ragged", cfg), Arm("ragged_graph", cfg), PADDED_GRAPH]
            runner = models["oracle"]
            out["oracle"] = min(t(lambda a=a: runner.run(a, x, mask, tuple(lengths), stats)) for a in arms)
    return out, chosen


def _what_ran(model, n: int) -> dict[str, int]:
    """How often each (arm with its config, reason) ran in the last `n` calls of `model` (the timed ones)."""
    ran: dict[str, int] = {}
    for d in autoragged.recent_decisions(model, n):
        label = d.arm if d.config is None else f"{d.arm}:{KernelConfig.from_dict(d.config).short()}"
        key = f"{label} | {d.reason[:80]}"
        ran[key] = ran.get(key, 0) + 1
    return ran


def bench_row(name, batch, args, models, peak, device) -> dict:
    rng = np.random.default_rng(sum(map(ord, name)) * 1000 + batch)
    cells: dict[str, list[float]] = {c: [] for c in [*args.columns, "roofline", "auto_max_err"]}
    chosen = []
    calls: dict[str, dict[str, int]] = {"auto_calls": {}, "auto_lengths_calls": {}}
    for b in range(args.batches):
        lengths = sample_cora(name, batch, rng)
        times, arm = bench_batch(name, lengths, b, args, models, device)
        for col, ms in times.items():
            if col in calls:  # what ran in the timed calls, summed over the row's batches
                for key, count in ms.items():
                    calls[col][key] = calls[col].get(key, 0) + count
                continue
            cells[col].append(ms)
        if arm:
            chosen.append(arm)
        cells["roofline"].append(roofline_ms(lengths, peak))
    row = {"dataset": name, "batch": batch}
    for col, values in cells.items():
        row[col] = statistics.median(values) if values else None
    if chosen:
        row["auto_arms"] = {a: chosen.count(a) for a in sorted(set(chosen))}
    row.update({col: ran for col, ran in calls.items() if ran})
    if cells.get("auto_max_err"):
        row["auto_max_err"] = max(cells["auto_max_err"])
    pytorch = [row[c] for c in ("padded_nofast", "pytorch_fast", "compile", "compile_ro") if row.get(c)]
    if pytorch and row.get("auto"):
        row["best_pytorch"] = min(pytorch)
        row["speedup_vs_best_pytorch"] = row["best_pytorch"] / row["auto"]
    if row.get("oracle") and row.get("auto"):
        row["auto_vs_oracle"] = row["auto"] / row["oracle"]
    if row.get("varlen_graph") and row.get("auto"):
        row["auto_vs_varlen_graph"] = row["auto"] / row["varlen_graph"]
    return row


def plot(rows, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    cols = [c for c in ALL_COLUMNS if any(r.get(c) for r in rows)] + ["roofline"]
    labels = [f"{r['dataset']}\nB={r['batch']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(10, len(rows) * 0.7), 5))
    width = 0.8 / len(cols)
    for i, col in enumerate(cols):
        ax.bar(np.arange(len(rows)) + i * width, [r.get(col) or 0 for r in rows], width, label=col)
    ax.set_yscale("log")
    ax.set_ylabel("ms per batch (log)")
    ax.set_xticks(np.arange(len(rows)) + 0.4, labels, fontsize=7)
    ax.legend(fontsize=7, ncol=4)
    ax.set_title("CoRa encoder (6 x 512, fp16) per batch")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="6 rows (CoLA, MNLI, RACE at B=32/128)")
    p.add_argument("--columns", nargs="+", default=DEFAULT_COLUMNS, help=f"subset of {ALL_COLUMNS}, or 'all'")
    p.add_argument("--batches", type=int, default=3, help="batches per row (default 3)")
    p.add_argument("--reps", type=int, default=10, help="timed calls per batch and column (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    p.add_argument("--datasets", nargs="+", choices=list(CORA), help="rows to run (default: all eight)")
    p.add_argument("--db", help="tuning database for the auto column (default $AUTORAGGED_DB or ~/.cache)")
    p.add_argument("--capture", default="second_sight", help="wrap(capture=...) of the auto column (or pays)")
    p.add_argument("--mask-reads", default="one_behind", help="wrap(mask_reads=...): one_behind or recheck")
    p.add_argument("--graph-cap", type=int, help="wrap(graph_cap=...) of the auto column (default: from memory)")
    p.add_argument("--out", help="JSON path (default benchmarks/results/cora_table.json)")
    args = p.parse_args(argv)
    args.columns = ALL_COLUMNS if args.columns == ["all"] else args.columns
    unknown = set(args.columns) - set(ALL_COLUMNS)
    if unknown:
        p.error(f"unknown columns {sorted(unknown)}; choose from {ALL_COLUMNS}")
    require_cuda("benchmarks/cora_table.py")
    env = environment()
    header("CoRa encoder table (6 x d512, 8 heads, ff 2048, fp16, inference)", env)
    device = torch.device("cuda")
    peak = matmul_peak_tflops()
    print(f"measured fp16 matmul peak: {peak:.0f} TFLOP/s; columns: {', '.join(args.columns)}", flush=True)

    plain = build_model(device)
    models = {"plain": plain, "varlen": VarlenEncoder(plain)}
    if "ragged" in args.columns:
        models["ragged"] = autoragged.wrap(copy.deepcopy(plain), db=False, policy="ragged", sample_every=0)
    if {"auto", "auto_lengths"} & set(args.columns):
        models["auto"] = autoragged.wrap(copy.deepcopy(plain), db=args.db, policy="auto", capture=args.capture,
                                         mask_reads=args.mask_reads, graph_cap=args.graph_cap)  # fmt: skip
    if "oracle" in args.columns:
        models["oracle"] = ArmRunner(copy.deepcopy(plain))
    if "compile" in args.columns:
        models["compile"] = torch.compile(copy.deepcopy(plain), dynamic=False)
    if "compile_ro" in args.columns:
        models["compile_ro"] = torch.compile(copy.deepcopy(plain), mode="reduce-overhead", dynamic=False)

    datasets = args.datasets or (["CoLA", "MNLI", "RACE"] if args.quick else list(CORA))
    batches = (32, 128) if args.quick else CORA_BATCH_SIZES
    rows = []
    for name in datasets:
        for batch in batches:
            row = bench_row(name, batch, args, models, peak, device)
            rows.append(row)
            shown = " ".join(f"{c}={row[c]:.3f}" for c in args.columns if row.get(c))
            print(f"  {name:8s} B={batch:3d} {shown}", flush=True)

    cols = [("dataset", "dataset", ""), ("batch", "B", "d")]
    cols += [(c, c, ".3f") for c in ALL_COLUMNS if c in args.columns] + [("roofline", "roofline", ".3f")]
    cols += [("speedup_vs_best_pytorch", "auto vs best PyTorch", ".2f"), ("auto_vs_oracle", "auto / oracle", ".2f"),
             ("auto_max_err", "auto max err", ".1e")]  # fmt: skip
    print("\n## CoRa encoder, ms per batch (median)\n")
    print(table(rows, cols))
    summary = {}
    speed = [r["speedup_vs_best_pytorch"] for r in rows if r.get("speedup_vs_best_pytorch")]
    if speed:
        summary["geomean_speedup_vs_best_pytorch"] = math.exp(np.mean(np.log(speed)))
        summary["min_speedup_vs_best_pytorch"] = min(speed)
        print(f"\nauto vs the fastest PyTorch column: geomean {summary['geomean_speedup_vs_best_pytorch']:.2f}x, "
              f"worst row {summary['min_speedup_vs_best_pytorch']:.2f}x")  # fmt: skip
    oracle = [r["auto_vs_oracle"] for r in rows if r.get("auto_vs_oracle")]
    if oracle:
        summary["max_auto_vs_oracle"] = max(oracle)
        print(f"auto / oracle: worst row {max(oracle):.2f}")
    short = [r["auto_vs_varlen_graph"] for r in rows if r.get("auto_vs_varlen_graph") and r["dataset"] in
             ("CoLA", "MRPC", "MNLI", "XNLI")]  # fmt: skip
    if short:
        summary["max_auto_vs_varlen_graph_short_rows"] = max(short)
        print(f"short rows (CoLA, MRPC, MNLI, XNLI): auto / varlen graph worst {max(short):.2f}")
    summary["failed_columns"] = FAILED
    path = write_json("cora_table.json", {"env": env, "peak_tflops": peak, "args": vars(args), "summary": summary,
                                          "rows": rows}, args.out)  # fmt: skip
    plot(rows, path.with_suffix(".png"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
