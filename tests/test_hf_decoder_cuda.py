"""HF decoders on the GPU: a Qwen2.5-0.5B-shaped model (random weights, 4 of its 24 layers; GQA 14/2 heads of
dim 64) in bf16 and fp16 through the eager ragged arm and the ragged graph arm against the original in the same
dtype and in float64; the KV cache of the plain call; the token-budget job, whose bins never synchronise."""

import warnings

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
transformers = pytest.importorskip("transformers")

from _tolerance import assert_within_torch_error  # noqa: E402
from autoragged.tuning_db import BatchStats  # noqa: E402

import autoragged  # noqa: E402
from autoragged.job import _prepare, _run_bin, _Staged  # noqa: E402
from autoragged.measure import ArmRunner  # noqa: E402
from autoragged.packing import run_job  # noqa: E402
from autoragged.planning.costmodel import Arm  # noqa: E402
from autoragged.planning.planner import default_ragged_config, graph_config  # noqa: E402
from autoragged.workloads import llm_config  # noqa: E402

LENGTHS = (100, 7, 63, 1, 128, 30)


def model(dtype, cls=transformers.AutoModel):
    torch.manual_seed(0)
    return cls.from_config(llm_config("qwen2.5-0.5b", layers=4)).to("cuda", dtype).eval()


def batch(side="right", seed=0):
    g = torch.Generator().manual_seed(seed)
    L = max(LENGTHS)
    lens = torch.tensor(LENGTHS)
    cols = torch.arange(L)[None, :]
    keep = cols < lens[:, None] if side == "right" else cols >= L - lens[:, None]
    ids = torch.randint(100, 150000, (len(LENGTHS), L), generator=g).masked_fill(~keep, 151643)
    return {"input_ids": ids.cuda(), "attention_mask": keep.long().cuda()}, keep.cuda()


def originals(dtype, kwargs, cls=transformers.AutoModel):
    plain = model(dtype, cls)
    with torch.inference_mode():
        want = plain(**kwargs)
        want64 = plain.double()(**kwargs)
    return want, want64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_eager_arm_computes_the_original(dtype):
    runner = ArmRunner(model(dtype))
    kwargs, keep = batch()
    kwargs["use_cache"] = False  # the graph arm returns no cache
    want, want64 = originals(dtype, kwargs)
    stats = BatchStats.from_lengths(LENGTHS)
    with pytest.raises(ValueError, match="no ragged graph"):  # their linears are cuBLAS's: no graph of a capacity
        runner.run_call(Arm("ragged_graph", graph_config(64, 128)), runner.hf_call(kwargs), LENGTHS, stats)
    for arm in [Arm("ragged", default_ragged_config(64, 128))]:
        for _ in range(2):
            out = runner.run_call(arm, runner.hf_call(kwargs), LENGTHS, stats)
        assert out.last_hidden_state.dtype == dtype
        assert_within_torch_error(out.last_hidden_state[keep], want.last_hidden_state[keep],
                                  want64.last_hidden_state[keep], f"{dtype} {arm.label}")  # fmt: skip
        assert (out.last_hidden_state[~keep] == 0).all()


@pytest.mark.parametrize("side", ["right", "left"])
def test_the_plain_call_of_a_causal_lm_and_its_cache(side):
    """`model(input_ids, attention_mask)` as users call it (use_cache defaults to True): logits on real tokens
    and the KV cache within 2x PyTorch's error, on the ragged arm the planner or the policy gives."""
    dtype = torch.bfloat16
    wrapped = autoragged.wrap(model(dtype, transformers.AutoModelForCausalLM), db=False, policy="ragged")
    kwargs, keep = batch(side)
    with torch.inference_mode():
        out = wrapped(**kwargs)
    assert autoragged.recent_decisions(wrapped, 1)[0].arm == "ragged"
    want, want64 = originals(dtype, kwargs, transformers.AutoModelForCausalLM)
    assert_within_torch_error(out.logits[keep], want.logits[keep], want64.logits[keep], f"{side} logits")
    for i, (a, b, c) in enumerate(zip(out.past_key_values.layers, want.past_key_values.layers,
                                      want64.past_key_values.layers)):  # fmt: skip
        for field in ("keys", "values"):
            x, y, z = (getattr(t, field).transpose(1, 2)[keep] for t in (a, b, c))
            assert_within_torch_error(x, y, z, f"{side} layer {i} {field}")


def test_run_job_matches_each_document_alone_and_its_bins_never_sync():
    dtype = torch.bfloat16
    wrapped = autoragged.wrap(model(dtype, transformers.AutoModelForCausalLM), db=False)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(100, 150000, (n,), generator=g).tolist() for n in (300, 5, 77, 1, 129, 64, 250, 16)]
    got = list(run_job(wrapped, docs, output="last_logits", max_tokens=512, progress=False))
    plain = model(dtype, transformers.AutoModelForCausalLM)
    plain64 = model(dtype, transformers.AutoModelForCausalLM).double()
    for i, doc in enumerate(docs):
        ids = torch.tensor([doc], device="cuda")
        with torch.inference_mode():
            want, want64 = plain(ids).logits[0, -1], plain64(ids).logits[0, -1]
        assert_within_torch_error(got[i].cuda(), want, want64, f"document {i}")
    job, documents = _prepare(wrapped, docs, "last_logits", 1)
    staged = _Staged(documents, range(len(docs)), job)
    _run_bin(job, staged)  # warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _run_bin(job, staged)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not [w for w in caught if "synchroniz" in str(w.message)]
