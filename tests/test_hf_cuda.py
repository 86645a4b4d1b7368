"""HF encoders on the GPU: bert-base and MiniLM shapes in fp16 and bf16 through every ragged arm, against the
original in the same dtype and in float64; no device sync with `lengths=`; one with a mask alone (the read)
unless the graph fed the mask serves the batch."""

import copy
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
transformers = pytest.importorskip("transformers")

from _tolerance import assert_within_torch_error  # noqa: E402
from autoragged.tuning_db import BatchStats  # noqa: E402

import autoragged  # noqa: E402
from autoragged.measure import ArmRunner  # noqa: E402
from autoragged.models import sentence as _sentence  # noqa: E402
from autoragged.planning.costmodel import Arm  # noqa: E402
from autoragged.planning.planner import default_ragged_config, graph_config  # noqa: E402
from autoragged.workloads import hf_config  # noqa: E402

LENGTHS = (100, 7, 63, 1, 128, 30)


def model(name, dtype, layers=None, pooler=True):
    config = hf_config(name)
    if layers:
        config.num_hidden_layers = layers
    torch.manual_seed(0)
    m = (
        transformers.BertModel(config, add_pooling_layer=pooler)
        if not pooler
        else transformers.AutoModel.from_config(config)
    )
    return m.to("cuda", dtype).eval()


def batch(lengths=LENGTHS, seed=0, pad=0):
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    keep = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    ids = torch.randint(5, 30000, (len(lengths), L), generator=g).masked_fill(~keep, pad)
    return {"input_ids": ids.cuda(), "attention_mask": keep.long().cuda()}, keep.cuda()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["bert-base", "MiniLM-L12-H384"])
def test_every_ragged_arm_computes_the_original(name, dtype):
    plain = model(name, dtype)
    runner = ArmRunner(model(name, dtype))
    kwargs, keep = batch()
    with torch.inference_mode():
        want = plain(**kwargs)
        want64 = plain.double()(**kwargs)
    plain.to(dtype)
    head_dim = runner.runtime.body.head_dim
    stats = BatchStats.from_lengths(LENGTHS)
    arms = [Arm("ragged", default_ragged_config(head_dim, 128)), Arm("ragged", graph_config(head_dim, 128, "triton"))]
    arms += [Arm("ragged_graph", graph_config(head_dim, 128))]
    for arm in arms:
        for _ in range(2):  # a graph arm captures, then replays
            out = runner.run_call(arm, runner.hf_call(kwargs), LENGTHS, stats)
        assert out.last_hidden_state.dtype == dtype
        assert_within_torch_error(out.last_hidden_state[keep], want.last_hidden_state[keep],
                                  want64.last_hidden_state[keep], f"{name} {arm.label}")  # fmt: skip
        assert_within_torch_error(out.pooler_output, want.pooler_output, want64.pooler_output, f"{arm.label} pooler")
        assert (out.last_hidden_state[~keep] == 0).all()


def test_the_graphs_see_updates_of_the_fused_q_k_v_parameters():
    """q/k/v laid out in one buffer (adapters/_qkv.py): a graph replays an in-place update of one of them, and a
    parameter given new storage (`.data =`) is laid out again and the graph recaptured."""
    runner = ArmRunner(model("bert-base", torch.float16, layers=2))
    kwargs, keep = batch()
    stats = BatchStats.from_lengths(LENGTHS)
    arm = Arm("ragged_graph", graph_config(runner.runtime.body.head_dim, 128))
    attention = runner.module.encoder.layer[1].attention.self
    plain = model("bert-base", torch.float16, layers=2)

    def check(what):
        plain.load_state_dict(runner.module.state_dict())
        with torch.inference_mode():
            want = plain(**kwargs).last_hidden_state[keep]
            want64 = copy.deepcopy(plain).double()(**kwargs).last_hidden_state[keep]
            got = runner.run_call(arm, runner.hf_call(kwargs), LENGTHS, stats).last_hidden_state[keep]
        assert_within_torch_error(got, want, want64, f"{what} {arm.label}")
        return got

    first = check("as wrapped")
    captures = runner.runtime.graphs.captures
    with torch.no_grad():
        attention.key.weight.data.copy_(torch.randn_like(attention.key.weight) / 16)
        attention.value.bias.add_(0.5)
    second = check("updated in place")
    assert runner.runtime.graphs.captures == captures  # replayed, not recaptured
    assert (second.float() - first.float()).abs().max() > 1e-2
    with torch.no_grad():
        attention.query.weight.data = attention.query.weight.data * 1.5
    check("given new storage")
    assert runner.runtime.graphs.captures > captures


@pytest.mark.parametrize("given", ["input_ids", "inputs_embeds"])
def test_the_lengths_graph_embeds_in_the_graph_or_packs_the_callers_embeddings(given):
    """The ragged graph fed host lengths runs the embeddings itself from token ids, or packs the caller's
    embeddings; pads come out zero (memory filled with NaN first, which a fresh output could reuse)."""
    plain = model("bert-base", torch.float16, layers=2)
    m = autoragged.wrap(model("bert-base", torch.float16, layers=2), db=False)
    lengths = (100, 7, 63, 1)
    kwargs, keep = batch(lengths)
    with torch.inference_mode():
        want = plain(**kwargs).last_hidden_state
        call = {"input_ids": kwargs["input_ids"]}
        if given == "inputs_embeds":
            call["inputs_embeds"] = plain.embeddings.word_embeddings(call.pop("input_ids"))
        rt = m._autoragged
        hf_call = m.forward.call_type(rt.body, m, dict(call), list(lengths))
        arm = Arm("ragged_graph", graph_config(64, 128))
        for _ in range(3):  # captures, then replays
            torch.full((64 << 20,), float("nan"), device="cuda", dtype=torch.float16)  # freed: NaN to reuse
            with hf_call.scope():
                out = rt.execute(m, hf_call, arm, lengths, BatchStats.from_lengths(lengths)).last_hidden_state
            assert (out[~keep] == 0).all()
            torch.testing.assert_close(out[keep].float(), want[keep].float(), rtol=2e-2, atol=2e-2)
    (key,) = rt.graphs.graphs
    assert key.lengths_from == "lengths" and key.width == 128
    assert key.inputs == ("ids_tt" if given == "input_ids" else "x")


def _unsynced(fn):
    """fn() with any device sync an error (the work queued before it drained first)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize(("pooler", "types"), [(False, False), (True, False), (True, True)])
def test_the_mask_graph_runs_any_padding_and_never_syncs(pooler, types):
    """Once its graph is captured, a mask alone replays it: no read, no sync, and the original's output on real
    tokens, left padding included, and on column 0 of a left-padded row (a pad the original computes, which a
    pooler or task head reads: a query-only row in the graph). The graph runs the embeddings itself, from the
    token ids (and token types) copied into static buffers: one graph for calls with token types and without."""
    from autoragged.graphs.worker import worker

    m = autoragged.wrap(model("bert-base", torch.float16, layers=4, pooler=pooler), db=False, sample_every=0)
    plain = model("bert-base", torch.float16, layers=4, pooler=pooler)
    kwargs, keep = batch()
    L = keep.shape[1]
    left = {k: v.flip(1) for k, v in kwargs.items()}
    if types:  # the graph captured on a call without token types replays a call with them
        left["token_type_ids"] = (torch.arange(L, device="cuda")[None] % 3 == 0).long() * keep.flip(1)
    calls = [(kwargs, keep), (left, keep.flip(1))] + ([(kwargs, keep)] if types else [])  # types, then none again
    with torch.inference_mode():
        for call, k in calls:
            for _ in range(3):
                m(**call)
            worker.drain()
            m(**call)  # (records the graph once its batch is queued)
            out = _unsynced(lambda call=call: m(**call))
            want = plain(**call)
            assert autoragged.recent_decisions(m, 1)[0].arm == "ragged_graph"
            torch.testing.assert_close(out.last_hidden_state[k].float(), want.last_hidden_state[k].float(),
                                       rtol=2e-2, atol=2e-2)  # fmt: skip
            if pooler:
                torch.testing.assert_close(out.pooler_output.float(), want.pooler_output.float(), rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(out.last_hidden_state[:, 0].float(), want.last_hidden_state[:, 0].float(),
                                       rtol=2e-2, atol=2e-2)  # fmt: skip
    (key,) = m._autoragged.graphs.graphs
    assert key.lengths_from == "mask" and key.inputs == "ids_tt"


def _syncs(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("policy", ["ragged", "auto"])
def test_lengths_never_sync_and_a_mask_syncs_once(policy):
    m = autoragged.wrap(model("MiniLM-L12-H384", torch.float16, layers=2), db=False, policy=policy, sample_every=0)
    kwargs, keep = batch()
    with torch.inference_mode():
        ids = kwargs["input_ids"]
        for _ in range(3):  # capture, plan, compile out of the way
            m(input_ids=ids, lengths=list(LENGTHS))
            m(**kwargs)
        with_lengths = _syncs(lambda: m(input_ids=ids, lengths=list(LENGTHS)))
        ran = autoragged.recent_decisions(m, 1)[0]
        if ran.arm != "padded":  # (the padded arm is HF's own forward, whose sdpa mask code reads the mask)
            assert with_lengths == 0, ran
        with_mask = _syncs(lambda: m(**kwargs))
        ran = autoragged.recent_decisions(m, 1)[0]
    if ran.arm != "padded":
        assert with_mask == (0 if ran.arm == "ragged_graph" else 1), ran
    assert policy == "auto" or ran.arm == "ragged"


@pytest.mark.parametrize("policy", ["ragged", "auto"])
def test_sentence_transformers_batches_reach_the_model_without_a_sync(policy, tmp_path):
    """ST's tokenizer output carries host lengths (adapters/_sentence.py): its forward never reads the mask;
    the same features without them read it once, unless the padded arm or the graph fed the mask serves them."""
    st_mod = pytest.importorskip("sentence_transformers")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(500)]
    (tmp_path / "vocab.txt").write_text("\n".join(words))
    transformers.BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt")).save_pretrained(tmp_path)
    config = hf_config("MiniLM-L12-H384")
    config.num_hidden_layers, config.vocab_size = 2, len(words)
    transformers.BertModel(config).save_pretrained(tmp_path)
    st = st_mod.SentenceTransformer(str(tmp_path), device="cuda").half().eval()
    texts = [" ".join(f"w{(i * 7 + j) % 500}" for j in range(n)) for i, n in enumerate(LENGTHS)]
    with torch.inference_mode():
        want = st.encode(texts, convert_to_tensor=True)
        autoragged.wrap(st, db=False, policy=policy, sample_every=0)
        features = {k: v.cuda() if torch.is_tensor(v) else v for k, v in st.tokenize(texts).items()}
        assert _sentence._KEY in features
        for _ in range(3):
            st.forward(dict(features))
        hinted = _syncs(lambda: st.forward(dict(features)))
        ran = autoragged.recent_decisions(st, 1)[0]
        assert hinted == 0 or ran.arm == "padded", ran
        unhinted = {k: v for k, v in features.items() if k != _sentence._KEY}
        read = _syncs(lambda: st.forward(dict(unhinted)))
        ran = autoragged.recent_decisions(st, 1)[0]
        if policy == "ragged":
            assert read == 1, ran
        got = st.encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)  # fp16 embeddings, two paths
