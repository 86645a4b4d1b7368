"""Training steps: BERT-base fine-tuning on the CoRa rows, decoder SFT on lognormal documents; HF against the wrapped
model (auto and forced ragged).

    python benchmarks/train_table.py                 # 24 rows: the eight CoRa datasets at B = 32, 64, 128
    python benchmarks/train_table.py --quick         # 6 rows: CoLA, MNLI, RACE at B = 32 and 128
    python benchmarks/train_table.py --models qwen2.5-0.5b qwen2.5-1.5b   # SFT steps, 8 and 16 documents a step
    python benchmarks/train_table.py --models gpt2   # the same for GPT-2's 124M shape (the module path's layers)
    python benchmarks/train_table.py --smoke         # a tiny BERT on the CPU: checks the script

Model: transformers.BertForSequenceClassification (bert-base shape, 3 labels) from a config (random weights), fp32
weights, bf16 autocast, sdpa attention, train mode with BERT's dropouts (hidden 0.1, attention probabilities 0.1).
One step: forward, the model's own cross-entropy loss, backward, fused AdamW (lr 1e-5), zero_grad.

Per row, each column trains a copy of the same initial weights: WARM steps (the wrapped model's policy tries its
arms), then TIMED new steps back to back with one synchronisation at the end (the first pass: every batch a new padded
length and token count, as the first epoch meets them), then the same steps again twice (the second pass, the faster
of the two: shapes seen before, as in later epochs). The columns train one after the other (padded, auto, ragged),
each model freed before the next: the wrapped models' training graphs keep a pool of activations (26 GiB for RACE
at B=128), and two such pools beside HF's padded step do not fit an 80 GB card. Cells are ms per step; GiB is the
peak memory of a column's passes. `loss_err`: on the row's first timed batch, with dropout off and the initial
weights, |loss of the column - the fp32 model's in float64|.

Columns: padded (the HF model), auto (autoragged.wrap(model, db=False): a fresh database, chooses per batch), ragged
(wrap(..., policy="ragged")). Goals (issue 45), on the second pass: auto at least 0.97x padded on every row and at
least 1.3x on rows with 40% padding or more at B >= 64.

SFT (--models qwen2.5-0.5b / qwen2.5-1.5b / gpt2): Qwen2ForCausalLM of that checkpoint's shape (or GPT-2's 124M
shape, dropout off) from a config, bf16 weights, sdpa, train mode; a step is forward with labels (the model's own
shifted cross-entropy), backward, fused AdamW;
documents of lognormal lengths (median 300 tokens, sigma 0.8, within 16-2048), 8 or 16 a step, random token ids.
Columns: padded (HF, DataCollatorWithPadding's format: right padding, labels -100 at pads), packed (HF's own packed
path: DataCollatorWithFlattening's one row with restarting position_ids, the first token of each document -100,
use_cache=False so transformers splits the documents), auto (the wrapped model on the padded batches: Qwen2's LM
head and loss run on the real tokens, GPT-2's on the padded output), auto_packed (the wrapped model on the packed
batches). Every call passes use_cache=False. HF padded trains first, on its own (at 8 documents its peak does not
fit an 80 GB card beside the wrapped models' training graphs); the other three take turns. Goals (issue 45): auto
>= 2.0x padded and >= 1.4x packed, peak memory at most packed's, loss within bf16's own error. Appends a line to
benchmarks/results/train_table.jsonl.
"""

from __future__ import annotations

import copy
import gc
import math
import pathlib
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import autoragged  # noqa: E402
from autoragged.workloads import hf_config, llm_config  # noqa: E402
from benchmarks._common import (  # noqa: E402
    add_row_arguments,
    arms_ran,
    cora_rows,
    device_of,
    geomean,
    header,
    parser,
    reasons_of,
    record,
    row_batches,
    sync,
    table,
)

SFT_MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "gpt2")
# GPT-2's 124M shape with room for the longest document; dropout off, as Qwen2 has none (the loss columns compare)
GPT2 = dict(n_positions=2048, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
TINY_GPT2 = dict(vocab_size=100, n_embd=64, n_layer=2, n_head=2)
TINY_DECODER = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, max_position_embeddings=4096)  # fmt: skip
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128}
COLUMNS = ("padded", "auto", "ragged")
GOAL_ALL, GOAL_PADDED = 0.97, 1.3  # auto / padded: every row; rows with >= 40% padding at B >= 64


def build(device, smoke: bool):
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, **TINY) if smoke else hf_config("bert-base")
    config.num_labels, config.attention_probs_dropout_prob, config.hidden_dropout_prob = 3, 0.1, 0.1  # BERT's
    config._attn_implementation = "sdpa"
    return transformers.BertForSequenceClassification(config).to(device).train()


def token_batch(lengths: list[int], g: torch.Generator, vocab: int, device) -> dict:
    L = max(lengths)
    keep = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    ids = torch.randint(5, vocab, (len(lengths), L), generator=g).masked_fill(~keep, 0)
    labels = torch.randint(0, 3, (len(lengths),), generator=g)
    return {"input_ids": ids.to(device), "attention_mask": keep.long().to(device), "labels": labels.to(device)}


def column_model(plain, col: str):
    model = copy.deepcopy(plain)
    if col != "padded":
        autoragged.wrap(model, db=False, policy="auto" if col == "auto" else "ragged")
    fused = next(model.parameters()).is_cuda
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused)


def step(model, opt, batch, device) -> None:
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def loss_of(model, batch, device, dtype=None) -> float:
    """The loss on `batch` with dropout off (eval mode, autograd on: the training path)."""
    was = model.training
    model.eval()
    try:
        if dtype is None:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return model(**batch).loss.item()
        with torch.no_grad():  # (the float64 reference's graph would not fit next to the rest on Wiki512 B=128)
            return model(**batch).loss.item()
    finally:
        model.train(was)


class Column(NamedTuple):
    """One column of a row: its model and optimizer, its warm-up and timed batches (each column's own format), and
    its step (forward, loss, backward, optimizer)."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    warm: list
    timed: list
    step: Callable


def _steps(c: Column, batches: list, device) -> bool:
    """Run the column's steps on `batches` to the end (synchronised); False where they ran out of memory (a result
    too: the column does not fit where another does)."""
    try:
        for b in batches:
            c.step(c.model, c.opt, b, device)
        sync(device)
        return True
    except torch.OutOfMemoryError:
        c.opt.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        return False


def race(columns: dict[str, Column], row: dict, device) -> None:
    """Warm each column up, then its timed batches: pass 1 (new), then twice more (pass 2, the faster), the columns
    taking turns pass by pass (forward, reverse, forward); ms per step, peak GiB and out-of-memory into `row` (which
    may hold the columns of an earlier call: the ratios to padded come out once it is there)."""
    names = list(columns)
    oom = {col for col, c in columns.items() if not _steps(c, c.warm, device)}
    for n, order in enumerate((names, names[::-1], names)):
        for col in (c for c in order if c not in oom):
            c = columns[col]
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            if not _steps(c, c.timed, device):
                oom.add(col)
                continue
            ms = (time.perf_counter() - t0) * 1e3 / len(c.timed)
            key = f"{col}1" if n == 0 else f"{col}2"
            row[key] = min(ms, row.get(key, ms))
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(device) / 2**30
                row[f"{col}_peak_gib"] = max(peak, row.get(f"{col}_peak_gib", 0.0))
    for col in oom:
        row[f"{col}1"] = row[f"{col}2"] = row[f"{col}_peak_gib"] = None
    row["oom"] = sorted(oom | set(row.get("oom", ())))
    for col, c in columns.items():
        row[f"{col}_ktok_s"] = row["tokens"] / row[f"{col}2"] if row[f"{col}2"] else None
        if col.startswith("auto") or col == "ragged":  # the wrapped columns
            row[f"{col}_arms"] = arms_ran(c.model, 3 * len(c.timed) + len(c.warm))
            row[f"{col}_reasons"] = reasons_of(c.model, 3 * len(c.timed))
            stats = autoragged.graph_stats(c.model).values()
            row[f"{col}_train_graphs"] = sum(s.training for s in stats), sum(s.training_refused for s in stats)
            row[f"{col}_train_graph_gib"] = sum(s.training_bytes for s in stats) / 2**30
    for n in (1, 2):
        padded = row[f"padded{n}"]
        for col in (c for c in names if c != "padded"):
            row[f"{col}_vs_padded{n}"] = padded / row[f"{col}{n}"] if padded and row[f"{col}{n}"] else None
    cells = " ".join(f"{c}={row.get(c + '1') or 0:.1f}/{row.get(c + '2') or 0:.1f}" for c in names)
    short = f" out of memory: {', '.join(sorted(oom))}" if oom else ""
    graphs = {c: (*row[f"{c}_train_graphs"], round(row[f"{c}_train_graph_gib"], 2)) for c in names
              if row.get(f"{c}_train_graphs", (0, 0)) != (0, 0)}  # fmt: skip
    graphs = f" training graphs (kept, refused, GiB) {graphs}" if graphs else ""
    print(f"  {row['dataset']:8s} B={row['batch']:3d} pad {row['padding']:.0%} {cells} auto arms "
          f"{row.get('auto_arms')}{graphs}{short}", flush=True)  # fmt: skip


def bench_row(plain, plain64, dataset: str, batch: int, device) -> dict:
    warm, timed = row_batches(dataset, batch, token_batch, plain.config.vocab_size, device)
    tokens = float(np.mean([int(b["attention_mask"].sum()) for b in timed]))
    padded_tokens = float(np.mean([b["attention_mask"].numel() for b in timed]))
    row = {"dataset": dataset, "batch": batch, "tokens": tokens, "padding": 1 - tokens / padded_tokens}
    exact = loss_of(plain64, timed[0], device, torch.float64)
    for col in COLUMNS:  # one at a time (the module docstring)
        model, opt = column_model(plain, col)
        row[f"{col}_loss_err"] = abs(loss_of(model, timed[0], device) - exact)
        race({col: Column(model, opt, warm, timed, step)}, row, device)
        del model, opt
        free(device)
    return row


def free(device) -> None:
    gc.collect()  # (a wrapped model's training graphs sit in a reference cycle)
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- decoder SFT ------------------------------------------------------------------------------------------------
SFT_ROWS = (8, 16)  # documents a step
SFT_COLUMNS = ("padded", "packed", "auto", "auto_packed")
LOGNORMAL = (math.log(300), 0.8, 16, 2048)  # (mu, sigma) of the lengths' log, and their clip


def sft_lengths(n: int, rng: np.random.Generator) -> list[int]:
    mu, sigma, lo, hi = LOGNORMAL
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), lo, hi).astype(int).tolist()


def sft_batch(lengths: list[int], g: torch.Generator, vocab: int, device) -> dict:
    """{"padded": right-padded kwargs, "packed": DataCollatorWithFlattening's}: the same documents, the same targets
    (a document's first token is no target in either)."""
    docs = [torch.randint(5, vocab, (n,), generator=g) for n in lengths]
    L = max(lengths)
    ids = torch.zeros(len(docs), L, dtype=torch.long)
    keep = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    ids[keep] = torch.cat(docs)
    padded = {"input_ids": ids, "attention_mask": keep.long(), "labels": ids.masked_fill(~keep, -100)}
    flat = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = flat.masked_fill(positions == 0, -100)
    packed = {"input_ids": flat, "position_ids": positions, "labels": labels}
    to = lambda kw: {k: v.to(device) for k, v in kw.items()} | {"use_cache": False}  # noqa: E731
    return {"padded": to(padded), "packed": to(packed)}


def sft_step(model, opt, batch, device) -> None:
    model(**batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def sft_row(plain, name: str, docs: int, device, args) -> dict:
    rng = np.random.default_rng(docs)
    g = torch.Generator().manual_seed(docs)
    made = [
        sft_batch(sft_lengths(docs, rng), g, plain.config.vocab_size, device) for _ in range(args.warm + args.steps)
    ]
    warm, timed = made[: args.warm], made[args.warm :]
    tokens = float(np.mean([int(b["padded"]["attention_mask"].sum()) for b in timed]))
    padded_tokens = float(np.mean([b["padded"]["attention_mask"].numel() for b in timed]))
    row = {
        "model": name,
        "dataset": "lognormal",
        "batch": docs,
        "tokens": tokens,
        "padding": 1 - tokens / padded_tokens,
    }
    # HF padded trains first, on its own: its peak (64 GiB at 8 documents) does not fit an 80 GB card beside the
    # wrapped models' training graphs; the other columns take turns
    for group in (SFT_COLUMNS[:1], SFT_COLUMNS[1:]):
        columns = {}
        for col in group:
            model = copy.deepcopy(plain)
            if col.startswith("auto"):
                autoragged.wrap(model, db=False)
            fmt = "packed" if col.endswith("packed") else "padded"
            with torch.no_grad():
                row[f"{col}_loss"] = model(**timed[0][fmt]).loss.item()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
            columns[col] = Column(model, opt, [b[fmt] for b in warm], [b[fmt] for b in timed], sft_step)
        race(columns, row, device)
        del columns, model, opt
        free(device)  # the next group starts with these models, optimizer states and graphs freed
    for col in SFT_COLUMNS:
        row[f"{col}_loss_diff"] = abs(row[f"{col}_loss"] - row["padded_loss"])
    return row


def sft_table(name: str, args, device) -> tuple[list[dict], dict]:
    import transformers

    torch.manual_seed(0)
    header(f"{name} SFT steps on lognormal documents (bf16, AdamW)" + (", smoke: tiny, CPU" if args.smoke else ""))
    if name == "gpt2":
        config = transformers.GPT2Config(**GPT2, **(TINY_GPT2 if args.smoke else {}))
    elif args.smoke:
        config = transformers.Qwen2Config(**TINY_DECODER)
    else:
        config = llm_config(name)
    config._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    plain = transformers.AutoModelForCausalLM.from_config(config).to(device, dtype).train()
    rows = [sft_row(plain, name, docs, device, args) for docs in ((2,) if args.smoke else SFT_ROWS)]
    cols = [("model", "model", ""), ("batch", "docs", "d"), ("padding", "pad", ".0%")]
    cols += [(f"{c}2", c, ".1f") for c in SFT_COLUMNS]
    cols += [("auto_vs_padded2", "padded / auto", ".2f"), ("auto_vs_packed", "packed / auto", ".2f")]
    cols += [("auto_packed_vs_packed", "packed / auto_packed", ".2f")]
    cols += [(f"{c}_peak_gib", f"{c} GiB", ".2f") for c in SFT_COLUMNS]
    cols += [(f"{c}_loss_diff", f"{c} loss - padded's", ".1e") for c in SFT_COLUMNS[1:]]
    for r in rows:
        for col in ("auto", "auto_packed"):
            ok = r.get("packed2") and r.get(f"{col}2")
            r[f"{col}_vs_packed"] = r["packed2"] / r[f"{col}2"] if ok else None
    print(f"\n## {name} SFT: ms per step (forward, loss, backward, AdamW), batches seen before\n")
    print(table(rows, cols))
    summary = {
        "geomean_auto_vs_padded": geomean(r["auto_vs_padded2"] for r in rows),
        "geomean_auto_vs_packed": geomean(r["auto_vs_packed"] for r in rows),
        "geomean_auto_packed_vs_packed": geomean(r["auto_packed_vs_packed"] for r in rows),
    }
    print(f"\npadded batches, auto / padded {summary['geomean_auto_vs_padded']:.2f}x (goal >= 2.0), auto / packed "
          f"{summary['geomean_auto_vs_packed']:.2f}x (goal >= 1.4); packed batches, wrapped / HF packed "
          f"{summary['geomean_auto_packed_vs_packed']:.2f}x, as geomeans")  # fmt: skip
    return rows, summary


def goals(rows: list[dict]) -> dict:
    rows = [r for r in rows if r["auto_vs_padded2"] is not None]  # (a row where padded ran out of memory: apart)
    heavy = [r for r in rows if r["padding"] >= 0.4 and r["batch"] >= 64]
    out = {
        "geomean_auto_vs_padded1": geomean(r["auto_vs_padded1"] for r in rows),
        "geomean_auto_vs_padded": geomean(r["auto_vs_padded2"] for r in rows),
        "min_auto_vs_padded": min(r["auto_vs_padded2"] for r in rows),
        "geomean_auto_vs_padded_heavy": geomean(r["auto_vs_padded2"] for r in heavy),
        "misses": {
            f"auto / padded below {GOAL_ALL}": [_label(r) for r in rows if r["auto_vs_padded2"] < GOAL_ALL],
            f">= 40% padding, B >= 64, auto / padded below {GOAL_PADDED}": [
                _label(r) for r in heavy if r["auto_vs_padded2"] < GOAL_PADDED
            ],
        },
    }
    heavy_text = f"{out['geomean_auto_vs_padded_heavy']:.2f}x" if heavy else "-"
    print(f"\nsecond pass, auto / padded: geomean {out['geomean_auto_vs_padded']:.2f}x, worst row "
          f"{out['min_auto_vs_padded']:.2f}x (goal >= {GOAL_ALL}); rows with >= 40% padding at B >= 64: geomean "
          f"{heavy_text} (goal >= {GOAL_PADDED}); first pass: geomean "
          f"{out['geomean_auto_vs_padded1']:.2f}x")  # fmt: skip
    for what, missed in out["misses"].items():
        print(f"rows with {what}: {', '.join(missed) or 'none'}")
    return out


def _label(row: dict) -> str:
    return f"{row['dataset']} B={row['batch']}"


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    add_row_arguments(p)
    p.add_argument("--steps", type=int, default=12, help="timed steps per row and column (default 12)")
    p.add_argument("--warm", type=int, default=8, help="warm-up steps per row and column (default 8)")
    p.add_argument("--models", nargs="+", choices=["bert-base", *SFT_MODELS], default=["bert-base"],
                   help="bert-base (the CoRa rows) and/or decoder SFT shapes (default bert-base)")  # fmt: skip
    args = p.parse_args(argv)
    device = device_of(args, "benchmarks/train_table.py")
    if args.smoke:
        args.steps, args.warm = 2, min(args.warm, 2)
    rows, summary = [], {}
    for name in args.models:
        if name == "bert-base":
            bert_rows, summary[name] = bert_table(args, device)
            rows += bert_rows
        else:
            sft_rows, summary[name] = sft_table(name, args, device)
            rows += sft_rows
    record("train_table", args, rows, summary=summary)
    return 0


def bert_table(args, device) -> tuple[list[dict], dict]:
    header("BERT-base fine-tuning steps on the CoRa rows (fp32 weights, bf16 autocast, AdamW)"
           + (", smoke: tiny, CPU" if args.smoke else ""))  # fmt: skip
    import benchmarks._common as common

    common.WARM, common.TIMED = args.warm, args.steps
    plain = build(device, args.smoke)
    plain64 = copy.deepcopy(plain).double()
    rows = [bench_row(plain, plain64, dataset, batch, device) for dataset, batch in cora_rows(args)]
    cols = [("dataset", "dataset", ""), ("batch", "B", "d"), ("padding", "pad", ".0%")]
    cols += [(f"{c}{n}", f"{c}{n}", ".1f") for n in (1, 2) for c in COLUMNS]
    cols += [(f"auto_vs_padded{n}", f"padded{n} / auto{n}", ".2f") for n in (1, 2)]
    cols += [("ragged_vs_padded2", "padded2 / ragged2", ".2f")]
    cols += [(f"{c}_peak_gib", f"{c} GiB", ".2f") for c in COLUMNS]
    cols += [(f"{c}_loss_err", f"{c} loss err", ".1e") for c in ("padded", "ragged")]
    print("\n## BERT-base fine-tuning: ms per step (forward, loss, backward, AdamW); 1 new batches, 2 the same again\n")
    print(table(rows, cols))
    return rows, goals(rows)


if __name__ == "__main__":
    raise SystemExit(main())
