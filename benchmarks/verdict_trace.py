"""What the runtime did with each batch of a stream of mask-only batches, and why (a diagnostic).

    python benchmarks/verdict_trace.py --rows CoLA:128 MNLI:128 [--models bert-base | cora]

For each row, the stream of `benchmarks/stream_table.py` (the same seeds: 24 warm-up batches, then 64 timed ones
back to back) runs on a fresh `autoragged.wrap(model)` called with the mask. The timed stream itself is traced (the
trace adds no synchronisation): per batch its GPU time between events, what its record says ran, the path taken
(a replay of the shape's kept graph fed the mask, an unread run, or a read and the arm run on the lengths) and
the graphs captured inside it; and every verdict, the warm-up's too (`_judge_entry`: the mask arm's prediction
against the best arm needing lengths plus the read's cost; what that cost is made of (`sync_ms`, the least
`prelaunch_ms`), the exploring rent paid, whether this verdict explored, and its (B, mask width) bucket's timings).
The same stream runs with the verdict forced each way
(`always_mask`: the read's cost taken as infinite; `always_read`: as minus infinite) and with `lengths=` (traced
too, per batch), so a row shows which rule would have been right in the stream. Prints one line per row and column,
the batch sequence of the auto column, and for both traced streams each path's median host and GPU time and the
slowest batches; `--profile` adds each path's costliest functions (cProfile: its host time then counts for
little). Writes benchmarks/results/verdict_trace.json (--out).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import gc
import json
import pathlib
import pstats
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import autoragged  # noqa: E402
from autoragged.runtime import core, unread  # noqa: E402
from autoragged.workloads import HF_SHAPES  # noqa: E402
from benchmarks._common import environment, write_json  # noqa: E402
from benchmarks.stream_table import (  # noqa: E402
    _caller,
    _graph_totals,
    _what_ran,
    build_cora,
    build_hf,
    make_batches,
    run_stream,
)

TRACE: dict = {"calls": [], "verdicts": []}


@contextlib.contextmanager
def _patched():
    """The runtime's decision points wrapped so each call logs what it did (class-level, undone on exit)."""
    judge, replay, run_unread, execute = (
        unread.UnreadShapes._judge_entry, unread.UnreadShapes._replay_unread,
        unread.UnreadShapes._run_unread, core.Runtime._execute,
    )  # fmt: skip

    def _judge(self, entry, predicted, mask_arm, tokens, explore=False):
        label = mask_arm.label if mask_arm is not None else None
        needs = {k: v for k, v in predicted.items() if k not in ("padded", "padded_graph", label)}
        best = min(needs, key=needs.get) if needs else None
        explored = entry[5]["explored"]
        out = judge(self, entry, predicted, mask_arm, tokens, explore)
        prelaunch = min(self.prelaunch) if self.prelaunch else None
        TRACE["verdicts"].append({
            "call": len(TRACE["calls"]) if TRACE.get("timed") else -1, "mask": predicted.get(label), "best": best,
            "best_ms": needs.get(best), "read_cost": round(self.read_cost_ms, 4), "streak": out[0],
            "arm": out[1].label, "lost": out[5]["lost"], "pipelined": self.pipelined, "explore": explore,
            "confirmed": out[5]["confirmed"],
            # why a mask graph ran: the read's parts, the rent paid, explored at this verdict, its bucket's timings
            "sync_ms": round(self.sync_ms, 4), "prelaunch_ms": prelaunch and round(prelaunch, 4),
            "paid": round(out[5]["paid"], 3), "explored_now": out[5]["explored"] and not explored,
            "bucket": out[9], "bucket_won": self._bucket_won(out[9]), "bucket_lost": out[9] in self.mask_lost,
        })  # fmt: skip
        return out

    def _replay(self, module, call, shape):
        out = replay(self, module, call, shape)
        if out is not None:
            TRACE["path"] = "R"
        return out

    def _unread(self, module, call, shape):
        out = run_unread(self, module, call, shape)
        if out is not unread._READ:
            TRACE["path"] = "U"
        return out

    def _execute(self, module, call, arm, *a, **k):
        TRACE["path"] = "read:" + arm.label + (f":{arm.config.backend}" if arm.config is not None else "")
        return execute(self, module, call, arm, *a, **k)

    unread.UnreadShapes._judge_entry = _judge
    core.Runtime._replay_unread = _replay
    core.Runtime._run_unread = _unread
    core.Runtime._execute = _execute
    try:
        yield
    finally:
        unread.UnreadShapes._judge_entry = judge
        del core.Runtime._replay_unread, core.Runtime._run_unread  # (inherited from UnreadShapes)
        core.Runtime._execute = execute


@contextlib.contextmanager
def _read_cost(value: float | None):
    """The verdict's read cost forced to `value` (None: as computed)."""
    original = unread.UnreadShapes.read_cost_ms
    if value is not None:
        unread.UnreadShapes.read_cost_ms = property(lambda self: value)
    try:
        yield
    finally:
        unread.UnreadShapes.read_cost_ms = original


def traced_stream(
    model, batches, hf: bool, device=None, lengths: bool = False, profile: dict | None = None
) -> tuple[float, list[dict]]:
    """The batches, mask-only (with `lengths=` where `lengths`), back to back as `run_stream` runs them (one
    synchronisation before, one after):
    per call its path, host ms, captures and, on a GPU, the time between its events and the previous batch's
    (its kernels, and idle while the host was behind). `profile`: a dict that gets, per path, the cProfile
    stats of its calls (the profiler slows the host, so the stream's times then count for little). Returns
    (seconds, calls)."""
    calls = []
    call = _caller(model, hf, lengths)
    cuda = device is not None and device.type == "cuda"
    # the runtimes' capture counts, read per call (walking the model's modules per call cost the host enough to
    # slow the short rows' streams)
    caches = [m.__dict__["_autoragged"] for m in model.modules() if "_autoragged" in m.__dict__]

    def captures() -> int:
        return sum(rt.graphs.captures for rt in caches if rt.graphs is not None)

    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(batches) + 1)] if cuda else []
    if cuda:
        torch.cuda.synchronize(device)
        events[0].record()
    t_start = time.perf_counter()
    for i, b in enumerate(batches):
        TRACE["path"] = "?"
        before = captures()
        prof = cProfile.Profile() if profile is not None else None
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        call(b)
        if prof is not None:
            prof.disable()
        host = (time.perf_counter() - t0) * 1e3
        if prof is not None:
            if TRACE["path"] in profile:
                profile[TRACE["path"]].add(prof)
            else:
                profile[TRACE["path"]] = pstats.Stats(prof)
        if cuda:
            events[i + 1].record()
        calls.append({"path": TRACE["path"], "host_ms": round(host, 3), "max_len": b.stats.max_len,
                      "total": b.stats.total, "captured": captures() - before})  # fmt: skip
        TRACE["calls"].append(calls[-1])
    if cuda:
        torch.cuda.synchronize(device)
        for i, c in enumerate(calls):
            c["gpu_ms"] = round(events[i].elapsed_time(events[i + 1]), 3)
    seconds = time.perf_counter() - t_start
    ran = autoragged.recent_decisions(model, len(batches))
    for c, d in zip(calls[len(calls) - len(ran) :], ran):
        c["ran"] = f"{d.arm}{'' if d.config is None else ':' + d.config.get('backend', '')} | {d.reason[:100]}"
    return seconds, calls


def run_row(plain, dataset: str, batch: int, device, n_warm: int = 24, n_timed: int = 64, profile=None) -> dict:
    hf = hasattr(plain, "config")  # else the CoRa encoder (nn.TransformerEncoder)
    family = "hf" if hf else "cora"
    width = plain.config.hidden_size if hf else plain.layers[0].self_attn.embed_dim
    vocab = plain.config.vocab_size if hf else 0
    seed = sum(map(ord, dataset)) * 1000 + batch
    dtype = next(plain.parameters()).dtype
    warm = make_batches(family, dataset, batch, n_warm, seed, device, width, dtype, vocab)
    timed = make_batches(family, dataset, batch, n_timed, seed + 1, device, width, dtype, vocab)
    row: dict = {"dataset": dataset, "batch": batch}
    for col, cost, lengths in (("auto", None, False), ("always_mask", float("inf"), False),
                               ("always_read", float("-inf"), False), ("auto_lengths", None, True)):  # fmt: skip
        model = autoragged.wrap(copy.deepcopy(plain), db=False)
        TRACE["calls"], TRACE["verdicts"], TRACE["timed"] = [], [], False
        with torch.inference_mode(), _read_cost(cost):
            call = _caller(model, hf, lengths)
            for b in warm:
                call(b)
            TRACE["timed"] = True
            before = _graph_totals(model)
            if col in ("auto", "auto_lengths"):  # the timed stream itself, traced call by call (no sync between)
                prof = profile if col == "auto" else None
                seconds, calls = traced_stream(model, timed, hf, device, lengths, prof)
                if col == "auto":
                    row["trace"] = {"calls": calls, "verdicts": TRACE["verdicts"]}
                else:
                    row["trace_lengths"] = {"calls": calls}
            else:
                seconds = run_stream(call, timed, device)
            after = _graph_totals(model)
        row[col] = {"ms": round(1e3 * seconds / len(timed), 4), "captures": after["captures"] - before["captures"],
                    "capture_ms": round(after["capture_ms"] - before["capture_ms"], 1),
                    **_what_ran(model, len(timed))}  # fmt: skip
        del model
        gc.collect()
    return row


def _row(spec: str) -> tuple[str, int]:
    from autoragged.workloads import CORA

    dataset, _, b = spec.partition(":")
    if dataset not in CORA or not b.isdigit() or int(b) < 1:
        raise argparse.ArgumentTypeError(f"{spec!r}: want DATASET:B, DATASET one of {', '.join(CORA)}, B >= 1")
    return dataset, int(b)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", type=_row, default=[("CoLA", 128), ("MNLI", 128)], help="DATASET:B")
    p.add_argument("--models", default="bert-base", choices=["cora", *HF_SHAPES],
                   help="an HF shape, or cora (the CoRa encoder): the stream's model")  # fmt: skip
    p.add_argument("--warm", type=int, default=24, help="warm-up batches (default 24, as stream_table.py)")
    p.add_argument("--batches", type=int, default=64, help="timed batches (default 64, as stream_table.py)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run (with --tiny)")
    p.add_argument("--tiny", action="store_true", help="a tiny model (2 layers, width 64): the CPU smoke run")
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile the auto column's calls (cProfile), print each path's costliest functions",
    )
    p.add_argument("--out", help="JSON path (default benchmarks/results/verdict_trace.json)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    plain = build_cora(device, args.tiny) if args.models == "cora" else build_hf(args.models, device, tiny=args.tiny)
    rows = []
    for dataset, b in args.rows:
        with _patched():
            profile = {} if args.profile else None
            row = run_row(plain, dataset, b, device, args.warm, args.batches, profile)
        rows.append(row)
        for col in ("auto", "always_mask", "always_read", "auto_lengths"):
            print(f"{dataset} B={b} {col}: {json.dumps(row[col])}")
        seq = "".join({"R": "r", "U": "u"}.get(c["path"], "c" if "cublas" in c["path"] else "t" if "triton" in
                      c["path"] else "p") + ("*" if c["captured"] else "") for c in row["trace"]["calls"])  # fmt: skip
        print(
            f"  sequence (r replay fed the mask, u unread run, c/t/p read then cuBLAS/Triton graph or eager/padded,"
            f" * captured): {seq}"
        )
        for name in ("trace", "trace_lengths"):
            calls = row[name]["calls"]
            gpu_total = sum(c.get("gpu_ms", 0.0) for c in calls)
            print(f"  {'auto (mask)' if name == 'trace' else 'auto (lengths=)'}: gpu {gpu_total:.2f} ms in all")
            by_path: dict[str, list] = {}
            for c in calls:
                by_path.setdefault(c["path"], []).append(c)
            for path, cs in sorted(by_path.items(), key=lambda kv: -len(kv[1])):
                host = sorted(c["host_ms"] for c in cs)[len(cs) // 2]
                gpu = sorted(c.get("gpu_ms", 0.0) for c in cs)[len(cs) // 2]
                total = sum(c.get("gpu_ms", 0.0) for c in cs)
                print(f"    path {path}: {len(cs)} batches, median host {host:.3f} ms, median gpu {gpu:.3f} ms,"
                      f" gpu {total:.2f} ms in all")  # fmt: skip
            for c in sorted(calls, key=lambda c: -c.get("gpu_ms", 0))[:4]:
                print(f"    slow batch: gpu {c.get('gpu_ms')} ms, host {c['host_ms']} ms, captured {c['captured']},"
                      f" max_len {c['max_len']}, {c['path']}: {c.get('ran')}")  # fmt: skip
        for path, st in (profile or {}).items():
            print(f"  profile of path {path} ({st.total_calls} function calls):")
            st.sort_stats("cumulative").print_stats(22)
        for v in row["trace"]["verdicts"][:40]:
            print(
                f"  verdict at {v['call']} (-1: warm-up): mask {v['mask']} vs {v['best']} {v['best_ms']}"
                f" + read {v['read_cost']}"
                f" -> streak {v['streak']} {v['arm']} lost={v['lost']} confirmed={v['confirmed']}"
                f" pipelined={v['pipelined']} explore={v['explore']} explored_now={v['explored_now']}"
            )
    path = args.out or str(pathlib.Path(__file__).parent / "results" / "verdict_trace.json")
    write_json(path, {"env": environment(), "args": vars(args), "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
