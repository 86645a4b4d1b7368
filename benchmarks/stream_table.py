"""Streams of new batches: throughput when no batch comes twice (the benchmark of record times each batch 13
times in a row, so captures, compiles and the planner's first guesses are paid before its clock starts).

    python benchmarks/stream_table.py --quick                 # 6 rows (CoLA, MNLI, RACE at B=32/128), CoRa encoder
    python benchmarks/stream_table.py --models cora bert-base # 24 rows each
    python benchmarks/stream_table.py --quick --warm 0        # cold runtime (kernels compiled by the earlier rows)
    python benchmarks/stream_table.py --quick --fresh-process # deploy: each run a fresh process, a new Triton cache
    python benchmarks/stream_table.py --quick --warmup-call --before   # also auto after warmup(), and the old rules
    python benchmarks/stream_table.py --device cpu --tiny --quick      # a CPU smoke run (tiny models)

Per row (a CoRa length distribution x a batch size): a warm-up stream of --warm batches, then --batches
distinct batches (fresh Beta-recipe draws, none seen before) run back to back with no synchronisation between
them, timed as a whole (one synchronisation at each end): ms per batch and real tokens per second. Every
column runs the same batches on models of its own, made fresh for the row: a wrapped model starts with no
graphs, no timings, no judged shapes; its cost model is the calibration in --db (none: the analytic prior).

Columns, CoRa encoder (6 x 512, fp16), called with the key padding mask unless said otherwise
  pytorch_fast     nn.TransformerEncoder as built by default (its fast path, nested tensors)
  pytorch_nofast   the same with PyTorch's fast path off
  varlen           a hand-written padding-free encoder (varlen_attn), eager, given host lengths
  ragged           autoragged forced to its eager ragged arm (policy="ragged")
  ragged_graph     autoragged's cuBLAS ragged graph, forced, host lengths known (captured on each new bucket's
                   first sight, inside the stream: what a graph-always policy pays)
  auto             autoragged.wrap(model)
  auto_lengths     the same, called with lengths= (host ints: no device sync)
  auto_before      (--before) auto with the rules before this issue's: 16 graphs a module, (B, L) mask shapes
                   trusted after 3 reads and read every 16th batch (captures at a bucket's second sight, as now)
  auto_warmed      (--warmup-call) auto after autoragged.warmup(model, <the row's workload>, batch_sizes=[B])
  auto_recheck     (--ablate) auto with the mask rules before (wrap(mask_reads="recheck"))
  auto_pays        (--ablate) auto with captures only when their recurrence repays them (wrap(capture="pays"))
HF bert-base (random weights, fp16, sdpa): hf_sdpa (the model's own padded forward), varlen (the model's
modules on packed tokens, varlen_attn), ragged, ragged_graph, auto, auto_lengths (and the optional ones).
For wrapped columns the JSON also has, over the timed stream, the arms that ran, the batches that read their
lengths from the mask, and the graphs captured (and their ms), evicted and declined: where a column loses,
that says whether to captures inside the stream, to the cap, or to the choice of arm; and the Triton compiles
each column paid inside its timed stream (kernels by name, seconds; logged through triton.knobs' JIT hooks).

--fresh-process: each run is a new Python process whose TRITON_CACHE_DIR is a new empty directory (as after
a deploy), run twice (the second process finds the first one's Triton cache, as a restart would). Per row:
a fresh wrapped model runs 100 new batches cold (no warm-up), then 100 more (its warm time); with
--warmup-call, another process pair runs warmup() first, then the same streams. The goal: cold at most 2x
warm, or 1.2x after warmup(); the first row of a process is the deploy's cold start, later rows reuse the
kernels it compiled. Each stream is traced per batch (host time of the call, GPU time between consecutive
batches' events, garbage-collector pauses, what ran): the JSON keeps the totals and the slowest batches, and
the output prints the three slowest of each cold stream. --profile-cold DIR also writes a cProfile of each cold
stream there. Prints tables and writes benchmarks/results/stream_table.json (--out).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from autoragged.tuning_db import BatchStats  # noqa: E402

import autoragged  # noqa: E402
from autoragged._costmodel import Arm  # noqa: E402
from autoragged._measure import ArmRunner  # noqa: E402
from autoragged._planner import graph_config  # noqa: E402
from autoragged._warmup import _bucket_label  # noqa: E402
from autoragged.workloads import CORA, CORA_BATCH_SIZES, CORA_MODEL, sample_cora  # noqa: E402
from benchmarks._common import environment, header, require_cuda, table, write_json  # noqa: E402

CORA_COLUMNS = ["pytorch_fast", "pytorch_nofast", "varlen", "ragged", "ragged_graph", "auto", "auto_lengths"]
HF_COLUMNS = ["hf_sdpa", "varlen", "ragged", "ragged_graph", "auto", "auto_lengths"]
OPTIONAL = ["auto_before", "auto_warmed", "auto_recheck", "auto_pays"]
WRAPPED = ("ragged", "auto", "auto_lengths", *OPTIONAL)
QUICK = (["CoLA", "MNLI", "RACE"], [32, 128])


@dataclass
class Batch:
    lengths: list[int]
    stats: BatchStats
    x: torch.Tensor  # (B, L, D) for the encoder, (B, L) token ids for HF
    mask: torch.Tensor  # (B, L): True = pad (encoder), 1 = token (HF)
    idx: torch.Tensor  # pinned host int64: the real tokens' flat positions (the varlen peers)
    cu: torch.Tensor  # pinned host int32: cumulative lengths


# -- models -------------------------------------------------------------------------------------------------
def build_cora(device, tiny: bool):
    torch.manual_seed(0)
    m = {"layers": 2, "d_model": 64, "heads": 2, "ff": 128} if tiny else CORA_MODEL
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    layer = torch.nn.TransformerEncoderLayer(m["d_model"], m["heads"], m["ff"], dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, m["layers"]).to(device, dtype).eval()


def build_hf(name: str, device, tiny: bool):
    import transformers

    from autoragged.workloads import hf_config

    torch.manual_seed(0)
    if tiny:
        dims = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128}
        config = transformers.BertConfig(vocab_size=100, max_position_embeddings=512, **dims)
    else:
        config = hf_config(name)
    config._attn_implementation = "sdpa"
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    return transformers.AutoModel.from_config(config).to(device, dtype).eval()


def _cora_varlen(plain):
    from benchmarks.cora_table import VarlenEncoder

    return VarlenEncoder(plain)


def _hf_varlen(plain):
    from benchmarks.hf_table import VarlenPeer

    return VarlenPeer(plain)


def _legacy(model, cap: bool = True, masks: bool = True, pays: bool = False) -> None:
    """On every wrapped module: the rules before this issue's (16 graphs; (B, L) mask shapes read every 16th
    batch), or one of them; or the capture policy that captures only what repays itself (`pays`)."""
    for m in model.modules():
        runtime = m.__dict__.get("_autoragged")
        if runtime is None:
            continue
        if cap:
            runtime.graph_cap = 16
        if masks:
            runtime.mask_reads = "recheck"
        runtime.capture_policy = pays


def _caller(model, hf: bool, lengths: bool = False):
    """fn(batch) calling `model` as its users do: with the mask, or with lengths= (host ints)."""
    if lengths:
        return (lambda b: model(input_ids=b.x, lengths=b.lengths)) if hf else (lambda b: model(b.x, lengths=b.lengths))
    if hf:
        return lambda b: model(input_ids=b.x, attention_mask=b.mask)
    return lambda b: model(b.x, src_key_padding_mask=b.mask)


def make_column(col: str, family: str, plain, args, dataset: str, batch: int):
    """(fn(batch) -> output, the wrapped model or None, a context the stream runs in, extra info)."""
    device = next(plain.parameters()).device
    hf = family != "cora"
    if col in ("pytorch_fast", "hf_sdpa", "pytorch_nofast"):
        return _caller(plain, hf), None, _no_fastpath if col == "pytorch_nofast" else contextlib.nullcontext, {}
    if col in ("varlen", "ragged_graph") and device.type != "cuda":
        raise RuntimeError(f"{col} needs CUDA")
    if col == "varlen":
        peer = _hf_varlen(plain) if hf else _cora_varlen(plain)

        def fn(b):
            idx, cu = b.idx.to(device, non_blocking=True), b.cu.to(device, non_blocking=True)
            return peer(b.x, idx, cu, max(b.lengths))

        return fn, None, contextlib.nullcontext, {}
    if col == "ragged_graph":
        runner = ArmRunner(copy.deepcopy(plain))
        head_dim = runner.runtime.body.head_dim

        def fn(b):
            arm = Arm("ragged_graph", graph_config(head_dim, b.stats.max_len, "cublas"))
            if hf:
                call = runner.hf_call({"input_ids": b.x, "attention_mask": b.mask})
                return runner.run_call(arm, call, tuple(b.lengths), b.stats)
            return runner.run(arm, b.x, b.mask, tuple(b.lengths), b.stats)

        return fn, runner.encoder, contextlib.nullcontext, {}
    forced = col == "ragged"
    options = {"db": False, "policy": "ragged", "sample_every": 0} if forced else {"db": args.db}
    model = autoragged.wrap(copy.deepcopy(plain), **options)
    info: dict = {}
    if col in ("auto_before", "auto_recheck", "auto_pays"):
        _legacy(model, cap=col == "auto_before", masks=col != "auto_pays", pays=col == "auto_pays")
    if col == "auto_warmed":
        s = autoragged.warmup(model, dataset, batch_sizes=[batch], batches=args.warmup_batches, progress=False,
                              seed=12345)  # fmt: skip
        info["warmup"] = {"seconds": s.seconds, "compile_s": s.compile_s, "capture_s": s.capture_s,
                          "captured": len(s.captured), "graphs": s.graphs, "graph_mb": s.graph_bytes / 2**20,
                          "declined": s.declined, "batches": s.batches, "ahead_s": s.ahead_s,
                          "buckets": s.captured}  # fmt: skip
    return _caller(model, hf, lengths=col == "auto_lengths"), model, contextlib.nullcontext, info


@contextlib.contextmanager
def _no_fastpath():
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(True)


# -- batches and timing ---------------------------------------------------------------------------------------
def make_batches(family, dataset, batch, n, seed, device, width, dtype, vocab) -> list[Batch]:
    rng = np.random.default_rng(seed)
    g = torch.Generator(device="cpu").manual_seed(seed)
    # made on the device: a RACE B=128 input took 0.2 s to draw on this 2-core host (88 a row: 18 s)
    on_device = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = sample_cora(dataset, batch, rng)
        L = max(lengths)
        keep = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
        if family == "cora":
            x = torch.randn(batch, L, width, generator=on_device, device=device, dtype=dtype)
            mask = (~keep).to(device)
        else:
            x = torch.randint(5, vocab, (batch, L), generator=g).masked_fill(~keep, 0).to(device)
            mask = keep.long().to(device)
        idx = torch.from_numpy(np.concatenate([np.arange(k) + i * L for i, k in enumerate(lengths)]))
        cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
        if device.type == "cuda":
            idx, cu = idx.pin_memory(), cu.pin_memory()
        out.append(Batch(lengths, BatchStats.from_lengths(tuple(lengths), padded_len=L), x, mask, idx, cu))
    return out


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_stream(fn, batches, device) -> float:
    """Seconds to run `batches` back to back: one synchronisation before, one after, none between."""
    _sync(device)
    t0 = time.perf_counter()
    for b in batches:
        fn(b)
    _sync(device)
    return time.perf_counter() - t0


def traced_stream(fn, batches, device, model, top: int = 6) -> tuple[float, dict]:
    """`run_stream` with a trace: the host time of each call (perf_counter around it; with nothing synchronised
    a call waits only where it reads lengths or captures), the GPU time between consecutive batches' events
    (kernels, and idle while the host was behind) and the garbage collector's pauses. Returns (seconds,
    {totals, the `top` slowest batches each way with what ran}). The events cost a few microseconds a batch."""
    _sync(device)
    cuda = device.type == "cuda"
    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(batches) + 1)] if cuda else []
    host, pauses, current, started = [], [], [0], [0.0]

    def on_gc(phase, info):  # the collector's pauses, by batch: a full collection can stall the host for ms
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((current[0], info["generation"], (time.perf_counter() - started[0]) * 1e3))

    gc.callbacks.append(on_gc)
    try:
        t0 = time.perf_counter()
        if cuda:
            events[0].record()
        for i, b in enumerate(batches):
            current[0] = i
            h0 = time.perf_counter()
            fn(b)
            if cuda:
                events[i + 1].record()
            host.append((time.perf_counter() - h0) * 1e3)
        _sync(device)
        seconds = time.perf_counter() - t0
    finally:
        gc.callbacks.remove(on_gc)
    gc_ms = [0.0] * len(batches)
    for i, _, ms in pauses:
        gc_ms[i] += ms
    gpu = [events[i].elapsed_time(events[i + 1]) for i in range(len(batches))] if cuda else [0.0] * len(batches)
    ran = [] if model is None else autoragged.recent_decisions(model, len(batches))
    what = [f"{d.arm}{'' if d.config is None else ':' + d.config.get('backend', '')} | {d.reason[:90]}" for d in ran]
    what = [""] * (len(batches) - len(what)) + what

    def slowest(xs):
        order = sorted(range(len(xs)), key=xs.__getitem__, reverse=True)[:top]
        return [{"batch": i, "host_ms": round(host[i], 3), "gpu_ms": round(gpu[i], 3), "gc_ms": round(gc_ms[i], 3),
                 "ran": what[i]} for i in order]  # fmt: skip

    def median(xs):
        return round(sorted(xs)[len(xs) // 2], 3) if xs else 0.0

    totals = {"host_ms": round(sum(host), 2), "gpu_ms": round(sum(gpu), 2), "host_median_ms": median(host),
              "gpu_median_ms": median(gpu), "gc_ms": round(sum(gc_ms), 2),
              "gc_by_generation": {g: sum(1 for p in pauses if p[1] == g) for g in (0, 1, 2)}}  # fmt: skip
    return seconds, {**totals, "slowest_host": slowest(host), "slowest_gpu": slowest(gpu)}


def _graph_totals(model) -> dict:
    totals = {"captures": 0, "capture_ms": 0.0, "evictions": 0, "declined": 0, "graphs": 0, "graph_mb": 0.0}
    totals["keys"] = set()  # the kept graphs' buckets, as labels
    if model is None:
        return totals
    for m in model.modules():
        cache = getattr(m.__dict__.get("_autoragged"), "graphs", None)
        if cache is not None:
            totals["keys"] |= {_bucket_label(k) for k in cache.graphs}
    for s in autoragged.graph_stats(model).values():
        totals["captures"] += s.captures
        totals["capture_ms"] += s.capture_ms
        totals["evictions"] += s.evictions
        totals["declined"] += s.declined
        totals["graphs"] += s.graphs
        totals["graph_mb"] += s.kept_bytes / 2**20
    return totals


def _what_ran(model, n: int) -> dict:
    """Over the last n decisions: arms (with the linears' backend) and the batches that read a mask's lengths."""
    arms: dict[str, int] = {}
    reads = 0
    for d in autoragged.recent_decisions(model, n):
        label = d.arm + ("" if d.config is None else f":{d.config.get('backend')}")
        arms[label] = arms.get(label, 0) + 1
        reads += "not read" not in d.reason
    return {"arms": arms, "mask_reads": reads}


def _why_ran(model, n: int) -> dict[str, int]:
    """Over the last n decisions: "arm[:backend] | the reason's first 70 characters", counted (what a cold stream
    paid for: explorations, eager runs of buckets not captured, reads)."""
    ran: dict[str, int] = {}
    for d in autoragged.recent_decisions(model, n):
        key = f"{d.arm}{'' if d.config is None else ':' + d.config.get('backend', '')} | {d.reason[:70]}"
        ran[key] = ran.get(key, 0) + 1
    return ran


def _graph_delta(model, before: dict) -> dict:
    """What the graph caches did since `before` (`_graph_totals`): counts, and the buckets captured meanwhile."""
    after = _graph_totals(model)
    delta = {k: round(after[k] - before[k], 3) for k in ("captures", "capture_ms", "evictions", "declined")}
    delta["buckets"] = sorted(after["keys"] - before["keys"])
    return delta


class CompileLog:
    """Triton compiles as they happen (kernel name, seconds, on the calling thread or not), through triton.knobs'
    JIT hooks: which ones a timed stream pays (a cache hit on disk is logged too, with its load time). Compiles
    on another thread (kernels/ragged_linear.py compiles tile variants ahead in the background) are counted
    apart: they cost the stream host time, not a stall."""

    def __init__(self):
        self.events: list[tuple[str, float, bool]] = []
        self._start: dict = {}

    def install(self) -> bool:
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = knobs.runtime
        if not hasattr(runtime, "jit_post_compile_hook"):
            return False

        def before(**kw):
            self._start[kw.get("key")] = time.perf_counter()
            return False  # (True would skip the compile)

        def after(**kw):
            t0 = self._start.pop(kw.get("key"), None)
            fn = kw.get("fn")
            seconds = 0.0 if t0 is None else time.perf_counter() - t0
            main = threading.current_thread() is threading.main_thread()
            self.events.append((getattr(fn, "name", "?"), seconds, main))

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after
        return True

    def since(self, n: int) -> dict:
        """Compiles logged after the first n on the main thread (count, seconds, count by kernel), and elsewhere."""
        events = [e for e in self.events[n:] if e[2]]
        names: dict[str, int] = {}
        for name, _, _ in events:
            names[name] = names.get(name, 0) + 1
        return {"compiles": len(events), "compile_s": round(sum(e[1] for e in events), 3), "compiled": names,
                "background_compiles": len(self.events) - n - len(events)}  # fmt: skip


COMPILES = CompileLog()


def diagnose(model, before: dict, n: int, col: str) -> dict:
    out = _graph_delta(model, before)
    after = _graph_totals(model)
    out.update(graphs=after["graphs"], graph_mb=round(after["graph_mb"], 1))
    if col in WRAPPED and col != "ragged":
        ran = _what_ran(model, n)
        out["arms"] = ran["arms"]
        if col != "auto_lengths":
            out["mask_reads"] = ran["mask_reads"]
    return out


def _check(fn, plain, b: Batch, family: str) -> float:
    """Max abs error of fn's output against the plain model's on the real tokens of b."""
    with torch.inference_mode():
        got, want = fn(b), (plain(input_ids=b.x, attention_mask=b.mask) if family != "cora" else
                            plain(b.x, src_key_padding_mask=b.mask))  # fmt: skip
    if family != "cora":
        got, want, keep = got.last_hidden_state, want.last_hidden_state, b.mask.bool()
    else:
        keep = ~b.mask
    return (got[keep].float() - want[keep].float()).abs().max().item()


# -- one row --------------------------------------------------------------------------------------------------
def bench_row(family, plain, dataset, batch, args, device) -> dict:
    cfg = plain.config if family != "cora" else None
    width = cfg.hidden_size if cfg is not None else plain.layers[0].self_attn.embed_dim
    dtype = next(plain.parameters()).dtype
    vocab = cfg.vocab_size if cfg is not None else 0
    seed = sum(map(ord, dataset)) * 1000 + batch
    warm = make_batches(family, dataset, batch, args.warm, seed, device, width, dtype, vocab)
    timed = make_batches(family, dataset, batch, args.batches, seed + 1, device, width, dtype, vocab)
    tokens = sum(sum(b.lengths) for b in timed)
    row: dict = {"model": family, "dataset": dataset, "batch": batch, "tokens": tokens, "diag": {}, "failed": {}}
    for col in args.columns:
        try:
            fn, model, ctx, info = make_column(col, family, plain, args, dataset, batch)  # (not in inference mode)
            with torch.inference_mode(), ctx():
                for b in warm:
                    fn(b)
                before = _graph_totals(model)
                compiled = len(COMPILES.events)
                seconds = run_stream(fn, timed, device)
                compiled = COMPILES.since(compiled)
        except Exception as e:  # noqa: BLE001 - a column that cannot run here is a result, not a crash
            row["failed"][col] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            continue
        row[col] = 1e3 * seconds / len(timed)  # ms per batch
        row[f"{col}_tok_s"] = tokens / seconds
        if model is not None:
            row["diag"][col] = {**diagnose(model, before, len(timed), col), **info}
        row["diag"].setdefault(col, {}).update(compiled)  # Triton compiles inside the timed stream
        if col in ("auto", "auto_warmed"):
            row[f"{col}_max_err"] = _check(fn, plain, timed[-1], family)
        del fn, model
        gc.collect()  # a wrapped module and its runtime refer to each other: free its graphs before the next column
    _ratios(row)
    return row


def _ratios(row: dict) -> None:
    auto = row.get("auto")
    if not auto:
        return
    best = [row[c] for c in ("ragged", "pytorch_fast", "pytorch_nofast", "hf_sdpa") if row.get(c)]
    if best:
        row["auto_vs_best"] = min(best) / auto  # >= 0.97: within 3% of the better of eager ragged and PyTorch
    if row.get("varlen"):
        row["auto_vs_varlen"] = row["varlen"] / auto
    if row.get("auto_lengths"):
        row["auto_over_lengths"] = auto / row["auto_lengths"]  # <= 1.15
    for col in ("auto_before", "auto_recheck", "auto_pays"):
        if row.get(col):
            row[f"{col[5:]}_over_auto"] = row[col] / auto


def summarize(rows: list[dict]) -> dict:
    out = {}
    for key in (
        "auto_vs_best",
        "auto_vs_varlen",
        "auto_over_lengths",
        "before_over_auto",
        "recheck_over_auto",
        "pays_over_auto",
    ):
        vals = [r[key] for r in rows if r.get(key)]
        if vals:
            out[f"geomean_{key}"] = math.exp(float(np.mean(np.log(vals))))
            out[f"min_{key}"], out[f"max_{key}"] = min(vals), max(vals)
    return out


def print_table(family: str, rows: list[dict], columns: list[str]) -> None:
    cols = [("dataset", "dataset", ""), ("batch", "B", "d")] + [(c, c, ".3f") for c in columns]
    cols += [("auto_vs_best", "best eager / auto", ".2f"), ("auto_vs_varlen", "varlen / auto", ".2f"),
             ("auto_over_lengths", "auto / auto_lengths", ".2f")]  # fmt: skip
    for col in ("auto_before", "auto_recheck", "auto_pays"):
        if col in columns:
            cols.append((f"{col[5:]}_over_auto", f"{col[5:]} / auto", ".2f"))
    print(f"\n## {family}: ms per batch over the timed stream (back to back, no sync between batches)\n")
    print(table(rows, cols))
    for r in rows:
        for col, d in r["diag"].items():
            print(f"  {r['dataset']} B={r['batch']} {col}: {json.dumps(d)}")
        for col, why in r["failed"].items():
            print(f"  {r['dataset']} B={r['batch']} {col} did not run: {why}")


# -- the fresh-process mode -----------------------------------------------------------------------------------
def _profiler(args):
    """--profile-cold: a running cProfile for the cold stream (its host time, call by call), else None."""
    if not args.profile_cold:
        return None
    import cProfile

    pathlib.Path(args.profile_cold).mkdir(parents=True, exist_ok=True)
    prof = cProfile.Profile()
    prof.enable()
    return prof


def cold_warm_row(family, plain, dataset, batch, args, device) -> dict:
    """In this process: a fresh wrapped model runs `args.batches` new batches cold, then as many more (its warm
    time); with auto_warmed, warmup() first."""
    cfg = plain.config if family != "cora" else None
    width = cfg.hidden_size if cfg is not None else plain.layers[0].self_attn.embed_dim
    dtype, vocab = next(plain.parameters()).dtype, (cfg.vocab_size if cfg is not None else 0)
    seed = sum(map(ord, dataset)) * 1000 + batch
    first = make_batches(family, dataset, batch, args.batches, seed + 1, device, width, dtype, vocab)
    second = make_batches(family, dataset, batch, args.batches, seed + 2, device, width, dtype, vocab)
    row = {"model": family, "dataset": dataset, "batch": batch, "diag": {}, "failed": {}}
    for col in args.columns:
        t0 = time.perf_counter()
        fn, model, ctx, info = make_column(col, family, plain, args, dataset, batch)
        setup = time.perf_counter() - t0
        with torch.inference_mode(), ctx():
            n = len(COMPILES.events)
            before = _graph_totals(model)
            prof = _profiler(args)
            cold, cold_trace = traced_stream(fn, first, device, model)
            if prof is not None:
                prof.disable()
                prof.dump_stats(pathlib.Path(args.profile_cold, f"cold_{col}_{dataset}_{batch}_pid{os.getpid()}.prof"))
            compiled, n = COMPILES.since(n), len(COMPILES.events)
            ran = {"cold": _why_ran(model, len(first)), "cold_graphs": _graph_delta(model, before),
                   "cold_trace": cold_trace}  # fmt: skip
            before = _graph_totals(model)
            warm, warm_trace = traced_stream(fn, second, device, model)
            ran.update(warm=_why_ran(model, len(second)), warm_graphs=_graph_delta(model, before),
                       warm_trace=warm_trace)  # fmt: skip
        row[f"{col}_cold_ms"], row[f"{col}_warm_ms"] = 1e3 * cold, 1e3 * warm
        row[f"{col}_cold_over_warm"] = cold / warm
        warm_compiles = {f"warm_{k}": v for k, v in COMPILES.since(n).items() if k != "compiled"}
        totals = {k: v for k, v in _graph_totals(model).items() if k != "keys"}
        row["diag"][col] = {"setup_s": round(setup, 3), **info, **totals, **compiled, **warm_compiles}
        if model is not None:
            row["diag"][col]["ran"] = ran
        del fn, model
        gc.collect()
    return row


def fresh_processes(args, argv: list[str]) -> int:
    """Run this script's rows in fresh processes, each variant twice with one new Triton cache directory."""
    variants = [["auto"]] + ([["auto_warmed"]] if args.warmup_call else [])
    if args.user_columns:
        variants = [[c] for c in args.user_columns]
    passthrough = _strip(argv, ("--fresh-process", "--out", "--columns", "--warmup-call", "--before", "--ablate"))
    results = []
    for cols in variants:
        cache = tempfile.mkdtemp(prefix="triton-cache-")
        for run in (1, 2):
            with tempfile.TemporaryDirectory() as tmp:
                out = pathlib.Path(tmp) / "child.json"
                cmd = [sys.executable, __file__, *passthrough, "--child", "--columns", *cols, "--out", str(out)]
                env = {**os.environ, "TRITON_CACHE_DIR": cache}
                env.pop("OUT", None)  # the parent writes the results
                print(f"# {' '.join(cols)}, process {run} (TRITON_CACHE_DIR={cache}{', empty' if run == 1 else ''})",
                      flush=True)  # fmt: skip
                t0 = time.perf_counter()
                done = subprocess.run(cmd, env=env, check=False)
                wall = time.perf_counter() - t0
                if done.returncode != 0 or not out.exists():
                    print(f"  the child process failed (exit {done.returncode})", flush=True)
                    continue
                child = json.loads(out.read_text())
                for r in child["rows"]:
                    r.update(process=run, columns=cols, process_wall_s=round(wall, 1))
                    results.append(r)
    cols = [("model", "model", ""), ("dataset", "dataset", ""), ("batch", "B", "d"), ("process", "process", "d")]
    for c in sorted({c for r in results for c in r["columns"]}):
        cols += [(f"{c}_cold_ms", f"{c} cold ms", ".1f"), (f"{c}_warm_ms", f"{c} warm ms", ".1f"),
                 (f"{c}_cold_over_warm", f"{c} cold / warm", ".2f")]  # fmt: skip
    print("\n## cold start: a 100-batch stream on a fresh model, then 100 more (fresh process, new Triton cache)\n")
    print(table(results, cols))
    for r in results:
        print(f"  {r['dataset']} B={r['batch']} process {r['process']}: {json.dumps(_untraced(r['diag']))}")
        for col, d in r["diag"].items():
            trace = d.get("ran", {}).get("cold_trace")
            if trace:
                slow = trace["slowest_host"][:3]
                top = "; ".join(f"#{s['batch']} {s['host_ms']:.1f} ms host ({s['gc_ms']:.1f} gc), "
                                f"{s['gpu_ms']:.1f} gpu: {s['ran'][:50]}" for s in slow)  # fmt: skip
                print(f"    {col} cold: host {trace['host_ms']:.1f} ms (gc {trace['gc_ms']:.1f}), "
                      f"gpu {trace['gpu_ms']:.1f} ms; slowest: {top}")  # fmt: skip
    path = write_json("stream_table_fresh.json", {"env": environment(), "args": vars(args), "rows": results},
                      args.out)  # fmt: skip
    print(f"wrote {path}")
    return 0


def _untraced(diag: dict) -> dict:
    """`diag` without the per-batch traces (printed apart)."""
    out = {}
    for col, d in diag.items():
        ran = {k: v for k, v in d.get("ran", {}).items() if not k.endswith("_trace")}
        out[col] = {**d, "ran": ran} if "ran" in d else d
    return out


def _strip(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """argv without `flags` and the values that follow them."""
    out, skipping = [], False
    for a in argv:
        if a in flags:
            skipping = a in ("--out", "--columns")
            continue
        if skipping and not a.startswith("--"):
            continue
        skipping = False
        out.append(a)
    return out


# -- main -----------------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["cora"], choices=["cora", "bert-base"])
    p.add_argument("--quick", action="store_true", help="6 rows: CoLA, MNLI, RACE at B=32 and 128")
    p.add_argument("--datasets", nargs="+", choices=list(CORA), help="rows to run (default: all eight)")
    p.add_argument("--batch-sizes", nargs="+", type=int, help="default 32 64 128")
    p.add_argument("--warm", type=int, default=24, help="warm-up batches before the timed stream (0: cold)")
    p.add_argument("--batches", type=int, help="timed batches per row (default 64; 100 with --fresh-process)")
    p.add_argument("--columns", nargs="+", help="subset of the model's columns and the optional ones")
    p.add_argument("--before", action="store_true", help="also auto_before (the rules before the capture policy)")
    p.add_argument("--warmup-call", action="store_true", help="also auto_warmed: autoragged.warmup() first")
    p.add_argument("--ablate", action="store_true", help="also auto_recheck and auto_pays (one rule each)")
    p.add_argument("--warmup-batches", type=int, default=24, help="warmup()'s batches per size (default 24)")
    p.add_argument("--fresh-process", action="store_true", help="cold start in fresh processes (see above)")
    p.add_argument("--profile-cold", metavar="DIR", help="--fresh-process: cProfile each cold stream into DIR")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--db", help="tuning database for the auto columns (default $AUTORAGGED_DB or ~/.cache)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run (with --tiny)")
    p.add_argument("--tiny", action="store_true", help="tiny models (2 layers, width 64): the CPU smoke run")
    p.add_argument("--out", help="JSON path (default benchmarks/results/stream_table.json)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = _parser()
    args = p.parse_args(argv)
    args.user_columns = args.columns
    if args.batches is None:
        args.batches = 100 if (args.fresh_process or args.child) else 64
    if args.fresh_process:
        return fresh_processes(args, argv)
    if args.device == "cuda":
        require_cuda("benchmarks/stream_table.py")
    COMPILES.install()
    device = torch.device(args.device)
    env = environment()
    header("Streams of new batches (CoRa distributions; timed back to back, no sync between batches)", env)
    datasets = args.datasets or (QUICK[0] if args.quick else list(CORA))
    sizes = args.batch_sizes or (QUICK[1] if args.quick else list(CORA_BATCH_SIZES))
    results = {"env": env, "args": {k: v for k, v in vars(args).items()}, "models": {}}
    for name in args.models:
        family = "cora" if name == "cora" else "hf"
        if family == "hf":
            import transformers

            env["transformers"] = transformers.__version__
        known = CORA_COLUMNS if family == "cora" else HF_COLUMNS
        columns = list(args.user_columns or known)
        extra = {"auto_before": args.before, "auto_warmed": args.warmup_call, "auto_recheck": args.ablate,
                 "auto_pays": args.ablate}  # fmt: skip
        columns += [c for c, on in extra.items() if on]
        unknown = sorted(set(columns) - set(known) - set(OPTIONAL))
        if unknown:
            p.error(f"unknown columns {unknown} for {name}; choose from {known + OPTIONAL}")
        args.columns = list(dict.fromkeys(columns))
        plain = build_cora(device, args.tiny) if family == "cora" else build_hf(name, device, args.tiny)
        rows = []
        for dataset in datasets:
            for batch in sizes:
                row = (cold_warm_row if args.child else bench_row)(family, plain, dataset, batch, args, device)
                row["model"] = name
                rows.append(row)
                shown = " ".join(f"{c}={row[c]:.3f}" for c in args.columns if row.get(c))
                print(f"  {name} {dataset:8s} B={batch:3d} {shown}", flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        summary = summarize(rows)
        results["models"][name] = {"columns": args.columns, "summary": summary, "rows": rows}
        if not args.child:
            print_table(name, rows, args.columns)
            print("\n" + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()), flush=True)
        del plain
    if args.child:
        rows = [r for m in results["models"].values() for r in m["rows"]]
        pathlib.Path(args.out).write_text(json.dumps({"rows": rows}, default=str))
        return 0
    path = write_json("stream_table.json", results, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
