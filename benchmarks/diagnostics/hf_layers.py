"""Where an HF encoder batch's GPU time goes: one CoRa batch through HF's padded sdpa forward, autoragged's eager
ragged arm (cuBLAS linears) and its ragged graph (Triton linears), CUDA kernel time by kind, against the real
tokens' roofline.

    python benchmarks/diagnostics/hf_layers.py                          # bert-base, RACE and MNLI at B=128
    python benchmarks/diagnostics/hf_layers.py --model minilm --rows CoLA:32 SQuAD:64

Per arm: the call's median wall time over --reps synchronised calls, and one torch.profiler pass summing CUDA
kernel time into kinds (gemm, attention, layernorm, activation, elementwise, copy/pack, other). The arms are
forced through the runtime's own execute path (`autoragged.measure.ArmRunner`). The roofline is the real
tokens' linear and attention FLOPs at the rate of one large cuBLAS fp16 product measured in the same process.
Beside the graph: its layers' linears alone, each layer's four (q/k/v as one product) captured in one CUDA graph
and timed by events over back-to-back replays, as the graph runs them (Triton, the graph's capacity of rows,
`live` at the batch's tokens, the tiles picked for them) and as cuBLAS on exactly the batch's tokens with the gelu
after it; "graph at cuBLAS" is the graph's call with its linears' kernel time replaced by cuBLAS's alone. Prints
two tables.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from autoragged.kernels import ragged_linear as k_lin  # noqa: E402
from autoragged.tuning_db import BatchStats  # noqa: E402

from autoragged.measure import ArmRunner  # noqa: E402
from autoragged.planning.buckets import mask_width  # noqa: E402
from autoragged.planning.costmodel import Arm  # noqa: E402
from autoragged.planning.planner import default_ragged_config, graph_config  # noqa: E402
from autoragged.workloads import sample_cora  # noqa: E402
from benchmarks._common import header, require_cuda, table  # noqa: E402
from benchmarks.hf_table import SHAPES, build, token_batch  # noqa: E402
from benchmarks.kernels import matmul_peak_tflops  # noqa: E402

KINDS = [
    ("gemm", ("gemm", "cutlass", "cublas", "sm90_xmma", "nvjet", "_linear")),
    ("attention", ("_ragged_attn", "flash", "fmha", "attention", "softmax")),
    ("layernorm", ("layer_norm", "_add_layer_norm", "layernorm")),
    ("activation", ("gelu",)),
    ("copy/pack", ("_pack", "_unpack", "index", "copy", "gather", "scatter", "cat")),
]


def kind_of(name: str, kinds: list[tuple[str, tuple[str, ...]]]) -> str:
    """The kind of a CUDA kernel by name: the first of `kinds` (kind, name fragments) that matches, else
    "elementwise" for PyTorch's elementwise kernels and "other"."""
    low = name.lower()
    for kind, keys in kinds:
        if any(k.lower() in low for k in keys):
            return kind
    return "elementwise" if "elementwise" in low or "vectorized" in low else "other"


def profile_kernels(fn, kinds) -> tuple[float, dict[str, float], list]:
    """One call of `fn` under torch.profiler: (kernel ms, kernel ms by `kind_of`, the 12 longest kernels as
    [name, ms, launches])."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_kind: dict[str, float] = {}
    kernels = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us:
            kind = kind_of(e.key, kinds)
            by_kind[kind] = by_kind.get(kind, 0.0) + us / 1e3
            kernels.append([e.key[:90], us / 1e3, e.count])
    kernels.sort(key=lambda k: -k[1])
    return sum(by_kind.values()), by_kind, kernels[:12]


def flops(config, lengths) -> float:
    """Real-token FLOPs of the encoder layers: linears 2 * params per token, attention 4 * n^2 * d per sequence."""
    d, ff, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    tokens = sum(lengths)
    return layers * (2 * tokens * (4 * d * d + 2 * d * ff) + sum(4 * n * n * d for n in lengths))


def arms_of(model, runner: ArmRunner, lengths: list[int]) -> dict:
    """{arm: a call of it on one batch of `lengths`}: HF's padded sdpa forward, the eager ragged arm, the graph."""
    b = token_batch(lengths, torch.Generator().manual_seed(0), model.config.vocab_size, torch.device("cuda"))
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    L = max(lengths)
    run = runner.batch_runner(tuple(lengths), BatchStats.from_lengths(tuple(lengths)))
    return {
        "hf_sdpa": lambda: model(input_ids=b.ids, attention_mask=b.mask),
        "ragged": lambda: run(Arm("ragged", default_ragged_config(head_dim, L))),
        "ragged_graph": lambda: run(Arm("ragged_graph", graph_config(head_dim, mask_width(L)))),
    }


def measure(fn, reps: int) -> tuple[float, tuple]:
    """(median ms of `reps` synchronised calls after 3 warm-up calls, `profile_kernels(fn)`)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), profile_kernels(fn, KINDS)


def events_ms(fn, reps: int = 30) -> float:
    """Mean ms of `fn` over `reps` back-to-back calls between two CUDA events, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def linears_alone(model, tokens: int, capacity: int) -> dict[str, float]:
    """ms of a BertModel's linears alone, each set captured in one CUDA graph: "triton" as the ragged graph runs
    them (a buffer of `capacity` rows, `live` at `tokens`, the tiles `default_config` picks for `tokens`),
    "cublas" on exactly `tokens` rows, gelu after ff1 (torch.compile's and the eager arm's products)."""
    weights = []
    for layer in model.encoder.layer:
        a = layer.attention.self
        qkv = [torch.cat([a.query.weight, a.key.weight, a.value.weight]), torch.cat([a.query.bias, a.key.bias,
               a.value.bias])]  # fmt: skip
        dense = [layer.attention.output.dense, layer.intermediate.dense, layer.output.dense]
        weights.append([qkv, *([d.weight, d.bias] for d in dense)])
    d, ff = model.config.hidden_size, model.config.intermediate_size
    x = torch.randn(capacity, d, device="cuda", dtype=torch.float16)
    h = torch.randn(capacity, ff, device="cuda", dtype=torch.float16)
    live = torch.tensor([tokens], device="cuda", dtype=torch.int32)
    outs = {n: torch.empty(capacity, n, device="cuda", dtype=torch.float16) for n in (3 * d, d, ff)}

    def triton():
        for (wq, bq), (wo, bo), (w1, b1), (w2, b2) in weights:
            for inp, w, b, act in ((x, wq, bq, None), (x, wo, bo, None), (x, w1, b1, "gelu"), (h, w2, b2, None)):
                config = k_lin.default_config(w.shape[0], w.shape[1], tokens, act)
                k_lin.ragged_linear(inp, w, b, act, config, live=live, out=outs[w.shape[0]])

    def cublas():
        xs, hs = x[:tokens], h[:tokens]
        for (wq, bq), (wo, bo), (w1, b1), (w2, b2) in weights:
            F.linear(xs, wq, bq), F.linear(xs, wo, bo), F.gelu(F.linear(xs, w1, b1)), F.linear(hs, w2, b2)

    times = {}
    for name, fn in (("triton", triton), ("cublas", cublas)):
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        times[name] = events_ms(graph.replay)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bert-base", choices=list(SHAPES))
    p.add_argument("--rows", nargs="+", default=["RACE:128", "MNLI:128"], help="dataset:batch")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    device = require_cuda("benchmarks/diagnostics/hf_layers.py")
    header(f"Where one {args.model} batch's GPU time goes (fp16)")
    model = build(args.model, device, smoke=False)
    runner = ArmRunner(copy.deepcopy(model))
    rate = matmul_peak_tflops(shape=(16384, 3072, 768))
    print(f"cuBLAS fp16 (16384 x 3072) @ (3072 x 768): {rate:.0f} TFLOP/s")
    rows, alone = [], []
    for spec in args.rows:
        dataset, batch = spec.split(":")
        lengths = sample_cora(dataset, int(batch), np.random.default_rng(0))
        roofline = flops(model.config, lengths) / (rate * 1e12) * 1e3
        with torch.inference_mode():
            for arm, fn in arms_of(model, runner, lengths).items():
                ms, (gpu_ms, by_kind, top) = measure(fn, args.reps)
                rows.append({"row": spec, "tokens": sum(lengths), "arm": arm, "ms": ms, "gpu_ms": gpu_ms,
                             "roofline_ms": roofline, **{f"{k}_ms": v for k, v in by_kind.items()}})  # fmt: skip
                print(f"  {spec} {arm}: {ms:.2f} ms, kernels {gpu_ms:.2f} ms", flush=True)
                for name, kms, count in top[:6]:
                    print(f"      {kms:7.2f} ms {count:4d}x {name}")
                if arm == "ragged_graph":
                    times = linears_alone(model, sum(lengths), int(batch) * mask_width(max(lengths)))
                    graph = events_ms(fn)
                    alone.append({"row": spec, "tokens": sum(lengths), "graph_ms": graph, "linears_ms": by_kind["gemm"],
                                  "triton_ms": times["triton"], "cublas_ms": times["cublas"],
                                  "at_cublas_ms": graph - by_kind["gemm"] + times["cublas"]})  # fmt: skip
    kinds = [k for k, _ in KINDS] + ["elementwise", "other"]
    cols = [("row", "row", ""), ("tokens", "tokens", "d"), ("arm", "arm", ""), ("ms", "call ms", ".2f"),
            ("gpu_ms", "kernels ms", ".2f"), ("roofline_ms", "roofline ms", ".2f")]  # fmt: skip
    print(f"\n## {args.model}: kernel time by kind (one profiled call)\n")
    print(table(rows, cols + [(f"{k}_ms", f"{k} ms", ".2f") for k in kinds]))
    print(f"\n## {args.model}: the graph's linears, in it and alone (ms, back-to-back calls timed by events)\n")
    print(table(alone, [("row", "row", ""), ("tokens", "tokens", "d"), ("graph_ms", "graph", ".3f"),
                        ("linears_ms", "its linears (profiler)", ".3f"), ("triton_ms", "alone, Triton", ".3f"),
                        ("cublas_ms", "alone, cuBLAS + gelu", ".3f"),
                        ("at_cublas_ms", "graph at cuBLAS", ".3f")]))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
