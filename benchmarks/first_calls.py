"""The first calls of a wrapped HF encoder, one by one: what each call ran and what it cost.

    python benchmarks/first_calls.py                                  # bert-base, CoLA B=32, 30 calls of one batch
    python benchmarks/first_calls.py --dataset Wiki128 --new          # 30 new batches of the row instead

A latency table (hf_table.py) times a batch's calls 4-10; a stream (stream_table.py) a whole run. Neither says
which call paid what: the reads, the verdicts on mask-only shapes, the probes that can revoke them, captures.
Here every call of a fresh `autoragged.wrap(model)` is timed alone (CUDA events, a synchronisation after each
call) next to its decision (arm and reason). The forced cuBLAS and Triton ragged graphs of the same batches,
after their captures, give the floor. Prints a table and writes benchmarks/results/first_calls.json (--out).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from autoragged.tuning_db import BatchStats  # noqa: E402

import autoragged  # noqa: E402
from autoragged._costmodel import Arm  # noqa: E402
from autoragged._measure import ArmRunner  # noqa: E402
from autoragged._planner import graph_config  # noqa: E402
from autoragged.workloads import CORA, HF_SHAPES, sample_cora  # noqa: E402
from benchmarks._common import environment, header, require_cuda, write_json  # noqa: E402
from benchmarks.hf_table import batch_of, build  # noqa: E402


def timed(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bert-base", choices=list(HF_SHAPES))
    p.add_argument("--dataset", default="CoLA", choices=list(CORA))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--new", action="store_true", help="a new batch of the row for every call (else one batch)")
    p.add_argument("--db", default=None, help="tuning database (default: none, the analytic prior)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    require_cuda("first_calls.py")
    device = torch.device("cuda")
    env = environment()
    what = "new batches" if args.new else "one batch"
    header(f"First calls: {args.model} {args.dataset} B={args.batch}, {what}", env)
    rng = np.random.default_rng(0)
    batches = [sample_cora(args.dataset, args.batch, rng) for _ in range(args.calls if args.new else 1)]
    model = build(args.model, device)
    vocab, pad = model.config.vocab_size, model.config.pad_token_id or 0
    data = [batch_of(lengths, vocab, device, i, pad) for i, lengths in enumerate(batches)]
    runner = ArmRunner(build(args.model, device))
    head_dim = runner.runtime.body.head_dim
    floors = {}
    with torch.inference_mode():
        for backend in ("cublas", "triton"):
            ms = []
            for lengths, (ids, mask) in zip(batches, data):
                arm = Arm("ragged_graph", graph_config(head_dim, max(lengths), backend))
                stats = BatchStats.from_lengths(tuple(lengths), padded_len=ids.shape[1])

                def run(ids=ids, mask=mask, arm=arm, lengths=tuple(lengths), stats=stats):
                    runner.run_call(arm, runner.hf_call({"input_ids": ids, "attention_mask": mask}), lengths, stats)

                for _ in range(3):  # capture, then replays
                    run()
                ms.append(min(timed(run) for _ in range(5)))
            floors[backend] = ms
        auto = autoragged.wrap(model, db=args.db if args.db else False)
        rows = []
        for i in range(args.calls):
            j = i if args.new else 0
            ids, mask = data[j]
            ms = timed(lambda ids=ids, mask=mask: auto(input_ids=ids, attention_mask=mask))
            d = autoragged.recent_decisions(auto, 1)[-1]
            rows.append({"call": i + 1, "ms": ms, "arm": d.arm, "reason": d.reason,
                         "graph_cublas": floors["cublas"][j], "graph_triton": floors["triton"][j]})  # fmt: skip
    print("| call | auto ms | graph cublas | graph triton | arm | reason |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['call']} | {r['ms']:.3f} | {r['graph_cublas']:.3f} | {r['graph_triton']:.3f} | {r['arm']} | "
              f"{r['reason'][:90]} |")  # fmt: skip
    tail = rows[len(rows) // 2 :]
    ratio = float(np.median([r["ms"] / min(r["graph_cublas"], r["graph_triton"]) for r in tail]))
    print(f"\nsecond half: median auto / best forced graph {ratio:.2f}")
    write_json("first_calls", {"env": env, "args": vars(args), "rows": rows, "tail_ratio": ratio}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
