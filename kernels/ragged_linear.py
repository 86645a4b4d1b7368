"""Linear layer over ragged values: y = act(x W^T + b) on `[T, K]` rows, with `nn.Linear`'s weight layout.

One weight is shared by every component, so the ragged product is a dense one over the values' rows
(gap rows included): a tiled matmul with grouped program order for L2 reuse of weight tiles, fp32
accumulation, and bias plus relu/gelu fused in the epilogue. cuBLAS (`torch.nn.functional.linear`)
is the other backend; the tuner decides which wins for which shape.

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

import torch
import torch.nn.functional as F

from ._config import KernelConfig, _identity, dot_upcast, interpreting
from ._triton import tl, triton

__all__ = [
    "check_live",
    "persistent_programs",
    "ragged_linear",
    "ragged_linear_ref",
    "cublas_linear",
    "CONFIGS",
    "DEFAULT_CONFIG",
    "ACTIVATIONS",
    "prune",
    "default_config",
]

ACTIVATIONS = (None, "relu", "gelu")
_ACT_CODE = {None: 0, "relu": 1, "gelu": 2}


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

    if HAS_BIAS:
        acc += tl.load(Bias + cols).to(tl.float32)[None, :]
    if ACTIVATION == 1:
        acc = tl.maximum(acc, 0.0)
    elif ACTIVATION == 2:  # exact gelu, as nn.GELU() / F.gelu default
        acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
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


@triton.jit
def _linear_kernel(
    X, W, Bias, Y, Live, M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, EVEN_K: tl.constexpr, HAS_LIVE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
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


# The default tiles by rows, measured in a CUDA graph with `live` rows (benchmarks/linear_tiles.py, H100,
# 2026-11-23, CoRa 512/2048 and BERT-base 768/3072 linears at 400-16384 rows): each pick is within
# 0.92-0.99 of the best of 14 tilings (geomean over the bucket's shapes); the old fixed m128n128k64w8s3
# was 0.55-0.93, worst on few rows with K > N (ff2 at 400 rows: 16.9 us against 8.5 us), where its 16
# tiles leave most of 132 SMs idle. cuBLAS stays 1.01-2.1x faster than these defaults: the cuBLAS arms stay.
_SMALL_ROWS, _MID_ROWS = 1024, 4096
_SMALL_DEEP = KernelConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3)  # K > N, few rows
_MID = KernelConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)
_LARGE = KernelConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)


def default_config(n: int, k: int, rows: int) -> KernelConfig:
    """The untuned tiles for an (N, K) weight on `rows` rows. Bucketed by rows, never keyed on them, so a
    new batch size never needs a new kernel."""
    if rows <= _SMALL_ROWS and k > n:
        return _SMALL_DEEP
    return _MID if rows <= _MID_ROWS else _LARGE


# -- launcher -----------------------------------------------------------------------------------
def check_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x (T, K) and weight (N, K) disagree: {tuple(x.shape)} vs {tuple(weight.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"bias must be (N,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(
            f"x, weight and bias must share a dtype, got {x.dtype}, {weight.dtype}, {getattr(bias, 'dtype', None)}"
        )


_PROGRAMS: dict = {}


def persistent_programs(device: torch.device) -> int:
    """Programs of a grid whose programs loop over work only the device can count: two per SM. The small
    and mid default tiles fit two per SM in an H100's shared memory; the large one fits one, and its
    second program per SM waits for the first. The interpreter gets 3, so loops run."""
    if interpreting() or device.type != "cuda":
        return 3
    n = _PROGRAMS.get(device.index)
    if n is None:
        n = _PROGRAMS[device.index] = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return n


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
) -> torch.Tensor:
    """act(x @ weight.T + bias) on every row of `x` (only rows < live[0] with `live`, see the module
    docstring); returns a new (T, N) tensor."""
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
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return ragged_linear_ref(x, weight, bias, activation)
    bm, bn = config.block_m, config.block_n
    bk = min(config.block_k, max(16, triton.next_power_of_2(K)))
    precision = "ieee" if x.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32 else "tf32"
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    if live is not None:
        grid = (min(grid[0], persistent_programs(x.device)),)
    (wrap or _identity)(_linear_kernel)[grid](
        x, weight, bias if bias is not None else x, out, live if live is not None else x, M, N, K,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, ACTIVATION=_ACT_CODE[activation], EVEN_K=K % bk == 0, HAS_LIVE=live is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m,
        PRECISION=precision, UPCAST=dot_upcast(str(x.dtype)[6:]),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


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
