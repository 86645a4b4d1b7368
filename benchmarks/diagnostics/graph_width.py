"""What spare width costs a mask graph: one batch of each row replayed on graphs of its own width rung and of 2x,
4x, 8x and 512, ms a replay, and the kernels' GPU time a replay (torch.profiler) on the narrowest and the widest, the
kernels whose time grows most first (a diagnostic beside benchmarks/hf_table.py; prints only).

    python benchmarks/diagnostics/graph_width.py --models bert-base minilm

It makes the wider graphs through the runtime's internals on purpose: the runtime itself replays a batch on a
wider graph only where no graph of its own width is kept (graphs/cache.py).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import header, require_cuda, row_batches  # noqa: E402
from hf_table import build, token_batch  # noqa: E402

import autoragged  # noqa: E402
from autoragged.planning.buckets import mask_width  # noqa: E402
from autoragged.runtime.policy import ShapeKey  # noqa: E402

ROWS = (("Wiki128", 128), ("MNLI", 64), ("CoLA", 32), ("CoLA", 128), ("MNLI", 128))


def replay_ms(run, reps: int = 50, rounds: int = 3) -> float:
    """The best of `rounds` means of `reps` replays queued back to back (CUDA events)."""
    for _ in range(20):
        run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(rounds):
        start.record()
        for _ in range(reps):
            run()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / reps)
    return best


def kernel_us(run, reps: int = 10) -> collections.Counter:
    """GPU microseconds a replay, per kernel name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    out = collections.Counter()
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", 0) or 0
        if us > 0:
            out[event.key[:60]] += us / reps
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["bert-base", "minilm"])
    args = parser.parse_args(argv)
    device = require_cuda("graph_width.py")
    header("mask graphs of spare width: ms a replay")
    table = []
    for name in args.models:
        plain = build(name, device, False)
        model = autoragged.wrap(plain, db=False)
        module = next(m for m in model.modules() if hasattr(m, "_autoragged"))
        rt = module._autoragged
        for dataset, B in ROWS:
            _, timed = row_batches(dataset, B, token_batch, plain.config.vocab_size, device)
            batch = timed[0]
            kwargs = {"input_ids": batch.ids, "attention_mask": batch.mask}
            call = module.forward.call_type(rt.body, module, kwargs, None)
            L = batch.ids.shape[1]
            own = mask_width(L)
            widths = sorted({w for w in (own, 2 * own, 4 * own, 8 * own, 512) if own <= w <= 512})
            kernels = {}
            with torch.inference_mode():
                base = rt._graph_key(call, ShapeKey(B, own, True))
                for width in widths:
                    key = base._replace(width=width)
                    make, nbytes = rt._graph_make(module, key, sum(batch.lengths))  # tiles for its rows
                    graph = rt.graph_cache().capture_now(key, make, device, nbytes)
                    run = lambda rt=rt, call=call, graph=graph: rt._replay(call, graph, None)  # noqa: E731
                    ms = replay_ms(run)
                    kernels[width] = kernel_us(run)
                    table.append((name, dataset, B, L, width, ms, sum(kernels[width].values()) / 1e3))
            narrow, wide = kernels[widths[0]], kernels[widths[-1]]
            print(f"\n{name} {dataset} B={B} (L={L}): GPU us a replay, width {widths[0]} / {widths[-1]}")
            for kernel in sorted(set(narrow) | set(wide), key=lambda k: narrow.get(k, 0) - wide.get(k, 0))[:8]:
                print(f"  {narrow.get(kernel, 0):8.1f} {wide.get(kernel, 0):8.1f}  {kernel}")
            rt.graph_cache().clear()
        del model
    print("\n| model | dataset | B | L | graph width | ms a replay | kernels, ms |\n|---|---|---|---|---|---|---|")
    for name, dataset, B, L, width, ms, kernel_ms in table:
        print(f"| {name} | {dataset} | {B} | {L} | {width} | {ms:.3f} | {kernel_ms:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
