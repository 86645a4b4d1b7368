"""The kernels as `torch.library` ops (namespace `autoragged`), so code that calls them compiles.

`triton_op` + `wrap_triton` let torch.compile see the Triton kernels themselves; the explicit fake
implementations below give output shapes without running anything. In eager mode `autoragged.ops` calls the launchers
directly: going through the dispatcher would add microseconds per call on a launch-bound path.
"""

from __future__ import annotations

import torch
from torch.library import triton_op, wrap_triton

from .kernels import ragged_add_layer_norm as k_ln
from .kernels import ragged_attention as k_attn
from .kernels import ragged_bmm as k_bmm
from .kernels import ragged_linear as k_lin
from .kernels._config import KernelConfig

_ACTIVATIONS = {0: None, 1: "relu", 2: "gelu"}


@triton_op("autoragged::ragged_attention", mutates_args={})
def ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    grid_mapping: torch.Tensor,
    block_offsets: torch.Tensor,
    causal: bool,
    scale: float,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    window_left: int = -1,
    window_right: int = -1,
) -> torch.Tensor:
    config = KernelConfig(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    return k_attn.ragged_attention(
        q,
        k,
        v,
        offsets,
        lengths,
        grid_mapping,
        block_offsets,
        causal=causal,
        scale=scale,
        config=config,
        wrap=wrap_triton,
        window=(window_left, window_right),
    )


@triton_op("autoragged::ragged_linear", mutates_args={})
def ragged_linear(
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
    return k_lin.ragged_linear(x, weight, bias, _ACTIVATIONS[activation], config, wrap=wrap_triton)


@triton_op("autoragged::ragged_bmm", mutates_args={})
def ragged_bmm(
    x: torch.Tensor,
    weights: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    grid_mapping: torch.Tensor,
    block_offsets: torch.Tensor,
    block_m: int,
    block_n: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
) -> torch.Tensor:
    config = KernelConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages)
    return k_bmm.ragged_bmm(x, weights, offsets, lengths, grid_mapping, block_offsets, config=config, wrap=wrap_triton)


@triton_op("autoragged::add_layer_norm", mutates_args={})
def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    store_sum: bool,
    block_m: int,
    num_warps: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    config = KernelConfig(block_m=block_m, num_warps=num_warps, num_stages=1)
    out, total = k_ln.add_layer_norm(
        x, residual, weight, bias, eps, store_sum=store_sum, config=config, wrap=wrap_triton
    )
    return out, (total if total is not None else x.new_empty(0))


# -- fake implementations: output shapes only, for FakeTensor tracing (torch.compile, export) -------
@ragged_attention.register_fake
def _(
    q, k, v, offsets, lengths, grid_mapping, block_offsets, causal, scale, block_m, block_n, num_warps, num_stages,
    window_left=-1, window_right=-1,
):  # fmt: skip
    return q.new_empty(q.shape)  # q's heads: GQA's k and v may have fewer


@ragged_linear.register_fake
def _(x, weight, bias, activation, block_m, block_n, block_k, num_warps, num_stages, group_m):
    return x.new_empty((x.shape[0], weight.shape[0]))


@ragged_bmm.register_fake
def _(x, weights, offsets, lengths, grid_mapping, block_offsets, block_m, block_n, block_k, num_warps, num_stages):
    return x.new_empty((x.shape[0], weights.shape[2]))


@add_layer_norm.register_fake
def _(x, residual, weight, bias, eps, store_sum, block_m, num_warps):
    return x.new_empty(x.shape), x.new_empty(x.shape if store_sum else (0,))
