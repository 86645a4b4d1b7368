"""What each batch of the serving protocol ran: per row and pass, ms per batch, the arms, the reasons and the graph
cache (a diagnostic beside benchmarks/hf_table.py; prints only).

    python benchmarks/diagnostics/serving_trace.py --datasets CoLA MNLI --batch-sizes 32 128
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import TIMED, pass_ms, row_batches, sync  # noqa: E402
from hf_table import build, token_batch  # noqa: E402

import autoragged  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=["RACE", "MNLI", "CoLA"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[32, 128])
    parser.add_argument("--model", default="bert-base")
    parser.add_argument("--warmup", action="store_true", help="autoragged.warmup on each dataset's lengths first")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    model = autoragged.wrap(build(args.model, device, False), db=False)
    if args.warmup:
        import numpy as np

        from autoragged.workloads import sample_cora

        rng = np.random.default_rng(12345)
        t0 = time.perf_counter()
        for d in args.datasets:
            autoragged.warmup(model, sample_cora(d, 800, rng), batch_sizes=args.batch_sizes, progress=False)
        print(f"warmup {time.perf_counter() - t0:.1f} s")
    with torch.inference_mode():
        for dataset in args.datasets:
            for b in args.batch_sizes:
                warm, timed = row_batches(dataset, b, token_batch, model.config.vocab_size, device)
                run = lambda x: model(input_ids=x.ids, attention_mask=x.mask)  # noqa: E731
                sync(device)
                t0 = time.perf_counter()
                for x in warm:
                    run(x)
                sync(device)
                print(f"{dataset} B={b}: warm-up {(time.perf_counter() - t0) * 1e3 / len(warm):.2f} ms/batch; "
                      f"widths {sorted({x.ids.shape[1] for x in timed})}")  # fmt: skip
                show(model, len(warm), "warm")
                for name in ("pass1", "pass2"):
                    ms = pass_ms(run, timed, device)
                    print(f"  {name}: {ms:.3f} ms/batch")
                    show(model, TIMED, name)
    return 0


def show(model, n: int, label: str) -> None:
    decisions = autoragged.recent_decisions(model, n)
    arms = collections.Counter(d.arm for d in decisions)
    reasons = collections.Counter(d.reason[:90] for d in decisions)
    (g,) = autoragged.graph_stats(model).values()
    print(f"    {label} arms {dict(arms)}; graphs {g.graphs} captures {g.captures} ({g.capture_ms:.0f} ms) "
          f"pending {g.pending} failed {g.failed}")  # fmt: skip
    for reason, count in reasons.most_common(4):
        print(f"      {count:3d} x {reason}")


if __name__ == "__main__":
    raise SystemExit(main())
