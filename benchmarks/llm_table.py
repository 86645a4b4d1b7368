"""Decoder LLM prefill on WarpGroup-backend's document mixes: HF padded batches against autoragged.

    python benchmarks/llm_table.py --quick                   # Qwen2.5-0.5B shape, both mixes (a few minutes)
    python benchmarks/llm_table.py --mix bimodal             # Qwen2.5-7B shape, one mix per run (< 10 min each)
    python benchmarks/llm_table.py --mix uniform --no-cap    # also every document in one padded batch (OOM)

Model: a Qwen2ForCausalLM of the Qwen2.5-7B shape (or 0.5B with --quick), random weights, bf16, built on the
GPU (nothing is downloaded), sdpa attention (transformers' default), eval mode, inference_mode. Documents:
400 per mix (autoragged.workloads.sample_documents: "bimodal" half 45-130 and half 1,820-2,000 words,
"uniform" 50-1,900 words, 1.3 tokens a word), random token ids, in random (data) order.

The task of every column: each document's next-token logits at its last token (scoring / classification),
kept on the GPU. The padded columns call the model as HF code does for that, left-padded so that the last
column is every row's last token: model(input_ids, attention_mask, logits_to_keep=1), use_cache left at its
default (True: the call returns a KV cache, as the plain call does).

Columns
  hf_b8          HF padded, batches of 8 in data order (WarpGroup's baseline)
  hf_sorted      HF padded, batches of 8 in length order (the usual cure for padding)
  wrap_b8        autoragged.wrap(model), the same call on hf_b8's batches (the cache the call asks for is
                 built from the ragged arm's keys and values)
  wrap_b8_nocache  the same with use_cache=False (what the docs advise for scoring: no cache to build)
  wrap_sorted    autoragged.wrap(model) on hf_sorted's batches
  bins           autoragged.packing.run_job(model, docs, output="last_logits"): FFD token-budget bins sized by
                 the capacity probe (its time reported apart, probe_s), packed ids, no padded tensor
  bins_modules   (on request: --columns ... bins_modules) the same bins with the model's own decoder layer
                 modules around our attention instead of our fused layer kernels (hf_decoder.FUSED_LAYERS off)
Per column: wall seconds over the whole mix (after a warm-up on its first two batches), real tokens per
second, the padding share of the token rows the batching computes, peak GPU memory (and that minus the
weights), speed-up over hf_b8, and the largest difference of its logits from hf_b8's (hf_sorted's is HF's own
difference between two paddings, the yardstick). --no-cap adds a row where the padded columns get all 400
documents as one batch: the padded model asks for more memory than the GPU has; bins never do.
Prints markdown tables and writes benchmarks/results/llm_table.json.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import autoragged  # noqa: E402
from autoragged._job import _align  # noqa: E402
from autoragged.adapters import hf_decoder  # noqa: E402
from autoragged.packing import (  # noqa: E402
    _is_oom,
    ffd_pack,
    fixed_size_batches,
    length_sorted_batches,
    padding_overhead,
    run_job,
    token_budget,
)
from autoragged.workloads import DOCUMENT_MIXES, llm_config, sample_documents  # noqa: E402
from benchmarks._common import environment, header, require_cuda, table, what_ran, write_json  # noqa: E402

COLUMNS = ["hf_b8", "hf_sorted", "wrap_b8", "wrap_b8_nocache", "wrap_sorted", "bins"]
OPTIONAL = ["bins_modules"]


def build(name: str, layers: int | None) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = llm_config(name, layers)
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def documents(mix: str, n: int, vocab: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed + sum(map(ord, mix)))
    return [rng.integers(100, vocab, size=k) for k in sample_documents(mix, n, rng)]


def left_padded(docs: list[np.ndarray], members: list[int], pad: int):
    """(input_ids, attention_mask) on the GPU, left padding, for the documents `members`."""
    L = max(len(docs[i]) for i in members)
    ids = np.full((len(members), L), pad, dtype=np.int64)
    mask = np.zeros((len(members), L), dtype=np.int64)
    for r, i in enumerate(members):
        ids[r, L - len(docs[i]) :] = docs[i]
        mask[r, L - len(docs[i]) :] = 1
    return torch.from_numpy(ids).cuda(non_blocking=True), torch.from_numpy(mask).cuda(non_blocking=True)


def run_padded(model, docs, batches, pad: int, **call) -> list[torch.Tensor]:
    """Each document's last-token logits (V,) on the GPU, through padded batches."""
    out: list[torch.Tensor | None] = [None] * len(docs)
    for members in batches:
        ids, mask = left_padded(docs, members, pad)
        logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=1, **call).logits[:, -1]
        for r, i in enumerate(members):
            out[i] = logits[r]
        del ids, mask, logits
    return out


def measure(fn, warm=None) -> dict:
    """Wall seconds of fn() (synchronised), peak GPU memory; an OOM is a result, not an error."""
    if warm is not None:
        warm()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        result = fn()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - out of memory is what the no-cap row measures
        if not _is_oom(e):
            raise
        message = str(e).splitlines()[0][:200]
        del e
        gc.collect()
        torch.cuda.empty_cache()
        return {"oom": message}
    return {"s": time.perf_counter() - t0, "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "result": result}


def _max_diff(got: list, want: list) -> float:
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))


def bench_mix(mix: str, args, model, wrapped, weights_gib: float) -> list[dict]:
    vocab, pad = model.config.vocab_size, model.config.pad_token_id
    docs = documents(mix, args.documents, vocab)
    lengths = [len(d) for d in docs]
    tokens = sum(lengths)
    b8 = fixed_size_batches(len(docs), args.batch)
    srt = length_sorted_batches(lengths, args.batch)
    runs = {
        "hf_b8": (lambda b: run_padded(model, docs, b, pad), b8),
        "hf_sorted": (lambda b: run_padded(model, docs, b, pad), srt),
        "wrap_b8": (lambda b: run_padded(wrapped, docs, b, pad), b8),
        "wrap_b8_nocache": (lambda b: run_padded(wrapped, docs, b, pad, use_cache=False), b8),
        "wrap_sorted": (lambda b: run_padded(wrapped, docs, b, pad), srt),
    }
    row: dict = {"mix": mix, "documents": len(docs), "tokens": tokens}
    results = {}
    seen = len(autoragged.recent_decisions(wrapped, 10_000))
    with torch.inference_mode():
        for col in args.columns:
            if col == "bins":
                cell = bins_cell(row, args, wrapped, docs, lengths)
            elif col == "bins_modules":
                hf_decoder.FUSED_LAYERS = False
                try:
                    # the bins column's budget when it ran first (the same bins): an A/B of the layer code
                    cell = bins_cell({}, args, wrapped, docs, lengths, row.get("bin_tokens"))
                finally:
                    hf_decoder.FUSED_LAYERS = True
            else:
                fn, batches = runs[col]
                cell = measure(lambda f=fn, b=batches: f(b), warm=lambda f=fn, b=batches: f(b[:2]))
                row[f"{col}_padding"] = _share(padding_overhead(batches, lengths))
            if "oom" in cell:
                row[f"{col}_oom"] = cell["oom"]
                print(f"  {mix} {col}: out of memory ({cell['oom']})", flush=True)
                continue
            results[col] = [t.cpu() for t in cell.pop("result")]  # off the GPU: the next column's peak is its own
            row[f"{col}_s"] = cell["s"]
            row[f"{col}_tok_s"] = tokens / cell["s"]
            row[f"{col}_peak_gib"] = cell["peak_gib"]
            row[f"{col}_act_gib"] = cell["peak_gib"] - weights_gib
            print(f"  {mix} {col}: {cell['s']:.1f} s, {tokens / cell['s']:,.0f} tok/s, "
                  f"peak {cell['peak_gib']:.1f} GiB", flush=True)  # fmt: skip
    if "hf_b8" in results:
        for col, got in results.items():
            if col != "hf_b8":
                row[f"{col}_diff"] = _max_diff(got, results["hf_b8"])
                row[f"{col}_speedup"] = row["hf_b8_s"] / row[f"{col}_s"]
    row["wrap_arms"] = what_ran(wrapped, len(autoragged.recent_decisions(wrapped, 10_000)) - seen)
    rows = [row]
    if args.no_cap:
        rows.append(no_cap(mix, docs, args, model, wrapped, weights_gib))
    return rows


def bins_cell(row: dict, args, wrapped, docs, lengths, budget: int | None = None) -> dict:
    """The bins column: the budget (given, --max-tokens, or probed), then run_job timed over the whole mix."""
    t0 = time.perf_counter()
    given = budget or args.max_tokens
    budget = given or token_budget(wrapped, docs, output="last_logits", cap=args.cap)
    row["probe_s"] = 0.0 if given else time.perf_counter() - t0
    align = _align(wrapped.model._autoragged, max(lengths), None)  # as run_job aligns its bins
    bins = ffd_pack(lengths, budget, align)
    row.update(bin_tokens=budget, bins_count=len(bins))
    row["bins_padding"] = _share(padding_overhead(bins, lengths, ragged=True, align=align))

    def job(some):
        return list(run_job(wrapped, some, output="last_logits", max_tokens=budget, progress=False))

    return measure(lambda: job(docs), warm=lambda: job(docs[:16]))


def no_cap(mix, docs, args, model, wrapped, weights_gib) -> dict:
    """Every document in one padded batch (what `model(**tokenizer(texts, padding=True))` does), against bins."""
    pad = model.config.pad_token_id
    everything = [list(range(len(docs)))]
    row: dict = {"mix": f"{mix} (no cap)", "documents": len(docs), "tokens": sum(len(d) for d in docs)}
    with torch.inference_mode():
        for col, m in (("hf_b8", model), ("wrap_b8_nocache", wrapped)):
            call = {"use_cache": False} if col.endswith("nocache") else {}
            cell = measure(lambda m=m, c=call: run_padded(m, docs, everything, pad, **c))
            row[f"{col}_padding"] = _share(padding_overhead(everything, [len(d) for d in docs]))
            if "oom" in cell:
                row[f"{col}_oom"] = cell["oom"]
                print(f"  {mix} no cap {col}: out of memory ({cell['oom']})", flush=True)
            else:
                row[f"{col}_s"], row[f"{col}_peak_gib"] = cell["s"], cell["peak_gib"]
                row[f"{col}_tok_s"] = row["tokens"] / cell["s"]
                print(f"  {mix} no cap {col}: {cell['s']:.1f} s, peak {cell['peak_gib']:.1f} GiB", flush=True)
    return row


def _share(overhead: float) -> float:
    """Padding as a share of the rows computed, from padding_overhead's cost / real - 1."""
    return overhead / (1 + overhead)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the Qwen2.5-0.5B shape instead of Qwen2.5-7B")
    p.add_argument("--model", choices=["qwen2.5-7b", "qwen2.5-0.5b"], help="the shape (default: by --quick)")
    p.add_argument("--layers", type=int, help="fewer layers than the shape has (smoke runs)")
    p.add_argument("--mix", nargs="+", choices=list(DOCUMENT_MIXES), default=list(DOCUMENT_MIXES))
    p.add_argument("--documents", type=int, default=400, help="documents per mix (default 400)")
    p.add_argument("--batch", type=int, default=8, help="padded batch size (default 8)")
    p.add_argument("--columns", nargs="+", default=COLUMNS, help=f"subset of {COLUMNS + OPTIONAL}")
    p.add_argument("--max-tokens", type=int, help="bin budget (default: measured by the capacity probe)")
    p.add_argument("--cap", type=int, default=16384, help="the probe's largest bin (default 16384 tokens)")
    p.add_argument("--no-cap", action="store_true", help="also all documents as one padded batch (the OOM case)")
    p.add_argument("--db", help="tuning database of the wrapped model (default $AUTORAGGED_DB or ~/.cache)")
    p.add_argument("--out", help="JSON path (default benchmarks/results/llm_table.json)")
    args = p.parse_args(argv)
    unknown = set(args.columns) - set(COLUMNS + OPTIONAL)
    if unknown:
        p.error(f"unknown columns {sorted(unknown)}; choose from {COLUMNS + OPTIONAL}")
    require_cuda("benchmarks/llm_table.py")
    import transformers

    name = args.model or ("qwen2.5-0.5b" if args.quick else "qwen2.5-7b")
    env = environment()
    env["transformers"] = transformers.__version__
    header(f"Decoder LLM prefill on WarpGroup's mixes ({name}, bf16, sdpa, inference)", env)
    model = build(name, args.layers)
    torch.cuda.synchronize()
    weights_gib = torch.cuda.memory_allocated() / 2**30
    # the same weights, wrapped: wrap() changes the model in place, so the padded columns use a twin that shares
    # its parameters (no second copy in memory) and only the twin's base model dispatches
    wrapped = _wrapped_twin(model, args.db)
    results = {"env": env, "args": vars(args), "model": name, "weights_gib": weights_gib, "rows": []}
    for mix in args.mix:
        results["rows"] += bench_mix(mix, args, model, wrapped, weights_gib)
    rows = results["rows"]
    cols = [("mix", "mix", ""), ("tokens", "tokens", "d")]
    for c in args.columns:
        cols += [(f"{c}_tok_s", f"{c} tok/s", ",.0f")]
    print(f"\n## {name}: real tokens per second (whole mix)\n")
    print(table(rows, cols))
    print("\n## speed-up over hf_b8, padding share, peak GiB (weights included), max |logit diff| vs hf_b8\n")
    detail = [("mix", "mix", "")]
    for c in args.columns:
        detail += [(f"{c}_speedup", f"{c} x", ".2f"), (f"{c}_padding", "pad", ".0%"),
                   (f"{c}_peak_gib", "GiB", ".1f"), (f"{c}_diff", "diff", ".3g")]  # fmt: skip
    print(table(rows, detail))
    for r in rows:
        ooms = {k: v for k, v in r.items() if k.endswith("_oom")}
        if ooms:
            print(f"\n{r['mix']}: " + "; ".join(f"{k[:-4]} out of memory: {v}" for k, v in ooms.items()))
        if r.get("bin_tokens"):
            print(f"{r['mix']}: {r['bins_count']} bins of at most {r['bin_tokens']} tokens "
                  f"(probe {r.get('probe_s', 0):.1f} s)")  # fmt: skip
        if r.get("wrap_arms"):
            print(f"{r['mix']}: wrapped arms {r['wrap_arms']}")
    path = write_json("llm_table.json", results, args.out)
    print(f"wrote {path}")
    return 0


def _wrapped_twin(model, db):
    """A second ...ForCausalLM object over the same parameter tensors, wrapped (the padded columns keep the
    original): module objects are copied, tensors shared."""
    import copy

    memo = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    twin = copy.deepcopy(model, memo)
    return autoragged.wrap(twin, db=db)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
