"""Kernel variants compiled ahead, on one background thread, off the caller's path.

A Triton kernel compiles one variant per set of constexprs (tiles, flags) and argument specialisations. The
runtime picks tiles from a batch's shape (its rows for a linear, its longest component for attention), so a
stream of new batches meets a variant it has not compiled yet at some batch of its own choosing: compiled
then, inside a CUDA-graph capture, it stalls the stream for 0.3-0.7 s on an H100 (benchmarks/stream_table.py).
So the first launch of a variant outside a capture hands its siblings (the same call with the other tiles the
runtime may pick) to this thread, which compiles them with Triton's `warmup` (no launch) and loads them: their
launcher and module, which a sibling's first launch on the caller's thread built and loaded in 0.8-1.4 ms of its
0.8-1.5 (an H100). A launch that comes before its sibling's compile finished compiles it itself. Nothing is done
in the interpreter or off the GPU.
"""

from __future__ import annotations

import logging
import threading

import torch

from .config import interpreting

__all__ = ["first_sight", "submit", "drain"]

_seen: set = set()
_executor = None
_lock = threading.Lock()


def first_sight(key, tensor: torch.Tensor) -> bool:
    """True the first time `key` comes with a CUDA tensor outside a capture and the interpreter (the caller
    then submits its siblings); False after, and always where nothing is compiled ahead."""
    if key in _seen or interpreting() or not tensor.is_cuda or torch.cuda.is_current_stream_capturing():
        return False
    _seen.add(key)
    return True


def submit(device: torch.device, jobs: list, name: str) -> None:
    """Run each job (a no-argument callable compiling one variant) on the background thread, on `device`."""
    global _executor
    if not jobs:
        return
    with _lock:
        if _executor is None:
            from concurrent.futures import ThreadPoolExecutor

            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autoragged-compile")
    _executor.submit(_run, device, jobs, name)


def _run(device, jobs, name: str) -> None:
    with torch.cuda.device(device):
        for job in jobs:
            try:
                load = getattr(job(), "_init_handles", None)  # (Triton's CompiledKernel; private, hence getattr)
                if load is not None:
                    load()
            except Exception as e:  # noqa: BLE001 - such a variant compiles (and fails loudly) where it is used
                logging.getLogger("autoragged").debug("compiling a %s variant ahead failed: %s", name, e)


def drain() -> None:
    """Wait for the compiles submitted so far (tests)."""
    if _executor is not None:
        _executor.submit(lambda: None).result()


def forget() -> None:
    """Forget which variants were seen (tests: the next launch of each submits its siblings again)."""
    _seen.clear()
