"""What programmatic dependent launch saves a mask graph (kernels/pdl.py): each CoRa row's graph, as the runtime
would ask for it (twice its width rung), captured once with PDL off and once on in one process, their replays of
the row's first three timed batches alternated four times; ms a replay (best of the four), and whether the two
graphs' outputs are equal bit for bit (a diagnostic beside benchmarks/hf_table.py; prints only).

    python benchmarks/diagnostics/graph_pdl.py --models bert-base minilm
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import header, require_cuda, row_batches  # noqa: E402
from autoragged.kernels import pdl  # noqa: E402
from hf_table import build, token_batch  # noqa: E402

import autoragged  # noqa: E402
from autoragged.planning.buckets import mask_width  # noqa: E402
from autoragged.runtime.policy import ShapeKey  # noqa: E402
from autoragged.workloads import CORA, CORA_BATCH_SIZES  # noqa: E402


def queued_ms(run, reps: int) -> float:
    """ms of one `run()`, from `reps` of them queued behind a sleep kernel (the GPU's time, not the host's)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(20_000_000)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["bert-base", "minilm"])
    parser.add_argument("--rounds", type=int, default=4, help="alternations of the two graphs (default 4)")
    args = parser.parse_args(argv)
    device = require_cuda("graph_pdl.py")
    header("mask graphs with and without programmatic dependent launch: ms a replay")
    if not pdl.enabled(device):
        print("PDL is not available here (it needs an NVIDIA Hopper GPU or newer, and AUTORAGGED_PDL not 0)")
        return 1
    table = []
    try:
        for name in args.models:
            plain = build(name, device, False)
            model = autoragged.wrap(plain, db=False)
            module = next(m for m in model.modules() if hasattr(m, "_autoragged"))
            rt = module._autoragged
            for dataset in CORA:
                for B in CORA_BATCH_SIZES:
                    tokens, off, on, equal = _row(rt, module, plain, dataset, B, device, args.rounds)
                    table.append((name, dataset, B, tokens, off, on, equal))
                    print(f"{name} {dataset} B={B}: off {off:.4f} ms, on {on:.4f}, equal {equal}", flush=True)
            del model, module, rt
    finally:
        pdl.set_enabled(True)
    print("\n| model | dataset | B | tokens | off, ms | on, ms | on / off | outputs equal |")
    print("|---|---|---|---|---|---|---|---|")
    for name, dataset, B, tokens, off, on, equal in table:
        print(f"| {name} | {dataset} | {B} | {tokens:,.0f} | {off:.4f} | {on:.4f} | {on / off:.3f} | {equal} |")
    for name in args.models:
        ratios = [on / off for n, *_, off, on, _ in table if n == name]
        geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(f"{name}: on / off geomean {geomean:.4f} ({min(ratios):.3f}-{max(ratios):.3f})")
    return 0


def _row(rt, module, plain, dataset: str, B: int, device, rounds: int):
    """(tokens a batch, best ms a replay off, on, outputs equal) for one row."""
    _, timed = row_batches(dataset, B, token_batch, plain.config.vocab_size, device)
    batches = timed[:3]
    L = max(b.ids.shape[1] for b in batches)
    with torch.inference_mode():
        calls = [module.forward.call_type(rt.body, module, {"input_ids": b.ids, "attention_mask": b.mask}, None)
                 for b in batches]  # fmt: skip
        limit = getattr(rt.body, "max_tokens", None) or 512
        own = mask_width(L)
        key = rt._graph_key(calls[0], ShapeKey(B, own, True))._replace(width=max(own, min(2 * own, mask_width(limit))))
        graphs, outputs = {}, {}
        cache = rt.graph_cache()
        for on in (False, True):
            pdl.set_enabled(on)
            cache.clear()  # (the cache keeps one graph a key; `graphs` keeps both alive)
            make, nbytes = rt._graph_make(module, key, sum(batches[0].lengths))  # tiles for its rows
            graphs[on] = graph = cache.capture_now(key, make, device, nbytes)
            outputs[on] = [rt._replay(call, graph, None)[0].last_hidden_state.clone() for call in calls]
        equal = all(map(torch.equal, outputs[False], outputs[True]))
        runs = {on: (lambda g=graphs[on]: [rt._replay(call, g, None) for call in calls]) for on in (False, True)}
        torch.cuda.synchronize()
        reps = max(3, min(30, int(30 / max(queued_ms(runs[False], 1), 1e-3))))
        ms = {False: math.inf, True: math.inf}
        for _ in range(rounds):
            for on in (False, True):
                ms[on] = min(ms[on], queued_ms(runs[on], reps) / len(calls))
    del graphs, runs
    rt.graph_cache().clear()
    tokens = sum(sum(b.lengths) for b in batches) / len(batches)
    return tokens, ms[False], ms[True], equal


if __name__ == "__main__":
    raise SystemExit(main())
