"""Token-budget batching: an epoch of fixed batches padded, through autoragged, and in first-fit-decreasing bins
ragged, on the CoRa length distributions and a bimodal mix.

    python benchmarks/packing.py                          # every workload, N=4096, batch 64
    python benchmarks/packing.py --quick                  # N=512, 2 epochs, RACE, MNLI and Bimodal
    python benchmarks/packing.py --datasets RACE Bimodal --batch-size 128 --reps 7
    python benchmarks/packing.py --smoke                  # a tiny encoder on the CPU: checks the script

For each workload, N sequence lengths are drawn (PyCoRa's Beta recipe; Bimodal is half uniform 45-130 and half
1,820-2,000 tokens), each sequence gets random features, and one epoch over all N is timed per arm, the CoRa
encoder (6 x d512, 8 heads, ff 2048, fp16, inference mode):

  padded         fixed batches of --batch-size in data order: the plain encoder on a padded tensor with
                 src_key_padding_mask (PyTorch's fast path with nested tensors)
  padded-sorted  the same on batches of length-sorted sequences (the usual bucketing)
  wrapped        fixed batches in data order through autoragged.wrap(model), called with the mask and lengths=
  ffd-ragged     first-fit-decreasing bins of at most --max-tokens aligned tokens (default: batch size x the
                 workload's longest length, the memory of a worst-case fixed batch): wrapped(RaggedTensor)

tokens/s counts real tokens over the median epoch's wall time (synchronised, after --warmup epochs); overhead
is autoragged.packing.padding_overhead of the batching (0.0: no waste). Appends a line to
benchmarks/results/packing.jsonl.
"""

from __future__ import annotations

import copy
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import autoragged  # noqa: E402
from autoragged import RaggedTensor  # noqa: E402
from autoragged.packing import ffd_pack, fixed_size_batches, length_sorted_batches, padding_overhead  # noqa: E402
from autoragged.workloads import CORA, CORA_MODEL, sample_cora  # noqa: E402
from benchmarks._common import device_of, header, parser, record, sync, table  # noqa: E402
from benchmarks.cora_table import TINY, encoder  # noqa: E402

ARMS = ("padded", "padded-sorted", "wrapped", "ffd-ragged")
BIMODAL = ((45, 130), (1820, 2000))


def lengths_of(name: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if name != "Bimodal":
        return np.asarray(sample_cora(name, n, rng), dtype=np.int64)
    (a0, a1), (b0, b1) = BIMODAL
    short = rng.random(n) < 0.5
    return np.where(short, rng.integers(a0, a1 + 1, n), rng.integers(b0, b1 + 1, n)).astype(np.int64)


def longest(name: str) -> int:
    return BIMODAL[1][1] if name == "Bimodal" else CORA[name].max


def padded_batch(seqs: list[torch.Tensor], idx: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(x (B, L, D), key padding mask (B, L), True = pad, host lengths) for the sequences `idx`."""
    lengths = [len(seqs[i]) for i in idx]
    x = torch.nn.utils.rnn.pad_sequence([seqs[i] for i in idx], batch_first=True)
    mask = torch.arange(x.shape[1], device=x.device)[None, :] >= torch.tensor(lengths, device=x.device)[:, None]
    return x, mask, lengths


def epochs_ms(step, batches: list, reps: int, warmup: int, device) -> list[float]:
    """Wall ms of `reps` epochs of `step` over `batches` (synchronised at each end), after `warmup` epochs."""
    times = []
    for rep in range(warmup + reps):
        sync(device)
        t0 = time.perf_counter()
        for b in batches:
            step(b)
        sync(device)
        if rep >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def max_error(out: torch.Tensor, ref: torch.Tensor, lengths) -> float:
    return max((out[k, :n] - ref[k, :n]).abs().max().item() for k, n in enumerate(lengths) if n)


def check(arm: str, batch, plain, wrapped) -> float | None:
    """max |wrapped - plain| on the real tokens of one batch (None for the plain arms)."""
    if arm == "wrapped":
        x, mask, lengths = batch
        return max_error(wrapped(x, src_key_padding_mask=mask, lengths=lengths), plain(x, src_key_padding_mask=mask),
                         lengths)  # fmt: skip
    if arm == "ffd-ragged":
        x = batch.to_padded()
        lengths = list(batch.lengths)
        mask = torch.arange(x.shape[1], device=x.device)[None, :] >= torch.tensor(lengths, device=x.device)[:, None]
        return max_error(wrapped(batch).to_padded(), plain(x, src_key_padding_mask=mask), lengths)
    return None


def run_workload(name: str, lengths: np.ndarray, plain, wrapped, args, device) -> list[dict]:
    width, dtype = plain.layers[0].self_attn.embed_dim, plain.layers[0].linear1.weight.dtype
    gen = torch.Generator(device=device).manual_seed(args.seed)
    seqs = [torch.randn(int(n), width, device=device, dtype=dtype, generator=gen) for n in lengths]
    max_tokens = args.max_tokens or args.batch_size * longest(name)
    batchings = {
        "padded": fixed_size_batches(len(lengths), args.batch_size),
        "padded-sorted": length_sorted_batches(lengths, args.batch_size),
        "wrapped": fixed_size_batches(len(lengths), args.batch_size),
        "ffd-ragged": ffd_pack(lengths, max_tokens, align=args.align),
    }
    steps = {
        "padded": lambda b: plain(b[0], src_key_padding_mask=b[1]),
        "padded-sorted": lambda b: plain(b[0], src_key_padding_mask=b[1]),
        "wrapped": lambda b: wrapped(b[0], src_key_padding_mask=b[1], lengths=b[2]),
        "ffd-ragged": wrapped,
    }
    rows = []
    for arm in args.arms:
        batches = batchings[arm]
        if arm == "ffd-ragged":
            inputs = [RaggedTensor.from_list([seqs[i] for i in b], align=args.align) for b in batches]
            overhead = padding_overhead(batches, lengths, ragged=True, align=args.align)
        else:
            inputs = [padded_batch(seqs, b) for b in batches]
            overhead = padding_overhead(batches, lengths)
        err = check(arm, inputs[0], plain, wrapped)
        median_ms = statistics.median(epochs_ms(steps[arm], inputs, args.reps, args.warmup, device))
        rows.append({"workload": name, "arm": arm, "sequences": len(lengths), "real_tokens": int(lengths.sum()),
                     "batches": len(batches), "padding_overhead": overhead, "median_ms": median_ms,
                     "tokens_per_s": int(lengths.sum()) / (median_ms / 1e3), "max_abs_diff": err})  # fmt: skip
        print(f"  {name} {arm}: {median_ms:.2f} ms, {len(batches)} batches, overhead {overhead:.3f}", flush=True)
    base = next((r["median_ms"] for r in rows if r["arm"] == "padded"), None)
    for r in rows:
        r["speedup_vs_padded"] = base / r["median_ms"] if base else None
    return rows


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--datasets", nargs="+", choices=[*CORA, "Bimodal"], help="workloads (default: all)")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--n", type=int, default=4096, help="sequences per workload (default 4096)")
    p.add_argument("--batch-size", type=int, default=64, help="fixed batch size (default 64)")
    p.add_argument("--max-tokens", type=int, help="FFD budget in aligned tokens (default: batch size x max length)")
    p.add_argument("--align", type=int, default=16, help="RaggedTensor alignment of the FFD bins (default 16)")
    p.add_argument("--reps", type=int, default=5, help="timed epochs; the median is reported (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed epochs first (default 1)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick or args.smoke:
        args.n, args.reps = (64, 1) if args.smoke else (512, 2)
        args.batch_size = 8 if args.smoke else args.batch_size
        args.datasets = args.datasets or (["MRPC", "CoLA"] if args.smoke else ["RACE", "MNLI", "Bimodal"])
    device = device_of(args, "benchmarks/packing.py")
    header("Token-budget batching, the CoRa encoder" + (", smoke: tiny, CPU" if args.smoke else " (fp16)"))
    plain = encoder(TINY if args.smoke else CORA_MODEL, device)
    wrapped = autoragged.wrap(copy.deepcopy(plain), db=False)
    rows = []
    with torch.inference_mode():
        for i, name in enumerate(args.datasets or [*CORA, "Bimodal"]):
            lengths = lengths_of(name, args.n, np.random.default_rng(args.seed + i))
            rows += run_workload(name, lengths, plain, wrapped, args, device)
    print()
    print(table(rows, [("workload", "workload", ""), ("arm", "arm", ""), ("batches", "batches", "d"),
                       ("padding_overhead", "overhead", ".3f"), ("median_ms", "epoch ms", ".2f"),
                       ("tokens_per_s", "tokens/s", ",.0f"), ("speedup_vs_padded", "vs padded", ".2f"),
                       ("max_abs_diff", "max diff", ".1e")]))  # fmt: skip
    record("packing", args, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
