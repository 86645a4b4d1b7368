"""Linear layer over ragged values: y = act(x W^T + b) on `[T, K]` rows, with `nn.Linear`'s weight layout.

One weight is shared by every component, so the ragged product is a dense one over the values' rows
(gap rows included): a tiled matmul with grouped program order for L2 reuse of weight tiles, fp32
accumulation, and bias plus relu/gelu fused in the epilogue. cuBLAS (`torch.nn.functional.linear`)
is the other backend; the tuner decides which wins for which shape.

Two kernels compute it. On Hopper (and in the interpreter) tiles move through TMA tensor descriptors, and
a persistent grid walks them in one flattened loop, so the loads of a program's next tile overlap the
epilogue of its last (`_linear_tma_kernel`). Elsewhere, for tensors TMA cannot address (16-byte aligned
base and row strides), and under torch.compile, the pointer kernel runs (`_linear_kernel`). In a CUDA
graph with live rows on an H100 the TMA kernel's default tiles reach 0.68-1.19x cuBLAS's rate (geomean 0.87), the
pointer kernel's geomean 0.67x (bert-base's four linears and MiniLM's ff2 at 2,811-11,560 rows,
benchmarks/diagnostics/linear_tiles.py).

Shape contracts
    x:       (T, K), stride 1 on K
    weight:  (N, K), `nn.Linear` layout, stride 1 on K
    bias:    (N,) or None
    out:     (T, N), contiguous
    live:    optional (1,) int32/int64 on the device: only rows < live[0] are needed. A fixed grid of at most
             `persistent_programs` programs then walks the tiles of those rows, so a CUDA graph captured for
             a row capacity does the work of the rows a batch fills; the output's rows from live[0] on are
             unspecified (the reference computes them).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.library import triton_op, wrap_triton

from . import ahead
from .config import KernelConfig, _identity, dot_upcast, interpreting, next_pow2
from .pdl import enabled as pdl_enabled
from .pdl import wait_prior
from .triton_compat import HAS_TRITON, tl, triton

if HAS_TRITON:
    from triton.tools.tensor_descriptor import TensorDescriptor

__all__ = [
    "check_live",
    "persistent_programs",
    "sm_count",
    "tma_usable",
    "fit_shared_memory",
    "ragged_linear",
    "ragged_linear_ref",
    "cublas_linear",
    "CONFIGS",
    "DEFAULT_CONFIG",
    "ACTIVATIONS",
    "prune",
    "default_config",
    "sibling_tiles",
    "compile_sibling_tiles",
]

ACTIVATIONS = (None, "relu", "gelu")
_ACT_CODE = {None: 0, "relu": 1, "gelu": 2}


@triton.jit
def _gelu(x):
    """Exact gelu (nn.GELU()'s default), x * (1 + erf(x / sqrt 2)) / 2, through erfc's Chebyshev fit (Numerical
    Recipes' erfcc, relative error below 1.2e-7, in the negative tail too, where 1 + erf cancels): about 15
    instructions an element against libdevice erf's 50. The epilogue does not overlap the tile's products, so
    this is most of its cost: bert-base's ff1 at 5,681 rows took 75 us against 108 with tl.math.erf (H200)."""
    z = tl.abs(x) * 0.7071067811865476
    t = 1.0 / (1.0 + 0.5 * z)
    p = -0.82215223 + t * 0.17087277
    p = 1.48851587 + t * p
    p = -1.13520398 + t * p
    p = 0.27886807 + t * p
    p = -0.18628806 + t * p
    p = 0.09678418 + t * p
    p = 0.37409196 + t * p
    p = 1.00002368 + t * p
    p = -1.26551223 + t * p
    half_erfc = 0.5 * t * tl.exp(p - z * z)  # erfc(z) / 2
    return x * tl.where(x >= 0, 1.0 - half_erfc, half_erfc)


@triton.jit
def _bias_activation(acc, Bias, offs_n, N, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr):
    """The epilogue both kernels share: + bias, then relu or exact gelu, in fp32."""
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == 1:
        acc = tl.maximum(acc, 0.0)
    elif ACTIVATION == 2:
        acc = _gelu(acc)
    return acc


@triton.jit
def _linear_tile(
    X, W, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym, pid_m, pid_n,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One (BLOCK_M, BLOCK_N) tile of the output."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # clamp rows/cols into range so the K loop needs no row/col masks (the store masks them)
    rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    x_ptrs = X + rows[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = W + cols[None, :] * stride_wn + offs_k[:, None]  # (BLOCK_K, BLOCK_N) tile of W^T
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            a = tl.load(x_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
            b = tl.load(w_ptrs, mask=offs_k[:, None] < K - k0, other=0.0)
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    acc = _bias_activation(acc, Bias, offs_n, N, HAS_BIAS, ACTIVATION)
    y_ptrs = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _grouped(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of linear tile number `tile` in grouped order: GROUP_M row tiles walk the
    column tiles together, so weight tiles stay in L2."""
    group = GROUP_M * num_n
    first_m = (tile // group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % group) % group_rows, (tile % group) // group_rows


# M changes with every batch: Triton would compile a kernel per value class (1, multiple of 16, other),
# inside a stream of new batches; it only bounds masks and the grid, so it is not specialised
@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    X, W, Bias, Y, Live, M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, EVEN_K: tl.constexpr, HAS_LIVE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_prior(PDL)
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    if HAS_LIVE:
        # Only rows < *Live are needed, and only the device knows how many: a fixed grid of programs (sized
        # on the host, for a CUDA graph's capture) walks the tiles of those rows, none past them.
        num_m = tl.cdiv(tl.minimum(tl.load(Live), M), BLOCK_M)
        for tile in range(pid, num_m * num_n, tl.num_programs(0)):
            pid_m, pid_n = _grouped(tile, num_m, num_n, GROUP_M)
            _linear_tile(X, W, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym, pid_m, pid_n,
                         HAS_BIAS, ACTIVATION, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST)  # fmt: skip
    else:
        pid_m, pid_n = _grouped(pid, tl.cdiv(M, BLOCK_M), num_n, GROUP_M)
        _linear_tile(X, W, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym, pid_m, pid_n,
                     HAS_BIAS, ACTIVATION, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST)  # fmt: skip


@triton.jit(do_not_specialize=["M"])  # as _linear_kernel
def _linear_tma_kernel(
    x_desc, w_desc, y_desc, Bias, Live, M, N, K,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_LIVE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """A persistent grid over the output tiles of the first min(*Live, M) rows (all M without Live), one
    flattened loop over (tile, k): TMA loads of the next tile start while this one's epilogue runs. Loads
    past M or K read zeros and stores past M or N are dropped, by the descriptors' bounds: no masks."""
    wait_prior(PDL)
    num_n = tl.cdiv(N, BLOCK_N)
    rows = M
    if HAS_LIVE:
        rows = tl.minimum(tl.load(Live), M)
    num_m = tl.cdiv(rows, BLOCK_M)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=True):
        pid_m, pid_n = _grouped(tile, num_m, num_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for ki in tl.range(0, k_tiles, num_stages=NUM_STAGES):
            a = x_desc.load([off_m, ki * BLOCK_K])
            b = w_desc.load([off_n, ki * BLOCK_K])
            if UPCAST:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32).T, acc, input_precision=PRECISION)
            else:
                acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
        if BLOCK_N >= 128:  # the epilogue and store in halves, fewer live registers and a smaller staging tile: a
            half: tl.constexpr = BLOCK_N // 2  # bert-base layer's linears, 11,560 rows, 128 x 128: 324 us against 380
            a0, a1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, half)), (0, 2, 1)))
            a0 = _bias_activation(a0, Bias, off_n + tl.arange(0, half), N, HAS_BIAS, ACTIVATION)
            y_desc.store([off_m, off_n], a0.to(y_desc.dtype))
            a1 = _bias_activation(a1, Bias, off_n + half + tl.arange(0, half), N, HAS_BIAS, ACTIVATION)
            y_desc.store([off_m, off_n + half], a1.to(y_desc.dtype))
        else:
            acc = _bias_activation(acc, Bias, off_n + tl.arange(0, BLOCK_N), N, HAS_BIAS, ACTIVATION)
            y_desc.store([off_m, off_n], acc.to(y_desc.dtype))


# -- config space -------------------------------------------------------------------------------
# Keyed by (N, K, dtype) and a bucket of T (rows), never T itself: T changes every batch.
CONFIGS = [
    KernelConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s, group_m=8)
    for bm in (64, 128)
    for bn in (64, 128, 256)
    for bk in (32, 64)
    for w in (4, 8)
    for s in (2, 3, 4)
] + [KernelConfig(backend="cublas")]
DEFAULT_CONFIG = KernelConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)


def prune(config: KernelConfig, *, n: int, k: int, element_size: int = 2) -> bool:
    """True if `config` is worth trying for an (N, K) weight."""
    if config.backend == "cublas":
        return True
    if config.block_k > max(16, k) or config.block_n > max(16, 2 * n):
        return False
    if config.block_m * config.block_n >= 128 * 256 and config.num_warps < 8:
        return False
    smem = config.num_stages * (config.block_m + config.block_n) * config.block_k * element_size
    return smem <= 200 * 1024


# The default tiles by rows: the TMA kernel in a CUDA graph with `live` rows on an H100, bert-base's, MiniLM's and
# CoRa's four linears at 400-23,302 rows (benchmarks/diagnostics/linear_tiles.py). Up to 1,024 rows the small tiles
# (most programs; the mid ones are as fast there), up to 3,072 the mid ones (at 2,811 rows 6-10% faster than the
# large on bert-base and CoRa, 2% slower on MiniLM), then 128 x 128 with the halved store (above): from 4,000 rows
# on 1-20% faster than the 128 x 256 tiles kept before, free of their wave quantization on narrow weights, and
# 0.91-1.17x cuBLAS's time for a layer's four. One class past 3,072 rows: a graph keeps its tiles for the narrower
# batches it serves (128 x 256 past 16,384 rows made bert-base's rows of 5,500-9,000 tokens 5-14% slower end to end).
# The exact-gelu epilogue (about 15 instructions an element) moves the pick: a gelu linear runs faster on its row
# bucket's next larger tiles (bert-base's ff1 at 2,811 rows: 30.3 us on the large against 36.2 on the mid).
_SMALL_ROWS, _MID_ROWS = 1024, 3072
_SMALL = KernelConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3)
_MID = KernelConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)
_LARGE = KernelConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
_BUCKET_TILES = (_SMALL, _MID, _LARGE)


def default_config(n: int, k: int, rows: int, activation: str | None = None) -> KernelConfig:
    """The untuned tiles for an (N, K) weight on `rows` rows. Bucketed by rows, never keyed on them, so a new batch
    size never needs a new kernel. N and K do not change the pick: the same tiles led for deep (ff2), wide (ff1)
    and square weights alike; gelu's epilogue does (above)."""
    bucket = 0 if rows <= _SMALL_ROWS else 1 if rows <= _MID_ROWS else 2
    if activation == "gelu":
        bucket = min(bucket + 1, 2)
    return _BUCKET_TILES[bucket]


def fit_shared_memory(config: KernelConfig, element_size: int, limit: int = 227 * 1024) -> KernelConfig:
    """`config` with fewer stages, then a shorter K tile, until its pipeline buffers and the TMA store's
    staging tile fit in `limit` bytes of shared memory (an H100 block may use 227 KB): the tiles are picked
    for 2-byte elements (m128n128k64s3 needs 128 KB), and fp32 doubles that."""

    def need(c: KernelConfig) -> int:
        return (c.num_stages * (c.block_m + c.block_n) * c.block_k + c.block_m * c.block_n) * element_size

    while need(config) > limit and config.num_stages > 2:
        config = config.replace(num_stages=config.num_stages - 1)
    while need(config) > limit and config.block_k > 16:
        config = config.replace(block_k=config.block_k // 2)
    while need(config) > limit and config.block_n > 16:
        config = config.replace(block_n=config.block_n // 2)
    return config


class _Plan(NamedTuple):
    """What a launch of one linear needs besides its tensors and rows, the same for every batch of a weight's
    shape, flags and tiles. Computed once: a graph's warm-up run and its record launch bert-base's 48 linears from
    Python, and this took a quarter of a launch's host time (143 us against 106 on an H100's host).
    config: the tiles fitted to shared memory; flags: the kernels' shared constexprs; x_block / w_block / y_block:
    the TMA blocks; programs / pointer_programs: the persistent grids' caps; tma_kwargs / pointer_kwargs: each
    kernel's constexprs and launch options (wrapped_kwargs: the pointer kernel's under torch.compile, which launches
    without PDL, kernels/pdl.py); sibling: the variant's key for compiling its sibling tiles ahead."""

    config: KernelConfig
    flags: dict
    x_block: list
    w_block: list
    y_block: list
    programs: int
    pointer_programs: int
    tma_kwargs: dict
    pointer_kwargs: dict
    wrapped_kwargs: dict
    sibling: tuple


@functools.lru_cache(maxsize=4096)
def _plan(n: int, k: int, dtype: torch.dtype, activation, has_bias: bool, has_live: bool, config: KernelConfig,
          precision: str, device: torch.device, chain: bool) -> _Plan:  # fmt: skip
    config = fit_shared_memory(config, dtype.itemsize)
    bm, bn = config.block_m, config.block_n
    bk = min(config.block_k, max(16, next_pow2(k)))
    flags = dict(HAS_BIAS=has_bias, ACTIVATION=_ACT_CODE[activation], HAS_LIVE=has_live, BLOCK_M=bm, BLOCK_N=bn,
                 BLOCK_K=bk, GROUP_M=config.group_m, PRECISION=precision,
                 UPCAST=dot_upcast(str(dtype)[6:]), PDL=chain)  # fmt: skip
    launch = dict(num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=chain)
    sibling = _sibling_key(dtype, device, n, k, flags)
    pointer = {**flags, "EVEN_K": k % bk == 0, **launch}
    wrapped = {**pointer, "PDL": False}
    del wrapped["launch_pdl"]
    return _Plan(config, flags, [bm, bk], [bn, bk], [bm, _store_width(bn)], persistent_programs(device, config),
                 persistent_programs(device), {**flags, "NUM_STAGES": config.num_stages, **launch}, pointer,
                 wrapped, sibling)  # fmt: skip


# -- launcher -----------------------------------------------------------------------------------
def check_inputs(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None, same_dtype: bool = True
) -> None:
    """A clear error for inputs the linear cannot take; `same_dtype` False (autocast casts them): shapes only."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x (T, K) and weight (N, K) disagree: {tuple(x.shape)} vs {tuple(weight.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"bias must be (N,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if same_dtype and (x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype)):
        raise TypeError(
            f"x, weight and bias must share a dtype, got {x.dtype}, {weight.dtype}, {getattr(bias, 'dtype', None)}"
        )


_PROPERTIES: dict = {}


def _properties(device: torch.device):
    """torch.cuda.get_device_properties, cached per device (launchers ask on every call)."""
    props = _PROPERTIES.get(device.index)
    if props is None:
        props = _PROPERTIES[device.index] = torch.cuda.get_device_properties(device)
    return props


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; 132, an H100's, off CUDA (the default tiles' GPU)."""
    return _properties(device).multi_processor_count if device.type == "cuda" else 132


def persistent_programs(device: torch.device, config: KernelConfig | None = None) -> int:
    """Programs of a grid whose programs loop over work only the device can count: two per SM, one for
    tiles of 128 x 256 and up (they fill an H100 SM's shared memory, and a second program per SM only
    waits). The interpreter gets 3, so loops run."""
    if interpreting() or device.type != "cuda":
        return 3
    per_sm = 1 if config is not None and config.block_m * config.block_n >= 128 * 256 else 2
    return per_sm * sm_count(device)


def tma_usable(*tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors can address these 2-D tensors: Hopper or newer (or the interpreter), rows
    contiguous, base addresses and row strides 16-byte aligned."""
    t0 = tensors[0]
    if not interpreting() and not (t0.is_cuda and _properties(t0.device).major >= 9):
        return False
    for t in tensors:
        size = t.element_size()
        if t.stride(1) != 1 or t.data_ptr() % 16 or (t.stride(0) * size) % 16 or t.shape[1] * size < 16:
            return False
    return True


def _store_width(block_n: int) -> int:
    """The TMA kernel's output block width: tiles 128 wide and up are stored in two halves."""
    return block_n // 2 if block_n >= 128 else block_n


def check_live(live: torch.Tensor | None, x: torch.Tensor) -> None:
    if live is None:
        return
    if live.numel() < 1 or live.dtype not in (torch.int32, torch.int64) or live.device != x.device:
        raise ValueError(
            f"live must be an int32/int64 tensor of at least one element on {x.device}, "
            f"got {live.dtype} of {live.numel()} on {live.device}"
        )


def ragged_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    config: KernelConfig = DEFAULT_CONFIG,
    wrap=None,
    live: torch.Tensor | None = None,
    tma: bool | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """act(x @ weight.T + bias) on every row of `x` (only rows < live[0] with `live`, see the module
    docstring), written to `out` (T, N) contiguous, or a new tensor. `tma`: None picks the TMA kernel
    wherever it can run (never under `wrap`, torch.compile's path), False the pointer kernel; True insists
    (ValueError if it cannot)."""
    check_inputs(x, weight, bias, activation)
    check_live(live, x)
    if config.backend == "cublas":
        return cublas_linear(x, weight, bias, activation)
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    elif out.shape != (M, N) or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous ({M}, {N}) {x.dtype} tensor on {x.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")  # fmt: skip
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.copy_(ragged_linear_ref(x, weight, bias, activation))
    precision = "ieee" if x.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32 else "tf32"
    plan = _plan(N, K, x.dtype, activation, bias is not None, live is not None, config, precision, x.device,
                 pdl_enabled(x.device))  # fmt: skip
    bias_arg, live_arg = bias if bias is not None else x, live if live is not None else x
    tiles = -(-M // plan.config.block_m) * -(-N // plan.config.block_n)
    usable = wrap is None and tma_usable(x, weight, out)
    if tma and not usable:
        raise ValueError("tma=True, but TMA cannot address these tensors here (needs sm90+ and 16-byte alignment)")
    if usable and tma is not False:
        compile_sibling_tiles(x, weight, bias_arg, live_arg, N, K, plan.flags, plan.config, plan.sibling)
        x_desc = TensorDescriptor.from_tensor(x, plan.x_block)
        w_desc = TensorDescriptor.from_tensor(weight, plan.w_block)
        y_desc = TensorDescriptor.from_tensor(out, plan.y_block)
        _linear_tma_kernel[(min(tiles, plan.programs),)](
            x_desc, w_desc, y_desc, bias_arg, live_arg, M, N, K, **plan.tma_kwargs
        )  # fmt: skip
        return out
    grid = (tiles if live is None else min(tiles, plan.pointer_programs),)
    (wrap or _identity)(_linear_kernel)[grid](
        x, weight, bias_arg, out, live_arg, M, N, K, x.stride(0), weight.stride(0), out.stride(0),
        **(plan.pointer_kwargs if wrap is None else plan.wrapped_kwargs),
    )  # fmt: skip
    return out


# -- the other row buckets' tiles, compiled off the caller's path -------------------------------------------------
# The tiles are constexprs, so a batch whose rows fall in a bucket of `default_config` not seen yet needs another
# compiled variant of the TMA kernel: compiled on first sight inside a graph capture, it costs a stream of new
# batches 0.66 s (bert-base, RACE B=32 on an H100, benchmarks/stream_table.py). So the first launch of a variant
# (dtype, flags, N and K) outside a graph capture hands the other buckets' tiles to one background thread, which
# compiles and loads them without launching (kernels/ahead.py; the descriptors are of 16-row tensors the caller's
# thread allocates, M not being specialized on); a launch that comes before its compile has finished compiles it
# itself.
_VARIANT_FLAGS = ("HAS_BIAS", "ACTIVATION", "HAS_LIVE", "PRECISION", "UPCAST", "PDL")  # the launcher's flags but tiles


def _sibling_key(dtype: torch.dtype, device: torch.device, N: int, K: int, flags: dict) -> tuple:
    """What a variant's specialization depends on besides its tiles (ints specialize on divisibility by 16)."""
    rest = tuple(flags[k] for k in _VARIANT_FLAGS)
    return "linear", dtype, device, N % 16 == 0, K % 16 == 0, N == 1, K == 1, rest


def sibling_tiles(config: KernelConfig, element_size: int, gelu: bool = False) -> list[KernelConfig]:
    """The row buckets' default tiles (fitted to shared memory) other than `config`'s; a gelu linear's never take
    the small ones (`default_config`)."""
    tiles = {fit_shared_memory(t, element_size) for t in _BUCKET_TILES[1 if gelu else 0 :]}
    return sorted((t for t in tiles if t != config), key=lambda t: (t.block_m, t.block_n))


def compile_sibling_tiles(x, weight, bias_arg, live_arg, N: int, K: int, flags: dict, config: KernelConfig,
                          key: tuple) -> None:  # fmt: skip
    """Hand the other row buckets' tiles of this launch's variant to the background compiler at its first sight
    (`key`: the variant's, `_sibling_key`, as `_plan` holds it)."""
    if not ahead.first_sight(key, x):
        return
    jobs = []
    for tiles in sibling_tiles(config, x.element_size(), flags["ACTIVATION"] == _ACT_CODE["gelu"]):
        bk = min(tiles.block_k, max(16, triton.next_power_of_2(K)))
        x_small = torch.empty((16, K), dtype=x.dtype, device=x.device)  # 16 rows: M is not specialized on
        out_small = torch.empty((16, N), dtype=x.dtype, device=x.device)
        store = [tiles.block_m, _store_width(tiles.block_n)]
        descs = (TensorDescriptor.from_tensor(x_small, [tiles.block_m, bk]),
                 TensorDescriptor.from_tensor(weight, [tiles.block_n, bk]),
                 TensorDescriptor.from_tensor(out_small, store))  # fmt: skip
        tile_flags = {**flags, "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": bk,
                      "GROUP_M": tiles.group_m}  # fmt: skip
        jobs.append(functools.partial(
            _linear_tma_kernel.warmup, *descs, bias_arg, live_arg, 16, N, K, **tile_flags,
            NUM_STAGES=tiles.num_stages, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
            launch_pdl=flags["PDL"], grid=(1,),
        ))  # fmt: skip
    ahead.submit(x.device, jobs, "linear tiles")


def cublas_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None
) -> torch.Tensor:
    """The cuBLAS backend: one cuBLASLt call with bias and relu in its epilogue (`torch._addmm_activation`,
    what PyTorch's own encoder fast path uses); gelu runs after it, exact (the epilogue's gelu is the
    tanh approximation)."""
    if activation == "relu" and bias is not None and x.is_cuda:
        return torch._addmm_activation(bias, x, weight.t())
    return ragged_linear_ref(x, weight, bias, activation)


def ragged_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None
) -> torch.Tensor:
    """PyTorch reference and the cuBLAS backend: F.linear, then the activation."""
    y = F.linear(x, weight, bias)
    if activation == "relu":
        return F.relu(y, inplace=True)
    if activation == "gelu":
        return F.gelu(y)
    return y


# -- the torch.library op: torch.compile traces the kernel itself through it (`autoragged.ops` calls it
# while compiling; eager calls take the launcher, a dispatcher hop costs microseconds on a launch-bound path)
ACTIVATION_CODES = {0: None, 1: "relu", 2: "gelu"}  # the op's int activation argument


@triton_op("autoragged::ragged_linear", mutates_args={})
def ragged_linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: int,
    block_m: int,
    block_n: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    group_m: int,
) -> torch.Tensor:
    config = KernelConfig(
        block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages, group_m=group_m
    )
    return ragged_linear(x, weight, bias, ACTIVATION_CODES[activation], config, wrap=wrap_triton)


@ragged_linear_op.register_fake
def _(x, weight, bias, activation, block_m, block_n, block_k, num_warps, num_stages, group_m):
    return x.new_empty((x.shape[0], weight.shape[0]))
