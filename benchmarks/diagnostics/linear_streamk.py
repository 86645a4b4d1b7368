"""Probe: a stream-K tail for the TMA linear's wave quantization, against data-parallel tiles and cuBLAS.

With live rows, `_linear_tma_kernel`'s persistent grid (two programs per SM) walks whole 128 x 128 tiles, so a
weight of 768 columns at 11,560 rows is 546 tiles on 264 programs: three rounds for 2.07 rounds of work. Here the
last (P + tiles % P) tiles are split by K iterations evenly over the P programs instead (stream-K): each program
walks its pieces from the highest down; a piece that does not end its tile leaves an fp32 partial and a flag, and the
program whose piece ends the tile waits for the lower programs' partials, adds them, and runs the epilogue (in the
interpreter programs run in id order, so the partials are there). Modes: 0 whole tiles in this kernel, 1 the
hybrid in one kernel, 2 stream-K over every tile, 3 and 4 the hybrid as two kernels (whole tiles, then the tail).

    python benchmarks/diagnostics/linear_streamk.py --shapes bert_ff2 bert_out --rows 5511 11560

Each call in a CUDA graph of ten (`linear_tiles.graph_ms`), the input sized for twice the rows, fp16, us a call.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from autoragged.kernels import ragged_linear as k_lin  # noqa: E402
from autoragged.kernels.config import KernelConfig  # noqa: E402
from autoragged.kernels.pdl import enabled as pdl_enabled  # noqa: E402
from autoragged.kernels.pdl import wait_prior  # noqa: E402
from autoragged.kernels.ragged_linear import _bias_activation, _grouped, _plan  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from benchmarks._common import header, require_cuda  # noqa: E402
from benchmarks.diagnostics.linear_tiles import SHAPES, graph_ms  # noqa: E402

LARGE = KernelConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)  # the default past 3,072 rows


@triton.jit
def _store_tile(y_desc, acc, Bias, off_m, off_n, N, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    if BLOCK_N >= 128:
        half: tl.constexpr = BLOCK_N // 2
        a0, a1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, half)), (0, 2, 1)))
        a0 = _bias_activation(a0, Bias, off_n + tl.arange(0, half), N, HAS_BIAS, ACTIVATION)
        y_desc.store([off_m, off_n], a0.to(y_desc.dtype))
        a1 = _bias_activation(a1, Bias, off_n + half + tl.arange(0, half), N, HAS_BIAS, ACTIVATION)
        y_desc.store([off_m, off_n + half], a1.to(y_desc.dtype))
    else:
        acc = _bias_activation(acc, Bias, off_n + tl.arange(0, BLOCK_N), N, HAS_BIAS, ACTIVATION)
        y_desc.store([off_m, off_n], acc.to(y_desc.dtype))


@triton.jit
def _product(x_desc, w_desc, acc, off_m, off_n, k_lo, k_hi, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
             PRECISION: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    for ki in tl.range(k_lo, k_hi, num_stages=NUM_STAGES):
        a = x_desc.load([off_m, ki * BLOCK_K])
        b = w_desc.load([off_n, ki * BLOCK_K])
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32).T, acc, input_precision=PRECISION)
        else:
            acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["M"])
def _linear_sk_kernel(
    x_desc, w_desc, y_desc, Bias, Live, Part, Flag, M, N, K,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_LIVE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip
    wait_prior(PDL)
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    num_n = tl.cdiv(N, BLOCK_N)
    rows = M
    if HAS_LIVE:
        rows = tl.minimum(tl.load(Live), M)
    num_m = tl.cdiv(rows, BLOCK_M)
    tiles = num_m * num_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    rem = tiles % P
    if MODE == 2:
        rem = 1
    whole = tiles  # tiles [0, whole) are whole; the rest are split
    if MODE == 1 or MODE == 3 or MODE == 4:
        if rem != 0:
            whole = tl.maximum(tiles // P - 1, 0) * P
    if MODE == 2:
        whole = 0
    whole_end = whole
    if MODE == 4:
        whole_end = 0
    for tile in tl.range(pid, whole_end, P, flatten=True):
        pid_m, pid_n = _grouped(tile, num_m, num_n, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc = _product(x_desc, w_desc, acc, pid_m * BLOCK_M, pid_n * BLOCK_N, 0, k_tiles, BLOCK_K, NUM_STAGES,
                       PRECISION, UPCAST)  # fmt: skip
        _store_tile(y_desc, acc, Bias, pid_m * BLOCK_M, pid_n * BLOCK_N, N, HAS_BIAS, ACTIVATION, BLOCK_M, BLOCK_N)
    if MODE != 0 and MODE != 3 and rem != 0:
        split = (tiles - whole) * k_tiles
        base = split // P
        extra = split % P
        start = pid * base + tl.minimum(pid, extra)
        end = start + base + (pid < extra).to(tl.int32)
        offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        it = end
        while it > start:
            t = (it - 1) // k_tiles
            t_begin = t * k_tiles
            lo = tl.maximum(start, t_begin)
            pid_m, pid_n = _grouped(whole + t, num_m, num_n, GROUP_M)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc = _product(x_desc, w_desc, acc, pid_m * BLOCK_M, pid_n * BLOCK_N, lo - t_begin, it - t_begin,
                           BLOCK_K, NUM_STAGES, PRECISION, UPCAST)  # fmt: skip
            if it == t_begin + k_tiles:  # this piece ends the tile: add the lower programs' pieces
                q = pid - 1
                q_end = start
                while q_end > t_begin:
                    while tl.atomic_cas(Flag + q, 1, 0, sem="acquire") != 1:
                        pass
                    acc += tl.load(Part + q.to(tl.int64) * (BLOCK_M * BLOCK_N) + offs)
                    q_end = q * base + tl.minimum(q, extra)
                    q -= 1
                _store_tile(y_desc, acc, Bias, pid_m * BLOCK_M, pid_n * BLOCK_N, N, HAS_BIAS, ACTIVATION, BLOCK_M,
                            BLOCK_N)  # fmt: skip
            else:
                tl.store(Part + pid.to(tl.int64) * (BLOCK_M * BLOCK_N) + offs, acc)
                tl.debug_barrier()
                tl.atomic_xchg(Flag + pid, 1, sem="release")
            it = lo


_WORK: dict = {}


def streamk_linear(x, weight, bias, activation, config, live=None, out=None, mode=1):
    """act(x @ weight.T + bias) by `_linear_sk_kernel` in `mode` (3 and 4 are two launches: whole, then split)."""
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device) if out is None else out
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    plan = _plan(N, K, x.dtype, activation, bias is not None, live is not None, config, precision, x.device,
                 pdl_enabled(x.device))  # fmt: skip
    c, P = plan.config, plan.programs
    key = (x.device, P, c.block_m, c.block_n)
    if key not in _WORK:  # one workspace: the probe runs one stream
        _WORK[key] = (torch.empty(P * c.block_m * c.block_n, dtype=torch.float32, device=x.device),
                      torch.zeros(P, dtype=torch.int32, device=x.device))  # fmt: skip
    part, flag = _WORK[key]
    descs = (TensorDescriptor.from_tensor(x, plan.x_block), TensorDescriptor.from_tensor(weight, plan.w_block),
             TensorDescriptor.from_tensor(out, plan.y_block))  # fmt: skip
    args = (*descs, bias if bias is not None else x, live if live is not None else x, part, flag, M, N, K)
    for m in (3, 4) if mode == 34 else (mode,):
        _linear_sk_kernel[(P,)](*args, **plan.tma_kwargs, MODE=m)
    return out


def bench(shape: str, rows: int, modes: list[int], stages: list[int], dev: torch.device) -> str:
    """One point's line: cuBLAS on exactly the rows, the whole tiles of `ragged_linear`, and each mode on each
    pipeline depth of the stream-K kernel."""
    n, k, act = SHAPES[shape]
    x = torch.randn(-(-2 * rows // 128) * 128, k, device=dev, dtype=torch.float16)
    w = torch.randn(n, k, device=dev, dtype=torch.float16) / k**0.5
    b = torch.randn(n, device=dev, dtype=torch.float16)
    live = torch.tensor([rows], dtype=torch.int32, device=dev)
    want = k_lin.ragged_linear_ref(x[:rows].float(), w.float(), b.float(), act)
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=dev)
    fns = {"cublas": lambda: k_lin.cublas_linear(x[:rows], w, b, act),
           "whole": lambda: k_lin.ragged_linear(x, w, b, act, LARGE, live=live, out=out)}  # fmt: skip
    for s in stages:
        config = LARGE.replace(num_stages=s)
        for m in modes:
            y = torch.full_like(out, float("nan"))
            streamk_linear(x, w, b, act, config, live, y, m)
            err = ((y[:rows].float() - want).norm() / want.norm()).item()
            if not err < 1e-2:  # NaN (a tile not written) fails too
                raise RuntimeError(f"{shape} rows={rows} mode {m}: relative error {err:.2e}")
            fns[f"s{s} mode {m}"] = lambda m=m, c=config: streamk_linear(x, w, b, act, c, live, out, m)
    tiles = -(-rows // 128) * -(-n // 128)
    cells = " ".join(f"{name}={graph_ms(fn) * 1e3:6.1f}" for name, fn in fns.items())
    return f"  {shape:10s} rows={rows:6d} tiles={tiles:5d} {cells}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["bert_ff2", "bert_out", "minilm_ff2"], choices=list(SHAPES))
    p.add_argument("--rows", nargs="+", type=int, default=[4000, 5511, 7472, 11560, 23302])
    p.add_argument("--modes", nargs="+", type=int, default=[0, 1, 2, 34], choices=[0, 1, 2, 34])
    p.add_argument("--stages", nargs="+", type=int, default=[3, 2], help="the stream-K kernel's pipeline depths")
    args = p.parse_args(argv)
    dev = require_cuda("benchmarks/diagnostics/linear_streamk.py")
    header("Stream-K tail for the TMA linear (fp16, live rows, in a CUDA graph), us a call")
    for shape in args.shapes:
        for rows in args.rows:
            print(bench(shape, rows, args.modes, args.stages, dev), flush=True)
    for kernel in (k_lin._linear_tma_kernel, _linear_sk_kernel):  # what each compiled variant holds
        for caches in getattr(kernel, "device_caches", {}).values():
            for compiled in caches[0].values():
                meta = compiled.metadata
                stages, shared = getattr(meta, "num_stages", "?"), getattr(meta, "shared", "?")
                print(f"  {kernel.fn.__name__}: {stages} stages, {compiled.n_regs} registers, "
                      f"{compiled.n_spills} spilled, {shared} B shared")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
