"""The ragged graph fed the mask with cuBLAS branches on rungs of rows against its Triton linears alone and
against the graphs fed host lengths, per CoRa row (HF bert-base, fp16).

    python benchmarks/mask_rungs.py
    python benchmarks/mask_rungs.py --rows MNLI:32 CoLA:64 --reps 30

A mask-only batch whose lengths are never read replays the ragged graph fed the mask (runtime/capture.py,
io="mask"). Only the device knows how many rows the batch fills; the graph's linears are our Triton kernel,
which stops there, and, where CUDA graphs take SWITCH nodes (CUDA 12.8+), also cuBLAS on a few rungs of rows
around the tokens its batches bring, one branch picked on the device (`_Rungs`, runtime/_cuda_if.py). Per row,
one batch: a wrapped model whose shape is trusted for the mask graph, with the branches (`mask_rungs`) and
without (`mask_triton`), and the forced cuBLAS and Triton graphs fed host lengths (`lengths_cublas`,
`lengths_triton`, no read, no plan); each timed per call (CUDA events around one call, synchronised after it,
median of --reps) and back to back (`*_stream`: 20 calls, no sync between them, ms a call). Also the branch the
replay took, the capture's host ms and the bytes the graph's capture added. Prints a table, writes
benchmarks/results/mask_rungs.json.
"""

from __future__ import annotations

import argparse
import copy
import gc
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from autoragged.tuning_db import BatchStats  # noqa: E402

import autoragged  # noqa: E402
from autoragged._costmodel import Arm  # noqa: E402
from autoragged._measure import ArmRunner, time_ms  # noqa: E402
from autoragged._planner import graph_config  # noqa: E402
from autoragged.runtime import core  # noqa: E402
from autoragged.workloads import HF_SHAPES, sample_cora  # noqa: E402
from benchmarks._common import environment, gpu_ms, header, require_cuda, table, write_json  # noqa: E402
from benchmarks.hf_table import batch_of, build  # noqa: E402


def mask_graph(plain, ids, mask, lengths, rungs: bool, reps: int) -> dict:
    """A wrapped copy of `plain`, its (B, L) shape trusted for the mask graph: the calls' times and the graph's."""
    m = autoragged.wrap(copy.deepcopy(plain), db=False, sample_every=0)
    rt = m._autoragged
    rt.mask_rungs = rungs and rt.mask_rungs
    rt.graph_min_seen = 1
    B, L = ids.shape
    arm = Arm("ragged_graph", graph_config(rt.body.head_dim, max(lengths), "triton"))
    rt.mask_shapes[rt._shape_key(B, L)] = core._shape_entry(core._TRUST, arm, {arm.label: 1.0}, sum(lengths))
    fn = lambda: m(input_ids=ids, attention_mask=mask)  # noqa: E731
    out = {"ms": time_ms(fn, ids.device, warmup=3, reps=reps).median_ms, "stream_ms": gpu_ms(fn, 20, 3)}
    graph = next(g for k, g in rt.graphs.graphs.items() if k[0] == "ragged" and k[6] == "mask")
    out.update(capture_ms=graph.capture_ms, graph_mb=graph.nbytes / 2**20)
    if graph.rungs is not None:
        out.update(rungs=list(graph.rungs.rows), branch=int(graph.rungs.taken.item()))
    return out


def bench_row(spec: str, plain, runner, device, reps: int) -> dict:
    name, B = spec.split(":")[0], int(spec.split(":")[1])
    lengths = sample_cora(name, B, np.random.default_rng(sum(map(ord, name)) * 1000 + B))
    ids, mask = batch_of(lengths, plain.config.vocab_size, device, 0, plain.config.pad_token_id or 0)
    row: dict = {"row": spec, "tokens": sum(lengths), "L": ids.shape[1]}
    with torch.inference_mode():
        for rungs in (True, False):
            got = mask_graph(plain, ids, mask, lengths, rungs, reps)
            gc.collect()  # (the wrapped copy and its graphs)
            tag = "mask_rungs" if rungs else "mask_triton"
            row[tag], row[f"{tag}_stream"] = got.pop("ms"), got.pop("stream_ms")
            row.update({f"{tag}_{k}": v for k, v in got.items()})
        stats = BatchStats.from_lengths(tuple(lengths), padded_len=ids.shape[1])
        for backend in ("cublas", "triton"):
            arm = Arm("ragged_graph", graph_config(runner.runtime.body.head_dim, max(lengths), backend))
            call = lambda a=arm: runner.run_call(  # noqa: E731
                a, runner.hf_call({"input_ids": ids, "attention_mask": mask}), tuple(lengths), stats
            )
            row[f"lengths_{backend}"] = time_ms(call, device, warmup=3, reps=reps).median_ms
            row[f"lengths_{backend}_stream"] = gpu_ms(call, 20, 3)
    row["rungs_vs_cublas"] = row["mask_rungs"] / row["lengths_cublas"]
    row["rungs_vs_cublas_stream"] = row["mask_rungs_stream"] / row["lengths_cublas_stream"]
    row["triton_vs_cublas"] = row["mask_triton"] / row["lengths_cublas"]
    row["triton_vs_cublas_stream"] = row["mask_triton_stream"] / row["lengths_cublas_stream"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bert-base", choices=list(HF_SHAPES))
    p.add_argument("--rows", nargs="+", default=["MNLI:32", "CoLA:64", "MRPC:128", "XNLI:128", "Wiki128:128"],
                   help="dataset:batch")  # fmt: skip
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", help="JSON path (default benchmarks/results/mask_rungs.json)")
    args = p.parse_args(argv)
    require_cuda("benchmarks/mask_rungs.py")
    env = environment()
    header(f"{args.model}: the mask graph with cuBLAS rungs (fp16)", env)
    device = torch.device("cuda")
    plain = build(args.model, device)
    runner = ArmRunner(copy.deepcopy(plain))
    rows = []
    for spec in args.rows:
        rows.append(bench_row(spec, plain, runner, device, args.reps))
        r = rows[-1]
        rungs, triton = (
            f"{r[t + '_capture_ms']:.0f} ms, {r[t + '_graph_mb']:.0f} MB" for t in ("mask_rungs", "mask_triton")
        )
        print(f"  {spec}: rungs {r.get('mask_rungs_rungs')}, branch {r.get('mask_rungs_branch')} for {r['tokens']} "
              f"tokens; capture {rungs} (Triton alone {triton})", flush=True)  # fmt: skip
    cols = [("row", "row", ""), ("mask_rungs", "mask, rungs", ".3f"), ("mask_triton", "mask, Triton", ".3f"),
            ("lengths_cublas", "lengths, cuBLAS", ".3f"), ("lengths_triton", "lengths, Triton", ".3f"),
            ("rungs_vs_cublas", "rungs / cuBLAS", ".2f"), ("triton_vs_cublas", "Triton / cuBLAS", ".2f"),
            ("mask_rungs_stream", "rungs b2b", ".3f"), ("lengths_cublas_stream", "cuBLAS b2b", ".3f"),
            ("rungs_vs_cublas_stream", "rungs / cuBLAS b2b", ".2f"),
            ("triton_vs_cublas_stream", "Triton / cuBLAS b2b", ".2f")]  # fmt: skip
    print(f"\n## {args.model}: ms a call, synchronised after each and back to back (b2b)\n")
    print(table(rows, cols))
    path = write_json("mask_rungs.json", {"env": env, "args": vars(args), "rows": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
