"""HuggingFace encoders on the CoRa length distributions: what users run, against autoragged.

    python benchmarks/hf_table.py                          # bert-base, 24 rows, every column
    python benchmarks/hf_table.py --models bert-base roberta-base MiniLM-L12-H384 --quick
    python benchmarks/hf_table.py --encode 20000           # also SentenceTransformer.encode of 20k sentences

Models: random-weight HF models of the named shapes (autoragged.workloads.HF_SHAPES; nothing is
downloaded), fp16, sdpa attention (transformers' default), eval mode. Batches: the eight CoRa length
distributions (PyCoRa Beta recipe, fixed seeds) at batch 32/64/128, random token ids, right padding.
Each cell is the median over --batches batches of the per-batch median ms (CUDA events around one call
after warm-up; the call ends with a synchronisation, so a cell is a batch's latency, host work included).

Columns
  hf_sdpa        the HF model's own padded forward (what users run): model(input_ids, attention_mask)
  hf_sorted      the same on the row's sequences re-batched in length order (the usual cure for padding);
                 the time per batch of B sequences
  varlen         a hand-packed peer: the same modules on the real tokens, torch's varlen_attn, packed once
                 after the embeddings and unpacked once at the end, eager
  ragged         autoragged forced to its eager ragged arm (policy="ragged")
  graph_cublas   autoragged's ragged graph arm with cuBLAS linears, forced (captured on first sight)
  graph_triton   the same with our Triton linears
  auto           autoragged.wrap(model), called with the attention mask as HF code calls it
  auto_lengths   the same wrapped model given input_ids and lengths= (host ints) instead of the mask: no
                 device sync (with both, wrap(validate_lengths=True) checks them against each other)
auto's output is checked against hf_sdpa's on the real tokens on every batch (max abs error reported).
Prints markdown tables and writes benchmarks/results/hf_table.json.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import math
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from autoragged.tuning_db import BatchStats  # noqa: E402

import autoragged  # noqa: E402
from autoragged._costmodel import Arm  # noqa: E402
from autoragged._measure import ArmRunner, time_ms  # noqa: E402
from autoragged._planner import graph_config  # noqa: E402
from autoragged.workloads import CORA, CORA_BATCH_SIZES, HF_SHAPES, hf_config, sample_cora  # noqa: E402
from benchmarks._common import RESULTS, environment, header, require_cuda, table, what_ran, write_json  # noqa: E402

COLUMNS = ["hf_sdpa", "hf_sorted", "varlen", "ragged", "graph_cublas", "graph_triton", "auto", "auto_lengths"]
FORCED = ("ragged", "graph_cublas", "graph_triton")


def build(name: str, device) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = hf_config(name)
    config._attn_implementation = "sdpa"
    return transformers.AutoModel.from_config(config).to(device, torch.float16).eval()


class VarlenPeer:
    """The padding-free BERT a user would write by hand: the model's own modules on the packed real tokens,
    torch's varlen_attn, one pack after the embeddings and one unpack at the end."""

    def __init__(self, model):
        self.model = model

    def __call__(self, ids, idx, cu, max_len):
        from torch.nn.attention.varlen import varlen_attn

        m = self.model
        x = m.embeddings(input_ids=ids)
        B, L, D = x.shape
        v = x.reshape(B * L, D).index_select(0, idx)
        for layer in m.encoder.layer:
            s, o = layer.attention.self, layer.attention.output
            H = s.num_attention_heads
            q, k, w = (lin(v).view(-1, H, D // H) for lin in (s.query, s.key, s.value))
            a = varlen_attn(q, k, w, cu, cu, max_len, max_len)
            h = o.LayerNorm(v + o.dense(a.reshape(-1, D)))
            v = layer.output.LayerNorm(h + layer.output.dense(layer.intermediate(h)))
        out = x.new_zeros(B * L, D).index_copy_(0, idx, v).view(B, L, D)
        return out, (m.pooler(out) if m.pooler is not None else None)


def batch_of(lengths, vocab: int, device, seed: int, pad: int = 0):
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    lens = torch.tensor(lengths)
    keep = torch.arange(L)[None, :] < lens[:, None]
    ids = torch.randint(5, vocab, (len(lengths), L), generator=g).masked_fill(~keep, pad)
    return ids.to(device), keep.long().to(device)


def bench_batch(lengths, seed, args, models, device) -> dict:
    ids, mask = batch_of(lengths, models["vocab"], device, seed, models["pad"])
    B, L = ids.shape
    out: dict = {}

    def t(fn):
        return time_ms(fn, device, warmup=args.warmup, reps=args.reps).median_ms

    plain = models["plain"]
    with torch.inference_mode():
        out["hf_sdpa"] = t(lambda: plain(input_ids=ids, attention_mask=mask))
        if "varlen" in args.columns:
            idx = torch.cat([torch.arange(n) + i * L for i, n in enumerate(lengths)]).to(device)
            cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device=device)
            out["varlen"] = t(lambda: models["varlen"](ids, idx, cu, max(lengths)))
        if "ragged" in args.columns:
            out["ragged"] = t(lambda: models["ragged"](input_ids=ids, attention_mask=mask))
        runner = models["runner"]
        stats = BatchStats.from_lengths(tuple(lengths), padded_len=L)
        head_dim = runner.runtime.body.head_dim
        for col, backend in (("graph_cublas", "cublas"), ("graph_triton", "triton")):
            if col in args.columns:
                arm = Arm("ragged_graph", graph_config(head_dim, max(lengths), backend))
                call = lambda a=arm: runner.run_call(a, runner.hf_call({"input_ids": ids, "attention_mask": mask}),  # noqa: E731
                                                     tuple(lengths), stats)  # fmt: skip
                out[col] = t(call)
        auto = models["auto"]
        if "auto" in args.columns:
            out["auto"] = t(lambda: auto(input_ids=ids, attention_mask=mask))
            out["auto_arms"] = what_ran(auto, args.reps)
            got = auto(input_ids=ids, attention_mask=mask).last_hidden_state
            want = plain(input_ids=ids, attention_mask=mask).last_hidden_state
            keep = mask.bool()
            out["auto_max_err"] = (got[keep].float() - want[keep].float()).abs().max().item()
        if "auto_lengths" in args.columns:
            out["auto_lengths"] = t(lambda: auto(input_ids=ids, lengths=lengths))  # no mask: nothing to read
            out["auto_lengths_arms"] = what_ran(auto, args.reps)
    return out


def sorted_ms(all_lengths: list[list[int]], args, models, device) -> float:
    """hf_sdpa on the row's sequences re-batched in length order: ms per batch of the row's size."""
    flat = sorted(n for lengths in all_lengths for n in lengths)
    B = len(all_lengths[0])
    batches = [flat[i : i + B] for i in range(0, len(flat), B)]
    total = 0.0
    with torch.inference_mode():
        for i, lengths in enumerate(batches):
            ids, mask = batch_of(lengths, models["vocab"], device, 1000 + i, models["pad"])
            call = lambda ids=ids, mask=mask: models["plain"](input_ids=ids, attention_mask=mask)  # noqa: E731
            total += time_ms(call, device, warmup=args.warmup, reps=args.reps).median_ms
    return total / len(batches)


def bench_row(name, batch, args, models, device) -> dict:
    rng = np.random.default_rng(sum(map(ord, name)) * 1000 + batch)
    all_lengths = [sample_cora(name, batch, rng) for _ in range(args.batches)]
    cells: dict[str, list] = {}
    arms: dict[str, dict[str, int]] = {"auto_arms": {}, "auto_lengths_arms": {}}
    for b, lengths in enumerate(all_lengths):
        for col, v in bench_batch(lengths, b, args, models, device).items():
            if col in arms:
                for key, count in v.items():
                    arms[col][key] = arms[col].get(key, 0) + count
            else:
                cells.setdefault(col, []).append(v)
    row = {"dataset": name, "batch": batch}
    row.update({col: (max(v) if col == "auto_max_err" else statistics.median(v)) for col, v in cells.items()})
    if "hf_sorted" in args.columns:
        row["hf_sorted"] = sorted_ms(all_lengths, args, models, device)
    row.update({k: v for k, v in arms.items() if v})
    if row.get("auto"):
        row["auto_vs_hf_sdpa"] = row["hf_sdpa"] / row["auto"]
        forced = [row[c] for c in FORCED if row.get(c)]
        if forced:
            row["auto_vs_best_forced"] = row["auto"] / min(forced)
        if row.get("varlen"):
            row["auto_vs_varlen"] = row["varlen"] / row["auto"]
    return row


ENCODE_MODES = ("plain", "wrapped_own_tokenizer", "wrapped")


def encode_bench(args, device) -> dict:
    """SentenceTransformer.encode of `args.encode` sentences drawn from the eight CoRa mixes: sentences/s, plain,
    wrapped with sentence-transformers' own tokenizer call (the fast tokenizing path off: what the model and the
    host lengths give), and wrapped as shipped. Each warm time follows one cold pass over the same sentences
    (the first mode's cold pass also pays the process's CUDA and tokenizer start-up). `convert_to_tensor=True`
    keeps the embeddings on the device (no sync per batch in encode()); the default numpy output copies each
    batch to the host, a sync per batch, and is timed too. The model's own share: ST's forward on the same
    batches tokenized first."""
    import tempfile

    import transformers
    from sentence_transformers import SentenceTransformer

    rng = np.random.default_rng(7)
    per = -(-args.encode // len(CORA))
    lengths = [n for name in CORA for n in sample_cora(name, per, rng)][: args.encode]
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(20000)]
    sentences = [" ".join(f"w{(i * 131 + j * 7) % 20000}" for j in range(max(n - 2, 1))) for i, n in enumerate(lengths)]
    result = {"sentences": len(sentences), "model": args.encode_model, "batch_size": args.encode_batch}
    embeddings = {}
    with tempfile.TemporaryDirectory() as tmp:
        pathlib.Path(tmp, "vocab.txt").write_text("\n".join(words))
        transformers.BertTokenizerFast(vocab_file=str(pathlib.Path(tmp, "vocab.txt"))).save_pretrained(tmp)
        config = hf_config(args.encode_model)
        config.vocab_size = len(words)
        torch.manual_seed(0)
        transformers.BertModel(config).save_pretrained(tmp)
        order = np.argsort([-n for n in lengths], kind="stable")  # as encode() does: longest first
        B = args.encode_batch
        for mode in ENCODE_MODES:
            st = SentenceTransformer(tmp, device=str(device)).half().eval()
            st.max_seq_length = 512
            if mode != "plain":
                autoragged.wrap(st, db=args.db)
                st[0]._autoragged_st.fast = mode == "wrapped"
            # the model's share: forward on batches tokenized beforehand (encode() tokenizes inside its loop)
            t0 = time.perf_counter()
            features = [st.tokenize([sentences[j] for j in order[i : i + B]]) for i in range(0, len(order), B)]
            tokenize_s = time.perf_counter() - t0
            features = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in f.items()} for f in features]
            forward_s = []
            with torch.inference_mode():
                for _ in range(2):  # cold, then warm
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for f in features:
                        st.forward(dict(f))
                    torch.cuda.synchronize()
                    forward_s.append(time.perf_counter() - t0)
            times = []
            for numpy_out in (False, False, True):  # cold, warm, warm with numpy output
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                emb = st.encode(sentences, batch_size=B, convert_to_tensor=not numpy_out)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            result[mode] = {
                "cold_s": times[0],
                "warm_s": times[1],
                "numpy_warm_s": times[2],
                "sentences_per_s": len(sentences) / times[1],
                "tokenize_s": tokenize_s,
                "forward_cold_s": forward_s[0],
                "forward_warm_s": forward_s[1],
            }
            embeddings[mode] = torch.as_tensor(emb).float().cpu()
            del st
            torch.cuda.empty_cache()
    for mode in ENCODE_MODES[1:]:
        result[mode]["max_abs_diff"] = (embeddings[mode] - embeddings["plain"]).abs().max().item()
        result[mode]["speedup_warm"] = result["plain"]["warm_s"] / result[mode]["warm_s"]
        result[mode]["speedup_numpy_warm"] = result["plain"]["numpy_warm_s"] / result[mode]["numpy_warm_s"]
        result[mode]["forward_speedup_warm"] = result["plain"]["forward_warm_s"] / result[mode]["forward_warm_s"]
    return result


def host_profile(models, device, dataset: str = "CoLA", batch: int = 128, calls: int = 200) -> None:
    """cProfile of `calls` calls of the forced cuBLAS graph (ArmRunner) and of auto with lengths= and with the
    mask, on one batch, each back to back (unsynced, as a stream) and synchronised after every call (as the
    latency table): where the host time between them goes. Prints the top functions and what auto ran, and
    writes each profile as host_profile_<dataset>_<B>_<path>_<mode>.prof (pstats) into $OUT, else
    benchmarks/results/."""
    import cProfile
    import pstats

    lengths = sample_cora(dataset, batch, np.random.default_rng(0))
    ids, mask = batch_of(lengths, models["vocab"], device, 0, models["pad"])
    runner, auto = models["runner"], models["auto"]
    stats = BatchStats.from_lengths(tuple(lengths), padded_len=ids.shape[1])
    arm = Arm("ragged_graph", graph_config(runner.runtime.body.head_dim, max(lengths), "cublas"))
    calls_of = {
        "forced cublas graph": lambda: runner.run_call(
            arm, runner.hf_call({"input_ids": ids, "attention_mask": mask}), tuple(lengths), stats
        ),  # fmt: skip
        "auto lengths=": lambda: auto(input_ids=ids, lengths=lengths),
        "auto mask": lambda: auto(input_ids=ids, attention_mask=mask),
    }
    with torch.inference_mode():
        for (name, fn), synced in itertools.product(calls_of.items(), (False, True)):
            # unsynced: back to back, as a stream runs (the host runs ahead: waits show as Event.synchronize);
            # synced: each call then a synchronisation, as the latency table times them (host time = latency)
            def call(fn=fn, synced=synced):
                fn()
                if synced:
                    torch.cuda.synchronize()

            for _ in range(20):
                call()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            host = (time.perf_counter() - t0) / calls * 1e3
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / calls * 1e3
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                call()
            prof.disable()
            torch.cuda.synchronize()
            mode = "synced" if synced else "unsynced"
            print(f"\n### {name}, {mode}: {host:.3f} ms host per call, {wall:.3f} ms with the GPU "
                  f"({dataset} B={batch})")  # fmt: skip
            if name.startswith("auto"):
                print(what_ran(auto, 2 * calls + 20))
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)
            slug = {"forced cublas graph": "forced", "auto lengths=": "lengths", "auto mask": "mask"}[name]
            dump = pathlib.Path(os.environ.get("OUT") or RESULTS, f"host_profile_{dataset}_{batch}_{slug}_{mode}.prof")
            prof.dump_stats(dump)  # for pstats here: what one path calls that the other does not
            print(f"wrote {dump}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["bert-base"], choices=list(HF_SHAPES))
    p.add_argument("--quick", action="store_true", help="6 rows (CoLA, MNLI, RACE at B=32/128)")
    p.add_argument("--columns", nargs="+", default=COLUMNS, help=f"subset of {COLUMNS}")
    p.add_argument("--datasets", nargs="+", choices=list(CORA), help="rows to run (default: all eight)")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=list(CORA_BATCH_SIZES))
    p.add_argument("--batches", type=int, default=2, help="batches per row (default 2)")
    p.add_argument("--reps", type=int, default=10, help="timed calls per batch and column (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    p.add_argument("--db", help="tuning database for the auto column (default $AUTORAGGED_DB or ~/.cache)")
    p.add_argument("--encode", type=int, default=0, help="also time SentenceTransformer.encode of N sentences")
    p.add_argument("--encode-model", default="bert-base", choices=list(HF_SHAPES))
    p.add_argument("--encode-batch", type=int, default=64)
    p.add_argument("--host-profile", action="store_true", help="profile one row's host path instead (the first "
                   "of --datasets and --batch-sizes)")  # fmt: skip
    p.add_argument("--out", help="JSON path (default benchmarks/results/hf_table.json)")
    args = p.parse_args(argv)
    unknown = set(args.columns) - set(COLUMNS)
    if unknown:
        p.error(f"unknown columns {sorted(unknown)}; choose from {COLUMNS}")
    require_cuda("benchmarks/hf_table.py")
    import transformers

    env = environment()
    env["transformers"] = transformers.__version__
    header("HF encoders on the CoRa distributions (fp16, sdpa, inference)", env)
    device = torch.device("cuda")
    datasets = args.datasets or (["CoLA", "MNLI", "RACE"] if args.quick else list(CORA))
    sizes = (32, 128) if args.quick else args.batch_sizes
    results = {"env": env, "args": vars(args), "models": {}}
    for name in args.models:
        plain = build(name, device)
        models = {
            "plain": plain, "vocab": plain.config.vocab_size, "pad": plain.config.pad_token_id or 0,
            "varlen": VarlenPeer(plain),
            "ragged": autoragged.wrap(copy.deepcopy(plain), db=False, policy="ragged", sample_every=0),
            "auto": autoragged.wrap(copy.deepcopy(plain), db=args.db),
            "runner": ArmRunner(copy.deepcopy(plain)),
        }  # fmt: skip
        if args.host_profile:
            host_profile(models, device, (args.datasets or ["CoLA"])[0], args.batch_sizes[0])
            continue
        rows = []
        for dataset in datasets:
            for batch in sizes:
                row = bench_row(dataset, batch, args, models, device)
                rows.append(row)
                shown = " ".join(f"{c}={row[c]:.3f}" for c in COLUMNS if row.get(c))
                print(f"  {name} {dataset:8s} B={batch:3d} {shown}", flush=True)
        summary = {}
        for key in ("auto_vs_hf_sdpa", "auto_vs_varlen"):
            vals = [r[key] for r in rows if r.get(key)]
            if vals:
                summary[f"geomean_{key}"] = math.exp(np.mean(np.log(vals)))
                summary[f"min_{key}"] = min(vals)
        worst = [r["auto_vs_best_forced"] for r in rows if r.get("auto_vs_best_forced")]
        if worst:
            summary["max_auto_vs_best_forced"] = max(worst)
        summary["max_abs_err"] = max((r.get("auto_max_err") or 0.0) for r in rows)
        results["models"][name] = {"summary": summary, "rows": rows}
        cols = [("dataset", "dataset", ""), ("batch", "B", "d")] + [(c, c, ".3f") for c in COLUMNS if c in args.columns]
        cols += [("auto_vs_hf_sdpa", "auto vs HF", ".2f"), ("auto_vs_varlen", "auto vs varlen", ".2f"),
                 ("auto_vs_best_forced", "auto / best forced", ".2f")]  # fmt: skip
        print(f"\n## {name}, ms per batch (median)\n")
        print(table(rows, cols))
        print("\n" + ", ".join(f"{k} {v:.3g}" for k, v in summary.items()), flush=True)
        del models
        torch.cuda.empty_cache()
    if args.encode:
        enc = encode_bench(args, device)
        results["encode"] = enc
        print(f"\n## SentenceTransformer.encode, {enc['sentences']} sentences, {enc['model']}, "
              f"batch {enc['batch_size']}")  # fmt: skip
        for mode in ENCODE_MODES:
            m = enc[mode]
            print(
                f"  {mode:22s} cold {m['cold_s']:.2f} s, warm {m['warm_s']:.2f} s = {m['sentences_per_s']:.0f} "
                f"sentences/s; numpy output {m['numpy_warm_s']:.2f} s; the model alone on pre-tokenized batches "
                f"{m['forward_warm_s']:.2f} s (cold {m['forward_cold_s']:.2f}); tokenizing {m['tokenize_s']:.2f} s"
            )
        for mode in ENCODE_MODES[1:]:
            m = enc[mode]
            print(f"  {mode} / plain (warm): encode() {m['speedup_warm']:.2f}x, with numpy output "
                  f"{m['speedup_numpy_warm']:.2f}x, the model alone {m['forward_speedup_warm']:.2f}x; "
                  f"max abs diff {m['max_abs_diff']:.2e}")  # fmt: skip
    path = write_json("hf_table.json", results, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
