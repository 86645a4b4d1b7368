"""A/B of a causal LM's head on the real tokens (models/causal_lm.py): SFT steps of the Qwen2.5-0.5B shape on padded
batches, the wrapped model with the head on the real tokens against the same model with the head removed (its LM
head and loss then run on the padded output, as the original's), beside HF padded, HF packed and the wrapped model
on packed rows; ms a step and the step's memory above the resident models.

    python benchmarks/diagnostics/sft_head.py            # 8 and 16 documents a step, on a GPU
    python benchmarks/diagnostics/sft_head.py --smoke    # a tiny model on the CPU: checks the script

The batches are train_table.py's (lognormal documents, right padding, labels -100 at pads). Per document count,
HF padded first runs alone (it needs most of the memory), then the other columns take turns over four passes of 8
steps (order reversed every other pass; the first pass, with 4 warm-up steps, is left out): cells are the fastest
and the median pass. "step GiB" is a pass's peak allocation above what was allocated before it (the models and
optimizer states of the resident columns). A column that runs out of memory is reported as such.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import autoragged  # noqa: E402
from autoragged.models import causal_lm  # noqa: E402
from autoragged.workloads import llm_config  # noqa: E402
from benchmarks.train_table import sft_batch, sft_lengths, sft_step  # noqa: E402

# column -> (batch format, wrapped, head on the real tokens)
COLUMNS = {
    "hf_padded": ("padded", False, False),
    "hf_packed": ("packed", False, False),
    "wrapped_padded_old_head": ("padded", True, False),
    "wrapped_padded": ("padded", True, True),
    "wrapped_packed": ("packed", True, True),
}
PASSES, WARM, STEPS = 4, 4, 8


def build(smoke: bool):
    import transformers

    config = llm_config("qwen2.5-0.5b", 1 if smoke else None)
    if smoke:
        config.vocab_size, config.hidden_size, config.intermediate_size = 500, 64, 96
        config.num_attention_heads, config.num_key_value_heads, config.head_dim = 2, 1, 32
        config.pad_token_id = config.bos_token_id = config.eos_token_id = 0
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).train(), device


def _allocated_now(cuda: bool) -> int:
    """The bytes allocated now, the peak counter reset to them (0 on the CPU)."""
    if not cuda:
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def run_columns(plain, names, batches, device) -> dict:
    cuda = device.type == "cuda"
    cols = {}
    for name in names:
        fmt, wrapped, head = COLUMNS[name]
        model = copy.deepcopy(plain)
        if wrapped:
            autoragged.wrap(model, db=False)
            if not head:
                causal_lm.uninstall(model)
        cols[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda), fmt)
    out = {name: {"ms": [], "gib": 0.0} for name in names}
    for p in range(PASSES):
        for name in names if p % 2 == 0 else names[::-1]:
            if out[name].get("oom"):
                continue
            model, opt, fmt = cols[name]
            try:
                for b in batches[:WARM] if p == 0 else []:
                    sft_step(model, opt, b[fmt], device)
                before = _allocated_now(cuda)
                t = time.perf_counter()
                for b in batches[WARM:]:
                    sft_step(model, opt, b[fmt], device)
                if cuda:
                    torch.cuda.synchronize()
                out[name]["ms"].append((time.perf_counter() - t) * 1000 / STEPS)
                if cuda:
                    out[name]["gib"] = max(out[name]["gib"], (torch.cuda.max_memory_allocated() - before) / 2**30)
            except torch.OutOfMemoryError:
                out[name]["oom"] = True
                model.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
    del cols
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", nargs="+", type=int, default=[8, 16], help="documents a step")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU")
    args = p.parse_args(argv)
    plain, device = build(args.smoke)
    if device.type == "cuda":
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| docs | column | ms, fastest pass | ms, median pass | step GiB |\n|---|---|---|---|---|")
    for docs in args.docs:
        rng, g = np.random.default_rng(docs), torch.Generator().manual_seed(docs)
        batches = [sft_batch(sft_lengths(docs, rng), g, plain.config.vocab_size, device) for _ in range(WARM + STEPS)]
        results = run_columns(plain, ["hf_padded"], batches, device)
        results |= run_columns(plain, [c for c in COLUMNS if c != "hf_padded"], batches, device)
        for name, r in results.items():
            timed = r["ms"][1:] or r["ms"]
            if r.get("oom") or not timed:
                print(f"| {docs} | {name} | out of memory | | |")
                continue
            print(f"| {docs} | {name} | {min(timed):.1f} | {statistics.median(timed):.1f} | {r['gib']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
