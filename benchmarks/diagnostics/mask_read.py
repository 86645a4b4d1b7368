"""What reading a batch's lengths off a CUDA attention mask costs the host, by implementation.

    python benchmarks/diagnostics/mask_read.py                 # bert-base batches of MNLI B=128 and RACE B=32

Latency, as in a synchronised call: the GPU is idle before each read. Each variant runs --reps times after a
synchronisation; the median host microseconds are printed.
The runtime's read (`autoragged.ragged.tensor.mask_lengths`) returns the lengths and whether each row is
right-padded; the bare sums below return the counts alone, for scale.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from autoragged.ragged.tensor import mask_lengths  # noqa: E402
from autoragged.workloads import sample_cora  # noqa: E402
from benchmarks._common import header, require_cuda  # noqa: E402
from benchmarks.hf_table import token_batch  # noqa: E402


def host_us(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def variants(mask: torch.Tensor) -> dict:
    """{name: a read of the (B, L) int64 HF mask (1 = keep)}."""
    B, L = mask.shape
    kpm = mask == 0  # the runtime's key padding mask (True = pad), made when the call is read
    w2 = torch.stack([torch.ones(L), torch.arange(L, dtype=torch.float32)], 1).to(mask.device)
    pinned = torch.empty(2 * B, dtype=torch.int32, pin_memory=True)
    event = torch.cuda.Event()

    def float_moments():  # a float product of two weight columns: the read mask_lengths replaced
        host = (torch.where(kpm.bool(), 0.0, 1.0).to(torch.float32) @ w2).cpu().numpy()
        counts = host[:, 0].astype(np.int64)
        return tuple(counts.tolist()), np.flatnonzero(host[:, 1] != counts * (counts - 1) / 2)

    def pinned_sum():
        pinned[:B].copy_(mask.sum(1, dtype=torch.int32), non_blocking=True)
        event.record()
        event.synchronize()
        return pinned[:B].tolist()

    return {
        "one tiny op (mask == 0)": lambda: mask == 0,
        "mask_lengths(kpm): int64 weighted sum (the runtime's read)": lambda: mask_lengths(kpm, batch=B, seq_len=L),
        "float product of two weight columns (the read before)": float_moments,
        "mask.sum(1).tolist() (counts alone)": lambda: mask.sum(1, dtype=torch.int32).tolist(),
        "sum, pinned copy, event (counts alone)": pinned_sum,
        "torch.cuda.synchronize() alone": torch.cuda.synchronize,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", default=["MNLI:128", "RACE:32"], help="dataset:batch")
    p.add_argument("--reps", type=int, default=300)
    args = p.parse_args(argv)
    require_cuda("benchmarks/diagnostics/mask_read.py")
    header("Reading lengths off a CUDA mask: host microseconds (median)")
    for spec in args.rows:
        name, b = spec.split(":")
        lengths = sample_cora(name, int(b), np.random.default_rng(0))
        mask = token_batch(lengths, torch.Generator().manual_seed(0), 30000, torch.device("cuda")).mask
        row = {k: host_us(fn, args.reps) for k, fn in variants(mask).items()}
        print(f"\n## {spec} (B, L = {tuple(mask.shape)})")
        for k, v in row.items():
            print(f"  {v:8.1f} us  {k}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
