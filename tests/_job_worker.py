"""One rank of `run_job` under torchrun, for tests/test_job_distributed.py (not a test module).

    torchrun --standalone --nproc-per-node 2 tests/_job_worker.py OUT_DIR

Each rank builds the same tiny models (seeded), runs each job once alone (before the process group exists: the
one-process result), then under the group gathered on rank 0 and into a shard directory. Rank 0 saves
OUT_DIR/results.pt: per job, the one-process, gathered and sharded results; every rank saves OUT_DIR/rank{r}.pt
with the documents it ran.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402

import autoragged  # noqa: E402
from autoragged import job  # noqa: E402
from autoragged.jobs import shards  # noqa: E402

JOBS = {  # name -> (model, output, max_tokens)
    "bert-mean": (lambda: transformers.BertModel(transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=1, intermediate_size=64)), "mean", 48),
    "llama-token_logprobs": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=100, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64)), "token_logprobs", 40),
}  # fmt: skip


def documents() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lengths = [30, 1, 2, *torch.randint(2, 25, (13,), generator=g).tolist()]
    return [torch.randint(3, 100, (n,), generator=g).tolist() for n in lengths]


def main(out: Path) -> None:
    docs = documents()
    models = {}
    for name, (make, _, _) in JOBS.items():
        torch.manual_seed(0)
        models[name] = autoragged.wrap(make().eval(), db=False)
    alone = {name: list(job.run_job(models[name], docs, output=o, max_tokens=t, align=4, progress=False))
             for name, (_, o, t) in JOBS.items()}  # fmt: skip
    rank, world = job.init_distributed()
    assert world == 2, world
    assert job.Ranks.current().store() is not None  # the ranks take bins from the store's counter (BinClaims)
    ran: dict[str, list[int]] = {}  # "job mode" -> the documents this rank ran
    real = job._run_bin
    job._run_bin = lambda j, staged: (ran[key].extend(staged.members), real(j, staged))[1]
    shards._SHARD_DOCS = 2  # several files per rank
    results = {}
    for name, (_, output, tokens) in JOBS.items():
        model = models[name]
        key = f"{name} gathered"
        ran[key] = []
        gathered = list(job.run_job(model, docs, output=output, max_tokens=tokens, align=4, progress=False))
        key = f"{name} sharded"
        ran[key] = []
        sharded = list(job.run_job(model, docs, output=output, max_tokens=tokens, align=4, progress=False,
                                   shards=out / name))  # fmt: skip
        results[name] = {"alone": alone[name], "gathered": gathered, "sharded": sharded}
    torch.save(ran, out / f"rank{rank}.pt")
    if rank == 0:
        torch.save(results, out / "results.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
