"""Where an SFT step's host time goes: the host cost of single launches, and whole steps of the Qwen2.5-0.5B shape
on tiny batches (8 documents of 16-40 tokens: the GPU's work negligible, so a step takes its host time) and on
train_table.py's batches (8 lognormal documents), for HF padded, HF packed and the wrapped model on both formats.

    python benchmarks/diagnostics/host_floor.py      # on a GPU

Per call: the host time of 300 calls queued back to back (synchronised before and after), in us. Per step: the
median of 8 steps after 4 warm-up steps of the wall time and of the host time of its forward, its backward (until
`backward()` returns: the autograd engine has launched everything) and the optimizer step, in ms.
"""

from __future__ import annotations

import copy
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from autoragged.kernels import rms_norm  # noqa: E402

import autoragged  # noqa: E402
from autoragged.workloads import llm_config  # noqa: E402


def host_us(fn, n: int = 300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return us


def per_call(dev) -> dict[str, float]:
    x = torch.randn(64, 896, device=dev, dtype=torch.bfloat16)
    w = torch.randn(896, 896, device=dev, dtype=torch.bfloat16)
    b = torch.randn(896, device=dev, dtype=torch.bfloat16)
    out, total = torch.empty_like(x), torch.empty_like(x)
    config = rms_norm.default_config(896)
    grid = (-(-64 // config.block_m),)
    args = (x, x, w[0], out, total, 64, 896, 1e-6, 896, 896, 896, 896)
    flags = dict(HAS_RES=True, STORE_SUM=True, BLOCK_M=config.block_m, BLOCK_N=1024, num_warps=config.num_warps)
    compiled = rms_norm._add_rms_norm_kernel[grid](*args, **flags)
    binder = rms_norm._add_rms_norm_kernel.device_caches[torch.cuda.current_device()][-1]  # Triton 3.6's
    bound = list(binder(*args, **flags)[0].values())
    stream = torch.cuda.current_stream().cuda_stream
    calls = {
        "torch.empty": lambda: torch.empty((64, 896), device=dev, dtype=torch.bfloat16),
        "torch.zeros": lambda: torch.zeros((64, 896), device=dev, dtype=torch.bfloat16),
        "linear": lambda: F.linear(x, w),
        "linear with a bias": lambda: F.linear(x, w, b),
        "add_rms_norm (its launcher)": lambda: rms_norm.add_rms_norm(x, x, w[0], 1e-6, store_sum=True),
        "Triton kernel[grid](...)": lambda: rms_norm._add_rms_norm_kernel[grid](*args, **flags),
        "Triton compiled handle": lambda: compiled.run(
            grid[0], 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *bound
        ),
    }
    return {name: host_us(fn) for name, fn in calls.items()}


def steps(dev) -> dict[tuple[str, str], dict[str, float]]:
    import transformers
    from train_table import sft_batch, sft_lengths

    config = llm_config("qwen2.5-0.5b")
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(dev).train()
    rng, g = np.random.default_rng(8), torch.Generator().manual_seed(8)
    regimes = {
        "tiny": [sft_batch([int(v) for v in rng.integers(16, 40, 8)], g, config.vocab_size, dev) for _ in range(12)],
        "real": [sft_batch(sft_lengths(8, rng), g, config.vocab_size, dev) for _ in range(12)],
    }
    out = {}
    for col in ("HF padded", "HF packed", "wrapped, padded", "wrapped, packed"):
        model = copy.deepcopy(plain)
        if col.startswith("wrapped"):
            autoragged.wrap(model, db=False, policy="ragged")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        fmt = "padded" if col.endswith("padded") else "packed"
        for regime, batches in regimes.items():
            for batch in batches[:4]:
                model(**batch[fmt]).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times = {"wall": [], "forward": [], "backward": [], "optimizer": []}
            for batch in batches[4:]:
                t0 = time.perf_counter()
                loss = model(**batch[fmt]).loss
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                opt.step()
                opt.zero_grad(set_to_none=True)
                t3 = time.perf_counter()
                torch.cuda.synchronize()
                for k, v in zip(times, (time.perf_counter() - t0, t1 - t0, t2 - t1, t3 - t2)):
                    times[k].append(v * 1000)
            out[col, regime] = {k: float(np.median(v)) for k, v in times.items()}
        del model, opt
        torch.cuda.empty_cache()
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("host_floor.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__}\n\n| call | host us |\n|---|---|")
    for name, us in per_call(dev).items():
        print(f"| {name} | {us:.1f} |")
    print("\n| column | batches | step ms | host forward | host backward | host optimizer |\n|---|---|---|---|---|---|")
    for (col, regime), t in steps(dev).items():
        cells = " | ".join(f"{t[k]:.1f}" for k in ("wall", "forward", "backward", "optimizer"))
        print(f"| {col} | {regime} | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
