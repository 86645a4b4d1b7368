"""cuBLAS row counts warmed ahead, on the background thread of `ahead`, off the caller's path.

cuBLAS plans a linear (its rows, features, dtype and epilogue) on the first call that meets it: host time on the
caller's thread. The eager ragged arm gives its linears a rung of rows (`planning.buckets.cublas_rows`), so a
stream meets a new problem whenever a batch lands on a rung it has not run: bert-base's 49 linears then took
7.1-10.1 ms of host time against 1.2-1.3 on that rung again (H100). So every cuBLAS linear on a GPU notes its
problem (`note`), and after a batch the runtime names the rungs its next batches may land on (`warm`): the
background thread runs each problem those rungs have not met, on empty tensors, on its own stream.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import ahead

__all__ = ["Problem", "note", "warm"]


class Problem(NamedTuple):
    """A cuBLAS linear less its rows: what a device has run, and what a rung is warmed with."""

    dtype: torch.dtype
    out_features: int
    in_features: int
    bias: bool
    relu: bool  # bias and relu in cuBLASLt's epilogue (`torch._addmm_activation`)


_met: set[tuple] = set()  # (device, rows, dtype, weight shape, bias, relu): each problem at each row count met
_problems: dict[torch.device, set[Problem]] = {}
_asked: set[tuple] = set()  # (device, rungs) asked of `warm` since the last new problem
_streams: dict[torch.device, torch.cuda.Stream] = {}


def note(x: torch.Tensor, weight: torch.Tensor, bias: bool, relu: bool) -> None:
    """Record a cuBLAS linear run on a GPU (the hot path: one set lookup once its row count was met)."""
    key = (x.device, x.shape[0], x.dtype, tuple(weight.shape), bias, relu)
    if key in _met:
        return
    _met.add(key)
    problem = Problem(x.dtype, weight.shape[0], weight.shape[1], bias, relu)
    problems = _problems.setdefault(x.device, set())
    if problem not in problems:
        problems.add(problem)
        _asked.clear()  # rungs asked before were warmed without it


def warm(device: torch.device, rungs: tuple[int, ...]) -> int:
    """Hand each problem run on `device` to the background thread at each of `rungs` it has not met; the number
    handed over (each once)."""
    if (device, rungs) in _asked:
        return 0
    _asked.add((device, rungs))
    jobs = []
    for problem in tuple(_problems.get(device, ())):  # (a snapshot: another thread may note a new one)
        for rows in rungs:
            key = (device, rows, problem.dtype, (problem.out_features, problem.in_features), problem.bias, problem.relu)
            if key not in _met:
                _met.add(key)
                jobs.append(functools.partial(_run, device, rows, problem))
    ahead.submit(device, jobs, "cuBLAS")
    return len(jobs)


def _run(device: torch.device, rows: int, problem: Problem) -> None:
    stream = _streams.get(device) or _streams.setdefault(device, torch.cuda.Stream(device))
    with torch.cuda.stream(stream):
        x = torch.empty((rows, problem.in_features), dtype=problem.dtype, device=device)
        weight = torch.empty((problem.out_features, problem.in_features), dtype=problem.dtype, device=device)
        bias = torch.empty(problem.out_features, dtype=problem.dtype, device=device) if problem.bias else None
        if problem.relu:
            torch._addmm_activation(bias, x, weight.t())
        else:
            F.linear(x, weight, bias)


def forget() -> None:
    """Forget what was met and asked (tests)."""
    _met.clear()
    _problems.clear()
    _asked.clear()
