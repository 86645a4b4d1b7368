"""The first calls of a fresh wrapped HF encoder, one by one: what each call ran and what it cost.

    python benchmarks/diagnostics/first_calls.py                        # bert-base, CoLA B=32, 30 calls of one batch
    python benchmarks/diagnostics/first_calls.py --dataset Wiki128 --new   # 30 new batches of the row instead

The tables of record time passes of 16 batches; here every call of a fresh `autoragged.wrap(model, db=False)` is
timed alone (synchronised before and after: its latency) next to its decision (arm, reason, measured ms where the
runtime timed it) and the graphs then captured and pending (`autoragged.graph_stats`): which call paid what.
Prints a table.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import autoragged  # noqa: E402
from autoragged.workloads import CORA, sample_cora  # noqa: E402
from benchmarks._common import header, require_cuda, table  # noqa: E402
from benchmarks.hf_table import SHAPES, build, token_batch  # noqa: E402


def call_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def graphs(model) -> tuple[int, int]:
    """(captures, pending captures) over the wrapped modules."""
    stats = autoragged.graph_stats(model).values()
    return sum(s.captures for s in stats), sum(s.pending for s in stats)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bert-base", choices=list(SHAPES))
    p.add_argument("--dataset", default="CoLA", choices=list(CORA))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--new", action="store_true", help="a new batch of the row for every call (else one batch)")
    args = p.parse_args(argv)
    device = require_cuda("benchmarks/diagnostics/first_calls.py")
    header(f"First calls: {args.model} {args.dataset} B={args.batch}, {'new batches' if args.new else 'one batch'}")
    rng, g = np.random.default_rng(0), torch.Generator().manual_seed(0)
    model = autoragged.wrap(build(args.model, device, smoke=False), db=False)
    made = [token_batch(sample_cora(args.dataset, args.batch, rng), g, model.config.vocab_size, device)
            for _ in range(args.calls if args.new else 1)]  # fmt: skip
    rows = []
    with torch.inference_mode():
        for i in range(args.calls):
            b = made[i % len(made)]
            ms = call_ms(lambda b=b: model(input_ids=b.ids, attention_mask=b.mask))
            d = autoragged.recent_decisions(model, 1)[-1]
            captures, pending = graphs(model)
            rows.append({"call": i + 1, "ms": ms, "arm": d.arm, "measured": d.measured_ms, "captures": captures,
                         "pending": pending, "reason": d.reason[:90]})  # fmt: skip
    cols = [("call", "call", "d"), ("ms", "ms", ".3f"), ("arm", "arm", ""), ("measured", "measured", ".3f"),
            ("captures", "captures", "d"), ("pending", "pending", "d"), ("reason", "reason", "")]  # fmt: skip
    print(table(rows, cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
