"""`run_job` under `torchrun --nproc-per-node 2` on the CPU (gloo): the ranks take the bins between them, and the
results gathered on rank 0 and read back from the ranks' shards are bit-identical to the same process's run of
the whole job alone, for an encoder (BERT, "mean") and a decoder (Llama, "token_logprobs"). A rerun in one process
over the shards of two resumes: it computes only the documents whose shard files are gone.

One torchrun launch (tests/_job_worker.py) serves every test here; tiny seeded models, 16 documents."""

from __future__ import annotations

import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import _job_worker as worker  # noqa: E402
from _torchrun import ROOT, torchrun  # noqa: E402

import autoragged  # noqa: E402
from autoragged import job as _job  # noqa: E402
from autoragged import ops  # noqa: E402
from autoragged.ragged import tensor as _ragged  # noqa: E402


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("job_worker")
    torchrun(str(ROOT / "tests" / "_job_worker.py"), str(out), db=out / "tuning.sqlite")
    return out


@pytest.mark.parametrize("name", list(worker.JOBS))
def test_two_ranks_give_the_one_process_results_gathered_and_from_shards(launched, name):
    results = torch.load(launched / "results.pt", weights_only=True)[name]
    alone, n = results["alone"], len(worker.documents())
    assert len(alone) == n
    for mode in ("gathered", "sharded"):
        got = results[mode]
        assert len(got) == n, mode
        assert all(torch.equal(a, b) for a, b in zip(got, alone)), f"{name} {mode} differs from one process"
    ran = [torch.load(launched / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for mode in ("gathered", "sharded"):
        mine, theirs = ran[0][f"{name} {mode}"], ran[1][f"{name} {mode}"]
        # every document once (which rank takes which bin is a race: test_job.py tests the taking)
        assert sorted(mine + theirs) == list(range(n))
    files = sorted(p.name for p in (launched / name).glob("*.pt"))
    assert files and {f[:14] for f in files} <= {"run001-rank000", "run001-rank001"}


def test_one_process_resumes_the_shards_of_two_computing_only_what_they_lack(launched, tmp_path, monkeypatch):
    monkeypatch.setattr(ops, "use_triton", lambda t: False)
    monkeypatch.setattr(_ragged, "use_triton", lambda t: False)
    name = "bert-mean"
    make, output, tokens = worker.JOBS[name]
    shards = tmp_path / name
    shutil.copytree(launched / name, shards)
    files = sorted(shards.glob("run001-*.pt"))
    lost = files[len(files) // 2 :]
    held = {
        i for p in shards.glob("*.pt") if p not in lost for i in torch.load(p, weights_only=True)["indices"].tolist()
    }
    for p in lost:
        p.unlink()
    torch.manual_seed(0)
    model = autoragged.wrap(make().eval(), db=False)
    real, ran = _job._run_bin, []
    monkeypatch.setattr(_job, "_run_bin", lambda j, staged: (ran.extend(staged.members), real(j, staged))[1])
    docs = worker.documents()
    got = list(_job.run_job(model, docs, output=output, max_tokens=tokens, align=4, progress=False, shards=shards))
    assert sorted(ran) == sorted(set(range(len(docs))) - held) and ran  # the lost files' documents, nothing else
    assert any(p.name.startswith("run002-rank000") for p in shards.glob("*.pt"))
    alone = torch.load(launched / "results.pt", weights_only=True)[name]["alone"]
    for i, (a, b) in enumerate(zip(got, alone)):  # (this process's threads: not bit for bit)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"document {i}")
