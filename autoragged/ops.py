"""Ragged ops on `RaggedTensor`s: the public face of the Triton kernels in `kernels/`.

Where each op runs:
- CUDA tensors: our Triton kernels (through their `torch.library` ops, registered beside each launcher,
  while torch.compile traces);
- CPU tensors with `TRITON_INTERPRET=1` set before import: the same kernels in Triton's interpreter;
- CPU otherwise (or no Triton): the PyTorch references that sit beside the kernels.

Every op returns a RaggedTensor of its input's layout with zeroed gap rows. The `*_values` functions
are the same ops on raw values (no gap zeroing); the ragged `nn` modules chain those.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from .kernels import gated_act as k_act
from .kernels import ragged_add_layer_norm as k_ln
from .kernels import ragged_attention as k_attn
from .kernels import ragged_attention_backward as k_attn_bwd
from .kernels import ragged_bmm as k_bmm
from .kernels import ragged_linear as k_lin
from .kernels import rms_norm as k_rms
from .kernels import rotary as k_rope
from .kernels.config import KernelConfig
from .ragged.backend import use_triton
from .ragged.layout import Layout
from .ragged.tensor import RaggedTensor, zero_gaps

__all__ = [
    "ragged_attention",
    "ragged_linear",
    "ragged_bmm",
    "ragged_add_layer_norm",
    "attention_values",
    "FULL",
    "CAUSAL",
    "linear_values",
    "bmm_values",
    "add_layer_norm_values",
    "add_rms_norm_values",
    "rotary_values",
    "rotary_pair_values",
    "silu_mul_values",
]

_ACT_CODE = {act: code for code, act in k_lin.ACTIVATION_CODES.items()}
FULL = (-1, -1)  # attention windows (`attention_values`): every key of the component
CAUSAL = (-1, 0)  # the keys up to the query's own


def _compiling(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.compiler.is_compiling()


def _recording(*tensors: torch.Tensor | None) -> bool:
    """True when autograd records an op on these inputs: it then takes the kernels' autograd Functions."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# -- value-level ops ------------------------------------------------------------------------------
def attention_values(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: Layout,
    *,
    window: tuple[int, int] = FULL,
    scale: float | None = None,
    config: KernelConfig | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """q (rows, H, Dh), k and v (rows, Hkv, Dh) values of `layout`, Hkv dividing H; returns (rows, H, Dh),
    gap rows unspecified. `window` (left, right): query i sees keys i - left <= j <= i + right of its component,
    -1 unbounded (`FULL`); right = 0 is causal attention (`CAUSAL`; with a left bound, a causal sliding window). A
    layout with
    `key_lengths` (a first-token pooler's column 0 as a query row: `Layout.with_query_rows`, or a CUDA graph fed
    a mask) has query-only rows past them. `dropout`: drop probability of the attention probabilities (training;
    the mask's seed is drawn on the device, so `torch.manual_seed` repeats it and a CUDA graph's replays draw it
    anew)."""
    k_attn.check_inputs(q, k, v)
    left, right = k_attn.check_window(window)
    causal = right == 0  # the kernels' causal variants (the plain causal one where nothing bounds the left)
    right = k_attn.UNBOUNDED if causal else right
    key_lengths = getattr(layout, "key_lengths", None)
    if not use_triton(q):
        keys = None if key_lengths is None else key_lengths.tolist()
        return k_attn.ragged_attention_ref(
            q, k, v, layout.offsets, layout.lengths, causal=causal, scale=scale, window=(left, right), key_lengths=keys,
            dropout=float(dropout),
        )  # fmt: skip
    config = config or k_attn.default_config(q.shape[-1], layout.max_len, q.element_size())
    if layout.align > config.block_m:  # the kernel zeroes gap rows only within the last query block
        config = config.replace(block_m=layout.align, block_n=min(config.block_n, layout.align))
    offsets, lengths = layout.device_meta(q.device)
    drop = k_attn.Dropout.draw(float(dropout), q.device) if dropout else None
    if _recording(q, k, v):  # training: the forward stores what the backward kernels need
        problem = k_attn_bwd.AttentionProblem(
            offsets, lengths, functools.partial(layout.prelude, device=q.device), key_lengths, bool(causal), scale,
            (left, right), config, layout.max_len, drop, layout.offsets[-1],
        )  # fmt: skip
        return k_attn_bwd.ragged_attention_train(q, k, v, problem)
    grid_mapping, block_offsets = layout.prelude(config.block_m, q.device)
    if _compiling(q) and key_lengths is None and drop is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        return torch.ops.autoragged.ragged_attention(
            q, k, v, offsets, lengths, grid_mapping, block_offsets, bool(causal), scale,
            config.block_m, config.block_n, config.num_warps, config.num_stages, left, right,
        )  # fmt: skip
    return k_attn.ragged_attention(
        q, k, v, offsets, lengths, grid_mapping, block_offsets, causal=causal, scale=scale, config=config,
        window=(left, right), key_lengths=key_lengths, dropout=drop,
    )  # fmt: skip


def linear_values(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    config: KernelConfig | None = None,
    *,
    live: torch.Tensor | None = None,
    rows: int | None = None,
) -> torch.Tensor:
    """act(x @ weight.T + bias) over all rows of x (T, K) -> (T, N). `live`, a device tensor whose first
    element counts the rows needed, lets the Triton kernel skip the rest (their output is unspecified);
    cuBLAS and the references compute every row. Without a `config`, the Triton tiles are picked for
    `rows` (default: x's rows), see `kernels.ragged_linear.default_config`. Under autograd or autocast: F.linear
    (cuBLAS, differentiable, cast as autocast casts) and PyTorch's activation."""
    if torch.is_autocast_enabled(x.device.type):  # (x may be of autocast's dtype and the weight not)
        k_lin.check_inputs(x, weight, bias, activation, same_dtype=False)
        return k_lin.ragged_linear_ref(x, weight, bias, activation)
    k_lin.check_inputs(x, weight, bias, activation)
    if _recording(x, weight, bias):
        return k_lin.ragged_linear_ref(x, weight, bias, activation)
    config = config or k_lin.default_config(weight.shape[0], weight.shape[1], rows or x.shape[0], activation)
    if config.backend == "cublas":
        return k_lin.cublas_linear(x, weight, bias, activation)
    if not use_triton(x):
        return k_lin.ragged_linear_ref(x, weight, bias, activation)
    if _compiling(x):
        c = config
        return torch.ops.autoragged.ragged_linear(
            x,
            weight,
            bias,
            _ACT_CODE[activation],
            c.block_m,
            c.block_n,
            c.block_k,
            c.num_warps,
            c.num_stages,
            c.group_m,
        )
    return k_lin.ragged_linear(x, weight, bias, activation, config, live=live)


def bmm_values(
    x: torch.Tensor, weights: torch.Tensor, layout: Layout, config: KernelConfig | None = None
) -> torch.Tensor:
    """Component i of x (rows, K) times weights[i] (K, N) -> (rows, N), gap rows unspecified."""
    if not use_triton(x):
        return k_bmm.ragged_bmm_ref(x, weights, layout.offsets, layout.lengths)
    config = config or k_bmm.DEFAULT_CONFIG
    offsets, lengths = layout.device_meta(x.device)
    grid_mapping, block_offsets = layout.prelude(config.block_m, x.device)
    if _compiling(x):
        c = config
        return torch.ops.autoragged.ragged_bmm(
            x, weights, offsets, lengths, grid_mapping, block_offsets,
            c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages,
        )  # fmt: skip
    return k_bmm.ragged_bmm(x, weights, offsets, lengths, grid_mapping, block_offsets, config=config)


def add_layer_norm_values(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    store_sum: bool = False,
    config: KernelConfig | None = None,
    live: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(LN(x + residual), the sum if store_sum) over all rows (with `live`, as `linear_values`)."""
    k_ln.check_inputs(x, residual, weight, bias)
    if not use_triton(x):
        return k_ln.add_layer_norm_ref(x, residual, weight, bias, eps, store_sum=store_sum)
    if _recording(x, residual, weight, bias):
        if live is not None:
            raise ValueError("add_layer_norm_values: live rows are inference-only; pass live=None when training")
        # PyTorch's add and layer_norm, not our kernel's Function (`k_ln.add_layer_norm_train`, as exact): two aten
        # launches forward and back cost less host time than two Triton ones, and a training step of bert-base is
        # host-bound on short rows (MNLI B=64: 41 ms a step against 56, H200, alternated in one lease)
        total = x if residual is None else x + residual
        return F.layer_norm(total, total.shape[-1:], weight, bias, eps), (total if store_sum else None)
    if _compiling(x):
        c = config or k_ln.default_config(x.shape[1])
        out, total = torch.ops.autoragged.add_layer_norm(
            x, residual, weight, bias, float(eps), store_sum, c.block_m, c.num_warps
        )
        return out, (total if store_sum else None)
    return k_ln.add_layer_norm(x, residual, weight, bias, eps, store_sum=store_sum, config=config, live=live)


def add_rms_norm_values(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *, store_sum: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(RMSNorm(residual + x) * weight, the sum if store_sum and a residual is given), rounded as HF's
    Llama-family RMSNorm (see `kernels.rms_norm`)."""
    k_rms.check_inputs(x, residual, weight)
    if not use_triton(x):
        return k_rms.add_rms_norm_ref(x, residual, weight, eps, store_sum=store_sum)
    if _recording(x, residual, weight):
        return k_rms.add_rms_norm_train(x, residual, weight, eps, store_sum)
    return k_rms.add_rms_norm(x, residual, weight, eps, store_sum=store_sum)


def rotary_values(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (rows, H, D) rotated by each row's cos and sin (rows, D), as HF's `apply_rotary_pos_emb`."""
    k_rope.check_inputs(x, cos, sin)
    if not use_triton(x):
        return k_rope.rotary_ref(x, cos, sin)
    if _recording(x, cos, sin):
        return k_rope.rotary_train(x, cos, sin)  # cos or sin requiring grad is an error there
    return k_rope.rotary(x, cos, sin)


def rotary_pair_values(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_values` of a layer's queries and keys (rows, H, D) and (rows, Hkv, D) in one launch."""
    k_rope.check_inputs(q, cos, sin)
    k_rope.check_inputs(k, cos, sin)
    if not use_triton(q):
        return k_rope.rotary_ref(q, cos, sin), k_rope.rotary_ref(k, cos, sin)
    if _recording(q, k, cos, sin):
        return k_rope.rotary_pair_train(q, k, cos, sin)
    return k_rope.rotary_pair(q, k, cos, sin)


def silu_mul_values(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (T, F), as HF's Llama-family MLP; may overwrite gate (never while autograd records)."""
    k_act.check_inputs(gate, up)
    if not use_triton(gate):
        return k_act.silu_mul_ref(gate, up)
    if _recording(gate, up):
        return k_act.silu_mul_train(gate, up)
    return k_act.silu_mul(gate, up)


# -- RaggedTensor ops -----------------------------------------------------------------------------
def _same_layout(name: str, first: RaggedTensor, *others: RaggedTensor) -> None:
    for i, other in enumerate(others, 1):
        if not isinstance(other, RaggedTensor):
            raise TypeError(f"{name}: argument {i} is a {type(other).__name__}, not a RaggedTensor")
        if not first.layout.same_as(other.layout):
            raise ValueError(
                f"{name}: argument {i} has another layout ({other.layout}) than argument 0 ({first.layout})"
            )
        if other.device != first.device or other.dtype != first.dtype:
            raise ValueError(
                f"{name}: argument {i} is {other.dtype} on {other.device}, argument 0 {first.dtype} on {first.device}"
            )


def ragged_attention(
    q: RaggedTensor,
    k: RaggedTensor,
    v: RaggedTensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    config: KernelConfig | None = None,
    window: tuple[int, int] = (-1, -1),
) -> RaggedTensor:
    """Flash-attention forward within each component: q has values (T, H, Dh), k and v (T, Hkv, Dh) with
    Hkv dividing H (grouped-query attention), all of one layout.

    fp16 / bf16 / fp32; head dims 32, 64, 80, 96, 128, 256; `scale` defaults to 1/sqrt(Dh); `causal` masks
    keys after each query; `window` (left, right) keeps keys i - left <= j <= i + right of query i (-1:
    unbounded; `kernels.ragged_attention.window_from_hf` converts a transformers `sliding_window`).
    No device->host sync: the grid comes from the host lengths.
    """
    if not isinstance(q, RaggedTensor):
        raise TypeError(f"ragged_attention: q is a {type(q).__name__}, not a RaggedTensor")
    _same_layout("ragged_attention", q, k, v)
    if q.values.dim() != 3:
        raise ValueError(f"ragged_attention: values must be (T, H, Dh), got {tuple(q.values.shape)}")
    left, right = k_attn.check_window(window)
    out = attention_values(
        q.values,
        k.values,
        v.values,
        q.layout,
        window=(left, 0) if causal else (left, right),
        scale=scale,
        config=config,
    )
    return q.with_values(zero_gaps(out, q.layout))


def ragged_linear(
    x: RaggedTensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    config: KernelConfig | None = None,
) -> RaggedTensor:
    """act(x W^T + b) per token, with `nn.Linear`'s weight layout (N, K); activation None / "relu" / "gelu".
    `config.backend == "cublas"` uses torch.nn.functional.linear instead of the Triton kernel."""
    if not isinstance(x, RaggedTensor):
        raise TypeError(f"ragged_linear: x is a {type(x).__name__}, not a RaggedTensor")
    if x.values.dim() != 2:
        raise ValueError(f"ragged_linear: values must be (T, K), got {tuple(x.values.shape)}")
    return x.with_values(zero_gaps(linear_values(x.values, weight, bias, activation, config), x.layout))


def ragged_bmm(x: RaggedTensor, weights: torch.Tensor, config: KernelConfig | None = None) -> RaggedTensor:
    """Component i (length_i, K) times weights[i] (K, N): PyCoRa's ragged batched matmul."""
    if not isinstance(x, RaggedTensor):
        raise TypeError(f"ragged_bmm: x is a {type(x).__name__}, not a RaggedTensor")
    if x.values.dim() != 2:
        raise ValueError(f"ragged_bmm: values must be (T, K), got {tuple(x.values.shape)}")
    if weights.dim() != 3 or weights.shape[0] != x.batch_size or weights.shape[1] != x.values.shape[1]:
        raise ValueError(
            f"ragged_bmm: weights must be (B, K, N) = ({x.batch_size}, {x.values.shape[1]}, N), "
            f"got {tuple(weights.shape)}"
        )
    return x.with_values(zero_gaps(bmm_values(x.values, weights, x.layout, config), x.layout))


def ragged_add_layer_norm(
    x: RaggedTensor,
    residual: RaggedTensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    return_sum: bool = False,
) -> RaggedTensor | tuple[RaggedTensor, RaggedTensor]:
    """LayerNorm(x + residual) over the feature dim, fused; with `return_sum` also x + residual."""
    if not isinstance(x, RaggedTensor):
        raise TypeError(f"ragged_add_layer_norm: x is a {type(x).__name__}, not a RaggedTensor")
    if residual is not None:
        _same_layout("ragged_add_layer_norm", x, residual)
    if x.values.dim() != 2:
        raise ValueError(f"ragged_add_layer_norm: values must be (T, N), got {tuple(x.values.shape)}")
    out, total = add_layer_norm_values(
        x.values, None if residual is None else residual.values, weight, bias, eps, store_sum=return_sum
    )
    normed = x.with_values(zero_gaps(out, x.layout))
    if return_sum:
        return normed, x.with_values(zero_gaps(total, x.layout))
    return normed
