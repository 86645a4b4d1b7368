"""What each batch of the serving protocol ran: per row and pass, ms per batch, the arms, the reasons, the graph
cache, and the Triton compiles each thread ran meanwhile (a diagnostic beside benchmarks/hf_table.py; prints only).

    python benchmarks/diagnostics/serving_trace.py --datasets CoLA MNLI --batch-sizes 32 128
    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/diagnostics/serving_trace.py --all   # first sight, cold cache

Unlike hf_table.py, nothing but the wrapped model runs in the process: HF's own forward meets each padded shape
first when the policy tries the padded arm, as in a user's process.
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import TIMED, pass_ms, row_batches, sync  # noqa: E402
from hf_table import build, token_batch  # noqa: E402

import autoragged  # noqa: E402
from autoragged.workloads import CORA  # noqa: E402


class Compiles:
    """Triton compiles per thread (count, seconds) since the last `take`: Triton's kernels bind `triton.compiler.
    compile` at their first launch, so it is wrapped before any runs. A compile found in Triton's cache is a load."""

    def __init__(self):
        import triton.compiler

        self.seen: collections.Counter = collections.Counter()
        self.seconds: collections.Counter = collections.Counter()
        original = triton.compiler.compile

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                name = threading.current_thread().name
                self.seen[name] += 1
                self.seconds[name] += time.perf_counter() - t0

        triton.compiler.compile = timed

    def take(self) -> str:
        out = ", ".join(f"{name} {n} ({self.seconds[name]:.1f} s)" for name, n in self.seen.items())
        self.seen.clear()
        self.seconds.clear()
        return out or "none"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=["RACE", "MNLI", "CoLA"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[32, 128])
    parser.add_argument("--model", default="bert-base")
    parser.add_argument("--warmup", action="store_true", help="autoragged.warmup on each dataset's lengths first")
    parser.add_argument("--all", action="store_true", help="the 24 CoRa rows in hf_table.py's order")
    args = parser.parse_args(argv)
    if args.all:
        args.datasets, args.batch_sizes = list(CORA), [32, 64, 128]
    device = torch.device("cuda")
    compiles = Compiles()
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
                show(model, len(warm), "warm", compiles)
                for name in ("pass1", "pass2"):
                    ms = pass_ms(run, timed, device)
                    print(f"  {name}: {ms:.3f} ms/batch")
                    show(model, TIMED, name, compiles)
    return 0


def show(model, n: int, label: str, compiles: Compiles) -> None:
    decisions = autoragged.recent_decisions(model, n)
    arms = collections.Counter(d.arm for d in decisions)
    reasons = collections.Counter(d.reason[:90] for d in decisions)
    (g,) = autoragged.graph_stats(model).values()
    print(f"    {label} arms {dict(arms)}; graphs {g.graphs} captures {g.captures} ({g.capture_ms:.0f} ms) "
          f"pending {g.pending} failed {g.failed}; compiles: {compiles.take()}")  # fmt: skip
    for reason, count in reasons.most_common(4):
        print(f"      {count:3d} x {reason}")


if __name__ == "__main__":
    raise SystemExit(main())
