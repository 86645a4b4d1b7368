"""Where a decoder prefill's time goes: one token-budget bin through a wrapped Qwen2.5 shape, our fused layer
kernels against the model's own layer modules (both with our attention), GPU kernel time by kind.

    python benchmarks/diagnostics/llm_layers.py              # Qwen2.5-7B shape, 8 layers, a 14,745-token bin
    python benchmarks/diagnostics/llm_layers.py --model qwen2.5-0.5b --layers 24

The bin: documents of the bimodal mix (autoragged.workloads.sample_documents) packed first-fit up to --tokens,
run as `autoragged.packing.run_job(wrapped, docs, output="last_logits")` in one bin. Per layer code: the
wall time of the bin (median of --reps, synchronised), and a torch.profiler pass summing CUDA kernel time into
kinds (GEMM, attention, norm, rotary, activation, elementwise, other). Prints a table.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import autoragged  # noqa: E402
from autoragged.models import hf_decoder  # noqa: E402
from autoragged.packing import run_job  # noqa: E402
from autoragged.workloads import sample_documents  # noqa: E402
from benchmarks._common import header, require_cuda, table  # noqa: E402
from benchmarks.diagnostics.hf_layers import profile_kernels  # noqa: E402
from benchmarks.llm_table import build  # noqa: E402

KINDS = [
    ("gemm", ("gemm", "cutlass", "cublas", "sm90_xmma", "nvjet")),
    ("attention", ("_ragged_attn",)),
    ("norm", ("_add_rms_norm", "mean", "rsqrt", "pow")),
    ("rotary", ("_rotary", "cat")),
    ("activation", ("_silu_mul", "silu")),
]


def bin_documents(tokens: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    docs, total = [], 0
    for k in sample_documents("bimodal", 400, rng):
        if total + k <= tokens:
            docs.append(rng.integers(100, vocab, size=k).tolist())
            total += k
    return docs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["qwen2.5-7b", "qwen2.5-0.5b"], default="qwen2.5-7b")
    p.add_argument("--layers", type=int, default=8, help="layers of the shape to build (default 8)")
    p.add_argument("--tokens", type=int, default=14745, help="the bin's token budget (default 14,745)")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    device = require_cuda("benchmarks/diagnostics/llm_layers.py")
    header(f"One bin of {args.model} ({args.layers} layers): fused layer kernels against the modules")
    model = build(args.model, args.layers, device, smoke=False)
    wrapped = autoragged.wrap(model, db=False, policy="ragged")
    docs = bin_documents(args.tokens, model.config.vocab_size)
    tokens = sum(map(len, docs))

    def once():
        return list(run_job(wrapped, docs, output="last_logits", max_tokens=args.tokens, progress=False))

    rows, outputs = [], {}
    with torch.inference_mode():
        for code, fused in (("fused", True), ("modules", False)):
            hf_decoder.FUSED_LAYERS = fused
            once()
            times = []
            for _ in range(args.reps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                outputs[code] = once()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            _, by_kind, _ = profile_kernels(once, KINDS)
            ms = statistics.median(times) * 1e3
            row = {"code": code, "tokens": tokens, "ms": ms, "ms_per_layer": ms / args.layers,
                   "tok_s": tokens / (ms / 1e3), **{f"{k}_ms": v for k, v in by_kind.items()}}  # fmt: skip
            rows.append(row)
            print(f"  {code}: {ms:.1f} ms, kernels by kind { ({k: round(v, 1) for k, v in by_kind.items()}) }")
    hf_decoder.FUSED_LAYERS = True
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(outputs["fused"], outputs["modules"]))
    kinds = [k for k, _ in KINDS] + ["elementwise", "other"]
    print(f"\n## one bin of {tokens} tokens, {len(docs)} documents; max |logit diff| fused vs modules {diff:.3g}\n")
    cols = [
        ("code", "layers", ""),
        ("ms", "bin ms", ".1f"),
        ("ms_per_layer", "ms/layer", ".2f"),
        ("tok_s", "tok/s", ",.0f"),
    ]
    cols += [(f"{k}_ms", f"{k} ms", ".1f") for k in kinds]
    print(table(rows, cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
