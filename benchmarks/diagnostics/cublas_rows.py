"""cuBLAS's first call on a new row count: why the eager ragged arm runs its linears on a rung of rows.

    python benchmarks/diagnostics/cublas_rows.py

A stream of new batches brings a new token count every batch. For each linear shape of bert-base and the CoRa
encoder (fp16), the host time of one `F.linear` (and of the fused relu epilogue the eager arm uses,
`torch._addmm_activation`) on 40 row counts drawn from 300-16,000: the first call on each count, the same
counts again, and the counts rounded to the eager arm's rungs (`autoragged.planning.buckets.cublas_rows`) once each
rung has been seen. Each call is timed alone between synchronisations (host time to return). Prints a table.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from autoragged.planning.buckets import cublas_rows  # noqa: E402
from benchmarks._common import header, require_cuda, table  # noqa: E402

SHAPES = {  # (N, K): bert-base qkv, out, ff1, ff2; CoRa encoder out, ff1, ff2
    "bert qkv": (2304, 768), "bert out": (768, 768), "bert ff1": (3072, 768), "bert ff2": (768, 3072),
    "cora out": (512, 512), "cora ff1": (2048, 512), "cora ff2": (512, 2048),
}  # fmt: skip


def host_us(fn, counts) -> list[float]:
    out = []
    for m in counts:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(m)
        out.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--counts", type=int, default=40, help="row counts per shape (default 40)")
    args = p.parse_args(argv)
    require_cuda("benchmarks/diagnostics/cublas_rows.py")
    header("cuBLAS first calls on new row counts (fp16)")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rng = random.Random(0)
    x = torch.randn(16384, 3072, device=dev, dtype=torch.float16)
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.float16)
        b = torch.randn(n, device=dev, dtype=torch.float16)
        for op in ("linear", "addmm_relu"):
            if op == "linear":
                fn = lambda m, w=w, b=b, k=k: F.linear(x[:m, :k], w, b)  # noqa: E731
            else:
                fn = lambda m, w=w, b=b, k=k: torch._addmm_activation(b, x[:m, :k], w.t())  # noqa: E731
            fn(4096)  # the shape's handle and workspace, on a count not drawn below
            counts = rng.sample(range(300, 16000), args.counts)
            first = host_us(fn, counts)
            again = host_us(fn, counts)
            rungs = [cublas_rows(m) for m in rng.sample(range(300, 16000), args.counts)]
            host_us(fn, sorted(set(rungs)))  # each rung once: what warm-up or the graph captures pay
            on_rungs = host_us(fn, rungs)
            rows.append({
                "shape": name, "n": n, "k": k, "op": op,
                "first_median_us": statistics.median(first), "first_max_us": max(first),
                "again_median_us": statistics.median(again), "again_max_us": max(again),
                "rungs_median_us": statistics.median(on_rungs), "rungs_max_us": max(on_rungs),
                "distinct_rungs": len(set(rungs)),
            })  # fmt: skip
    cols = [("shape", "shape", ""), ("op", "op", ""), ("first_median_us", "new count, median us", ".0f"),
            ("first_max_us", "max", ".0f"), ("again_median_us", "seen count, median us", ".0f"),
            ("rungs_median_us", "on rungs, median us", ".0f"), ("rungs_max_us", "max", ".0f")]  # fmt: skip
    print(table(rows, cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
