"""Where an HF encoder batch's GPU time goes: one CoRa batch through HF's padded sdpa forward and autoragged's
eager ragged arm with cuBLAS or Triton linears, CUDA kernel time by kind, against the real tokens' roofline.

    python benchmarks/hf_layers.py                                  # bert-base, RACE and MNLI at B=128
    python benchmarks/hf_layers.py --model MiniLM-L12-H384 --rows CoLA:32 SQuAD:64

Per arm: the call's median wall time over --reps synchronised calls, and one torch.profiler pass summing
CUDA kernel time into kinds (gemm, attention, layernorm, activation, elementwise, copy/pack, other). The
roofline is the real tokens' linear and attention FLOPs at the rate of one large cuBLAS fp16 product measured
in the same process. Prints a table, writes benchmarks/results/hf_layers.json.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from autoragged.tuning_db import BatchStats  # noqa: E402

from autoragged._costmodel import Arm  # noqa: E402
from autoragged._measure import ArmRunner  # noqa: E402
from autoragged._planner import default_ragged_config  # noqa: E402
from autoragged.workloads import HF_SHAPES, sample_cora  # noqa: E402
from benchmarks._common import (  # noqa: E402
    environment,
    header,
    matmul_peak_tflops,
    profile_kernels,
    require_cuda,
    table,
    write_json,
)
from benchmarks.hf_table import batch_of, build  # noqa: E402

KINDS = [
    ("gemm", ("gemm", "cutlass", "cublas", "sm90_xmma", "nvjet", "_linear")),
    ("attention", ("_ragged_attn", "flash", "fmha", "attention", "softmax")),
    ("layernorm", ("layer_norm", "_add_layer_norm", "layernorm")),
    ("activation", ("gelu",)),
    ("copy/pack", ("_pack", "_unpack", "index", "copy", "gather", "scatter", "cat")),
]


def flops(config, lengths) -> float:
    """Real-token FLOPs of the encoder layers: linears 2 * params per token, attention 4 * n^2 * d per sequence."""
    d, ff, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    tokens = sum(lengths)
    linear = 2 * tokens * (4 * d * d + 2 * d * ff)
    attention = sum(4 * n * n * d for n in lengths)
    return layers * (linear + attention)


def arms_of(model, runner, lengths, ids, mask) -> dict:
    """{arm: a call of it on this batch}: HF's padded sdpa forward, the eager ragged arm with each linear."""
    stats = BatchStats.from_lengths(tuple(lengths), padded_len=ids.shape[1])
    cfg = default_ragged_config(runner.runtime.body.head_dim, max(lengths))

    def ragged(backend):
        arm = Arm("ragged", cfg.replace(backend=backend))
        return lambda: runner.run_call(arm, runner.hf_call({"input_ids": ids, "attention_mask": mask}),
                                       tuple(lengths), stats)  # fmt: skip

    return {"hf_sdpa": lambda: model(input_ids=ids, attention_mask=mask), "ragged_cublas": ragged("cublas"),
            "ragged_triton": ragged("triton")}  # fmt: skip


def measure(fn, reps: int) -> tuple[float, tuple]:
    """(median ms of `reps` synchronised calls after 3 warm-up calls, `profile(fn)`)."""
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bert-base", choices=list(HF_SHAPES))
    p.add_argument(
        "--rows", nargs="+", default=["RACE:128", "MNLI:128"], help="dataset:batch (default RACE:128 MNLI:128)"
    )
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", help="JSON path (default benchmarks/results/hf_layers.json)")
    args = p.parse_args(argv)
    require_cuda("benchmarks/hf_layers.py")
    env = environment()
    header(f"Where one {args.model} batch's GPU time goes (fp16)", env)
    device = torch.device("cuda")
    model = build(args.model, device)
    runner = ArmRunner(copy.deepcopy(model))
    rate = matmul_peak_tflops(shape=(16384, 3072, 768))
    print(f"cuBLAS fp16 (16384 x 3072) @ (3072 x 768): {rate:.0f} TFLOP/s")
    rows = []
    for spec in args.rows:
        dataset, batch = spec.split(":")
        lengths = sample_cora(dataset, int(batch), np.random.default_rng(0))
        ids, mask = batch_of(lengths, model.config.vocab_size, device, 0, model.config.pad_token_id or 0)
        roofline = flops(model.config, lengths) / (rate * 1e12) * 1e3
        arms = arms_of(model, runner, lengths, ids, mask)
        with torch.inference_mode():
            for arm, fn in arms.items():
                ms, (gpu_ms, by_kind, top) = measure(fn, args.reps)
                row = {"row": spec, "tokens": sum(lengths), "arm": arm, "ms": ms, "gpu_ms": gpu_ms,
                       "roofline_ms": roofline, "top_kernels": top}  # fmt: skip
                row.update({f"{k}_ms": v for k, v in by_kind.items()})
                rows.append(row)
                shown = {k: round(v, 2) for k, v in by_kind.items()}
                print(f"  {spec} {arm}: {ms:.2f} ms, kernels {gpu_ms:.2f} ms {shown}", flush=True)
                for name, kms, count in top[:6]:
                    print(f"      {kms:7.2f} ms {count:4d}x {name}")
    kinds = [k for k, _ in KINDS] + ["elementwise", "other"]
    cols = [("row", "row", ""), ("tokens", "tokens", "d"), ("arm", "arm", ""), ("ms", "call ms", ".2f"),
            ("gpu_ms", "kernels ms", ".2f"), ("roofline_ms", "roofline ms", ".2f")]  # fmt: skip
    cols += [(f"{k}_ms", f"{k} ms", ".2f") for k in kinds]
    print(f"\n## {args.model}: kernel time by kind (one profiled call)\n")
    print(table(rows, cols))
    path = write_json("hf_layers.json", {"env": env, "args": vars(args), "tflops": rate, "rows": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
