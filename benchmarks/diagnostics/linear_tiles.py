"""Tile sweep of our Triton linear at the row counts a ragged CUDA graph sees, against cuBLAS.

A ragged CUDA graph with Triton linears runs `ragged_linear(..., live=...)`: a fixed
grid walks the tiles of the rows the batch fills. This measures it that way: for each (shape, rows,
config, kernel), 10 back-to-back calls captured in one CUDA graph, replayed with CUDA events (median of
the replays / 10), the input buffer sized for twice the rows (a graph's capacity, as with a mask; rounded
up to 128 rows, as graph buckets are), and `live` holding the real row count. Both kernels: "tma" (TMA
descriptors, the default on Hopper) and "ptr" (the pointer kernel, the fallback). cuBLAS is timed the
same way on exactly the real rows (the best it could do), with its activation (relu in cuBLASLt's epilogue, gelu
as F.gelu after it, as torch.compile's and the eager arm's products run).

    python benchmarks/diagnostics/linear_tiles.py                 # CoRa, BERT-base, MiniLM shapes, 400..23302 rows
    python benchmarks/diagnostics/linear_tiles.py --rows 512 2048 --shapes qkv ff2
    python benchmarks/diagnostics/linear_tiles.py --kernels tma --results benchmarks/results   # TMA only, kept

Prints the best config per (shape, rows). The table
`kernels/ragged_linear.py::default_config` picks from comes from this benchmark.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from autoragged.kernels import ragged_linear as k_lin  # noqa: E402
from autoragged.kernels.config import KernelConfig  # noqa: E402

from benchmarks._common import geomean, header, record, require_cuda, table  # noqa: E402

# (name, N, K, activation): the four linears of the CoRa encoder (d 512, ff 2048, relu), BERT-base (768, 3072, gelu)
# and the MiniLM shape (384, 1536, gelu)
SHAPES = {
    "qkv": (1536, 512, None), "out": (512, 512, None), "ff1": (2048, 512, "relu"), "ff2": (512, 2048, None),
    "bert_qkv": (2304, 768, None), "bert_out": (768, 768, None), "bert_ff1": (3072, 768, "gelu"),
    "bert_ff2": (768, 3072, None), "minilm_qkv": (1152, 384, None), "minilm_out": (384, 384, None),
    "minilm_ff1": (1536, 384, "gelu"), "minilm_ff2": (384, 1536, None),
}  # fmt: skip
ROWS = [400, 1000, 2000, 2811, 4000, 5511, 7472, 11560, 23302]
TILES = [  # (block_m, block_n, block_k, warps, stages)
    (32, 128, 64, 4, 4), (64, 64, 128, 4, 3), (64, 128, 64, 4, 4), (64, 256, 64, 4, 3), (128, 64, 64, 4, 4),
    (128, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
    # deeper pipelines for the deep weights (ff2's K of 3,072 is a 48-step loop): 144-208 KB of shared memory
    (128, 128, 64, 4, 4), (128, 128, 64, 8, 4), (128, 128, 64, 8, 5), (128, 128, 128, 8, 3),
]  # fmt: skip
KERNELS = {"tma": None, "ptr": False}  # ragged_linear's `tma` argument
TIMED = ("cublas", "tma_best", "tma_default", "ptr_best", "ptr_default")
CALLS = 10


def graph_ms(fn, replays: int = 15) -> float:
    """Median ms of one `fn` call: CALLS calls captured in one CUDA graph, replayed `replays` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    g.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / CALLS)
    return sorted(times)[len(times) // 2]


def bench(shape: str, rows: int, kernels: dict) -> dict:
    n, k, act = SHAPES[shape]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(rows)
    x = torch.randn(-(-2 * rows // 128) * 128, k, device=dev, dtype=torch.float16, generator=g)
    w = torch.randn(n, k, device=dev, dtype=torch.float16, generator=g) / k**0.5
    b = torch.randn(n, device=dev, dtype=torch.float16, generator=g)
    live = torch.tensor([rows], dtype=torch.int32, device=dev)
    real = x[:rows]
    want = F.linear(real.float(), w.float(), b.float())
    want = {"relu": F.relu, "gelu": F.gelu}[act](want) if act else want
    row = {"shape": shape, "n": n, "k": k, "rows": rows}
    row["cublas_ms"] = graph_ms(lambda: k_lin.cublas_linear(real, w, b, act))
    configs = {f"m{bm}n{bn}k{bk}w{wp}s{st}": KernelConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=wp,
                                                           num_stages=st) for bm, bn, bk, wp, st in TILES}  # fmt: skip
    configs["default"] = k_lin.default_config(n, k, rows, act)
    for kernel, tma in kernels.items():
        ours = {}
        for name, c in configs.items():
            y = torch.full((x.shape[0], n), float("nan"), dtype=x.dtype, device=dev)
            k_lin.ragged_linear(x, w, b, act, c, live=live, tma=tma, out=y)
            err = ((y[:rows].float() - want).norm() / want.norm()).item()
            if not err < 1e-2:  # NaN (a row not written) fails too
                raise RuntimeError(f"{shape} rows={rows} {kernel} {name}: relative error {err:.2e}")
            ours[name] = graph_ms(lambda c=c, tma=tma: k_lin.ragged_linear(x, w, b, act, c, live=live, tma=tma))
        best = min((v, key) for key, v in ours.items() if key != "default")
        row[kernel] = ours
        row[f"{kernel}_best"], row[f"{kernel}_best_ms"], row[f"{kernel}_default_ms"] = best[1], best[0], ours["default"]
        row[f"{kernel}_best_vs_cublas"] = row["cublas_ms"] / best[0]
        row[f"{kernel}_default_vs_cublas"] = row["cublas_ms"] / ours["default"]
    row["default_config"] = configs["default"].short()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rows", nargs="+", type=int, default=ROWS)
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    p.add_argument("--results", help="append the rows (every config's time) to <folder>/linear_tiles.jsonl")
    args = p.parse_args(argv)
    require_cuda("benchmarks/diagnostics/linear_tiles.py")
    header("Triton linear tiles at graph row counts (fp16, live rows, in a CUDA graph)")
    rows = []
    for shape in args.shapes:
        for r in args.rows:
            rows.append(bench(shape, r, {k: KERNELS[k] for k in args.kernels}))
            x = rows[-1]
            cells = " ".join(f"{c}={x[f'{c}_ms'] * 1e3:6.1f}us" for c in TIMED if f"{c}_ms" in x)
            best = " ".join(f"{k} best {x[f'{k}_best']}" for k in args.kernels)
            print(f"  {shape:8s} rows={r:6d} {cells} ({best})", flush=True)
    timed = [c for c in TIMED if f"{c}_ms" in rows[0]]
    us = [{**r, **{f"{c}_us": r[f"{c}_ms"] * 1e3 for c in timed}} for r in rows]
    names = {"tma": "TMA", "ptr": "pointer"}
    columns = [("shape", "shape", ""), ("rows", "rows", "d"), ("cublas_us", "cuBLAS", ".1f"),
               ("default_config", "default config", "")]  # fmt: skip
    for k in args.kernels:
        columns += [(f"{k}_best_us", f"{names[k]} best", ".1f"), (f"{k}_best", f"{names[k]} best config", ""),
                    (f"{k}_default_us", f"{names[k]} default", ".1f"),
                    (f"{k}_default_vs_cublas", f"cuBLAS/{names[k]} default", ".2f")]  # fmt: skip
    print("\n## Triton linear in a CUDA graph, us per call (cuBLAS / ours: > 1 means ours is faster)\n")
    print(table(us, columns))
    for kernel in args.kernels:
        for which in ("best", "default"):
            ratios = [r[f"{kernel}_{which}_vs_cublas"] for r in rows]
            print(f"cuBLAS / {kernel} {which}: geomean {geomean(ratios):.2f}, {min(ratios):.2f}-{max(ratios):.2f}")
    if args.results:
        record("linear_tiles", args, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
