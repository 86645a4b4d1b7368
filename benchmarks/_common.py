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


def matmul_peak_tflops(dtype=torch.float16, n: int = 8192) -> float:
    """Measured dense matmul rate (random data, n x n x n), the yardstick for 'share of peak'."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = bench_ms(lambda: a @ b, rep_ms=300)["median_ms"]
    return 2 * n**3 / ms / 1e9


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
