"""Where a wrapped HF encoder's mask call (the ragged graph fed the mask) loses time against the forced cuBLAS graph
fed host lengths: latency, GPU time, and the kernels of one call of each.

    python benchmarks/mask_gap.py                                   # bert-base, five CoRa rows
    python benchmarks/mask_gap.py --rows CoLA:64 MNLI:64 --calls 12

Per row, a fresh wrapped model is called `--calls` times with the batch's attention mask (so its shape is trusted
and the mask graph captured, as in a latency table), then four calls are timed: the forced cuBLAS ragged graph and
the forced Triton one (both fed host lengths, no read, no plan), the wrapped model with the mask, and with
lengths=. Columns per call:

  *_lat     latency of one call (CUDA events, synchronised after it; median of 15)
  *_b2b     ms per call queued back to back (the GPU's time where the host keeps ahead of it)
  *_host    host ms per call of 30 calls queued back to back (the clock stops before the sync)
  *_prof    one call under torch.profiler: its kernels' GPU ms, by kind and the longest ones

`auto_ran` says what the wrapped model's calls ran. Prints a table and writes benchmarks/results/mask_gap.json.
(The first two stored runs, `mask_gap_h100.json` and `mask_gap_branch_rows_h100.json`, came from this script
as a scratch probe: the same measurements, the rows without the env header.)
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from autoragged.tuning_db import BatchStats  # noqa: E402

import autoragged  # noqa: E402
from autoragged._costmodel import Arm  # noqa: E402
from autoragged._measure import ArmRunner, time_ms  # noqa: E402
from autoragged._planner import graph_config  # noqa: E402
from autoragged.workloads import HF_SHAPES, sample_cora  # noqa: E402
from benchmarks import _common as common  # noqa: E402
from benchmarks.hf_table import batch_of, build  # noqa: E402

KINDS = [
    ("gemm", ("gemm", "sm90", "cutlass", "nvjet", "ragged_linear", "_linear")),
    ("attn", ("attention", "attn")),
    ("norm", ("layer_norm", "norm")),
    ("pack", ("pack", "layout", "gather", "scatter", "embed", "index")),
]


def measure(spec: str, plain, runner, device, calls: int) -> dict:
    dataset, batch = spec.split(":")
    auto = autoragged.wrap(copy.deepcopy(plain), db=False)
    lengths = sample_cora(dataset, int(batch), np.random.default_rng(sum(map(ord, dataset)) * 1000 + int(batch)))
    ids, mask = batch_of(lengths, plain.config.vocab_size, device, 0, plain.config.pad_token_id or 0)
    stats = BatchStats.from_lengths(tuple(lengths), padded_len=ids.shape[1])
    head_dim = runner.runtime.body.head_dim
    fns = {}
    for col, backend in (("graph_cublas", "cublas"), ("graph_triton", "triton")):
        arm = Arm("ragged_graph", graph_config(head_dim, max(lengths), backend))
        fns[col] = lambda a=arm: runner.run_call(  # noqa: E731
            a, runner.hf_call({"input_ids": ids, "attention_mask": mask}), tuple(lengths), stats
        )
    fns["auto_mask"] = lambda: auto(input_ids=ids, attention_mask=mask)
    fns["auto_len"] = lambda: auto(input_ids=ids, lengths=lengths)
    row = {"row": spec, "tokens": int(sum(lengths)), "L": int(ids.shape[1])}
    for key in ("graph_cublas", "graph_triton", "auto_mask"):
        for _ in range(calls):
            fns[key]()
    row["auto_ran"] = common.what_ran(auto, calls)
    for key, fn in fns.items():
        row[f"{key}_lat"] = time_ms(fn, device, warmup=3, reps=15).median_ms
        t0 = time.perf_counter()
        for _ in range(30):
            fn()
        row[f"{key}_host"] = (time.perf_counter() - t0) * 1e3 / 30
        torch.cuda.synchronize()
        row[f"{key}_b2b"] = common.gpu_ms(fn, n=40, warmup=3)
    for key in ("graph_cublas", "auto_mask"):
        total, by_kind, top = common.profile_kernels(fns[key], KINDS)
        row[f"{key}_prof"] = {"total": total, "by": by_kind, "top": top}
        row[f"{key}_gpu"] = total
    row["auto_ran_after"] = common.what_ran(auto, 20)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bert-base", choices=list(HF_SHAPES))
    p.add_argument("--rows", nargs="+", default=["RACE:32", "Wiki512:32", "MNLI:64", "CoLA:64", "MRPC:32"],
                   help="dataset:batch")  # fmt: skip
    p.add_argument("--calls", type=int, default=12, help="mask calls before the timing (default 12)")
    p.add_argument("--out", help="JSON path (default benchmarks/results/mask_gap.json)")
    args = p.parse_args(argv)
    common.require_cuda("benchmarks/mask_gap.py")
    env = common.environment()
    common.header(f"{args.model}: the mask call against the forced cuBLAS graph (fp16)", env)
    device = torch.device("cuda")
    plain = build(args.model, device)
    runner = ArmRunner(copy.deepcopy(plain))
    rows = []
    with torch.inference_mode():
        for spec in args.rows:
            row = measure(spec, plain, runner, device, args.calls)
            rows.append(row)
            print(f"  {spec}: auto ran {row['auto_ran']}", flush=True)
            for key in ("graph_cublas", "auto_mask"):
                prof = row[f"{key}_prof"]
                kinds = " ".join(f"{k}={v:.3f}" for k, v in prof["by"].items())
                print(f"    {key}: {prof['total']:.3f} ms of kernels ({kinds})")
                for name, ms, launches in prof["top"][:6]:
                    print(f"      {ms:7.3f} ms {launches:3d}x {name[:80]}")
    cols = [("row", "row", ""), ("graph_cublas_lat", "cuBLAS graph ms", ".3f"), ("auto_mask_lat", "mask ms", ".3f"),
            ("graph_cublas_b2b", "cuBLAS b2b", ".3f"), ("auto_mask_b2b", "mask b2b", ".3f"),
            ("graph_cublas_gpu", "cuBLAS kernels", ".3f"), ("auto_mask_gpu", "mask kernels", ".3f"),
            ("graph_cublas_host", "cuBLAS host", ".3f"), ("auto_mask_host", "mask host", ".3f")]  # fmt: skip
    print(f"\n## {args.model}: the mask call against the forced cuBLAS graph (ms)\n")
    print(common.table(rows, cols))
    path = common.write_json("mask_gap.json", {"env": env, "args": vars(args), "rows": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
