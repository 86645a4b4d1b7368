"""Kernel benchmark: ragged attention vs varlen_attn and padded SDPA; ragged_linear vs cuBLAS.

    python benchmarks/kernels.py            # full: 24 CoRa rows, config sweep, linear shapes
    python benchmarks/kernels.py --quick    # 6 rows, 4 configs

Attention: CoRa length distributions (PyCoRa Beta recipe, seed 0) at batch 32/64/128, 8 heads x 64,
fp16, forward. FLOPs counted on real tokens only (4 * sum(L_i^2) * H * Dh) for every column, so
TFLOP/s compare useful work. Linear: [T, K] x [K, N] + bias for the encoder's four shapes.
Prints a table and writes benchmarks/results/kernels.json.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
import torch.nn.functional as F

# the repository root first: benchmarks/ on sys.path would make this file shadow the `kernels` package
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

from autoragged.kernels import ragged_attention as k_attn  # noqa: E402
from autoragged.kernels import ragged_linear as k_lin  # noqa: E402

from autoragged import KernelConfig, RaggedTensor  # noqa: E402
from autoragged.workloads import CORA, CORA_BATCH_SIZES, sample_cora  # noqa: E402
from benchmarks._common import (  # noqa: E402
    bench_ms,
    environment,
    header,
    matmul_peak_tflops,
    require_cuda,
    table,
    write_json,
)

HEADS, HEAD_DIM = 8, 64


def attention_configs(max_len: int, quick: bool) -> list[KernelConfig]:
    candidates = [
        KernelConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
        for bm, bn, w, s in [
            (64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2),
            (64, 32, 4, 2), (32, 32, 4, 2), (32, 16, 2, 2), (16, 16, 2, 1), (128, 32, 8, 3), (64, 128, 4, 2),
        ]
    ]  # fmt: skip
    kept = [c for c in candidates if k_attn.prune(c, head_dim=HEAD_DIM, max_len=max_len)]
    return kept[:4] if quick else kept


def bench_attention(dataset: str, batch: int, quick: bool) -> dict:
    rng = np.random.default_rng(0)
    lengths = sample_cora(dataset, batch, rng)
    T, L = sum(lengths), max(lengths)
    dev = torch.device("cuda")
    q, k, v = (torch.randn(T, HEADS, HEAD_DIM, device=dev, dtype=torch.float16) for _ in range(3))
    rt = RaggedTensor.from_values_offsets(q, torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device=dev))
    offsets, dev_lengths = rt.layout.device_meta(dev)
    flops = 4 * sum(n * n for n in lengths) * HEADS * HEAD_DIM
    row = {"dataset": dataset, "batch": batch, "tokens": T, "max_len": L, "gflop": flops / 1e9}

    results = {}
    for config in attention_configs(L, quick):
        gm, bo = rt.prelude(config.block_m)
        fn = lambda c=config, gm=gm, bo=bo: k_attn.ragged_attention(q, k, v, offsets, dev_lengths, gm, bo, config=c)
        results[config.short()] = bench_ms(fn)["median_ms"]
    default = k_attn.default_config(HEAD_DIM, L)
    if default.short() not in results:
        gm, bo = rt.prelude(default.block_m)
        results[default.short()] = bench_ms(
            lambda: k_attn.ragged_attention(q, k, v, offsets, dev_lengths, gm, bo, config=default)
        )["median_ms"]
    best = min(results, key=results.get)
    row.update(ours_default_ms=results[default.short()], ours_best_ms=results[best], ours_best_config=best)

    from torch.nn.attention.varlen import varlen_attn

    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device=dev)
    row["varlen_ms"] = bench_ms(lambda: varlen_attn(q, k, v, cu, cu, L, L))["median_ms"]

    # padded SDPA with a key padding mask: (B, H, L, Dh) and a (B, 1, 1, L) keep-mask
    qp, kp, vp = (torch.randn(batch, HEADS, L, HEAD_DIM, device=dev, dtype=torch.float16) for _ in range(3))
    keep = (torch.arange(L, device=dev)[None, :] < torch.tensor(lengths, device=dev)[:, None])[:, None, None, :]
    row["sdpa_padded_ms"] = bench_ms(lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=keep))["median_ms"]

    for key in ("ours_best", "ours_default", "varlen", "sdpa_padded"):
        row[f"{key}_tflops"] = flops / row[f"{key}_ms"] / 1e9
    row["best_vs_varlen"] = row["varlen_ms"] / row["ours_best_ms"]
    return row


LINEAR_SHAPES = [("qkv", 1536, 512), ("out", 512, 512), ("ff1", 2048, 512), ("ff2", 512, 2048)]


def linear_configs(quick: bool) -> list[KernelConfig]:
    cs = [
        KernelConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=st, group_m=g)
        for bm, bn, bk, w, st, g in [
            (128, 128, 64, 8, 3, 8), (128, 256, 64, 8, 3, 8), (128, 128, 64, 4, 4, 8), (64, 128, 64, 4, 4, 8),
            (128, 64, 64, 4, 4, 8), (64, 64, 64, 4, 3, 8), (128, 128, 128, 8, 3, 8), (128, 256, 64, 8, 4, 4),
            (256, 128, 64, 8, 3, 4), (128, 128, 64, 8, 5, 8), (64, 256, 64, 8, 4, 8), (64, 128, 128, 4, 3, 8),
        ]
    ]  # fmt: skip
    return cs[:3] if quick else cs


def bench_linear(tokens: int, name: str, n: int, k: int, quick: bool) -> dict:
    dev = torch.device("cuda")
    x = torch.randn(tokens, k, device=dev, dtype=torch.float16)
    w = torch.randn(n, k, device=dev, dtype=torch.float16) / k**0.5
    b = torch.randn(n, device=dev, dtype=torch.float16)
    flops = 2 * tokens * n * k
    cublas = bench_ms(lambda: F.linear(x, w, b))["median_ms"]
    ours = {
        c.short(): bench_ms(lambda c=c: k_lin.ragged_linear(x, w, b, None, c))["median_ms"]
        for c in linear_configs(quick)
    }
    best = min(ours, key=ours.get)
    return {
        "shape": name, "tokens": tokens, "n": n, "k": k,
        "cublas_ms": cublas, "ours_best_ms": ours[best], "ours_best_config": best,
        "ours_default_ms": ours[k_lin.DEFAULT_CONFIG.short()],
        "cublas_tflops": flops / cublas / 1e9, "ours_best_tflops": flops / ours[best] / 1e9,
        "ours_vs_cublas": cublas / ours[best],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="6 attention rows, fewer configs")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/kernels.json)")
    args = parser.parse_args(argv)
    require_cuda("benchmarks/kernels.py")
    env = environment()
    header("ragged kernels vs PyTorch peers", env)
    peak = matmul_peak_tflops()
    print(f"measured fp16 matmul peak (8192^3, random data): {peak:.0f} TFLOP/s", flush=True)

    datasets = ["CoLA", "MNLI", "RACE"] if args.quick else list(CORA)
    batches = (32, 128) if args.quick else CORA_BATCH_SIZES
    attn = []
    for name in datasets:
        for batch in batches:
            row = bench_attention(name, batch, args.quick)
            row["ours_best_share_of_peak"] = row["ours_best_tflops"] / peak
            attn.append(row)
            print(f"  {name:8s} B={batch:3d} T={row['tokens']:6d} ours {row['ours_best_ms']:.3f} ms "
                  f"varlen {row['varlen_ms']:.3f} ms sdpa {row['sdpa_padded_ms']:.3f} ms", flush=True)  # fmt: skip

    token_counts = [2048, 8192, 16384, 46592] if args.quick else [512, 2048, 8192, 16384, 32768, 46592]
    linear = [bench_linear(t, *shape, args.quick) for t in token_counts for shape in LINEAR_SHAPES]

    print("\n## attention, fp16, 8 heads x 64 (ms per call, median; TFLOP/s on real tokens)\n")
    print(table(attn, [
        ("dataset", "dataset", ""), ("batch", "B", "d"), ("tokens", "tokens", "d"), ("max_len", "max", "d"),
        ("ours_default_ms", "ours default", ".3f"), ("ours_best_ms", "ours best", ".3f"),
        ("ours_best_config", "best config", ""), ("varlen_ms", "varlen_attn", ".3f"),
        ("sdpa_padded_ms", "SDPA padded", ".3f"), ("ours_best_tflops", "ours TF/s", ".0f"),
        ("varlen_tflops", "varlen TF/s", ".0f"), ("best_vs_varlen", "ours/varlen", ".2f"),
    ]))  # fmt: skip
    print(f"\n## linear + bias, fp16 (share of the measured {peak:.0f} TFLOP/s peak)\n")
    print(table(linear, [
        ("shape", "shape", ""), ("tokens", "T", "d"), ("n", "N", "d"), ("k", "K", "d"),
        ("cublas_ms", "cuBLAS ms", ".4f"), ("ours_best_ms", "ours ms", ".4f"), ("ours_best_config", "config", ""),
        ("cublas_tflops", "cuBLAS TF/s", ".0f"), ("ours_best_tflops", "ours TF/s", ".0f"),
        ("ours_vs_cublas", "ours/cuBLAS", ".2f"),
    ]))  # fmt: skip
    big = [r for r in attn if r["tokens"] >= 16384]
    if big:
        print(f"\nattention, rows with >= 16k tokens: ours/varlen min {min(r['best_vs_varlen'] for r in big):.2f}, "
              f"geomean {np.exp(np.mean([np.log(r['best_vs_varlen']) for r in big])):.2f}")  # fmt: skip
    print(f"linear: ours/cuBLAS min {min(r['ours_vs_cublas'] for r in linear):.2f}, "
          f"geomean {np.exp(np.mean([np.log(r['ours_vs_cublas']) for r in linear])):.2f}")  # fmt: skip
    path = write_json("kernels.json", {"env": env, "peak_tflops": peak, "attention": attn, "linear": linear}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
