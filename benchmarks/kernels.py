"""Kernel benchmark: ragged attention vs varlen_attn and padded SDPA; ragged_linear vs cuBLAS.

    python benchmarks/kernels.py                   # full: 24 CoRa rows, variant rows, config sweep, linear
    python benchmarks/kernels.py --quick           # 6 CoRa rows, 5 variant rows, 4 configs
    python benchmarks/kernels.py --only variants   # the GQA and sliding-window rows alone

Attention: CoRa length distributions (PyCoRa Beta recipe, seed 0) at batch 32/64/128, 8 heads x 64,
fp16, forward. FLOPs counted on real tokens only (4 * sum(L_i^2) * H * Dh) for every column, so
TFLOP/s compare useful work. Variants: decoder-style causal GQA (Qwen2.5-7B's 28 query / 4 kv heads x 128,
Qwen2.5-0.5B's 14 / 2 x 64) and ModernBERT-base's local layers (12 heads x 64, window (64, 64)) on
sequences of max_len / 2 .. max_len tokens (~16k tokens a batch), bf16, against varlen_attn and aten's
_flash_attention_forward with the same window and kv heads; FLOPs count the (query, key) pairs the mask
keeps. Linear: [T, K] x [K, N] + bias for the encoder's four shapes, ours and cuBLAS each timed as 10 calls
captured in one CUDA graph, as the ragged graphs run our linear (launched eagerly, ours took a floor of ~40 us a
call, its host time, at 2,048 rows: the eager arm's linears are cuBLAS's); "default" is the tiles the runtime picks
for T rows (`ragged_linear.default_config`).
GPU only (no --smoke: the Triton interpreter runs the kernels, not their speed). Prints tables and appends a line
to benchmarks/results/kernels.jsonl.
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
from benchmarks._common import header, record, require_cuda, table  # noqa: E402

HEADS, HEAD_DIM = 8, 64


def bench_ms(fn, *, warmup_ms: float = 25, rep_ms: float = 100) -> dict:
    """Median / p10 / p90 ms of `fn` (CUDA events through triton.testing.do_bench, which flushes L2 between
    runs)."""
    from triton.testing import do_bench

    p10, med, p90 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.1, 0.5, 0.9])
    return {"median_ms": med, "p10_ms": p10, "p90_ms": p90}


def matmul_peak_tflops(dtype=torch.float16, shape: tuple[int, int, int] = (8192, 8192, 8192)) -> float:
    """The measured dense matmul rate on random data of (m, k, n) = `shape`: the yardstick for a share of peak."""
    m, k, n = shape
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype)
    return 2 * m * k * n / bench_ms(lambda: a @ b, rep_ms=300)["median_ms"] / 1e9


def attention_configs(max_len: int, quick: bool, head_dim: int = HEAD_DIM, **prune_args) -> list[KernelConfig]:
    candidates = [
        KernelConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
        for bm, bn, w, s in [
            (64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2),
            (64, 32, 4, 2), (32, 32, 4, 2), (32, 16, 2, 2), (16, 16, 2, 1), (128, 32, 8, 3), (64, 128, 4, 2),
            (64, 32, 8, 2),
        ]
    ]  # fmt: skip
    kept = [c for c in candidates if k_attn.prune(c, head_dim=head_dim, max_len=max_len, **prune_args)]
    return kept[:4] if quick else kept


def time_ours(q, k, v, rt: RaggedTensor, configs: list[KernelConfig], default: KernelConfig, **kwargs) -> dict:
    """Median ms of our kernel per config (the default included), and the default's and the best's."""
    offsets, dev_lengths = rt.layout.device_meta(q.device)
    results = {}
    for config in [*configs, default]:
        if config.short() in results:
            continue
        gm, bo = rt.prelude(config.block_m)
        fn = lambda c=config, gm=gm, bo=bo: k_attn.ragged_attention(
            q, k, v, offsets, dev_lengths, gm, bo, config=c, **kwargs
        )
        results[config.short()] = bench_ms(fn)["median_ms"]
    best = min(results, key=results.get)
    return {"ours_default_ms": results[default.short()], "ours_best_ms": results[best], "ours_best_config": best}


def bench_attention(dataset: str, batch: int, quick: bool) -> dict:
    rng = np.random.default_rng(0)
    lengths = sample_cora(dataset, batch, rng)
    T, L = sum(lengths), max(lengths)
    dev = torch.device("cuda")
    q, k, v = (torch.randn(T, HEADS, HEAD_DIM, device=dev, dtype=torch.float16) for _ in range(3))
    rt = RaggedTensor.from_values_offsets(q, torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device=dev))
    flops = 4 * sum(n * n for n in lengths) * HEADS * HEAD_DIM
    row = {"dataset": dataset, "batch": batch, "tokens": T, "max_len": L, "gflop": flops / 1e9}

    row.update(time_ours(q, k, v, rt, attention_configs(L, quick), k_attn.default_config(HEAD_DIM, L)))

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


# (name, query heads, kv heads, head dim, causal, window, max lengths)
VARIANTS = [
    ("qwen2.5-7b", 28, 4, 128, True, (-1, -1), (512, 2048, 8192)),
    ("qwen2.5-0.5b", 14, 2, 64, True, (-1, -1), (512, 2048, 8192)),
    ("modernbert-local", 12, 12, 64, False, (64, 64), (512, 1024, 8192)),
]
VARIANT_TOKENS = 16384


def variant_lengths(max_len: int, rng: np.random.Generator) -> list[int]:
    """Sequences of max_len / 2 .. max_len tokens, about VARIANT_TOKENS in all (at least one)."""
    count = max(1, round(VARIANT_TOKENS / (0.75 * max_len)))
    return [int(n) for n in rng.integers(max_len // 2, max_len + 1, size=count)]


def kept_pairs(n: int, window: tuple[int, int], causal: bool) -> int:
    """(query, key) pairs of an n-token sequence that the window and causal rule keep."""
    left, right = window[0], 0 if causal else window[1]
    i = np.arange(n)
    hi = np.full(n, n - 1) if right < 0 else np.minimum(n - 1, i + right)
    lo = np.zeros(n, dtype=np.int64) if left < 0 else np.maximum(0, i - left)
    return int((hi - lo + 1).sum())


def varlen_kwargs(causal: bool, window: tuple[int, int], gqa: bool) -> tuple[dict | None, str | None]:
    """varlen_attn's arguments for this case on the installed torch, or None and what it lacks: newer
    versions take window_size ((-1, 0) is causal) and enable_gqa, older ones is_causal only."""
    from torch.nn.attention.varlen import varlen_attn

    params = __import__("inspect").signature(varlen_attn).parameters
    kwargs, missing = {}, []
    if "window_size" in params and (causal or window != (-1, -1)):
        kwargs["window_size"] = (window[0], 0) if causal else window
    elif window != (-1, -1):
        missing.append("window_size")
    elif causal:
        kwargs["is_causal"] = True
    if gqa:
        kwargs["enable_gqa"] = True
        if "enable_gqa" not in params:
            missing.append("enable_gqa")
    return (None, f"varlen_attn lacks {', '.join(missing)}") if missing else (kwargs, None)


def _peer_ms(fn) -> tuple[float | None, str | None]:
    """A peer's median ms, or None and why it could not run this case."""
    try:
        fn()
        return bench_ms(fn)["median_ms"], None
    except Exception as error:  # noqa: BLE001 - a peer that lacks a feature is a row with a dash
        return None, f"{type(error).__name__}: {str(error)[:120]}"


def bench_variant(name, heads, kv_heads, head_dim, causal, window, max_len, quick) -> dict:
    from torch.nn.attention.varlen import varlen_attn

    lengths = variant_lengths(max_len, np.random.default_rng(0))
    T, L = sum(lengths), max(lengths)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    q = torch.randn(T, heads, head_dim, device=dev, dtype=dtype)
    k, v = (torch.randn(T, kv_heads, head_dim, device=dev, dtype=dtype) for _ in "kv")
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device=dev)
    rt = RaggedTensor.from_values_offsets(q, cu)
    flops = 4 * sum(kept_pairs(n, window, causal) for n in lengths) * heads * head_dim
    row = {"case": name, "heads": f"{heads}/{kv_heads}", "head_dim": head_dim, "causal": causal,
           "window": str(window), "batch": len(lengths), "tokens": T, "max_len": L, "gflop": flops / 1e9}  # fmt: skip
    configs = attention_configs(L, quick, head_dim, causal=causal, window=window)
    default = k_attn.default_config(head_dim, L)
    row.update(time_ours(q, k, v, rt, configs, default, causal=causal, window=window))

    kwargs, row["varlen_error"] = varlen_kwargs(causal, window, kv_heads != heads)
    row["varlen_ms"] = None
    if kwargs is not None:
        row["varlen_ms"], row["varlen_error"] = _peer_ms(lambda: varlen_attn(q, k, v, cu, cu, L, L, **kwargs))
    wl, wr = (None if w < 0 else w for w in window)  # aten's flash: None is unbounded; GQA is native to it
    flash = torch.ops.aten._flash_attention_forward
    row["flash_ms"], row["flash_error"] = _peer_ms(
        lambda: flash(q, k, v, cu, cu, L, L, 0.0, causal, False, window_size_left=wl, window_size_right=wr)
    )
    for key in ("ours_best", "ours_default", "varlen", "flash"):
        ms = row[f"{key}_ms"]
        row[f"{key}_tflops"] = None if ms is None else flops / ms / 1e9
    peers = [row[p] for p in ("varlen_ms", "flash_ms") if row[p] is not None]
    row["best_vs_peer"] = min(peers) / row["ours_best_ms"] if peers else None
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


GRAPH_CALLS = 10


def graph_ms(fn) -> float:
    """Median ms of one `fn` call: GRAPH_CALLS calls captured in one CUDA graph (warmed up on a side stream first),
    the replay timed by `bench_ms`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    return bench_ms(graph.replay)["median_ms"] / GRAPH_CALLS


def bench_linear(tokens: int, name: str, n: int, k: int, quick: bool) -> dict:
    dev = torch.device("cuda")
    x = torch.randn(tokens, k, device=dev, dtype=torch.float16)
    w = torch.randn(n, k, device=dev, dtype=torch.float16) / k**0.5
    b = torch.randn(n, device=dev, dtype=torch.float16)
    flops = 2 * tokens * n * k
    cublas = graph_ms(lambda: F.linear(x, w, b))
    default = k_lin.default_config(n, k, tokens)
    configs = {c.short(): c for c in [*linear_configs(quick), default]}
    ours = {key: graph_ms(lambda c=c: k_lin.ragged_linear(x, w, b, None, c)) for key, c in configs.items()}
    best = min(ours, key=ours.get)
    return {
        "shape": name, "tokens": tokens, "n": n, "k": k,
        "cublas_ms": cublas, "ours_best_ms": ours[best], "ours_best_config": best,
        "ours_default_ms": ours[default.short()], "ours_default_config": default.short(),
        "cublas_tflops": flops / cublas / 1e9, "ours_best_tflops": flops / ours[best] / 1e9,
        "ours_vs_cublas": cublas / ours[best], "ours_default_vs_cublas": cublas / ours[default.short()],
    }  # fmt: skip


SECTIONS = ("attention", "variants", "linear")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="6 attention rows, fewer configs")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="sections to run")
    parser.add_argument("--results", help="folder of the JSONL file (default benchmarks/results)")
    args = parser.parse_args(argv)
    require_cuda("benchmarks/kernels.py")
    header("ragged kernels vs PyTorch peers")
    peak = matmul_peak_tflops()
    print(f"measured fp16 matmul peak (8192^3, random data): {peak:.0f} TFLOP/s", flush=True)

    attn, variants, linear = [], [], []
    if "attention" in args.only:
        datasets = ["CoLA", "MNLI", "RACE"] if args.quick else list(CORA)
        batches = (32, 128) if args.quick else CORA_BATCH_SIZES
        for name in datasets:
            for batch in batches:
                row = bench_attention(name, batch, args.quick)
                row["ours_best_share_of_peak"] = row["ours_best_tflops"] / peak
                attn.append(row)
                print(f"  {name:8s} B={batch:3d} T={row['tokens']:6d} ours {row['ours_best_ms']:.3f} ms "
                      f"varlen {row['varlen_ms']:.3f} ms sdpa {row['sdpa_padded_ms']:.3f} ms", flush=True)  # fmt: skip
    if "variants" in args.only:
        for name, heads, kv_heads, head_dim, causal, window, max_lens in VARIANTS:
            for max_len in max_lens[:2] if args.quick else max_lens:
                if args.quick and len(variants) >= 5:
                    break
                row = bench_variant(name, heads, kv_heads, head_dim, causal, window, max_len, args.quick)
                variants.append(row)
                varlen, flash = (row[key] or float("nan") for key in ("varlen_ms", "flash_ms"))
                print(f"  {name:16s} L<={max_len:5d} T={row['tokens']:6d} ours {row['ours_best_ms']:.3f} ms "
                      f"varlen {varlen:.3f} ms flash {flash:.3f} ms", flush=True)  # fmt: skip
    if "linear" in args.only:
        token_counts = [2048, 8192, 16384, 46592] if args.quick else [512, 2048, 8192, 16384, 32768, 46592]
        linear = [bench_linear(t, *shape, args.quick) for t in token_counts for shape in LINEAR_SHAPES]

    if attn:
        print("\n## attention, fp16, 8 heads x 64 (ms per call, median; TFLOP/s on real tokens)\n")
        print(table(attn, [
            ("dataset", "dataset", ""), ("batch", "B", "d"), ("tokens", "tokens", "d"), ("max_len", "max", "d"),
            ("ours_default_ms", "ours default", ".3f"), ("ours_best_ms", "ours best", ".3f"),
            ("ours_best_config", "best config", ""), ("varlen_ms", "varlen_attn", ".3f"),
            ("sdpa_padded_ms", "SDPA padded", ".3f"), ("ours_best_tflops", "ours TF/s", ".0f"),
            ("varlen_tflops", "varlen TF/s", ".0f"), ("best_vs_varlen", "ours/varlen", ".2f"),
        ]))  # fmt: skip
    if variants:
        print("\n## attention variants, bf16: GQA (q/kv heads), windows (ms per call, median; TFLOP/s on kept pairs)\n")
        print(table(variants, [
            ("case", "case", ""), ("heads", "heads", ""), ("head_dim", "Dh", "d"), ("causal", "causal", ""),
            ("window", "window", ""), ("batch", "B", "d"), ("tokens", "tokens", "d"), ("max_len", "max", "d"),
            ("ours_default_ms", "ours default", ".3f"), ("ours_best_ms", "ours best", ".3f"),
            ("ours_best_config", "best config", ""), ("varlen_ms", "varlen_attn", ".3f"),
            ("flash_ms", "aten flash", ".3f"), ("ours_best_tflops", "ours TF/s", ".0f"),
            ("best_vs_peer", "ours/best peer", ".2f"),
        ]))  # fmt: skip
        for r in variants:
            for peer in ("varlen", "flash"):
                if r[f"{peer}_error"]:
                    print(f"  {r['case']} L<={r['max_len']}: {peer} did not run: {r[f'{peer}_error']}")
    if linear:
        print(f"\n## linear + bias, fp16 (share of the measured {peak:.0f} TFLOP/s peak)\n")
        print(table(linear, [
            ("shape", "shape", ""), ("tokens", "T", "d"), ("n", "N", "d"), ("k", "K", "d"),
            ("cublas_ms", "cuBLAS ms", ".4f"), ("ours_default_ms", "ours default ms", ".4f"),
            ("ours_default_config", "default", ""), ("ours_best_ms", "ours best ms", ".4f"),
            ("ours_best_config", "best", ""), ("cublas_tflops", "cuBLAS TF/s", ".0f"),
            ("ours_best_tflops", "ours best TF/s", ".0f"), ("ours_default_vs_cublas", "default/cuBLAS", ".2f"),
            ("ours_vs_cublas", "best/cuBLAS", ".2f"),
        ]))  # fmt: skip
    big = [r for r in attn if r["tokens"] >= 16384]
    if big:
        print(f"\nattention, rows with >= 16k tokens: ours/varlen min {min(r['best_vs_varlen'] for r in big):.2f}, "
              f"geomean {np.exp(np.mean([np.log(r['best_vs_varlen']) for r in big])):.2f}")  # fmt: skip
    if linear:
        for key, label in (("ours_default_vs_cublas", "default"), ("ours_vs_cublas", "best")):
            ratios = [r[key] for r in linear]
            print(f"linear, cuBLAS's time / ours ({label} tiles): min {min(ratios):.2f}, "
                  f"geomean {np.exp(np.mean(np.log(ratios))):.2f}")  # fmt: skip
    rows = [{"section": name, **r} for name, rs in (("attention", attn), ("variants", variants), ("linear", linear))
            for r in rs]  # fmt: skip
    record("kernels", args, rows, peak_tflops=peak)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
