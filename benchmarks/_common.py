"""Shared benchmark plumbing: environment header, timing, tables, JSON."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import sys

import torch

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def environment() -> dict:
    import triton

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["sm_count"] = props.multi_processor_count
        env["memory_gb"] = round(props.total_memory / 2**30, 1)
    return env


def header(title: str, env: dict) -> None:
    print(f"# {title}")
    print(" | ".join(f"{k} {v}" for k, v in env.items()))
    sys.stdout.flush()


def require_cuda(name: str) -> None:
    if not torch.cuda.is_available():
        print(f"{name}: needs a CUDA GPU (none found); nothing measured.", file=sys.stderr)
        raise SystemExit(2)


def bench_ms(fn, *, warmup_ms: float = 25, rep_ms: float = 100) -> dict:
    """Median / p10 / p90 milliseconds of `fn` (CUDA events through triton.testing.do_bench, which
    also flushes L2 between runs)."""
    from triton.testing import do_bench

    p10, med, p90 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.1, 0.5, 0.9])
    return {"median_ms": med, "p10_ms": p10, "p90_ms": p90}


def gpu_ms(fn, n: int = 200, warmup: int = 5) -> float:
    """ms a call of `fn` queued back to back: n calls, no sync between them, timed by CUDA events, divided by n
    (the GPU's time where the host keeps ahead of it, else the host's)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def matmul_peak_tflops(dtype=torch.float16, n: int = 8192, shape: tuple[int, int, int] | None = None) -> float:
    """Measured dense matmul rate (random data, n x n x n, or (m, k, n) = `shape`), the yardstick for 'share of
    peak' (a model's own product shape gives its roofline)."""
    m, k, n = shape or (n, n, n)
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype)
    ms = bench_ms(lambda: a @ b, rep_ms=300)["median_ms"]
    return 2 * m * k * n / ms / 1e9


def kind_of(name: str, kinds: list[tuple[str, tuple[str, ...]]]) -> str:
    """The kind of a CUDA kernel by name: the first of `kinds` (kind, name fragments) that matches, else
    "elementwise" for PyTorch's elementwise kernels and "other"."""
    low = name.lower()
    for kind, keys in kinds:
        if any(k.lower() in low for k in keys):
            return kind
    return "elementwise" if "elementwise" in low or "vectorized" in low else "other"


def profile_kernels(fn, kinds) -> tuple[float, dict[str, float], list]:
    """One call of `fn` under torch.profiler: (kernel ms, kernel ms by `kind_of`, the 12 longest kernels as
    [name, ms, launches])."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_kind: dict[str, float] = {}
    kernels = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us:
            kind = kind_of(e.key, kinds)
            by_kind[kind] = by_kind.get(kind, 0.0) + us / 1e3
            kernels.append([e.key[:90], us / 1e3, e.count])
    kernels.sort(key=lambda k: -k[1])
    return sum(by_kind.values()), by_kind, kernels[:12]


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Markdown table; columns are (key, title, format)."""
    head = "| " + " | ".join(t for _, t, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = []
    for r in rows:
        cells = []
        for key, _, fmt in columns:
            v = r.get(key)
            cells.append("-" if v is None else format(v, fmt) if fmt else str(v))
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, rule, *body])


def write_json(name: str, payload: dict, out: str | None = None) -> pathlib.Path:
    """Write under benchmarks/results/ (and also into $OUT when set, for the lent GPU machine)."""
    path = pathlib.Path(out) if out else RESULTS / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=str))
    extra = os.environ.get("OUT")
    if extra:
        pathlib.Path(extra, path.name).write_text(path.read_text())
    return path


def what_ran(model, n: int) -> dict[str, int]:
    """What a wrapped model's last n decisions ran ("arm[:linear backend] | reason"), counted."""
    import autoragged

    ran: dict[str, int] = {}
    for d in autoragged.recent_decisions(model, n):
        key = f"{d.arm}{'' if d.config is None else ':' + d.config['backend']} | {d.reason[:70]}"
        ran[key] = ran.get(key, 0) + 1
    return ran
