"""Where a wrapped HF encoder's mask call loses time against the same call given lengths=.

    python benchmarks/mask_path.py                                   # bert-base, six CoRa rows
    python benchmarks/mask_path.py --rows RACE:64 MNLI:128 --reps 30

A wrapped model called with the attention mask must read the batch's lengths off the GPU before it can plan
and launch the ragged arm; called with lengths= it plans at once. Per row, both calls are timed (CUDA events
around one call, synchronised after it, median of --reps), and each step of the runtime's path is timed on
the host (perf_counter around the embeddings' launch before the read, which the runtime skips where its graphs
run the embeddings themselves, the mask read, the plan and the arm) with a CUDA event
at the arm's start: `gpu_to_arm_ms` is the GPU time from the call's start to the arm's first work, what the
mask path adds before the arm runs. Steps are medians over the timed calls. The forced cuBLAS ragged graph
given host lengths (no read, no plan) is the floor. Prints a table, writes benchmarks/results/mask_path.json.
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

import autoragged  # noqa: E402
from autoragged._costmodel import Arm  # noqa: E402
from autoragged._measure import ArmRunner  # noqa: E402
from autoragged._planner import graph_config  # noqa: E402
from autoragged.adapters._hf import HFCall  # noqa: E402
from autoragged.runtime.core import Runtime  # noqa: E402
from autoragged.workloads import HF_SHAPES, sample_cora  # noqa: E402
from benchmarks._common import environment, header, require_cuda, table, what_ran, write_json  # noqa: E402
from benchmarks.hf_table import batch_of, build  # noqa: E402

STEPS = {"prefetch": (HFCall, "prefetch"), "read": (Runtime, "_lengths"), "plan": (Runtime, "_plan"),
         "arm": (Runtime, "_execute")}  # fmt: skip


class Steps:
    """Host ms of each step of the runtime's path in the calls made while `on`, and the CUDA event the arm
    starts at (the wrappers cost a few microseconds each; the totals are timed with them in place)."""

    def __init__(self):
        self.on, self.host, self.arm_event = False, {k: [] for k in STEPS}, None
        self.saved = {}
        for name, (cls, attr) in STEPS.items():
            self.saved[name] = (cls, attr, getattr(cls, attr))
            setattr(cls, attr, self._wrap(name, getattr(cls, attr)))

    def _wrap(self, name, fn):
        def timed(*a, **k):
            if not self.on:
                return fn(*a, **k)
            if name == "arm":
                self.arm_event = torch.cuda.Event(enable_timing=True)
                self.arm_event.record()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            self.host[name].append((time.perf_counter() - t0) * 1e3)
            return out

        return timed

    def restore(self):
        for cls, attr, fn in self.saved.values():
            setattr(cls, attr, fn)

    def timed_calls(self, fn, reps: int) -> dict:
        """Latency, host time of the call and of each step, GPU ms to the arm's start: medians."""
        for v in self.host.values():
            v.clear()
        lat, host, to_arm = [], [], []
        for _ in range(reps):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.on, self.arm_event = True, None
            start.record()
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e3)
            end.record()
            self.on = False
            end.synchronize()
            lat.append(start.elapsed_time(end))
            if self.arm_event is not None:
                to_arm.append(start.elapsed_time(self.arm_event))
        out = {"ms": statistics.median(lat), "host_ms": statistics.median(host)}
        out["gpu_to_arm_ms"] = statistics.median(to_arm) if to_arm else None
        out.update({f"{k}_ms": statistics.median(v) if v else 0.0 for k, v in self.host.items()})
        return out


def calls_of(spec: str, plain, auto, runner, device) -> dict:
    """{"mask": the wrapped call with the mask, "lengths": with lengths=, "graph": the forced cuBLAS graph}."""
    dataset, batch = spec.split(":")
    lengths = sample_cora(dataset, int(batch), np.random.default_rng(0))
    ids, mask = batch_of(lengths, plain.config.vocab_size, device, 0, plain.config.pad_token_id or 0)
    stats = BatchStats.from_lengths(tuple(lengths), padded_len=ids.shape[1])
    arm = Arm("ragged_graph", graph_config(runner.runtime.body.head_dim, max(lengths), "cublas"))
    return {
        "mask": lambda: auto(input_ids=ids, attention_mask=mask),
        "lengths": lambda: auto(input_ids=ids, lengths=lengths),
        "graph": lambda: runner.run_call(
            arm, runner.hf_call({"input_ids": ids, "attention_mask": mask}), tuple(lengths), stats
        ),  # fmt: skip
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bert-base", choices=list(HF_SHAPES))
    p.add_argument("--rows", nargs="+", default=["RACE:32", "RACE:64", "MNLI:128", "XNLI:128", "MRPC:128", "CoLA:64"],
                   help="dataset:batch")  # fmt: skip
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", help="JSON path (default benchmarks/results/mask_path.json)")
    args = p.parse_args(argv)
    require_cuda("benchmarks/mask_path.py")
    env = environment()
    header(f"Where {args.model}'s mask call loses time against lengths= (fp16)", env)
    device = torch.device("cuda")
    plain = build(args.model, device)
    auto = autoragged.wrap(copy.deepcopy(plain), db=False)
    runner = ArmRunner(copy.deepcopy(plain))
    steps = Steps()
    rows = []
    try:
        with torch.inference_mode():
            for spec in args.rows:
                for mode, fn in calls_of(spec, plain, auto, runner, device).items():
                    for _ in range(5):
                        fn()
                    row = {"row": spec, "mode": mode, **steps.timed_calls(fn, args.reps)}
                    if mode != "graph":
                        row["ran"] = what_ran(auto, args.reps)
                    rows.append(row)
                    shown = " ".join(f"{k}={v:.3f}" for k, v in row.items() if isinstance(v, float))
                    print(f"  {spec} {mode}: {shown} {row.get('ran', '')}", flush=True)
    finally:
        steps.restore()
    cols = [("row", "row", ""), ("mode", "call", ""), ("ms", "latency ms", ".3f"), ("host_ms", "host ms", ".3f"),
            ("gpu_to_arm_ms", "GPU to arm ms", ".3f"), ("prefetch_ms", "embeddings", ".3f"),
            ("read_ms", "read", ".3f"), ("plan_ms", "plan", ".3f"), ("arm_ms", "arm host", ".3f")]  # fmt: skip
    print(f"\n## {args.model}: the mask call against lengths= and the forced cuBLAS graph (medians, ms)\n")
    print(table(rows, cols))
    path = write_json("mask_path.json", {"env": env, "args": vars(args), "rows": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
