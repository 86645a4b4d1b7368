"""GPU time of the cuBLAS ragged graph at its bucket's rung of rows against one row more, and which one the
runtime's capture-time choice (`autoragged.runtime.graphs.replay_ms` on replays with no batch loaded) keeps.

    python benchmarks/graph_rows.py

cuBLAS picks its GEMM kernel per problem shape, and some row counts get slower kernels than their
neighbours. For each encoder and batch size the script captures the ragged graph of the batch's bucket at
both row counts, times each on the batch itself (GPU time of back-to-back replays, the median of three
interleaved rounds), and compares with the choice the runtime would make from replays with no batch.
Prints a table and writes benchmarks/results/graph_rows.json.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from autoragged.tuning_db import BatchStats, ModuleSignature  # noqa: E402

from autoragged._buckets import ragged_bucket  # noqa: E402
from autoragged._measure import ArmRunner, build_encoder, make_batch  # noqa: E402
from autoragged._planner import graph_config  # noqa: E402
from autoragged.runtime.graphs import _ROW_MARGIN, _RaggedGraph, replay_ms  # noqa: E402
from benchmarks._common import environment, header, require_cuda, table, write_json  # noqa: E402
from benchmarks.short_rows import gpu_ms  # noqa: E402

PLAN = {
    "encoder:6x512/8h/ff2048:relu:post:float16:nested": (600, 1500, 3000, 6000, 12000, 24000, 45000),
    "encoder:12x768/12h/ff3072:gelu:post:float16:nested": (600, 1500, 3000, 6000, 12000, 24000),
    "encoder:24x1024/16h/ff4096:gelu:post:float16:nested": (600, 1500, 3000, 6000, 12000),
}


def lengths_for(target: int, seed: int) -> tuple[int, ...]:
    """A log-normal batch of about `target` tokens (B = target / 120, lengths up to 512)."""
    rng = np.random.default_rng(seed)
    B = int(np.clip(target // 120, 4, 256))
    return tuple(int(v) for v in np.clip(rng.lognormal(np.log(target / B) - 0.18, 0.6, B), 1, 512))


def measure(runner: ArmRunner, sig: ModuleSignature, lengths: tuple[int, ...], device: torch.device) -> dict:
    stats = BatchStats.from_lengths(lengths)
    x, _ = make_batch(lengths, sig.d_model, torch.float16, device)
    cfg = graph_config(sig.d_model // sig.heads, stats.max_len, "cublas")
    rung, batch, max_len = ragged_bucket(stats.total, stats.batch, stats.max_len)
    graphs = [
        _RaggedGraph(runner.runtime, runner.encoder, cfg, False, (rows, batch, max_len, cfg, False, "padded"),
                     torch.float16, device, None)
        for rows in (rung, rung + 1)
    ]  # fmt: skip
    empty = replay_ms(graphs)  # what the runtime times at capture: no batch loaded yet
    outs = [g.run_padded(x, lengths) for g in graphs]
    diff = float((outs[0] - outs[1]).abs().max())
    reps = int(np.clip(30 / max(gpu_ms(lambda: graphs[0].run_padded(x, lengths), 2), 0.05), 3, 200))
    times: list[list[float]] = [[], []]
    for _ in range(3):
        for j, g in enumerate(graphs):
            times[j].append(gpu_ms(lambda g=g: g.run_padded(x, lengths), reps))
    a, b = float(np.median(times[0])), float(np.median(times[1]))
    pick = 1 if empty[1] < empty[0] * (1 - _ROW_MARGIN) else 0
    chosen = (a, b)[pick]
    return {
        "signature": sig.key, "layers": sig.layers, "d_model": sig.d_model, "batch": stats.batch,
        "tokens": stats.total, "rung_rows": rung, "rung_ms": a, "plus_one_ms": b, "ratio": b / a,
        "empty_replay_ms": empty, "chosen_rows": rung + pick, "chosen_vs_rung": chosen / a,
        "regret": chosen / min(a, b) - 1.0, "max_abs_diff": diff,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="JSON path (default benchmarks/results/graph_rows.json)")
    args = p.parse_args(argv)
    require_cuda("benchmarks/graph_rows.py")
    env = environment()
    header("cuBLAS ragged graph: the bucket's rows against one row more", env)
    device = torch.device("cuda", torch.cuda.current_device())
    rows_out = []
    with torch.inference_mode():
        for sig_key, targets in PLAN.items():
            sig = ModuleSignature.from_key(sig_key)
            runner = ArmRunner(build_encoder(sig, device))
            for i, target in enumerate(targets):
                rows_out.append(measure(runner, sig, lengths_for(target, 100 + i), device))
                r = rows_out[-1]
                print(f"  {sig.layers}x{sig.d_model} B={r['batch']} T={r['tokens']} rows={r['rung_rows']}: "
                      f"{r['rung_ms']:.3f} / {r['plus_one_ms']:.3f} ms, "
                      f"kept {r['chosen_rows']}", flush=True)  # fmt: skip
            del runner
            torch.cuda.empty_cache()
    cols = [("layers", "layers", "d"), ("d_model", "d_model", "d"), ("batch", "B", "d"), ("tokens", "T", "d"),
            ("rung_rows", "rung rows", "d"), ("rung_ms", "rung ms", ".3f"), ("plus_one_ms", "rung+1 ms", ".3f"),
            ("ratio", "rung+1 / rung", ".3f"), ("chosen_rows", "kept", "d"), ("chosen_vs_rung", "kept / rung", ".3f"),
            ("regret", "regret", ".3f")]  # fmt: skip
    print(table(rows_out, cols))
    kept = np.array([r["chosen_vs_rung"] for r in rows_out])
    regret = np.array([r["regret"] for r in rows_out])
    summary = {
        "kept_vs_rung_geomean": float(np.exp(np.log(kept).mean())),
        "kept_vs_rung_min": float(kept.min()),
        "mean_regret": float(regret.mean()),
        "max_regret": float(regret.max()),
        "max_abs_diff": max(r["max_abs_diff"] for r in rows_out),
    }
    print(f"\nkept / rung: geomean {summary['kept_vs_rung_geomean']:.3f}, best {summary['kept_vs_rung_min']:.3f}; "
          f"regret of the choice: mean {summary['mean_regret']:.3%}, max {summary['max_regret']:.3%}")  # fmt: skip
    path = write_json("graph_rows.json", {"env": env, "summary": summary, "rows": rows_out}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
