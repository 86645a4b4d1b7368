"""Where the short rows' time goes: GPU time of each graph against the host time around it.

    python benchmarks/short_rows.py                  # CoLA, MRPC, MNLI, XNLI at B=32/64/128
    python benchmarks/short_rows.py --datasets CoLA --batches 32
    python benchmarks/short_rows.py --datasets MRPC --batches 32 --host-profile   # where the mask call's host time goes

On the short rows of the benchmark of record a batch is a few hundred microseconds, so a column of
`cora_table.py` (latency of one call, host work included) mixes two things. This splits them:

  varlen_graph      latency of the hand-written varlen encoder's graph, captured for the batch (the goal's yardstick)
  varlen_gpu        its GPU time alone: many replays back to back, divided by their count
  ragged_graph      latency of autoragged's ragged graph arm (through the dispatcher's execute path)
  ragged_gpu        that graph's GPU time alone (replays back to back)
  triton_gpu        GPU time of the ragged graph with Triton linears, which stop at the batch's rows
  mask_gpu          GPU time of the ragged graph fed the mask (Triton linears; counts and packs on the device)
  padded_graph_gpu  GPU time of the padded graph arm
  lengths_call      latency of the wrapped model called with lengths= and forced to the ragged graph arm
  host_call_us      host microseconds of that call (the clock stops when the call returns, before a sync)
  host_replay_us    host microseconds of the replay step alone (output allocation, args posted, replay)
  mask_call         latency of the wrapped model called with the mask alone, forced to the ragged graph
                    fed the mask once the shape is trusted (every 16th call still reads the lengths)
  mask_host_us      host microseconds of that call (the clock stops when the call returns, before a sync)
  general_call, general_host_us   the same two with the trusted shape's hot path (`_replay_unread`) turned
                    off: the general path, with its graph lookup (an A/B of the hot path on one machine)
  mask_call_again   mask_call once more, after them (how far the machine drifted meanwhile)
  lengths_call / varlen_graph and mask_call / varlen_graph are the ratios the goal asks about (within 1.2x).
Prints a table and writes benchmarks/results/short_rows.json.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from autoragged.tuning_db import BatchStats  # noqa: E402

import autoragged  # noqa: E402
from autoragged._costmodel import PADDED_GRAPH, Arm  # noqa: E402
from autoragged._measure import ArmRunner, time_ms  # noqa: E402
from autoragged._planner import Planner, default_ragged_config, graph_config  # noqa: E402
from autoragged.adapters.torch_encoder import TorchCall  # noqa: E402
from autoragged.workloads import CORA, CORA_MODEL, sample_cora  # noqa: E402
from benchmarks._common import environment, gpu_ms, header, require_cuda, table, write_json  # noqa: E402
from benchmarks.cora_table import VarlenEncoder, build_model, graphed, varlen_inputs  # noqa: E402

SHORT = ("CoLA", "MRPC", "MNLI", "XNLI")


class _PreferLast:
    """A cost model that predicts the last candidate fastest (forces an arm through the planner's path)."""

    name = "forced"

    def predict_ms(self, sig, stats, arms):
        return np.arange(len(arms), 0, -1, dtype=float)


def host_us(fn, n: int = 200) -> float:
    """Median host microseconds of fn(), each call followed by a sync outside the clock."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def host_profile(name: str, call, n: int = 2000) -> None:
    """cProfile of `n` calls (each followed by a sync): the functions by their own time. cProfile adds its
    own cost per Python call, so the shares matter more than the absolute numbers."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for _ in range(n):
        torch.cuda.synchronize()
        prof.enable()
        call()
        prof.disable()
    torch.cuda.synchronize()
    print(f"\n### host profile of the mask call, {name}, {n} calls\n")
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)


def host_steps(name: str, masked, x, mask, mgraph, varlen_replay) -> dict[str, float]:
    """Median host microseconds of the steps of an unread mask call, each timed alone (printed, and returned
    for the JSON)."""
    rt = masked._autoragged
    head = mgraph._io(x)[0]
    B, L = mask.shape
    shape = rt.mask_shapes[rt._shape_key(B, L)]
    arm, tokens = shape[1], shape[4]
    pads = mgraph.pads
    call = lambda: TorchCall(rt.body, x, None, mask, None, None)  # noqa: E731
    steps = [
        ("the whole call", lambda: masked(x, src_key_padding_mask=mask)),
        ("runtime.run", lambda: rt.run(masked, call())),
        # (its count reset each time: it leaves every 16th batch, a read, to the general path)
        ("_replay_unread (trusted)", lambda: (shape.__setitem__(2, 1), rt._replay_unread(masked, call(), shape))),
        ("_execute_unread", lambda: rt._execute_unread(masked, call(), arm, tokens)),
        (
            "graph lookup (ragged_mask)",
            lambda: rt.graphs.ragged_mask(rt, masked, arm.config, False, B, L, x.dtype, x.device, tokens),
        ),
        ("pads ring put", lambda: rt.pads_ring.put(pads, None)),
        ("run_mask (output, args, replay)", lambda: mgraph.run_mask(x, mask)),
        ("replay of the varlen graph", varlen_replay),
        ("_io (output, pointers)", lambda: mgraph._io(x)),
        # a post that no replay follows is harmless: the next post rewrites the same slot and stamp
        ("post the args (a pinned slot)", lambda: mgraph.mailbox.post((*head, mask.data_ptr(), *mask.stride()))),
        ("post the args, then the replay", lambda: mgraph.replay((*head, mask.data_ptr(), *mask.stride()))),
        ("_check_params", lambda: rt.graphs._check_params(rt._parameters(masked))),
        ("_dynamic_reason", lambda: rt._dynamic_reason(masked, call())),
    ]
    print(f"\n### host steps of the mask call, {name} (median us)\n")
    out = {}
    for label, fn in steps:
        out[label] = host_us(fn, 500)
        print(f"  {label:40s} {out[label]:7.1f}")
    return out


def profile(name: str, batch: int, varlen_replay, ragged_replay) -> None:
    """Kernel times inside each graph (CUPTI traces a replayed graph's kernels one by one)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for label, replay in (("varlen graph", varlen_replay), ("ragged graph", ragged_replay)):
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                replay()
            torch.cuda.synchronize()
        print(f"\n### kernels of the {label}, {name} B={batch}, 20 replays\n")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


def bench(name: str, batch: int, args, models, device) -> dict:
    rng = np.random.default_rng(sum(map(ord, name)) * 1000 + batch)
    lengths = tuple(sample_cora(name, batch, rng))
    D = CORA_MODEL["d_model"]
    L = max(lengths)
    torch.manual_seed(0)
    x = torch.randn(batch, L, D, device=device, dtype=torch.float16)
    mask = torch.arange(L, device=device)[None, :] >= torch.tensor(lengths, device=device)[:, None]
    stats = BatchStats.from_lengths(lengths)
    cfg = default_ragged_config(D // CORA_MODEL["heads"], L)
    arm = Arm("ragged_graph", cfg)
    runner, forced = models["runner"], models["forced"]
    row: dict = {"dataset": name, "batch": batch, "tokens": sum(lengths), "max_len": L}

    def t(fn):
        return time_ms(fn, device, warmup=3, reps=args.reps).median_ms

    with torch.inference_mode():
        idx, cu, max_len = varlen_inputs(lengths, L, device)
        replay = graphed(lambda: models["varlen"](x, idx, cu, max_len))
        row["varlen_graph"] = t(replay)
        row["varlen_gpu"] = gpu_ms(replay)
        row["ragged_graph"] = t(lambda: runner.run(arm, x, mask, lengths, stats))
        graph = next(g for k, g in runner.runtime.graphs.graphs.items() if k[0] == "ragged")
        # ragged graphs replay through their run methods, which post the args (x and a fresh output alive)
        ragged_replay = lambda: graph.run_padded(x, lengths)  # noqa: E731
        row["ragged_gpu"] = gpu_ms(ragged_replay)
        runner.run(PADDED_GRAPH, x, mask, lengths, stats)
        pgraph = next(g for k, g in runner.runtime.graphs.graphs.items() if k[0] == "padded")
        # bare replays: they post no lengths, so they run on none (all pads), and the padded graph's work does
        # not depend on its lengths; the graph is dropped below, before anything posts to it again
        row["padded_graph_gpu"] = gpu_ms(pgraph.graph.replay)
        runner.run(Arm("ragged_graph", cfg.replace(backend="triton")), x, mask, lengths, stats)
        tgraph = next(g for k, g in runner.runtime.graphs.graphs.items() if k[0] == "ragged" and k[4] != cfg)
        row["triton_gpu"] = gpu_ms(lambda: tgraph.run_padded(x, lengths))
        runner.runtime.graphs.clear()
        masked = models["masked"]
        call = lambda: masked(x, src_key_padding_mask=mask)  # noqa: E731
        for _ in range(4):  # the reads that earn the shape its trust (3), then the capture
            call()
        row["mask_call"] = t(call)
        row["mask_host_us"] = host_us(call)
        rt = masked._autoragged
        rt._replay_unread = lambda *a: None  # the general path only
        row["general_call"] = t(call)
        row["general_host_us"] = host_us(call)
        del rt._replay_unread  # the method again
        row["mask_call_again"] = t(call)
        if args.host_profile:
            host_profile(f"{name} B={batch}", call)
            mgraph = next(g for k, g in masked._autoragged.graphs.graphs.items() if k[0] == "ragged" and k[6] == "mask")
            row["host_steps_us"] = host_steps(f"{name} B={batch}", masked, x, mask, mgraph, replay)
        last = autoragged.recent_decisions(masked, 1)[0]
        if "not read" not in last.reason:
            raise RuntimeError(f"the mask call read its lengths: {last.arm}, {last.reason}")
        mgraph = next(g for k, g in masked._autoragged.graphs.graphs.items() if k[0] == "ragged" and k[6] == "mask")
        row["mask_gpu"] = gpu_ms(lambda: mgraph.run_mask(x, mask))
        missed = int(mgraph.mailbox.state[1])
        if missed:
            raise RuntimeError(f"{missed} replays of the mask graph fetched no posted args")
        masked._autoragged.graphs.clear()
        call = lambda: forced(x, lengths=lengths)  # noqa: E731
        row["lengths_call"] = t(call)
        row["host_call_us"] = host_us(call)
        fgraph = next(g for k, g in forced._autoragged.graphs.graphs.items() if k[0] == "ragged")
        row["host_replay_us"] = host_us(lambda: fgraph.run_padded(x, lengths))
        row["arm"] = autoragged.recent_decisions(forced, 1)[0].arm
        if row["arm"] != "ragged_graph":
            raise RuntimeError(f"the forced call ran {row['arm']}: {autoragged.recent_decisions(forced, 1)[0].reason}")
        forced._autoragged.graphs.clear()
    if args.profile:
        profile(name, batch, replay, ragged_replay)
        args.profile = False
    row["call_vs_varlen_graph"] = row["lengths_call"] / row["varlen_graph"]
    row["mask_vs_varlen_graph"] = row["mask_call"] / row["varlen_graph"]
    row["gpu_ratio"] = row["ragged_gpu"] / row["varlen_gpu"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", nargs="+", default=list(SHORT), choices=list(CORA))
    p.add_argument("--batches", nargs="+", type=int, default=[32, 64, 128])
    p.add_argument("--reps", type=int, default=30, help="timed calls per latency cell (default 30)")
    p.add_argument("--profile", action="store_true", help="print the kernel times of both graphs on the first row")
    p.add_argument(
        "--host-profile",
        action="store_true",
        help="on every row: a cProfile of the mask call, and its steps timed alone (also in the JSON)",
    )
    p.add_argument("--out", help="JSON path (default benchmarks/results/short_rows.json)")
    args = p.parse_args(argv)
    require_cuda("benchmarks/short_rows.py")
    env = environment()
    header("short rows: GPU time against host time (CoRa encoder, fp16)", env)
    device = torch.device("cuda", torch.cuda.current_device())  # the planners are keyed by x.device
    plain = build_model(device)
    forced_arm = lambda stats: Arm("ragged_graph", default_ragged_config(64, stats.max_len))  # noqa: E731
    forced = autoragged.wrap(copy.deepcopy(plain), db=False, policy="auto", sample_every=0)
    forced._autoragged.graph_min_seen = 1
    # the planner's whole path, with a model that always prefers its one candidate (the ragged graph)
    forced._autoragged.planners[device] = Planner(forced._autoragged.sig, _PreferLast(), lambda s: [forced_arm(s)])
    # the same with the mask alone: the graph fed the mask (Triton linears) is the one arm it may run
    masked = autoragged.wrap(copy.deepcopy(plain), db=False, policy="auto", sample_every=0)
    masked._autoragged.graph_min_seen = 1
    mask_arm = lambda stats: Arm("ragged_graph", graph_config(64, stats.max_len, "triton"))  # noqa: E731
    masked._autoragged.planners[device] = Planner(masked._autoragged.sig, _PreferLast(), lambda s: [mask_arm(s)])
    models = {"varlen": VarlenEncoder(plain), "runner": ArmRunner(copy.deepcopy(plain)), "forced": forced,
              "masked": masked}  # fmt: skip
    rows = []
    for name in args.datasets:
        for batch in args.batches:
            rows.append(bench(name, batch, args, models, device))
            r = rows[-1]
            print(f"  {name:6s} B={batch:3d} varlen_graph={r['varlen_graph']:.3f} varlen_gpu={r['varlen_gpu']:.3f} "
                  f"ragged_gpu={r['ragged_gpu']:.3f} triton_gpu={r['triton_gpu']:.3f} mask_gpu={r['mask_gpu']:.3f} "
                  f"lengths_call={r['lengths_call']:.3f} mask_call={r['mask_call']:.3f} "
                  f"host_call={r['host_call_us']:.0f}us mask_host={r['mask_host_us']:.0f}us", flush=True)  # fmt: skip
    cols = [("dataset", "dataset", ""), ("batch", "B", "d"), ("tokens", "T", "d"),
            ("varlen_graph", "varlen graph", ".3f"), ("varlen_gpu", "varlen GPU", ".3f"),
            ("ragged_graph", "ragged graph", ".3f"), ("ragged_gpu", "ragged GPU", ".3f"),
            ("triton_gpu", "Triton-linear graph GPU", ".3f"), ("mask_gpu", "mask graph GPU", ".3f"),
            ("padded_graph_gpu", "padded graph GPU", ".3f"), ("lengths_call", "lengths= call", ".3f"),
            ("mask_call", "mask call", ".3f"), ("mask_host_us", "mask host us/call", ".0f"),
            ("general_call", "mask call, general path", ".3f"), ("general_host_us", "its host us/call", ".0f"),
            ("mask_call_again", "mask call again", ".3f"),
            ("host_call_us", "host us/call", ".0f"), ("host_replay_us", "host us/replay step", ".0f"),
            ("gpu_ratio", "GPU ragged/varlen", ".2f"),
            ("call_vs_varlen_graph", "call / varlen graph", ".2f"),
            ("mask_vs_varlen_graph", "mask call / varlen graph", ".2f")]  # fmt: skip
    print("\n## short rows, ms (latency columns end in a sync; GPU columns are back-to-back replays)\n")
    print(table(rows, cols))
    path = write_json("short_rows.json", {"env": env, "args": vars(args), "rows": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
