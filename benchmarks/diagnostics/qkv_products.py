"""Three q/k/v products against one: what laying a layer's q, k and v weights out in one buffer buys.

    python benchmarks/diagnostics/qkv_products.py                 # d_model 768 (bert-base) and 384 (MiniLM)
    python benchmarks/diagnostics/qkv_products.py --d-model 1024 --rows 512 4096

Per row count M: one layer's three (M, D) x (D, D) cuBLAS products with bias (HF's query, key, value), against
one (M, D) x (D, 3 D) product (autoragged/adapters/_qkv.py), each captured 10 times in a CUDA graph and
replayed (benchmarks/diagnostics/linear_tiles.py `graph_ms`); microseconds per layer, the median replay's.
Prints a table.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks._common import header, require_cuda, table  # noqa: E402
from benchmarks.diagnostics.linear_tiles import graph_ms  # noqa: E402

ROWS = (416, 897, 1409, 1900, 2945, 4500, 8000, 12000, 24000, 46000)  # CoRa batches' packed rows, bert-base


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", nargs="+", type=int, default=[768, 384])
    p.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    args = p.parse_args(argv)
    require_cuda("benchmarks/diagnostics/qkv_products.py")
    header("q/k/v: three cuBLAS products against one, in a CUDA graph (fp16)")
    dev = torch.device("cuda")
    rows = []
    for D in args.d_model:
        g = torch.Generator(device=dev).manual_seed(0)
        ws = [torch.randn(D, D, device=dev, dtype=torch.float16, generator=g) / D**0.5 for _ in range(3)]
        bs = [torch.randn(D, device=dev, dtype=torch.float16, generator=g) for _ in range(3)]
        W, b = torch.cat(ws), torch.cat(bs)
        for M in args.rows:
            x = torch.randn(M, D, device=dev, dtype=torch.float16, generator=g)
            three = 1e3 * graph_ms(lambda x=x, ws=ws, bs=bs: [F.linear(x, w, c) for w, c in zip(ws, bs)])
            one = 1e3 * graph_ms(lambda x=x, W=W, b=b: F.linear(x, W, b))
            rows.append({"d_model": D, "rows": M, "three_us": three, "one_us": one, "one_over_three": one / three})
            print(f"  D={D} M={M:6d}: three {three:7.1f} us, one {one:7.1f} us ({one / three:.2f}x)", flush=True)
    cols = [("d_model", "D", "d"), ("rows", "rows", "d"), ("three_us", "three products, us", ".1f"),
            ("one_us", "one product, us", ".1f"), ("one_over_three", "one / three", ".2f")]  # fmt: skip
    print("\n" + table(rows, cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
