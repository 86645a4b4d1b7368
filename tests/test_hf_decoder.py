"""HuggingFace decoder LLMs through `autoragged.wrap()`: the wrapped model computes the original's function on
real tokens for every family (Llama, Qwen2 with GQA and sliding layers, Mistral with a window that bites,
Qwen3, Gemma at head dim 256, Phi-3, GPT-2), both padding sides and every policy; the KV cache a call asks for
is the original's on real tokens; no leakage between sequences; task heads, hidden states, generate(); the
token-budget job gives each document's result as if it ran alone, in input order.

Tiny random models from config objects (no hub). The ragged arm runs the PyTorch references on most cases and
our Triton kernels in the interpreter on one."""

from __future__ import annotations

import copy
import inspect
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
from _tolerance import assert_within_torch_error  # noqa: E402

import autoragged  # noqa: E402
from autoragged import RaggedTensor, ops  # noqa: E402
from autoragged.packing import run_job, token_budget  # noqa: E402
from autoragged.ragged import tensor as _ragged  # noqa: E402

COMMON = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              intermediate_size=128, pad_token_id=0, max_position_embeddings=64)  # fmt: skip
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    # GQA; layer 1 slides over 4 tokens (layer 0 is global), shorter than the lengths below
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=4),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=32),
    "gemma": lambda: transformers.GemmaConfig(**COMMON, head_dim=256),
    "phi3": lambda: transformers.Phi3Config(**COMMON),
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=100, n_embd=64, n_layer=2, n_head=2, n_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2
    ),  # fmt: skip
}
LENGTHS = (12, 7, 1, 9)


def model_of(family: str, cls=transformers.AutoModelForCausalLM, **extra):
    config = CONFIGS[family]()
    for k, v in extra.items():
        setattr(config, k, v)
    torch.manual_seed(0)
    make = getattr(cls, "from_config", None)
    return (make(config) if make is not None else cls(config)).eval()


def batch(lengths=LENGTHS, side="right", seed=0):
    """(kwargs of one HF call, keep mask (B, L) bool) with real tokens on `side`, pads of id 0."""
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    lens = torch.tensor(lengths)
    cols = torch.arange(L)[None]
    keep = cols < lens[:, None] if side == "right" else cols >= L - lens[:, None]
    ids = torch.randint(3, 100, (len(lengths), L), generator=g).masked_fill(~keep, 0)
    return {"input_ids": ids, "attention_mask": keep.long()}, keep


def use_reference(monkeypatch):
    monkeypatch.setattr(ops, "use_triton", lambda t: False)
    monkeypatch.setattr(_ragged, "use_triton", lambda t: False)


def last(model) -> autoragged.Decision:
    return autoragged.recent_decisions(model, 1)[-1]


def _unwrapped(model):
    twin = copy.deepcopy(model)
    autoragged.unwrap(twin)
    return twin


def originals(model, kwargs):
    """(the original model's output on kwargs in float32, in float64)."""
    plain = _unwrapped(model)
    with torch.no_grad():
        return plain(**kwargs), copy.deepcopy(plain).double()(**kwargs)


def check_close(what, ours, want, want64, keep=None):
    if keep is not None:
        ours, want, want64 = ours[keep], want[keep], want64[keep]
    assert_within_torch_error(ours, want, want64, what)


def check_cache(what, ours, want, want64, keep):
    """Every layer's cached keys and values on real tokens (a sliding layer keeps its last columns only)."""
    assert type(ours) is type(want) and ours.get_seq_length() == want.get_seq_length()
    for a, b, c in zip(ours.layers, want.layers, want64.layers):
        cols = keep[:, -a.keys.shape[2] :]
        for field in ("keys", "values"):
            x, y, z = (getattr(t, field).transpose(1, 2) for t in (a, b, c))  # (B, L, Hkv, Dh)
            check_close(f"{what} cached {field}", x, y, z, cols)


# -- every family -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_every_family_computes_the_original_and_its_cache(family, side, monkeypatch):
    """The plain call `model(input_ids, attention_mask)`: logits on real tokens within 2x PyTorch's error, and
    the KV cache it asks for (use_cache defaults to True) equal to the original's on real tokens."""
    use_reference(monkeypatch)
    model = autoragged.wrap(model_of(family), db=False, policy="ragged")
    kwargs, keep = batch(side=side)
    with torch.no_grad():
        out = model(**kwargs)
    assert last(model).arm == "ragged", last(model).reason
    want, want64 = originals(model, kwargs)
    check_close(f"{family} {side} logits", out.logits, want.logits, want64.logits, keep)
    check_cache(f"{family} {side}", out.past_key_values, want.past_key_values, want64.past_key_values, keep)


def test_the_triton_kernel_in_the_interpreter():
    """GQA, a sliding window that bites, left padding: our kernel itself (Triton's interpreter) on the layers."""
    model = autoragged.wrap(model_of("mistral"), db=False, policy="ragged")
    kwargs, keep = batch(lengths=(9, 3, 6), side="left")
    with torch.no_grad():
        out = model(**kwargs, use_cache=False)
    assert last(model).arm == "ragged"
    want, want64 = originals(model, {**kwargs, "use_cache": False})
    check_close("mistral interpreter", out.logits, want.logits, want64.logits, keep)


def _body(model):
    return model.base_model._autoragged.body


def test_llama_style_layers_take_the_fused_kernels_and_others_say_why_not():
    fused = {f: _body(autoragged.wrap(model_of(f), db=False)).unfused for f in CONFIGS}
    assert fused["llama"] is fused["qwen2"] is fused["mistral"] is fused["qwen3"] is None
    assert (
        "not Llama-style" in fused["gemma"]
        and "not Llama-style" in fused["phi3"]
        and "not Llama-style" in fused["gpt2"]
    )
    assert "activation 'gelu'" in _body(autoragged.wrap(model_of("llama", hidden_act="gelu"), db=False)).unfused
    partial = _body(autoragged.wrap(model_of("llama", partial_rotary_factor=0.5), db=False)).unfused
    assert partial == "partial rotary embeddings"
    replaced = model_of("qwen2")
    replaced.model.layers[1].post_attention_layernorm = torch.nn.LayerNorm(64)
    assert "layer 1: post_attention_layernorm is a LayerNorm" in _body(autoragged.wrap(replaced, db=False)).unfused
    wrapped = model_of("llama")
    wrapped.model.layers[0].mlp.up_proj = torch.nn.Sequential(wrapped.model.layers[0].mlp.up_proj)
    assert "layer 0: mlp.up_proj is not an nn.Linear" in _body(autoragged.wrap(wrapped, db=False)).unfused


def test_fused_layers_with_biases_and_a_norm_kept_in_fp32(monkeypatch):
    """Llama with attention and MLP biases runs fused and computes the original; a norm whose weight is not
    the model's dtype sends the layers to the model's own modules, with the reason (our kernels take one dtype)."""
    use_reference(monkeypatch)
    model = autoragged.wrap(model_of("llama", attention_bias=True, mlp_bias=True), db=False, policy="ragged")
    assert _body(model).unfused is None
    kwargs, keep = batch(side="left")
    with torch.no_grad():
        out = model(**kwargs, use_cache=False)
    want, want64 = originals(model, {**kwargs, "use_cache": False})
    check_close("llama with biases", out.logits, want.logits, want64.logits, keep)
    mixed = model_of("qwen2").to(torch.bfloat16)
    mixed.model.layers[0].input_layernorm.float()
    reason = _body(autoragged.wrap(mixed, db=False, policy="ragged")).unfused
    assert reason == "layer 0: input_layernorm's weight is torch.float32, the model torch.bfloat16"


@pytest.mark.parametrize("family, dtype", [("qwen2", torch.bfloat16), ("qwen3", torch.float32)])
def test_the_fused_layers_in_the_interpreter(family, dtype, monkeypatch):
    """Our layer kernels (Triton's interpreter) on Qwen2 (GQA, a sliding layer that bites, biases) in bf16 and
    Qwen3 (q/k norms): logits, every hidden state and the KV cache equal the original's on real tokens; the
    module path (FUSED_LAYERS off) gives the same within the same error."""
    from autoragged.models import fused_decoder as _fused_decoder
    from autoragged.models import hf_decoder

    runs = []
    real_run = _fused_decoder.run
    monkeypatch.setattr(_fused_decoder, "run", lambda *a, **k: runs.append(1) or real_run(*a, **k))
    model = autoragged.wrap(model_of(family).to(dtype), db=False, policy="ragged")
    kwargs, keep = batch(lengths=(9, 3, 6), side="left")
    with torch.no_grad():
        out = model(**kwargs, output_hidden_states=True)
        monkeypatch.setattr(hf_decoder, "FUSED_LAYERS", False)
        modules = model(**kwargs, output_hidden_states=True)
    assert last(model).arm == "ragged" and runs == [1]
    want, want64 = originals(model, {**kwargs, "output_hidden_states": True})
    for name, ours in (("fused", out), ("modules", modules)):
        check_close(f"{family} {name} logits", ours.logits, want.logits, want64.logits, keep)
        for i, (a, b, c) in enumerate(zip(ours.hidden_states, want.hidden_states, want64.hidden_states)):
            check_close(f"{family} {name} hidden state {i}", a, b, c, keep)
        check_cache(f"{family} {name}", ours.past_key_values, want.past_key_values, want64.past_key_values, keep)
    assert len(out.hidden_states) == len(want.hidden_states)


@pytest.mark.parametrize("policy", ["padded", "ragged", "auto"])
def test_every_policy_gives_the_original(policy, monkeypatch):
    use_reference(monkeypatch)
    model = autoragged.wrap(model_of("llama"), db=False, policy=policy)
    kwargs, keep = batch()
    with torch.no_grad():
        for _ in range(3):
            out = model(**kwargs, use_cache=False)
    if policy != "auto":
        assert last(model).arm == policy
    want, want64 = originals(model, kwargs)
    check_close(f"policy {policy}", out.logits, want.logits, want64.logits, keep)


@pytest.mark.parametrize(("family", "side"), [("llama", "right"), ("gpt2", "left")])
def test_changing_one_sequence_leaves_the_others_bit_identical(family, side, monkeypatch):
    use_reference(monkeypatch)
    model = autoragged.wrap(model_of(family), db=False, policy="ragged")
    kwargs, keep = batch(side=side)
    other = {k: v.clone() for k, v in kwargs.items()}
    other["input_ids"][1][keep[1]] = torch.randint(3, 100, (LENGTHS[1],))
    with torch.no_grad():
        a, b = (model(**kw, use_cache=False).logits for kw in (kwargs, other))
    assert (a[1][keep[1]] != b[1][keep[1]]).any()
    for i in (0, 2, 3):
        assert torch.equal(a[i], b[i]), f"sequence {i} changed when only sequence 1 did"


# -- task models, hidden states, positions -------------------------------------------------------------------
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_sequence_classification_pools_each_sequences_own_last_token(family, side, monkeypatch):
    use_reference(monkeypatch)
    cls = transformers.AutoModelForSequenceClassification
    model = autoragged.wrap(model_of(family, cls, num_labels=3), db=False, policy="ragged")
    kwargs, keep = batch(side=side)
    with torch.no_grad():
        out = model(**kwargs)
    assert last(model).arm == "ragged"
    want, want64 = originals(model, kwargs)
    assert out.logits.shape == (len(LENGTHS), 3)
    check_close(f"{family} {side} classification", out.logits, want.logits, want64.logits)


def test_hidden_states_tuples_and_the_base_model(monkeypatch):
    use_reference(monkeypatch)
    model = autoragged.wrap(model_of("qwen3", transformers.AutoModel), db=False, policy="ragged")
    kwargs, keep = batch(side="left")
    plain = _unwrapped(model)
    with torch.no_grad():
        out = model(**kwargs, output_hidden_states=True, use_cache=False)
        want = plain(**kwargs, output_hidden_states=True, use_cache=False)
        want64 = copy.deepcopy(plain).double()(**kwargs, output_hidden_states=True, use_cache=False)
        as_tuple = model(**kwargs, return_dict=False)
        want_tuple = plain(**kwargs, return_dict=False)
    assert last(model).arm == "ragged"
    assert len(out.hidden_states) == len(want.hidden_states) == 3  # the embeddings, then each layer (last: normed)
    for i, (a, b, c) in enumerate(zip(out.hidden_states, want.hidden_states, want64.hidden_states)):
        check_close(f"hidden state {i}", a, b, c, keep)
    torch.testing.assert_close(out.hidden_states[-1], out.last_hidden_state)
    assert isinstance(as_tuple, tuple) and len(as_tuple) == len(want_tuple) == 2  # (last_hidden_state, cache)
    assert type(as_tuple[1]) is type(want_tuple[1])


def test_explicit_position_ids_and_lengths(monkeypatch):
    """position_ids as generate() makes them for left padding (cumsum of the mask), and `lengths=`."""
    use_reference(monkeypatch)
    model = autoragged.wrap(model_of("phi3"), db=False, policy="ragged")
    kwargs, keep = batch(side="left")
    positions = (kwargs["attention_mask"].cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(**kwargs, position_ids=positions, use_cache=False)
        assert last(model).arm == "ragged"
        want, want64 = originals(model, {**kwargs, "position_ids": positions, "use_cache": False})
        check_close("explicit position_ids", out.logits, want.logits, want64.logits, keep)
        right, keep = batch()
        alone = model(input_ids=right["input_ids"], lengths=list(LENGTHS), use_cache=False)
        assert last(model).arm == "ragged" and last(model).stats.total == sum(LENGTHS)
        want, want64 = originals(model, right)
        check_close("lengths=", alone.logits, want.logits, want64.logits, keep)


# -- the KV cache --------------------------------------------------------------------------------------------
def test_use_cache_false_returns_no_cache_and_decoding_steps_run_padded(monkeypatch):
    use_reference(monkeypatch)
    model = autoragged.wrap(model_of("llama"), db=False, policy="ragged")
    kwargs, keep = batch()
    with torch.no_grad():
        out = model(**kwargs, use_cache=False)
        assert out.past_key_values is None and last(model).arm == "ragged"
        prefill = model(**kwargs)  # the cache the default call asks for
        step = {"input_ids": kwargs["input_ids"][:, :1], "past_key_values": prefill.past_key_values,
                "attention_mask": torch.cat([kwargs["attention_mask"], keep[:, :1].long()], 1)}  # fmt: skip
        model(**step)
    assert last(model).arm == "padded" and "holds 12 tokens" in last(model).reason


def test_generate_prefills_ragged_and_matches_the_original(monkeypatch):
    use_reference(monkeypatch)
    model = autoragged.wrap(model_of("qwen2"), db=False, policy="ragged")
    kwargs, _ = batch(side="left")
    plain = _unwrapped(model)
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = model.generate(**kwargs, **settings)
        want = plain.generate(**kwargs, **settings)
    decisions = autoragged.recent_decisions(model)
    assert decisions[0].arm == "ragged", decisions[0].reason  # the prefill, with generate()'s empty cache
    assert {d.arm for d in decisions[1:]} == {"padded"}  # the decoding steps
    assert torch.equal(got, want)


# -- what runs padded, and why ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("call", "reason"),
    [
        (lambda m, kw: m(**kw, output_attentions=True), "output_attentions"),
        (
            lambda m, kw: m(**kw, past_key_values=transformers.StaticCache(config=m.config, max_cache_len=16)),
            "StaticCache",
        ),  # fmt: skip
        (lambda m, kw: m(**kw, is_causal=False), "argument is_causal"),  # bidirectional for this call
        (lambda m, kw: m(**kw, token_type_ids=torch.zeros_like(kw["input_ids"])), "token_type_ids"),
    ],
)
def test_unsupported_arguments_run_padded_with_their_reason(call, reason, monkeypatch):
    use_reference(monkeypatch)
    model = autoragged.wrap(model_of("llama"), db=False, policy="ragged")
    kwargs, _ = batch()
    with torch.no_grad():
        try:
            call(model, kwargs)
        except (TypeError, ValueError, RuntimeError, IndexError):  # the original model may refuse it itself
            pass
    assert last(model).arm == "padded" and reason in last(model).reason


def test_softcapping_and_small_heads_always_run_padded(caplog, monkeypatch):
    use_reference(monkeypatch)
    gemma2 = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**COMMON, head_dim=32)).eval()
    tiny = model_of("llama", num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with caplog.at_level(logging.WARNING, logger="autoragged"):
        for m in (gemma2, tiny):
            autoragged.wrap(m, db=False, policy="ragged")
    assert "softcapping" in caplog.text and "head dim 16" in caplog.text
    kwargs, keep = batch()
    with torch.no_grad():
        for m in (gemma2, tiny):
            out = m(**kwargs)
            assert last(m).arm == "padded"
    want, want64 = originals(tiny, kwargs)
    check_close("padded head dim 16", out.logits, want.logits, want64.logits, keep)


def test_unwrap_restores_and_the_signature_names_the_family(monkeypatch):
    use_reference(monkeypatch)
    model = model_of("gemma")
    before = model.config._attn_implementation
    plain = copy.deepcopy(model)
    autoragged.wrap(model, db=False, policy="ragged")
    assert model.model._autoragged.sig_key.startswith("hf-gemma:2x64/2h/ff128:gelu_pytorch_tanh:pre:float32")
    params = inspect.signature(model.model.forward).parameters
    assert list(params)[:3] == ["input_ids", "attention_mask", "position_ids"] and "lengths" in params
    kwargs, keep = batch()
    with torch.no_grad():
        model(kwargs["input_ids"], kwargs["attention_mask"])  # positional arguments bind to the model's own names
        assert model.config._attn_implementation == before  # switched only inside the ragged arm
        autoragged.unwrap(model)
        assert "forward" not in model.model.__dict__ and not hasattr(model.model, "_autoragged")
        torch.testing.assert_close(model(**kwargs).logits, plain(**kwargs).logits)


# -- packed input and the token-budget job ---------------------------------------------------------------------
def _documents(n=11, seed=3, longest=30):
    g = torch.Generator().manual_seed(seed)
    lengths = [1, longest, *torch.randint(2, longest, (n - 2,), generator=g).tolist()]
    return [torch.randint(3, 100, (k,), generator=g).tolist() for k in lengths]


def _alone(plain, doc):
    with torch.no_grad():
        out = plain(torch.tensor([doc]), output_hidden_states=True, use_cache=False)
        out64 = copy.deepcopy(plain).double()(torch.tensor([doc]), output_hidden_states=True, use_cache=False)
    return out, out64


def test_a_ragged_tensor_of_ids_runs_each_sequence_as_if_alone(monkeypatch):
    use_reference(monkeypatch)
    model = autoragged.wrap(model_of("gpt2", transformers.AutoModel), db=False)
    docs = _documents(n=4)
    ids = RaggedTensor.from_list([torch.tensor(d) for d in docs], align=4)
    plain = _unwrapped(model)
    with torch.no_grad():
        out = model(input_ids=ids)
    assert isinstance(out.last_hidden_state, RaggedTensor) and out.past_key_values is None
    assert last(model).arm == "ragged" and last(model).stats.total == sum(map(len, docs))
    for i, doc in enumerate(docs):
        want, want64 = _alone(plain, doc)
        check_close(f"document {i}", out.last_hidden_state.select(i), want.last_hidden_state[0],
                    want64.last_hidden_state[0])  # fmt: skip


@pytest.mark.parametrize(
    ("output", "family"),
    [("token_logprobs", "llama"), ("last_logits", "mistral"), ("mean", "gpt2"), ("hidden", "qwen2")],
)
def test_run_job_yields_each_documents_result_in_input_order(output, family, monkeypatch):
    use_reference(monkeypatch)
    model = autoragged.wrap(model_of(family), db=False)
    plain = _unwrapped(model)
    docs = _documents()
    results = list(run_job(model, docs, output=output, max_tokens=40, align=4, progress=False))
    assert len(results) == len(docs)
    assert {d.arm for d in autoragged.recent_decisions(model)} == {"ragged"}
    base = model.transformer if family == "gpt2" else model.model
    assert base._autoragged.policy == "auto"  # forced to ragged only while a bin runs
    for i, (doc, got) in enumerate(zip(docs, results)):
        want, want64 = _alone(plain, doc)
        if output == "token_logprobs":
            target = torch.tensor(doc[1:])[:, None]
            want, want64 = (torch.log_softmax(o.logits[0, :-1], -1).gather(1, target)[:, 0] for o in (want, want64))
            assert got.shape == (len(doc) - 1,) and got.dtype == torch.float32
        elif output == "last_logits":
            want, want64 = want.logits[0, -1], want64.logits[0, -1]
        else:
            want, want64 = want.hidden_states[-1][0], want64.hidden_states[-1][0]
            if output == "mean":
                want, want64 = want.mean(0), want64.mean(0)
        check_close(f"{output} of document {i}", got, want, want64)


def test_run_job_sizes_bins_from_the_probe_and_takes_a_function(monkeypatch):
    use_reference(monkeypatch)
    model = autoragged.wrap(model_of("llama", transformers.AutoModelForSequenceClassification, num_labels=2),
                            db=False)  # fmt: skip
    docs = _documents(n=6)
    budget = token_budget(model, docs, cap=50, safety=0.9, align=1)
    assert budget == 45  # the cap fits on a CPU host: 0.9 of it
    lengths = list(run_job(model, docs, output=lambda hidden, ids: torch.tensor(hidden.lengths), progress=False))
    assert lengths == [torch.tensor(len(d)) for d in docs]
    scores = list(run_job(model, {"input_ids": docs}, output="last_logits", progress=False))
    kwargs = {"input_ids": torch.tensor([docs[3]])}
    want, want64 = originals(model, kwargs)
    check_close("classification of document 3", scores[3], want.logits[0], want64.logits[0])
    with pytest.raises(ValueError, match="document 2 is empty"):
        list(run_job(model, [[5], [6, 7], []], progress=False))
    with pytest.raises(ValueError, match="wrap"):
        list(run_job(model_of("llama"), docs, progress=False))


@pytest.mark.parametrize("use_cache", [False, True])
def test_packed_position_ids_are_attended_as_the_original_attends(use_cache, monkeypatch):
    """Rows of several sequences with restarting position_ids and no mask (DataCollatorWithFlattening): without a
    cache transformers attends within each sequence, and so does the ragged arm; with one (use_cache=True) it
    attends across the row, and so does the ragged arm. Two rows, each packing sequences of its own."""
    use_reference(monkeypatch)
    model = autoragged.wrap(model_of("llama"), db=False, policy="ragged")
    docs = ((5, 9, 2), (3, 13))
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(4))
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in docs])
    kwargs = {"input_ids": ids, "position_ids": positions, "use_cache": use_cache}
    with torch.no_grad():
        out = model(**kwargs)
    want, want64 = originals(model, kwargs)
    check_close(f"packed, use_cache={use_cache}", out.logits, want.logits, want64.logits)
    assert last(model).arm == "ragged" and last(model).stats.batch == (5 if not use_cache else 2)


def test_packed_rows_price_the_padded_arm_as_the_whole_rows(monkeypatch):
    """The padded arm of packed rows is the original module over each whole row (its attention spans the row): the
    cost model prices that, not the row's sequences padded to their longest, and its record says what it ran."""
    from autoragged.tuning_db import BatchStats

    from autoragged.planning.costmodel import PADDED, AnalyticPrior
    from autoragged.planning.device import device_key

    use_reference(monkeypatch)
    model = autoragged.wrap(model_of("llama"), db=False)
    docs = (2, 3, 4, 2, 3, 2)  # six sequences in one row of 16
    ids = torch.randint(3, 100, (1, 16), generator=torch.Generator().manual_seed(4))
    positions = torch.cat([torch.arange(n) for n in docs])[None]
    runtime = model.base_model._autoragged
    with torch.no_grad(), runtime.forcing("padded"):
        model(input_ids=ids, position_ids=positions, use_cache=False)
    prior, sig = AnalyticPrior(device_key(torch.device("cpu"))), runtime.sig
    rows = BatchStats.from_lengths((16,))
    assert last(model).arm == "padded" and last(model).stats == rows  # what the padded arm computed
    with torch.no_grad():
        model(input_ids=ids, position_ids=positions, use_cache=False)
    decision = last(model)
    assert decision.predicted_ms["padded"] == pytest.approx(prior.predict_ms(sig, rows, [PADDED])[0])
    sequences = BatchStats.from_lengths(docs, padded_len=16)  # what it was priced as: six rows of 16
    assert decision.predicted_ms["padded"] < prior.predict_ms(sig, sequences, [PADDED])[0]
