"""The dispatcher's own cost per batch: lengths, stats, plan, record (the arms themselves excluded).

    python benchmarks/dispatch_overhead.py            # CPU is fine; the goal is a median under 20 us

The wrapped CoRa encoder's runtime is called directly with its arm execution replaced by a no-op, on
batches of CoRa lengths (new lengths every call, so layouts and stats are fresh; the planner's decision
cache sees the realistic hit rate). Modes: host `lengths=` (also with the model frozen and grad mode on,
as a frozen encoder is called in a training loop without torch.no_grad), a RaggedTensor input, a key padding mask
(on the GPU when there is one: then the cost includes the mask reduction and its one device->host copy),
and a mask of a (B, L) shape the padded side keeps winning, whose lengths are not read (the cost then
includes the deferred stats: one device->host copy into pinned memory and an event, no sync).
Decisions are recorded to a temporary tuning database (the recorder's queue; flushes happen on its
thread). Prints a table and writes benchmarks/results/dispatch_overhead.json.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import autoragged  # noqa: E402
from autoragged import RaggedTensor  # noqa: E402
from autoragged._costmodel import PADDED  # noqa: E402
from autoragged.runtime.core import _shape_entry  # noqa: E402
from autoragged.workloads import CORA, sample_cora  # noqa: E402
from benchmarks._common import environment, header, table, write_json  # noqa: E402


def measure(runtime, module, inputs, calls: int) -> list[float]:
    """Per-call microseconds of the wrapped module's forward (reading the call, then runtime.run) over
    `inputs` (cycled)."""
    times = []
    n = len(inputs)
    for i in range(calls):
        src, kpm, lengths = inputs[i % n]
        t0 = time.perf_counter_ns()
        module.forward(src, None, kpm, None, lengths=lengths)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000, help="timed calls per row (default 20000)")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/dispatch_overhead.json)")
    args = parser.parse_args(argv)
    env = environment()
    header("dispatcher overhead per batch (arms excluded)", env)
    torch.manual_seed(0)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 6, enable_nested_tensor=False).eval().to(dev)
    with tempfile.TemporaryDirectory() as tmp:
        autoragged.wrap(model, db=pathlib.Path(tmp) / "overhead.sqlite", sample_every=0)
        runtime = model._autoragged
        runtime._execute = lambda module, call, arm, *rest: (call.src, None)  # the arms are not what this measures
        pads = {}
        runtime._execute_unread = lambda module, call, arm, *rest: (call.x, pads[call.B], call.L, None, None)
        judge, judge_entry = runtime._judge_shape, runtime._judge_entry

        def trusted_entry(entry, *a):  # the one-behind verdict's work, its outcome kept: the mode stays unread
            streak = entry[0]
            judge_entry(entry, *a)
            entry[0] = streak
            return entry

        rows = []
        rng = np.random.default_rng(0)
        for batch in (32, 128):
            for dataset in ("CoLA", "RACE"):
                L = CORA[dataset].max
                x = torch.zeros(batch, L, 1, device=dev)  # shape only: the arm never reads it
                pads[batch] = torch.zeros(batch, dtype=torch.int32, device=dev)
                draws = [sample_cora(dataset, batch, rng) for _ in range(256)]

                def mask(lens, L=L):
                    return (torch.arange(L)[None, :] >= torch.tensor(lens)[:, None]).to(dev)

                modes = {
                    "lengths=": [(x, None, lens) for lens in draws],
                    "lengths=, frozen, grad mode on": [(x, None, lens) for lens in draws],
                    "RaggedTensor": [(RaggedTensor.from_padded(x, lens), None, None) for lens in draws],
                    f"mask on {dev.type}": [(x, mask(lens), None) for lens in draws],
                    f"mask on {dev.type}, not read": [(x, mask(lens), None) for lens in draws],
                }
                for mode, inputs in modes.items():
                    runtime.mask_shapes.clear()
                    if mode.endswith("not read"):  # the shape is trusted padded: lengths stay on the device
                        runtime._judge_shape, runtime._judge_entry = judge, trusted_entry
                        runtime.mask_shapes[runtime._shape_key(batch, L)] = _shape_entry(10**9, PADDED, {"padded": 1.0})
                    else:  # every mask is read (the shape is never trusted)
                        runtime._judge_shape = lambda *a: _shape_entry()  # (a streak of 0)
                    # a frozen model called without torch.no_grad: the autograd check reads every parameter's flag
                    frozen = "frozen" in mode
                    model.requires_grad_(not frozen)
                    with torch.enable_grad() if frozen else torch.no_grad():
                        measure(runtime, model, inputs, 2000)  # warm: planner, caches
                        us = measure(runtime, model, inputs, args.calls)
                    model.requires_grad_(True)
                    us.sort()
                    rows.append({
                        "batch": batch, "dataset": dataset, "mode": mode,
                        "median_us": statistics.median(us), "p90_us": us[len(us) * 9 // 10],
                        "p99_us": us[len(us) * 99 // 100],
                    })  # fmt: skip
                    print(f"  B={batch} {dataset} {mode}: median {rows[-1]['median_us']:.1f} us", flush=True)
        autoragged.flush()
    print("\n## dispatcher cost per batch, microseconds (arms excluded)\n")
    columns = [("batch", "B", "d"), ("dataset", "lengths", ""), ("mode", "input", ""),
               ("median_us", "median", ".1f"), ("p90_us", "p90", ".1f"), ("p99_us", "p99", ".1f")]  # fmt: skip
    print(table(rows, columns))
    host = max(r["median_us"] for r in rows if not r["mode"].startswith("mask"))
    masked = max(r["median_us"] for r in rows if r["mode"].startswith("mask") and not r["mode"].endswith("read"))
    unread = max(r["median_us"] for r in rows if r["mode"].endswith("not read"))
    print(f"\nworst median with host lengths / RaggedTensor input: {host:.1f} us (goal: under 20 us)")
    print(f"worst median when lengths come from a key padding mask (its reduction and one copy): {masked:.1f} us")
    print(f"worst median of a mask whose lengths are not read (deferred stats): {unread:.1f} us")
    path = write_json("dispatch_overhead.json", {"env": env, "rows": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
