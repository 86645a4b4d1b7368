"""What the runtime's own bookkeeping costs a short batch, and what its sampled timings look like.

    python benchmarks/sampling.py --db <tuning database>
    python benchmarks/sampling.py --db DB --datasets CoLA --calls 128

The same CoRa encoder is wrapped five ways, and each is called on the same short batches (two batches per
dataset at B=32, the CoRa Beta recipe) with `lengths=` and with the mask alone:

  nodb_nosample      db=False, sample_every=0: the analytic prior, nothing recorded, nothing timed
  nodb_sample32      db=False, sample_every=32: the prior, corrected by sampled timings and exploration
  db_nosample        the tuning database's cost model; decisions recorded; nothing timed
  db_sample32        the default: the cost model, recorded, every 32nd batch timed, exploration on
  db_sample32_noexplore   the same without exploration

Each cell is the latency of `--calls` synchronised calls (CUDA events around the call; median, p10, p90)
after 8 warm-up calls, the host time of the call alone, and which arms ran. After the runs it lists the
samples each sampling planner holds per bucket: the timings its decisions rest on.
Prints a table and writes benchmarks/results/sampling.json.
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

import autoragged  # noqa: E402
from autoragged.workloads import sample_cora  # noqa: E402
from benchmarks._common import environment, header, require_cuda, table, write_json  # noqa: E402
from benchmarks.cora_table import build_model  # noqa: E402

VARIANTS = {
    "nodb_nosample": dict(db=False, sample_every=0),
    "nodb_sample32": dict(db=False, sample_every=32),
    "db_nosample": dict(sample_every=0),
    "db_sample32": dict(sample_every=32),
    "db_sample32_noexplore": dict(sample_every=32, explore=False),
}


def batch_of(name: str, B: int, k: int, device):
    """The k-th batch of a (dataset, B) row, drawn as cora_table.py draws its rows."""
    rng = np.random.default_rng(sum(map(ord, name)) * 1000 + B)
    for _ in range(k + 1):
        lengths = sample_cora(name, B, rng)
    L = max(lengths)
    torch.manual_seed(k)
    x = torch.randn(B, L, 512, device=device, dtype=torch.float16)
    mask = torch.arange(L, device=device)[None, :] >= torch.tensor(lengths, device=device)[:, None]
    return lengths, x, mask


def cell(model, x: torch.Tensor, kwargs: dict, calls: int) -> dict:
    """Latency and host time of `calls` synchronised calls model(x, **kwargs), and the arms that ran."""

    def fn():
        return model(x, **kwargs)

    for _ in range(8):
        fn()
    torch.cuda.synchronize()
    latency, host = [], []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        end.record()
        end.synchronize()
        latency.append(start.elapsed_time(end))
    arms: dict[str, int] = {}
    for d in autoragged.recent_decisions(model, calls):
        arms[d.arm] = arms.get(d.arm, 0) + 1
    return {
        "median_ms": float(np.median(latency)), "p10_ms": float(np.quantile(latency, 0.1)),
        "p90_ms": float(np.quantile(latency, 0.9)), "host_us": float(np.median(host)),
        "host_p90_us": float(np.quantile(host, 0.9)), "arms": arms,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--db", required=True, help="a tuning database calibrated on this GPU (it is written to)")
    p.add_argument("--datasets", nargs="+", default=["MRPC", "MNLI", "CoLA"])
    p.add_argument("--calls", type=int, default=64, help="timed calls per cell (default 64)")
    p.add_argument("--out", help="JSON path (default benchmarks/results/sampling.json)")
    args = p.parse_args(argv)
    require_cuda("benchmarks/sampling.py")
    env = environment()
    header("the runtime's bookkeeping on short batches (CoRa encoder, fp16, B=32)", env)
    device = torch.device("cuda", torch.cuda.current_device())
    plain = build_model(device)
    models = {
        name: autoragged.wrap(copy.deepcopy(plain), policy="auto", **{"db": args.db, **kw})
        for name, kw in VARIANTS.items()
    }
    rows = []
    with torch.inference_mode():
        for name in args.datasets:
            for k in range(2):
                lengths, x, mask = batch_of(name, 32, k, device)
                for call in ("lengths", "mask"):
                    kwargs = {"lengths": lengths} if call == "lengths" else {"src_key_padding_mask": mask}
                    for variant, m in models.items():
                        row = {"dataset": name, "batch": k, "call": call, "variant": variant,
                               **cell(m, x, kwargs, args.calls)}  # fmt: skip
                        row["ran"] = ", ".join(f"{a} {n}" for a, n in sorted(row["arms"].items(), key=lambda a: -a[1]))
                        rows.append(row)
                        print(f"  {name} b{k} {call:7s} {variant:22s} {row['median_ms']:.3f} ms, "
                              f"host {row['host_us']:.0f} us, {row['ran']}", flush=True)  # fmt: skip
    samples = {}
    for variant, m in models.items():
        for planner in m._autoragged.planners.values():
            for key, arms in planner._measured.items():
                samples[f"{variant} {key}"] = {label: [round(v, 3) for v in s] for label, s in arms.items()}
    cols = [("dataset", "dataset", ""), ("batch", "batch", "d"), ("call", "call", ""), ("variant", "wrapped", ""),
            ("median_ms", "ms", ".3f"), ("p10_ms", "p10", ".3f"), ("p90_ms", "p90", ".3f"),
            ("host_us", "host us", ".0f"), ("ran", "arms that ran", "")]  # fmt: skip
    print("\n## latency of synchronised calls, by how the encoder is wrapped\n")
    print(table(rows, cols))
    print("\n## sampled timings the planners hold (ms, per bucket and arm)\n")
    for key, arms in samples.items():
        print(f"  {key}: {arms}")
    path = write_json("sampling.json", {"env": env, "args": vars(args), "rows": rows, "samples": samples}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
