"""DistributedDataParallel over a wrapped model, one rank of `torchrun --nproc-per-node 2` (tests/test_ddp.py):
token-budget batches from the distributed `TokenBudgetBatchSampler`, SGD; rank 0 saves the final parameters and
every rank its arms. Not a test module."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import autoragged
from autoragged.packing import TokenBudgetBatchSampler
from autoragged.runtime.recorder import RECORDER

STEPS_LR = 0.5
BUDGET = 64


def data():
    """(token ids (40, 12), lengths (40,), labels (40,)): the same on every rank."""
    g = torch.Generator().manual_seed(21)
    return (
        torch.randint(4, 100, (40, 12), generator=g),
        torch.randint(2, 13, (40,), generator=g),
        torch.randint(0, 3, (40,), generator=g),
    )


def model():
    import transformers

    config = transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, pad_token_id=1, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0, num_labels=3)  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config).train()


def batch(rows, ids, lengths, labels):
    rows = torch.tensor(rows)
    keep = torch.arange(12)[None] < lengths[rows][:, None]
    return {"input_ids": ids[rows].masked_fill(~keep, 1), "attention_mask": keep.long()}, labels[rows]


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ids, lengths, labels = data()
    net = autoragged.wrap(model(), policy="ragged")  # every rank records into one database ($AUTORAGGED_DB)
    ddp = DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=STEPS_LR)
    sampler = TokenBudgetBatchSampler(lengths, BUDGET, align=1)  # num_replicas and rank from the process group
    for rows in sampler:
        kwargs, y = batch(rows, ids, lengths, labels)
        n = torch.tensor(len(rows))
        dist.all_reduce(n)  # the step's sequences on every rank: the global batch's mean, as one process takes it
        loss = torch.nn.functional.cross_entropy(ddp(**kwargs).logits, y, reduction="sum") / n * world
        loss.backward()  # DDP averages the ranks' gradients
        opt.step()
        opt.zero_grad()
    arms = sorted({d.arm for d in autoragged.recent_decisions(net, 100)})
    RECORDER.flush()
    torch.save({"arms": arms, "steps": len(sampler)}, out / f"rank{rank}.pt")
    if rank == 0:
        torch.save({k: v.detach() for k, v in net.state_dict().items()}, out / "params.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
