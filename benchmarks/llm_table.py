"""Decoder LLM prefill on WarpGroup-backend's document mixes: HF padded batches against autoragged.

    python benchmarks/llm_table.py --quick                   # the Qwen2.5-0.5B shape, both mixes (a few minutes)
    python benchmarks/llm_table.py --mix bimodal             # the Qwen2.5-7B shape, one mix per run (< 10 min each)
    python benchmarks/llm_table.py --mix uniform --no-cap    # also every document in one padded batch (OOM)
    python benchmarks/llm_table.py --smoke                   # a tiny Qwen2 on the CPU: checks the script

Model: a Qwen2ForCausalLM of the Qwen2.5-7B shape (0.5B with --quick), random weights, bf16, sdpa attention, eval,
inference mode. Documents: 400 per mix (autoragged.workloads.sample_documents: "bimodal" half 45-130 and half
1,820-2,000 words, "uniform" 50-1,900 words, 1.3 tokens a word), random token ids, in random (data) order.

The task of every column: each document's next-token logits at its last token (scoring), kept on the device.
The padded columns call the model as HF code does for that, left padding so that the last column is every
row's last token: model(input_ids, attention_mask, logits_to_keep=1), use_cache at its default (True).

Columns (real tokens per second over the whole mix, after a warm-up on its first two batches)
  hf_b8            HF padded, batches of 8 in data order (WarpGroup's baseline)
  hf_sorted        HF padded, batches of 8 in length order (the usual cure for padding)
  wrap_b8          autoragged.wrap(model): the same call on hf_b8's batches
  wrap_b8_nocache  the same with use_cache=False (no cache to build: what scoring needs)
  wrap_sorted      autoragged.wrap(model) on hf_sorted's batches
  bins             autoragged.packing.run_job(model, docs, output="last_logits"): first-fit-decreasing bins of
                   --max-tokens, else of token_budget()'s probe (its seconds reported apart, probe_s)
Per column also: the padding share of the token rows computed, peak GPU memory (and that minus the weights), the
speed-up over hf_b8 and the largest difference of its logits from hf_b8's (hf_sorted's is HF's own difference
between two paddings: the yardstick). --no-cap adds a row with all 400 documents in one padded batch, which asks
for more memory than the GPU has; bins never do. Appends a line to benchmarks/results/llm_table.jsonl.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import autoragged  # noqa: E402
from autoragged.packing import (  # noqa: E402
    ffd_pack,
    fixed_size_batches,
    length_sorted_batches,
    padding_overhead,
    run_job,
    token_budget,
)
from autoragged.workloads import DOCUMENT_MIXES, llm_config, sample_documents  # noqa: E402
from benchmarks._common import arms_ran, device_of, header, parser, record, sync, table  # noqa: E402

COLUMNS = ["hf_b8", "hf_sorted", "wrap_b8", "wrap_b8_nocache", "wrap_sorted", "bins"]
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1000}  # fmt: skip
TINY_TOKENS = {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}  # (Qwen2's ids are past a tiny vocabulary)


def build(name: str, layers: int | None, device, smoke: bool) -> torch.nn.Module:
    """A Qwen2ForCausalLM of one of LLM_SHAPES (TINY with --smoke), bf16 on a GPU, built on the device."""
    import transformers

    torch.manual_seed(0)
    config = llm_config(name, layers)
    if smoke:
        config.update({**TINY, **TINY_TOKENS})
    config._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with device:
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def documents(mix: str, n: int, vocab: int, max_len: int | None, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed + sum(map(ord, mix)))
    return [rng.integers(100, vocab, size=min(k, max_len or k)) for k in sample_documents(mix, n, rng)]


def left_padded(docs: list[np.ndarray], members: list[int], pad: int, device):
    """(input_ids, attention_mask) on the device, left padding, for the documents `members`."""
    L = max(len(docs[i]) for i in members)
    ids = np.full((len(members), L), pad, dtype=np.int64)
    mask = np.zeros((len(members), L), dtype=np.int64)
    for r, i in enumerate(members):
        ids[r, L - len(docs[i]) :] = docs[i]
        mask[r, L - len(docs[i]) :] = 1
    return torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)


def run_padded(model, docs, batches, pad: int, device, **call) -> list[torch.Tensor]:
    """Each document's last-token logits (V,) on the device, through padded batches."""
    out: list[torch.Tensor | None] = [None] * len(docs)
    for members in batches:
        ids, mask = left_padded(docs, members, pad, device)
        logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=1, **call).logits[:, -1]
        for r, i in enumerate(members):
            out[i] = logits[r]
    return out


def measure(fn, device, warm=None) -> dict:
    """Wall seconds of fn() (synchronised) and peak GPU memory; an out-of-memory error is a result."""
    if warm is not None:
        warm()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    sync(device)
    t0 = time.perf_counter()
    try:
        result = fn()
        sync(device)
    except torch.cuda.OutOfMemoryError as e:  # what the no-cap row measures
        message = str(e).splitlines()[0][:200]
        gc.collect()
        torch.cuda.empty_cache()
        return {"oom": message}
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {"s": time.perf_counter() - t0, "peak_gib": peak, "result": result}


def _share(overhead: float) -> float:
    """Padding as a share of the rows computed, from padding_overhead's cost / real - 1."""
    return overhead / (1 + overhead)


def bins_cell(row: dict, args, wrapped, docs, lengths) -> dict:
    """The bins column: the budget (--max-tokens, or probed), then run_job timed over the whole mix."""
    t0 = time.perf_counter()
    budget = args.max_tokens or token_budget(wrapped, docs, output="last_logits", align=args.align, cap=args.cap)
    row["probe_s"] = 0.0 if args.max_tokens else time.perf_counter() - t0
    bins = ffd_pack(lengths, budget, args.align)
    row.update(bin_tokens=budget, bins_count=len(bins))
    row["bins_padding"] = _share(padding_overhead(bins, lengths, ragged=True, align=args.align))

    def job(some):
        return list(run_job(wrapped, some, output="last_logits", max_tokens=budget, align=args.align, progress=False))

    return measure(lambda: job(docs), args.device, warm=lambda: job(docs[:16]))


def bench_mix(mix: str, args, model, wrapped, weights_gib: float) -> list[dict]:
    vocab, pad, device = model.config.vocab_size, model.config.pad_token_id, args.device
    docs = documents(mix, args.documents, vocab, args.max_len)
    lengths = [len(d) for d in docs]
    b8, srt = fixed_size_batches(len(docs), args.batch), length_sorted_batches(lengths, args.batch)
    runs = {
        "hf_b8": (model, b8, {}),
        "hf_sorted": (model, srt, {}),
        "wrap_b8": (wrapped, b8, {}),
        "wrap_b8_nocache": (wrapped, b8, {"use_cache": False}),
        "wrap_sorted": (wrapped, srt, {}),
    }
    row: dict = {"mix": mix, "documents": len(docs), "tokens": sum(lengths)}
    results = {}
    with torch.inference_mode():
        for col in args.columns:
            if col == "bins":
                cell = bins_cell(row, args, wrapped, docs, lengths)
            else:
                m, batches, call = runs[col]
                run = lambda b, m=m, c=call: run_padded(m, docs, b, pad, device, **c)  # noqa: E731
                cell = measure(lambda run=run, b=batches: run(b), device, warm=lambda run=run, b=batches: run(b[:2]))
                row[f"{col}_padding"] = _share(padding_overhead(batches, lengths))
            if _cell(row, col, cell, weights_gib):
                results[col] = [t.cpu() for t in cell["result"]]  # off the GPU: the next column's peak is its own
    for col, got in results.items():
        if col != "hf_b8" and "hf_b8" in results:
            row[f"{col}_diff"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, results["hf_b8"]))
            row[f"{col}_speedup"] = row["hf_b8_s"] / row[f"{col}_s"]
    return [row, no_cap(mix, docs, args, model, wrapped, weights_gib)] if args.no_cap else [row]


def _cell(row: dict, col: str, cell: dict, weights_gib: float) -> bool:
    """Put a column's measurement into `row`; False for an out-of-memory."""
    if "oom" in cell:
        row[f"{col}_oom"] = cell["oom"]
        print(f"  {row['mix']} {col}: out of memory ({cell['oom']})", flush=True)
        return False
    row[f"{col}_s"], row[f"{col}_tok_s"] = cell["s"], row["tokens"] / cell["s"]
    if cell["peak_gib"] is not None:
        row[f"{col}_peak_gib"], row[f"{col}_act_gib"] = cell["peak_gib"], cell["peak_gib"] - weights_gib
    print(f"  {row['mix']} {col}: {cell['s']:.2f} s, {row[f'{col}_tok_s']:,.0f} tok/s", flush=True)
    return True


def no_cap(mix, docs, args, model, wrapped, weights_gib) -> dict:
    """Every document in one padded batch (what `model(**tokenizer(texts, padding=True))` does)."""
    everything = [list(range(len(docs)))]
    row: dict = {"mix": f"{mix} (no cap)", "documents": len(docs), "tokens": sum(len(d) for d in docs)}
    with torch.inference_mode():
        for col, m, call in (("hf_b8", model, {}), ("wrap_b8_nocache", wrapped, {"use_cache": False})):
            cell = measure(lambda m=m, c=call: run_padded(m, docs, everything, model.config.pad_token_id, args.device,
                                                          **c), args.device)  # fmt: skip
            row[f"{col}_padding"] = _share(padding_overhead(everything, [len(d) for d in docs]))
            _cell(row, col, cell, weights_gib)
    return row


def wrapped_twin(model):
    """A second ...ForCausalLM object over the same parameter tensors, wrapped (the padded columns keep the
    original): module objects are copied, tensors shared, so the weights are in memory once."""
    memo = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return autoragged.wrap(copy.deepcopy(model, memo), db=False)


def report(rows: list[dict], columns: list[str], name: str) -> None:
    print(f"\n## {name}: real tokens per second (whole mix)\n")
    print(table(rows, [("mix", "mix", ""), ("tokens", "tokens", "d")] + [(f"{c}_tok_s", c, ",.0f") for c in columns]))
    print("\n## speed-up over hf_b8, padding share, peak GiB (weights included), max |logit diff| against hf_b8\n")
    detail = [("mix", "mix", "")]
    for c in columns:
        detail += [(f"{c}_speedup", f"{c} x", ".2f"), (f"{c}_padding", "pad", ".0%"),
                   (f"{c}_peak_gib", "GiB", ".1f"), (f"{c}_diff", "diff", ".3g")]  # fmt: skip
    print(table(rows, detail))
    for r in rows:
        if r.get("bin_tokens"):
            print(
                f"{r['mix']}: {r['bins_count']} bins of at most {r['bin_tokens']} tokens (probe {r['probe_s']:.1f} s)"
            )


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--model", choices=["qwen2.5-7b", "qwen2.5-0.5b"], help="the shape (default: by --quick)")
    p.add_argument("--layers", type=int, help="fewer layers than the shape has")
    p.add_argument("--mix", nargs="+", choices=list(DOCUMENT_MIXES), default=list(DOCUMENT_MIXES))
    p.add_argument("--documents", type=int, default=400, help="documents per mix (default 400)")
    p.add_argument("--batch", type=int, default=8, help="padded batch size (default 8)")
    p.add_argument("--columns", nargs="+", choices=COLUMNS, default=COLUMNS)
    p.add_argument("--max-tokens", type=int, help="bin budget (default: measured by token_budget's probe)")
    p.add_argument("--align", type=int, default=1, help="the bins' alignment in tokens (default 1)")
    p.add_argument("--cap", type=int, default=16384, help="the probe's largest bin (default 16384 tokens)")
    p.add_argument("--no-cap", action="store_true", help="also all documents as one padded batch (the OOM case)")
    args = p.parse_args(argv)
    args.max_len = None
    if args.smoke:  # documents of at most 256 tokens: the tiny model's full mix runs in seconds
        args.documents, args.max_len, args.max_tokens = 24, 256, args.max_tokens or 1024
    args.device = device_of(args, "benchmarks/llm_table.py")
    name = args.model or ("qwen2.5-0.5b" if args.quick or args.smoke else "qwen2.5-7b")
    header(
        f"Decoder LLM prefill on WarpGroup's mixes ({name}, bf16, sdpa)" + (", smoke: tiny, CPU" if args.smoke else "")
    )
    model = build(name, args.layers, args.device, args.smoke)
    sync(args.device)
    weights_gib = torch.cuda.memory_allocated() / 2**30 if args.device.type == "cuda" else 0.0
    wrapped = wrapped_twin(model)
    rows = [r for mix in args.mix for r in bench_mix(mix, args, model, wrapped, weights_gib)]
    report(rows, args.columns, name)
    record("llm_table", args, rows, model=name, weights_gib=weights_gib, wrap_arms=arms_ran(wrapped, 100_000))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
