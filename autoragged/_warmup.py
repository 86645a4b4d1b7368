"""`autoragged.warmup()`: pay compilation, capture and the policy's first timings before traffic arrives.

Traffic meets each new shape with what is ready: kernels compile on their first launch (an empty Triton cache
after a deploy compiles every specialisation again), and a graph is captured in the background while the shape
runs eagerly. `warmup` runs synthetic batches of the shapes a workload will bring through every wrapped module,
exactly as traffic runs them, waits for the captures they asked for, and runs them again exploring (policy rule
5: each arm is timed on each shape, so traffic meets no first trial there): new batches from that workload then
find their graphs captured, their kernels compiled and their arm chosen. Its batches are recorded like any (their
reason ends in "(warmup)").
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from .graphs.worker import worker
from .kernels.ahead import drain as drain_ahead
from .planning.buckets import cublas_rows, mask_width
from .planning.planner import default_ragged_config
from .ragged.layout import Layout
from .runtime.policy import MIN_SAMPLES
from .workloads import CORA, CORA_BATCH_SIZES, sample_cora

__all__ = ["warmup", "WarmupSummary"]

log = logging.getLogger("autoragged")

INPUTS = ("mask", "lengths", "both")
# At most one exploring pass per arm kind: a pass runs an untimed arm of a shape on each of its batches, so a shape
# with fewer batches than arms, or whose timing came beside a compile (no timing), leaves one for the next pass
ARM_KINDS = ("padded", "ragged", "ragged_graph")


@dataclass
class WarmupSummary:
    """What `warmup` did. modules: wrapped modules warmed; skipped: modules it could not warm, with why;
    batches: synthetic batches run (all modules); seconds: wall time; compile_s: time Triton spent compiling
    (or loading from its cache) kernels, None where not measurable (Triton's interpreter, a Triton without
    compile hooks); capture_s: host time of the CUDA-graph captures; captured: the graphs captured, as
    "module: B x width, lengths_from (inputs)" labels; graphs, graph_bytes: graphs kept now and their bytes (all
    modules); evictions: graphs evicted meanwhile; bound_reached: the memory bound stopped captures;
    explored: batches that ran an arm to time it on a shape where it had no timing (policy rule 5), all modules;
    cublas_rows: row counts (rungs) the eager arm's cuBLAS linears were run on, all modules (`_warm_cublas_rows`);
    ahead_s: the wait, at the end, for the kernel variants compiling in the background (`kernels/ahead.py`) to be
    done."""

    modules: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    batches: int = 0
    seconds: float = 0.0
    compile_s: float | None = None
    capture_s: float = 0.0
    captured: list[str] = field(default_factory=list)
    graphs: int = 0
    graph_bytes: int = 0
    evictions: int = 0
    bound_reached: bool = False
    explored: int = 0
    cublas_rows: int = 0
    ahead_s: float = 0.0


def warmup(
    model: nn.Module,
    lengths_or_workload,
    *,
    batch_sizes: Sequence[int] | None = None,
    batches: int = 32,
    inputs: str = "mask",
    max_memory: int | float | None = None,
    progress: bool = True,
    seed: int = 0,
) -> WarmupSummary:
    """Compile, capture and plan ahead of traffic for the shapes `lengths_or_workload` brings.

    lengths_or_workload: a CoRa workload name ("CoLA", ..., `autoragged.workloads.CORA`) or a list of them;
        a list of sequence lengths (a sample of the traffic's: batches are drawn from it); a list of batches
        (lists of lengths), run as given; or "calibration": the batch shapes the tuning database's
        calibration of this device measured (for each module's signature, else any).
    batch_sizes: the batch sizes traffic brings (default 32, 64, 128); not used with explicit batches.
    batches: synthetic batches per workload and batch size. On a GPU, a CoRa workload or a length sample also
        gets a few batches for each graph width the draws missed, from one below the narrowest drawn up to its
        longest sequence (`_tail`).
    inputs: "mask" (the key padding / attention mask, as PyTorch and HF code call a model), "lengths"
        (`lengths=` host ints) or "both": what traffic will pass.
    max_memory: bytes the captures may add (or a fraction of the device's free memory); None: only the
        graph cache's own budget (`wrap(graph_cap=)`).
    progress: a tqdm progress bar. seed: for the batches drawn.
    It returns once the captures and the kernel variants handed to the background meanwhile are done.
    Returns a `WarmupSummary`. Works anywhere: on a CPU there are no graphs to capture.
    """
    if inputs not in INPUTS:
        raise ValueError(f"inputs must be one of {INPUTS}, got {inputs!r}")
    if not isinstance(batches, int) or batches < 1:
        raise ValueError(f"batches must be an int >= 1, got {batches!r}")
    modules = [(name, m) for name, m in model.named_modules() if "_autoragged" in m.__dict__]
    if not modules:
        raise ValueError(f"warmup found no wrapped module in {type(model).__name__}: call autoragged.wrap(model) first")
    sizes = tuple(batch_sizes) if batch_sizes is not None else CORA_BATCH_SIZES
    if not sizes or any(not isinstance(b, int) or b < 1 for b in sizes):
        raise ValueError(f"batch_sizes must be ints >= 1, got {batch_sizes!r}")
    rng = np.random.default_rng(seed)
    plan = [(name, m, _batches(m._autoragged, lengths_or_workload, sizes, batches, rng)) for name, m in modules]
    longest = _longest(lengths_or_workload)
    if longest is not None:  # the length buckets the draws missed, up to the workload's longest sequence
        plan = [(name, m, groups + _tail(groups, longest, m._autoragged)) for name, m, groups in plan]
    modes = (True, False) if inputs == "both" else (inputs == "mask",)
    total = sum(len(groups) for _, _, groups in plan) * len(modes) * 2
    summary = WarmupSummary()
    t0 = time.perf_counter()
    with _compile_clock() as compile_s, _progress(total, progress) as bar, torch.inference_mode():
        for name, module, groups in plan:
            label = name or type(module).__name__
            why = _warm_module(label, module, groups, modes, max_memory, bar, summary)
            if why is not None:
                summary.skipped[label] = why
                bar.update(len(groups) * len(modes) * 2)
        # the variants the warm batches handed to the background compiler (the other tiles of each kernel they
        # launched) must be ready too: one compiled at first sight costs traffic 0.1-0.3 s
        t_ahead = time.perf_counter()
        drain_ahead()
        summary.ahead_s = time.perf_counter() - t_ahead
    summary.compile_s = compile_s[0]
    summary.seconds = time.perf_counter() - t0
    return summary


def _warm_module(label, module, groups, modes, max_memory, bar, summary) -> str | None:
    """Run `groups` (lists of lengths) through `module` as traffic would, wait for the captures they asked for,
    and run them again exploring; None, or why the module could not be warmed."""
    runtime = module._autoragged.ready(module)
    synthetic = getattr(runtime.body, "synthetic", None)
    if synthetic is None:
        return f"its adapter ({runtime.adapter.name}) makes no synthetic batches"
    device = runtime.probe().device
    cache = runtime.graph_cache() if device.type == "cuda" and runtime.options.graphs else None
    before = cache.stats() if cache is not None else None
    keys_before = set(cache.graphs) if cache is not None else set()
    if cache is not None and max_memory is not None:
        bound = max_memory
        if isinstance(max_memory, float) and max_memory <= 1.0:
            bound = int(max_memory * torch.cuda.mem_get_info(device)[0])
        cache.limit_bytes = cache.kept_bytes + int(bound)
    limit = getattr(runtime.body, "max_tokens", None)
    clipped = [[min(n, limit) for n in g] if limit is not None else g for g in groups]
    try:
        _force_first_runs(module, clipped, device)
        # traffic's first sight (asks for captures), then again exploring (times the graphs and every other arm),
        # and again while a pass explored (a timing taken beside a compile or a capture does not count)
        _pass(module, clipped, modes, synthetic, device, bar, summary, explore=False)
        for i in range(len(ARM_KINDS)):
            explored = _pass(module, clipped, modes, synthetic, device, bar, summary, explore=True)
            if not explored:
                break
            if i + 1 < len(ARM_KINDS):
                bar.total += len(clipped) * len(modes)
        runtime = module._autoragged  # (a structure change re-binds the module)
        summary.cublas_rows += _warm_cublas_rows(runtime, clipped, device)
        runtime.harvest(wait=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        if cache is not None:
            summary.bound_reached |= cache.limit_bytes is not None and cache.kept_bytes >= cache.limit_bytes
            cache.limit_bytes = None
    summary.modules += 1
    if cache is not None:
        after = cache.stats()
        summary.captured += [f"{label}: {_key_label(k)}" for k in cache.graphs if k not in keys_before]
        summary.capture_s += (after.capture_ms - before.capture_ms) / 1e3
        summary.evictions += after.evictions - before.evictions
        summary.graphs += after.graphs
        summary.graph_bytes += after.kept_bytes
    return None


def _pass(module, groups, modes, synthetic, device, bar, summary, explore: bool) -> int:
    """Run `groups` through `module` once, as traffic would (`explore`: exploring, policy rule 5), wait for the
    captures and timings they asked for; returns how many batches ran an arm to explore it."""
    runtime = module._autoragged
    before = sum(state.explored for state in runtime.shapes.values())
    for lengths in groups:
        for mask in modes:
            args, kwargs = synthetic(lengths, max(max(lengths), 1), device, mask=mask)
            with _tagged(module._autoragged, explore):
                module(*args, **kwargs)
            summary.batches += 1
            bar.update(1)
    worker.drain()
    after = module._autoragged  # (a structure change re-binds the module: its shapes start anew)
    if after.graphs is not None:
        after.graphs.record_ready()
    after.harvest(wait=True)
    explored = sum(state.explored for state in after.shapes.values()) - (before if after is runtime else 0)
    summary.explored += explored
    return explored


@contextlib.contextmanager
def _tagged(runtime, explore: bool = False):
    """Batches run inside are recorded with "(warmup)" at the end of their reason; `explore`: exploring."""
    runtime.tag, runtime.exploring = " (warmup)", explore
    try:
        yield
    finally:
        runtime.tag, runtime.exploring = "", False


def _force_first_runs(module, groups, device) -> None:
    """One batch of each batch size through the padded and the eager ragged arm, forced: an arm's first run in a
    process pays its kernels' first use (cuBLAS's handles, PyTorch's fast path), which a trial in traffic would
    otherwise pay. Only on a GPU, where the policy chooses."""
    runtime = module._autoragged
    if device.type != "cuda" or runtime.policy != "auto" or runtime.static_reason:
        return
    first: dict[int, list[int]] = {}
    for lengths in groups:
        first.setdefault(len(lengths), lengths)
    for forced in ("padded", "ragged"):
        for lengths in first.values():
            args, kwargs = runtime.body.synthetic(lengths, max(max(lengths), 1), device, mask=True)
            with runtime.forcing(forced), _tagged(runtime):
                module(*args, **kwargs)


def _warm_cublas_rows(runtime, groups, device) -> int:
    """Run the module's layers eagerly with cuBLAS linears on zeros, once on every row rung (`cublas_rows`) up to
    the most tokens a batch of `groups`' sizes and lengths can hold (or 1.5x the most a batch brought, if less);
    returns how many rungs. cuBLAS's first call on a row count costs 0.14-5 ms of host time per weight shape, and
    the eager arm runs on rungs: a stream's eager runs then find them paid. Nothing on a CPU, for causal (decoder)
    modules, nor where the ragged arm never runs."""
    body = runtime.body
    if device.type != "cuda" or body.causal or runtime.static_reason or runtime.policy == "padded":
        return 0
    top = cublas_rows(max(min(len(g) * max(g, default=0), sum(g) * 3 // 2) for g in groups))
    piece = max(1, min(64, getattr(body, "max_tokens", None) or 64))  # components short enough for cheap attention
    config = default_ragged_config(body.head_dim, piece)  # cuBLAS linears
    dtype, rows, n = runtime.probe().dtype, cublas_rows(1), 0
    with torch.inference_mode():
        while rows <= top:
            lengths = (piece,) * (rows // piece) + ((rows % piece,) if rows % piece else ())
            x = torch.zeros(rows, body.d_model, dtype=dtype, device=device)
            body.values(x, Layout.make(lengths), config, False)
            rows, n = cublas_rows(rows + 1), n + 1
    return n


def _key_label(key) -> str:
    return f"{key.batch} x {key.width}, {key.lengths_from} ({key.inputs}){' causal' if key.causal else ''}"


# -- the batches ----------------------------------------------------------------------------------------------
def _batches(runtime, workload, sizes, n: int, rng) -> list[list[int]]:
    """The synthetic batches (lists of lengths) for one module."""
    if isinstance(workload, str):
        workload = [workload]
    if not isinstance(workload, Sequence) or not workload:
        raise TypeError(
            "warmup needs a CoRa workload name or a list of them, a list of sequence lengths, a list of batches "
            f"(lists of lengths), or 'calibration'; got {type(workload).__name__}"
        )
    if all(isinstance(w, str) for w in workload):
        out = []
        for name in workload:
            if name == "calibration":
                out += _calibrated(runtime)
            elif name in CORA:
                out += [sample_cora(name, b, rng) for b in sizes for _ in range(n)]
            else:
                raise ValueError(f"unknown workload {name!r}: one of {sorted(CORA)} or 'calibration'")
        return out
    if all(isinstance(w, (int, np.integer)) for w in workload):
        pool = np.asarray(workload, dtype=np.int64)
        if pool.min() < 0:
            raise ValueError(f"sequence lengths must be >= 0, got {int(pool.min())}")
        return [rng.choice(pool, size=b).tolist() for b in sizes for _ in range(n)]
    batches = [list(map(int, b)) for b in workload if isinstance(b, Sequence) and not isinstance(b, str)]
    if len(batches) != len(workload) or any(not b or min(b) < 0 for b in batches):
        raise ValueError("a list of batches must hold non-empty lists of lengths >= 0")
    return batches


def _longest(workload) -> int | None:
    """The longest sequence a workload brings: a CoRa dataset's maximum, a length sample's; None for explicit
    batches and the calibration's shapes (run as given)."""
    names = [workload] if isinstance(workload, str) else workload
    if all(isinstance(w, str) for w in names):
        found = [CORA[w].max for w in names if w in CORA]
        return max(found) if found and len(found) == len(names) else None
    if all(isinstance(w, (int, np.integer)) for w in workload):
        return int(max(workload))
    return None


def _tail(groups: list[list[int]], longest: int, runtime) -> list[list[int]]:
    """Batches for the graph widths (`mask_width`, 2 per octave) that no drawn batch of a batch size reached, from
    one below the narrowest drawn to the one of `longest`: each a drawn batch (the one with the longest sequence
    under the width, else the shortest) with its lengths cut to the width and its longest one set to it (at most
    `longest`), `MIN_SAMPLES` times each, so the graph is captured and its arm timed. Only where graphs run (a
    GPU): traffic after a warm-up on 24 draws of CoLA B=128 met a width no draw had reached (33-37 tokens against
    at most 32) within 20 batches."""
    if not runtime.options.graphs or runtime.probe().device.type != "cuda":
        return []
    out = []
    top = mask_width(longest)
    for b in sorted({len(g) for g in groups}):
        drawn = [g for g in groups if len(g) == b]
        widths = {mask_width(max(g)) for g in drawn}
        rungs = _rungs(top)
        below = [w for w in rungs if w < min(widths)]
        wanted = below[-1:] + [w for w in rungs if w > min(widths) and w not in widths]
        for w in wanted:
            under = [g for g in drawn if max(g) <= w]
            base = max(under, key=max) if under else min(drawn, key=max)
            batch = sorted(min(n, w) for n in base)
            batch[-1] = min(w, longest)
            out += [batch] * MIN_SAMPLES
    return out


def _rungs(top: int) -> list[int]:
    """The mask widths up to `top`, ascending."""
    out, w = [], mask_width(1)
    while w <= top:
        out.append(w)
        w = mask_width(w + 1)
    return out


def _calibrated(runtime) -> list[list[int]]:
    """One batch per distinct (batch, max_len, total) the tuner measured on this device: for this module's
    signature, else for any; lengths with those statistics (one row at max_len, the rest even)."""
    from .planning.device import device_key
    from .tuning_db import DatabaseError

    path = runtime.db_path
    if path is None or not path.exists():
        raise ValueError("warmup('calibration') needs the module's tuning database (wrap(db=...)); it has none")
    from .runtime.recorder import RECORDER

    key = device_key(runtime.probe().device).key
    try:
        db = RECORDER.open_db(path)
        if db is None:
            raise ValueError(f"warmup('calibration') cannot use {path}: see the WARNING above")
        found = db.measurements(device=key, signature=runtime.sig_key, source="tune")
        found = found or db.measurements(device=key, source="tune")
    except DatabaseError as e:
        raise ValueError(f"warmup('calibration') cannot read {path}: {e}") from e
    if not found:
        raise ValueError(f"{path} holds no calibration of {key}: run python -m autoragged.tune on this device")
    shapes = sorted({(m.stats.batch, m.stats.max_len, m.stats.total) for m in found})
    return [_lengths_like(*shape) for shape in shapes if shape[0] > 0]


def _lengths_like(batch: int, max_len: int, total: int) -> list[int]:
    rest = max(total - max_len, 0)
    if batch == 1:
        return [max_len]
    base, extra = divmod(rest, batch - 1)
    return [max_len] + [min(base + (i < extra), max_len) for i in range(batch - 1)]


# -- helpers --------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc="autoragged warmup", unit="batch", disable=not enabled)
    try:
        yield bar
    finally:
        bar.close()


@contextlib.contextmanager
def _compile_clock():
    """[seconds Triton spent compiling (or loading from its cache) kernels meanwhile], through Triton's JIT
    hooks where this Triton has them; [None] otherwise (and under the interpreter, which compiles nothing)."""
    total = [None]
    try:
        from triton import knobs

        hooks = knobs.runtime
        before, after = hooks.jit_cache_hook, hooks.jit_post_compile_hook
    except (ImportError, AttributeError):
        yield total
        return
    from .kernels.config import interpreting

    if interpreting():
        yield total
        return
    total[0] = 0.0
    started = [None]

    def pre(*args, **kwargs):
        started[0] = time.perf_counter()
        return before(*args, **kwargs) if before is not None else None

    def post(*args, **kwargs):
        if started[0] is not None:
            total[0] += time.perf_counter() - started[0]
            started[0] = None
        return after(*args, **kwargs) if after is not None else None

    hooks.jit_cache_hook, hooks.jit_post_compile_hook = pre, post
    try:
        yield total
    finally:
        hooks.jit_cache_hook, hooks.jit_post_compile_hook = before, after
