"""DistributedDataParallel(autoragged.wrap(model)) under `torchrun --nproc-per-node 2` on the CPU (gloo): each rank
its token-balanced share of every step (the distributed `TokenBudgetBatchSampler`), every step on the ragged arm,
both ranks' decisions recorded into one tuning database, and the trained parameters equal one process's training on
the same global batches."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import _ddp_worker as worker  # noqa: E402
from _torchrun import ROOT, torchrun  # noqa: E402
from autoragged.tuning_db import TuningDB  # noqa: E402

from autoragged.packing import TokenBudgetBatchSampler  # noqa: E402


def test_ddp_of_a_wrapped_model_trains_as_one_process_on_the_global_batch(tmp_path):
    torchrun(str(ROOT / "tests" / "_ddp_worker.py"), str(tmp_path), db=tmp_path / "tuning.sqlite")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert ranks[0]["steps"] == ranks[1]["steps"] > 1 and all(r["arms"] == ["ragged"] for r in ranks)
    # both ranks recorded into the one database, nothing lost
    decisions = TuningDB.open(tmp_path / "tuning.sqlite", readonly=True).decisions()
    assert len(decisions) == 2 * ranks[0]["steps"]
    trained = torch.load(tmp_path / "params.pt")

    ids, lengths, labels = worker.data()
    alone = worker.model()
    opt = torch.optim.SGD(alone.parameters(), lr=worker.STEPS_LR)
    shares = [TokenBudgetBatchSampler(lengths, worker.BUDGET, align=1, num_replicas=2, rank=r) for r in (0, 1)]
    for step in zip(*shares):  # the global batch of each step: both ranks' bins
        kwargs, y = worker.batch([i for rows in step for i in rows], ids, lengths, labels)
        torch.nn.functional.cross_entropy(alone(**kwargs).logits, y).backward()
        opt.step()
        opt.zero_grad()
    for name, value in alone.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-4, atol=1e-5, msg=name)
