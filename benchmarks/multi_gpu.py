"""Past one GPU: an embedding job, a scoring job and DDP fine-tuning of wrapped models on 1, 2, 4 GPUs of one host.

    python benchmarks/multi_gpu.py                         # every task on 1 GPU and on 2, 4 where visible
    python benchmarks/multi_gpu.py --tasks embed --gpus 1 4
    python benchmarks/multi_gpu.py --quick                 # a fifth of the documents and steps
    python benchmarks/multi_gpu.py --smoke                 # tiny models on the CPU, 1 and 2 gloo ranks: checks it

Each (task, GPU count) is one `torchrun --nproc-per-node N` of this script (`--worker TASK`); the parent prints the
table and appends a line to benchmarks/results/multi_gpu.jsonl.

- embed: BERT-base shape (fp16, a fresh database), 100,000 documents of the eight CoRa datasets' lengths (an equal
  share each, random ids), `run_job(output="mean")`. Every rank writes its shards (`shards=DIR`), then rank 0 reads
  them back in input order: the time is from a common start to rank 0 holding every result.
- score: Qwen2.5-0.5B shape (bf16), 8,000 documents of lognormal lengths (median 300, sigma 0.8, 16-2048),
  `run_job(output="token_logprobs")`, timed the same way.
- ddp: Qwen2.5-0.5B-shape SFT: `DistributedDataParallel(autoragged.wrap(model))`, fused AdamW, each rank a
  `TokenBudgetBatchSampler` bin of at most 8,192 tokens a step (the same per-GPU budget at every GPU count) in
  DataCollatorWithFlattening's packed format, the global batch's token-mean loss (`num_items_in_batch`). 8 warm-up
  steps, then 48 timed.
  The one-GPU run also trains the largest count's global batches (its ranks' bins, accumulated in one process)
  for the first steps: the loss curves of the two are compared. Each rank's training graphs (graphs/train.py) kept
  when the timed steps begin and at their end are recorded: a capture among the timed steps stalls every rank.

Before its timed part every rank runs a warm-up (2,000 documents, or the warm-up steps): kernel compiles and graphs.
Columns: docs/s (tokens/s for ddp), the speed-up over one GPU, the spread of the ranks' finishing times (last over
first, minus one; for ddp the ranks' busy time outside the all-reduce is not separable, so it is left out), and the
largest difference of any result from the one-GPU run's (ddp: of the per-step losses at the same global batch).
Goals (issue 46) on 4 GPUs: jobs >= 3.7x one GPU's documents per second, identical results, the last rank within
5% of the first; DDP >= 3.6x one GPU's tokens per second, the loss curve equal to one GPU's.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks._common import header, parser, reasons_of, record, require_cuda, table  # noqa: E402

TASKS = ("embed", "score", "ddp")
DOCS = {"embed": 100_000, "score": 8_000}
WARM_DOCS = 2_000
DDP_BUDGET, DDP_WARM, DDP_STEPS, DDP_COMPARE = 8192, 8, 48, 8
LOGNORMAL = (math.log(300), 0.8, 16, 2048)
TINY_BERT = dict(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
TINY_QWEN = dict(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=512)  # fmt: skip


# -- the worker: one rank of one (task, GPU count) ---------------------------------------------------------------
def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _lognormal(n: int, rng: np.random.Generator, cap: int) -> np.ndarray:
    mu, sigma, lo, hi = LOGNORMAL
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), lo, min(hi, cap)).astype(np.int64)


def _documents(task: str, n: int, vocab: int, cap: int) -> list[np.ndarray]:
    from autoragged.workloads import CORA, sample_cora

    rng = np.random.default_rng(0)
    if task == "embed":
        names = sorted(CORA)
        lengths = np.concatenate([sample_cora(d, -(-n // len(names)), rng) for d in names])[:n]
        lengths = np.minimum(lengths, cap)
    else:
        lengths = _lognormal(n, rng, cap)
    rng.shuffle(lengths)
    ids = rng.integers(5, vocab, int(lengths.sum()))
    return np.split(ids, np.cumsum(lengths)[:-1])


def _model(task: str, smoke: bool, device: torch.device):
    import transformers

    from autoragged.workloads import hf_config, llm_config

    torch.manual_seed(0)
    cuda = device.type == "cuda"
    if task == "embed":
        config = transformers.BertConfig(**TINY_BERT) if smoke else hf_config("bert-base")
        dtype = torch.float16 if cuda else torch.float32
        return transformers.BertModel(config).to(device, dtype).eval()
    config = transformers.Qwen2Config(**TINY_QWEN) if smoke else llm_config("qwen2.5-0.5b")
    config._attn_implementation = "sdpa"
    model = transformers.Qwen2ForCausalLM(config).to(device, torch.bfloat16 if cuda else torch.float32)
    return model.train() if task == "ddp" else model.eval()


def _job(task: str, args, out: pathlib.Path) -> dict:
    import torch.distributed as dist

    import autoragged
    from autoragged.job import read_shards, run_job

    device = _device()
    model = autoragged.wrap(_model(task, args.smoke, device), db=False)
    cap = 512 if task == "embed" else 2048
    n = 300 if args.smoke else DOCS[task] // (5 if args.quick else 1)
    vocab = model.config.vocab_size
    docs = _documents(task, n, vocab, cap)
    output = "mean" if task == "embed" else "token_logprobs"
    warm = _documents(task, 40 if args.smoke else WARM_DOCS, vocab, cap)
    passes = []
    with torch.inference_mode():
        for _ in run_job(model, warm, output=output, progress=False):
            pass
        for k in range(2):  # the job, then the same job again (every shape seen: first sight's costs left out)
            shards = out / f"shards{k}"
            _sync(device)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in run_job(model, docs, output=output, progress=False, gather=None, shards=shards):
                pass
            _sync(device)
            done = time.perf_counter() - t0
            dist.barrier()
            t1 = time.perf_counter()
            results = list(read_shards(shards)) if dist.get_rank() == 0 else None
            passes.append({"seconds": time.perf_counter() - t0, "read_s": time.perf_counter() - t1, "finished": done})
    for one in passes:
        finished = [None] * dist.get_world_size()
        dist.all_gather_object(finished, one["finished"])
        one["finished"] = finished
    line = {"passes": passes, "docs": n, "tokens": int(sum(len(d) for d in docs))}
    if results is not None:
        torch.save(torch.cat([r.reshape(-1).float() for r in results]), out / "results.pt")
    return line


def _sft_batch(docs: list[np.ndarray], device: torch.device) -> tuple[dict, int]:
    """DataCollatorWithFlattening's format (one row, position_ids restarting at each document, its first token no
    target) and the batch's targets (each document's n - 1)."""
    lengths = [len(d) for d in docs]
    ids = torch.from_numpy(np.concatenate(docs))[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    kwargs = {"input_ids": ids, "position_ids": positions, "labels": ids.masked_fill(positions == 0, -100)}
    return {k: v.to(device, non_blocking=True) for k, v in kwargs.items()}, sum(lengths) - len(lengths)


def _ddp(args, out: pathlib.Path) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import autoragged
    from autoragged.packing import TokenBudgetBatchSampler

    device = _device()
    world = dist.get_world_size()
    budget = 512 if args.smoke else DDP_BUDGET
    warm_steps, steps = (1, 3) if args.smoke else (DDP_WARM, DDP_STEPS // (3 if args.quick else 1))
    compare_world = max(args.gpus)
    plain = _model("ddp", args.smoke, device)
    vocab = plain.config.vocab_size
    # enough documents for every rank's steps at the largest count, the same documents at every count
    docs = _documents("ddp", (warm_steps + steps) * compare_world * budget // 250, vocab, budget)
    lengths = np.array([len(d) for d in docs])

    def train(model, shares, n_steps: int, timed_from: int) -> tuple[list[float], float | None, int]:
        """Steps over `shares` (per step, the bins this process runs, accumulated): the global token-mean loss of
        each step, and the seconds and real tokens of the steps from `timed_from` on."""
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
        losses, tokens, t0 = [], 0, None
        for i, bins in enumerate(shares[:n_steps]):
            if i == timed_from:
                _sync(device)
                dist.barrier()
                t0 = time.perf_counter()
                captures[0] = _training_graphs(model)
            batches = [_sft_batch([docs[j] for j in b], device) for b in bins]
            targets = torch.tensor(float(sum(t for _, t in batches)), device=device)
            dist.all_reduce(targets)  # the step's targets over every rank: the global token mean, as one process
            total = torch.zeros((), device=device)
            for kwargs, _ in batches:
                loss = model(**kwargs, num_items_in_batch=targets, use_cache=False).loss * world
                loss.backward()  # DDP averages the ranks' gradients: times world, the global mean's
                total += loss.detach() / world
            if t0 is not None:
                tokens += sum(int(lengths[b].sum()) for b in bins)
            dist.all_reduce(total)
            losses.append(total)
            opt.step()
            opt.zero_grad(set_to_none=True)
        _sync(device)
        seconds = time.perf_counter() - t0 if t0 is not None else None
        return [float(x) for x in losses], seconds, tokens

    captures = [0]  # the training graphs kept when the timed steps began

    sampler = TokenBudgetBatchSampler(lengths, budget, align=16)  # num_replicas, rank: the process group's
    mine = [[b] for b in sampler]
    if len(mine) < warm_steps + steps:
        raise RuntimeError(f"{len(mine)} steps of documents, {warm_steps + steps} needed")
    net = autoragged.wrap(_copy(plain), db=False, policy=args.policy)
    ddp = DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    losses, seconds, tokens = train(ddp, mine, warm_steps + steps, warm_steps)
    counts, arms = [None] * world, [None] * world
    dist.all_gather_object(counts, tokens)
    dist.all_gather_object(arms, reasons_of(net, steps))  # each rank's arms and reasons in the timed steps
    graphs = [None] * world  # each rank's training graphs: kept when the timed steps began, and at their end
    dist.all_gather_object(graphs, (captures[0], _training_graphs(net)))
    line = {"seconds": seconds, "tokens": sum(counts), "steps": steps, "losses": losses[:DDP_COMPARE]}
    line |= {"policy": args.policy, "arms": arms, "training_graphs": graphs}
    del ddp, net
    if world == 1 and compare_world > 1:  # the largest count's global batches, accumulated here
        per_rank = [
            list(TokenBudgetBatchSampler(lengths, budget, align=16, num_replicas=compare_world, rank=r))
            for r in range(compare_world)
        ]
        shares = [list(step) for step in zip(*per_rank)]
        model = autoragged.wrap(_copy(plain), db=False)
        line["reference_losses"] = train(model, shares, DDP_COMPARE, DDP_COMPARE)[0]
    return line


def _training_graphs(model) -> int:
    """The training graphs the wrapped modules in `model` keep (graphs/train.py)."""
    import autoragged

    return sum(s.training for s in autoragged.graph_stats(model).values())


def _copy(model):
    import copy

    return copy.deepcopy(model)


def worker(task: str, args) -> None:
    import torch.distributed as dist

    from autoragged.job import init_distributed

    rank, world = init_distributed()
    if not dist.is_initialized():  # torchrun's variables are missing: a process group of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
        rank, world = init_distributed()
    out = pathlib.Path(args.out)
    line = _ddp(args, out) if task == "ddp" else _job(task, args, out)
    if rank == 0:
        line |= {"world": world, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
        (out / "line.json").write_text(json.dumps(line))
    dist.barrier()
    # everything is written: leave without the process group's teardown, which once aborted a gloo rank on CI's
    # CPU ("terminate called without an active exception") after its work was done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- the parent: one torchrun per (task, GPU count), the table -------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(task: str, gpus: int, args) -> dict:
    out = pathlib.Path(tempfile.mkdtemp(prefix=f"multi_gpu_{task}{gpus}_"))
    flags = [f for f, on in (("--smoke", args.smoke), ("--quick", args.quick)) if on] + ["--policy", args.policy]
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}",
               f"--master-port={_free_port()}", __file__, "--worker", task, "--out", str(out),
               "--gpus", *map(str, args.gpus), *flags]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-6000:], sep="\n", file=sys.stderr)
        raise RuntimeError(f"{task} on {gpus} GPUs failed (exit {done.returncode})")
    line = json.loads((out / "line.json").read_text())
    line["launch_s"] = time.perf_counter() - started
    results = out / "results.pt"
    line["results"] = str(results) if results.exists() else None
    line["dir"] = str(out)
    return line


def row_of(task: str, gpus: int, line: dict, one: dict | None, args_gpus) -> dict:
    row = {"task": task, "gpus": gpus, "launch_s": line["launch_s"]}
    if task == "ddp":
        row |= {"seconds": line["seconds"], "policy": line["policy"], "arms": line["arms"]}
        row["training_graphs"] = line["training_graphs"]
        row["rate"] = line["tokens"] / line["seconds"]
        row["unit"] = "tokens/s"
        if one is not None and "reference_losses" in one and gpus == max(args_gpus):
            ref, got = one["reference_losses"], line["losses"]
            k = min(len(ref), len(got))
            row["max_diff"] = max(abs(a - b) for a, b in zip(ref[:k], got[:k])) if k else None
            row["compared"] = k
    else:
        first, again = line["passes"]
        row |= {"seconds": first["seconds"], "read_s": first["read_s"], "finished": first["finished"]}
        row["rate"], row["rate_again"] = line["docs"] / first["seconds"], line["docs"] / again["seconds"]
        row["unit"] = "docs/s"
        row["rank_spread"] = max(first["finished"]) / min(first["finished"]) - 1
        if one is not None and line["results"] and one["results"] and gpus > 1:
            a, b = torch.load(one["results"]), torch.load(line["results"])
            row["max_diff"] = float((a - b).abs().max()) if a.shape == b.shape else math.inf
            row["identical"] = bool(torch.equal(a, b))
    if one is not None:
        base = one["tokens"] / one["seconds"] if task == "ddp" else one["docs"] / one["passes"][0]["seconds"]
        row["speedup"] = row["rate"] / base
        if task != "ddp":
            row["speedup_again"] = row["rate_again"] * one["passes"][1]["seconds"] / one["docs"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--gpus", nargs="+", type=int, help="GPU counts (default 1 and 2, 4 where visible; --smoke: 1 2)")
    p.add_argument("--policy", choices=("auto", "ragged", "padded"), default="auto", help="ddp: the wrapped model's")
    p.add_argument("--worker", choices=TASKS, help=argparse_hidden())
    p.add_argument("--out", help=argparse_hidden())
    args = p.parse_args(argv)
    if args.gpus is None:
        visible = torch.cuda.device_count() if not args.smoke else 2
        args.gpus = [1] + [n for n in (2, 4) if n <= visible]
    if args.worker:
        worker(args.worker, args)
        return 0
    if not args.smoke:
        require_cuda("multi_gpu")
    if not args.smoke and max(args.gpus) > torch.cuda.device_count():
        raise SystemExit(f"--gpus {max(args.gpus)} but {torch.cuda.device_count()} GPUs are visible")
    header("multi-GPU: jobs and DDP fine-tuning under torchrun" + (", smoke: tiny, CPU (gloo)" if args.smoke else ""))
    rows, lines = [], {}
    for task in args.tasks:
        for gpus in sorted(set(args.gpus)):
            lines[task, gpus] = launch(task, gpus, args)
            rows.append(row_of(task, gpus, lines[task, gpus], lines.get((task, 1)), args.gpus))
            print(json.dumps(rows[-1]), flush=True)
    for line in lines.values():
        shutil.rmtree(line["dir"], ignore_errors=True)
    cols = [("task", "task", ""), ("gpus", "GPUs", "d"), ("rate", "rate", ",.0f"), ("unit", "unit", ""),
            ("speedup", "vs 1 GPU", ".2f"), ("speedup_again", "again", ".2f"),
            ("rank_spread", "last/first rank - 1", ".1%"),
            ("max_diff", "max diff vs 1 GPU", ".1e"), ("seconds", "timed s", ".1f")]  # fmt: skip
    print("\n## throughput by GPU count (timed part; launch, imports and warm-up excluded)\n")
    print(table(rows, cols))
    record("multi_gpu", args, rows)
    return 0


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    raise SystemExit(main())
