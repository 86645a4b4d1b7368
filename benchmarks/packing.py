"""Token-budget batching on the GPU: what fixed batches cost padded, through autoragged, and what FFD bins cost
ragged, on the CoRa length distributions and a bimodal mix.

For each workload, N sequence lengths are sampled (PyCoRa's Beta recipe; the bimodal mix is 50/50 uniform
45-130 and 1820-2000 tokens), each sequence gets random fp16 features, and one epoch over all N sequences
is timed for each arm:

  padded         fixed batches of --batch-size in data order, the plain model on a padded tensor with
                 src_key_padding_mask (in eval PyTorch's encoder may take its own nested-tensor fast path)
  padded-sorted  the same, batches of length-sorted sequences (the usual bucketing baseline; not in the brief
                 of record, kept because it is what people run)
  wrapped        fixed batches in data order through autoragged.wrap(model, policy="auto"), called as
                 wrapped(x, src_key_padding_mask=mask, lengths=lengths)
  ffd-ragged     first-fit-decreasing bins of at most --max-tokens aligned tokens (default: batch size x the
                 workload's max length, the memory of a worst-case fixed batch), wrapped(RaggedTensor)

tokens/s counts real tokens (N sequences' lengths) over the median epoch time (CUDA events, after warm-up).
overhead is `autoragged.packing.padding_overhead` of the batching: the padded rectangles for the fixed
batchings, the aligned rows for the FFD bins (0.0 = no waste).

  python benchmarks/packing.py                        # all workloads, N=4096, batch 64
  python benchmarks/packing.py --quick                # a short run
  python benchmarks/packing.py --datasets RACE Bimodal --batch-size 128 --reps 7
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The repository root first: `python benchmarks/packing.py` puts benchmarks/ on sys.path, where kernels.py
# would shadow the `kernels` package that autoragged imports.
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import autoragged  # noqa: E402
from autoragged import RaggedTensor  # noqa: E402
from autoragged.packing import ffd_pack, fixed_size_batches, length_sorted_batches, padding_overhead  # noqa: E402
from autoragged.workloads import CORA, sample_cora  # noqa: E402
from benchmarks._common import write_json  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "packing.json"
BIMODAL = {"min": 45, "max": 2000, "modes": [[45, 130], [1820, 2000]]}
ARMS = ("padded", "padded-sorted", "wrapped", "ffd-ragged")
log = logging.getLogger("autoragged.benchmarks.packing")


# -- workloads ----------------------------------------------------------------------------------
def beta_lengths(name: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """PyCoRa's Beta recipe for a CoRa dataset (autoragged.workloads, the package's copy of cora.json)."""
    return np.asarray(sample_cora(name, n, rng), dtype=np.int64)


def bimodal_lengths(n: int, rng: np.random.Generator) -> np.ndarray:
    """50/50 uniform integers in [45, 130] and [1820, 2000]."""
    (a0, a1), (b0, b1) = BIMODAL["modes"]
    short = rng.random(n) < 0.5
    return np.where(short, rng.integers(a0, a1 + 1, n), rng.integers(b0, b1 + 1, n)).astype(np.int64)


def load_workloads(names: Sequence[str] | None) -> dict[str, dict[str, Any]]:
    datasets: dict[str, dict[str, Any]] = {d.name: {"min": d.min, "mean": d.mean, "max": d.max} for d in CORA.values()}
    datasets["Bimodal"] = BIMODAL
    if names:
        unknown = [n for n in names if n not in datasets]
        if unknown:
            raise SystemExit(f"unknown dataset(s) {unknown}; known: {sorted(datasets)}")
        datasets = {n: datasets[n] for n in names}
    return datasets


# -- batches ------------------------------------------------------------------------------------
def padded_batch(seqs: list[torch.Tensor], idx: list[int]) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """(x (B, L, D), key padding mask (B, L) True = pad, host lengths) for the sequences `idx`."""
    parts = [seqs[i] for i in idx]
    lengths = tuple(len(p) for p in parts)
    x = torch.nn.utils.rnn.pad_sequence(parts, batch_first=True)
    return x, key_padding_mask(lengths, x.shape[1], x.device), lengths


def key_padding_mask(lengths: Sequence[int], max_len: int, device: torch.device) -> torch.Tensor:
    """(B, max_len) bool, True = pad."""
    return torch.arange(max_len, device=device)[None, :] >= torch.tensor(lengths, device=device)[:, None]


def time_epoch(step: Callable[[Any], Any], batches: list[Any], reps: int, warmup: int) -> list[float]:
    """Milliseconds of `reps` epochs of `step` over `batches`, each timed with CUDA events after `warmup` epochs."""
    for _ in range(warmup):
        for b in batches:
            step(b)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for b in batches:
            step(b)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def max_error_on_real_tokens(out: torch.Tensor, ref: torch.Tensor, lengths: Sequence[int]) -> float:
    return max((out[k, :n] - ref[k, :n]).abs().max().item() for k, n in enumerate(lengths) if n)


def run_workload(
    name: str, lengths: np.ndarray, model: torch.nn.Module, wrapped: Any, args: argparse.Namespace, max_len: int
) -> list[dict[str, Any]]:
    device, d_model = torch.device(args.device), args.d_model
    gen = torch.Generator(device=device).manual_seed(args.seed)
    seqs = [torch.randn(int(n), d_model, device=device, dtype=torch.float16, generator=gen) for n in lengths]
    real_tokens = int(lengths.sum())
    max_tokens = args.max_tokens or args.batch_size * max_len
    batchings = {
        "padded": fixed_size_batches(len(lengths), args.batch_size),
        "padded-sorted": length_sorted_batches(lengths, args.batch_size),
        "wrapped": fixed_size_batches(len(lengths), args.batch_size),
        "ffd-ragged": ffd_pack(lengths, max_tokens, align=args.align),
    }

    def plain(b):
        x, mask, _ = b
        return model(x, src_key_padding_mask=mask)

    def through_wrap(b):
        x, mask, lens = b
        return wrapped(x, src_key_padding_mask=mask, lengths=lens)

    steps = {"padded": plain, "padded-sorted": plain, "wrapped": through_wrap, "ffd-ragged": wrapped}
    rows = []
    for arm in args.arms:
        batches = batchings[arm]
        if arm == "ffd-ragged":
            inputs = [RaggedTensor.from_list([seqs[i] for i in b], align=args.align) for b in batches]
            overhead = padding_overhead(batches, lengths, ragged=True, align=args.align)
        else:
            inputs = [padded_batch(seqs, b) for b in batches]
            overhead = padding_overhead(batches, lengths)
        err = check(arm, inputs[0], model, wrapped) if args.check else None
        times = time_epoch(steps[arm], inputs, args.reps, args.warmup)
        median_ms = statistics.median(times)
        rows.append(
            {
                "workload": name,
                "arm": arm,
                "n_seqs": len(lengths),
                "real_tokens": real_tokens,
                "batch_size": None if arm == "ffd-ragged" else args.batch_size,
                "max_tokens": max_tokens if arm == "ffd-ragged" else None,
                "align": args.align if arm == "ffd-ragged" else 1,
                "n_batches": len(batches),
                "padding_overhead": overhead,
                "median_ms": median_ms,
                "times_ms": times,
                "tokens_per_s": real_tokens / (median_ms / 1e3),
                "max_abs_diff_vs_padded": err,
            }
        )
        log.info("%s %s: %.2f ms, %d batches, overhead %.3f", name, arm, median_ms, len(batches), overhead)
        del inputs
        torch.cuda.empty_cache()
    base = next((r["median_ms"] for r in rows if r["arm"] == "padded"), None)
    for r in rows:
        r["speedup_vs_padded"] = None if base is None else base / r["median_ms"]
    return rows


def check(arm: str, batch: Any, model: torch.nn.Module, wrapped: Any) -> float | None:
    """Max |wrapped - plain| on the real tokens of one batch (None for the plain arms)."""
    if arm == "wrapped":
        x, mask, lens = batch
        return max_error_on_real_tokens(
            wrapped(x, src_key_padding_mask=mask, lengths=lens), model(x, src_key_padding_mask=mask), lens
        )
    if arm == "ffd-ragged":
        out = wrapped(batch)
        if not isinstance(out, RaggedTensor):
            raise TypeError(f"wrapped(RaggedTensor) returned a {type(out).__name__}, expected a RaggedTensor")
        x = batch.to_padded()
        mask = key_padding_mask(batch.lengths, x.shape[1], x.device)
        return max_error_on_real_tokens(out.to_padded(), model(x, src_key_padding_mask=mask), batch.lengths)
    return None


# -- report -------------------------------------------------------------------------------------
def environment() -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "autoragged": getattr(autoragged, "__version__", None),
        "python": platform.python_version(),
        "commit": commit,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'workload':<9} {'arm':<14} {'batches':>7} {'overhead':>9} {'median ms':>10} {'tokens/s':>12} "
        f"{'vs padded':>9} {'max diff':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        speed = "" if r["speedup_vs_padded"] is None else f"{r['speedup_vs_padded']:.2f}x"
        diff = "" if r["max_abs_diff_vs_padded"] is None else f"{r['max_abs_diff_vs_padded']:.2e}"
        print(
            f"{r['workload']:<9} {r['arm']:<14} {r['n_batches']:>7} {r['padding_overhead']:>9.3f} "
            f"{r['median_ms']:>10.2f} {r['tokens_per_s']:>12,.0f} {speed:>9} {diff:>9}"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/packing.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: python benchmarks/packing.py --quick --datasets RACE Bimodal",
    )
    p.add_argument("--datasets", nargs="+", help="CoRa dataset names and/or Bimodal (default: all)")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="which arms to time (default: all)")
    p.add_argument("--n", type=int, default=4096, help="sequences sampled per workload (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=64, help="fixed batch size (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, help="FFD budget in aligned tokens (default: batch size x max length)")
    p.add_argument("--align", type=int, default=16, help="RaggedTensor alignment of the FFD bins (default: 16)")
    p.add_argument("--reps", type=int, default=5, help="timed epochs, the median is reported (default: 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed epochs first (default: 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the wrapped-vs-plain output check")
    p.add_argument("--quick", action="store_true", help="short run: N=512, 2 reps, RACE, MNLI and Bimodal")
    p.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT, help="JSON output (default: %(default)s)")
    p.add_argument("-v", "--verbose", action="store_true", help="log each arm as it finishes")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.reps = min(args.n, 512), min(args.reps, 2)
        args.datasets = args.datasets or ["RACE", "MNLI", "Bimodal"]
    for name in ("n", "batch_size", "reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or (args.max_tokens is not None and args.max_tokens < 1):
        p.error("--warmup must be >= 0 and --max-tokens >= 1")
    args.d_model, args.device = 512, "cuda"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    if not torch.cuda.is_available():
        print("benchmarks/packing.py needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    if not hasattr(autoragged, "wrap"):
        print("benchmarks/packing.py needs autoragged.wrap, which this checkout does not have yet.", file=sys.stderr)
        return 2
    workloads = load_workloads(args.datasets)
    env = environment()
    print(f"device: {env['device']} ({env['sm_count']} SMs, {env['memory_gib']} GiB)")
    print(f"torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, autoragged {env['autoragged']}")
    print(f"N={args.n} per workload, batch {args.batch_size}, align {args.align}, {args.reps} reps, fp16")

    torch.manual_seed(args.seed)
    layer = torch.nn.TransformerEncoderLayer(args.d_model, 8, 2048, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 6).to("cuda", torch.float16).eval()
    wrapped = autoragged.wrap(model, policy="auto")
    rows = []
    with torch.inference_mode():
        for i, (name, spec) in enumerate(workloads.items()):
            rng = np.random.default_rng(args.seed + i)
            lengths = bimodal_lengths(args.n, rng) if name == "Bimodal" else beta_lengths(name, args.n, rng)
            print(f"{name}: lengths {lengths.min()}-{lengths.max()}, mean {lengths.mean():.1f}", flush=True)
            rows += run_workload(name, lengths, model, wrapped, args, int(spec["max"]))
    config = {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()}
    write_json("packing.json", {"environment": env, "config": config, "rows": rows}, str(args.out))
    print(f"wrote {args.out}\n")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
