"""Per-batch arguments that a replayed CUDA graph fetches itself from pinned host memory: its first node.

A ragged graph reads its batch (pointers, strides, sizes, lengths) from a static int64 `args` buffer on
the device. Filling that buffer with a host->device copy per batch costs 15-17 us of host time on an H100
host (torch's copy dispatch and the event guarding the pinned slot), against 3.1-3.7 us for a post into the
ring. Here the host writes the batch into a slot of a pinned ring (a numpy store) and replays; the graph's
first kernel reads the slot over PCIe and writes `args`.

Which slot: the n-th posted batch of a graph (n = 1, 2, ...) goes to slot n % slots, stamped with n. The
kernel keeps the last stamp it consumed in `state[0]` and reads slot (state[0] + 1) % slots, whose stamp
must be state[0] + 1. A stamp that does not match means no batch was posted for this replay: it zeroes
`args` (no component, so the graph reads and writes nothing through pointers), counts the miss in
`state[1]` and leaves `state[0]` as it was, so the next posted batch still matches. So every replay must
post first: a replay that did not (a bare `graph.replay()`) takes the next posted batch if the host has
written it by the time the kernel runs, and that batch's own replay then finds none; either way a miss is
counted. The host reuses a slot only once the replay that read it has completed (autoragged/graphs/capture.py:
an event per slot), so a queued replay never sees its slot overwritten.

The ring's loads are volatile (system scope): the host rewrites a slot between replays, and a line cached
by an earlier replay must not be read.

Shape contracts
    ring:   (slots, width) int64, pinned host memory (a CPU tensor under the interpreter), contiguous;
            ring[s, 0] = stamp, ring[s, 1 : 1 + n_args] = the batch's args; width >= n_args + 1
    args:   (n_args,) int64 on the device, written whole
    state:  (2,) int64 on the device: [last stamp consumed, replays that found no posted batch]
"""

from __future__ import annotations

import numpy as np
import torch

from .config import next_pow2
from .triton_compat import tl, triton

__all__ = ["fetch", "fetch_ref"]


@triton.jit
def _fetch_kernel(ring_ptr, args_ptr, state_ptr, slots, width, n_args, BLOCK: tl.constexpr):
    last = tl.load(state_ptr)
    want = last + 1
    i = tl.arange(0, BLOCK)
    row = tl.load(ring_ptr + (want % slots) * width + i, mask=i <= n_args, other=0, volatile=True)
    ok = tl.sum(tl.where(i == 0, row, 0), 0) == want  # the stamp
    tl.store(args_ptr + (i - 1), tl.where(ok, row, 0), mask=(i >= 1) & (i <= n_args))
    tl.store(state_ptr, tl.where(ok, want, last))
    tl.store(state_ptr + 1, tl.load(state_ptr + 1) + tl.where(ok, 0, 1))


def fetch(ring: torch.Tensor, args: torch.Tensor, state: torch.Tensor) -> None:
    """Fill `args` from the ring slot of the next stamp (see the module docstring); one program."""
    if ring.dim() != 2 or ring.dtype != torch.int64 or not ring.is_contiguous():
        raise ValueError(f"ring must be a contiguous 2-D int64 tensor, got {ring.dtype} of shape {tuple(ring.shape)}")
    slots, width = ring.shape
    n_args = args.numel()
    if args.dtype != torch.int64 or not args.is_contiguous() or width < n_args + 1:
        raise ValueError(f"args must be contiguous int64 of at most {width - 1} elements (the ring's width - 1), "
                         f"got {args.dtype} of {n_args}")  # fmt: skip
    if state.dtype != torch.int64 or state.numel() != 2 or state.device != args.device:
        got = f"{state.dtype} of {state.numel()} on {state.device}"
        raise ValueError(f"state must be 2 int64 on the args' device, got {got}")
    _fetch_kernel[(1,)](ring, args, state, slots, width, n_args, BLOCK=next_pow2(n_args + 1), num_warps=1)


def fetch_ref(ring: np.ndarray, args: np.ndarray, state: np.ndarray) -> None:
    """Numpy reference of `fetch`, in place."""
    want = int(state[0]) + 1
    row = ring[want % ring.shape[0]]
    if int(row[0]) == want:
        args[:] = row[1 : 1 + args.size]
        state[0] = want
    else:
        args[:] = 0
        state[1] += 1
