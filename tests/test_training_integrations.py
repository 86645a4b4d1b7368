"""What a wrapped model meets in training besides a plain loop (issue 45): HF's gradient checkpointing, peft's LoRA
adapters on the linears, and `torch.compile` of the step around it. Each trains on the ragged arm with the unwrapped
model's loss and every gradient, by the rule of every numerical test (tests/_tolerance.py: within twice the original's
own float32 error against float64). Tiny models from configs, random weights; the ragged arm runs Triton's
interpreter on the CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from _tolerance import assert_gradients_within, assert_within_torch_error
from conftest import triton_available
from torch import nn

import autoragged

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not triton_available("cpu"), reason="needs Triton (the interpreter on CPU)")

LENGTHS = (9, 4, 1, 7)  # a length-1 row; the longest not in row 0
_DECODER = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=96, pad_token_id=0, max_position_embeddings=64)  # fmt: skip
_BERT = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=96,
             pad_token_id=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)  # fmt: skip
_MODERNBERT = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=96,
                   pad_token_id=1, bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3, num_labels=3,
                   global_attn_every_n_layers=2, local_attention=4)  # fmt: skip
MODELS = {
    "bert": lambda: transformers.BertForSequenceClassification(transformers.BertConfig(**_BERT)),
    # the model's own layer modules around our attention (layer 1 of ModernBERT local, a +-2 token window)
    "modernbert": lambda: transformers.ModernBertForSequenceClassification(
        transformers.ModernBertConfig(**_MODERNBERT)
    ),
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=100,
            n_embd=64,
            n_layer=2,
            n_head=2,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    ),
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**_DECODER)),
    # GQA; layer 1 slides over 4 tokens, shorter than the lengths
    "qwen2": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**_DECODER, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    ),
}
# BERT's "dense": the attention's output, the feed-forward's two (the first's gelu after it) and the pooler's
LORA_TARGETS = {"bert": ["query", "key", "value", "dense"], "llama": ["q_proj", "k_proj", "v_proj", "o_proj"]}
LORA_TARGETS["qwen2"] = LORA_TARGETS["llama"]


ENCODERS = ("bert", "modernbert")


def _model(family: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[family]().train()


def _batch(family: str, side: str, lengths=LENGTHS) -> dict:
    """A padded batch with labels: a class per row for BERT; for a causal LM the real tokens, but for each row's first
    (a left-padded row's last pad would predict it: from a pad's logits, which the ragged arm leaves zero)."""
    L = max(lengths)
    lens, cols = torch.tensor(lengths), torch.arange(L)[None]
    keep = cols < lens[:, None] if side == "right" else cols >= L - lens[:, None]
    ids = torch.randint(4, 100, (len(lengths), L), generator=torch.Generator().manual_seed(1))
    ids = ids.masked_fill(~keep, 1 if family in ENCODERS else 0)  # (the configs' pad_token_id)
    kwargs = {"input_ids": ids, "attention_mask": keep.long()}
    if family in ENCODERS:
        return {**kwargs, "labels": torch.arange(len(lengths)) % 3}
    first = keep & (keep.cumsum(1) == 1)
    return {**kwargs, "labels": ids.masked_fill(~keep | first, -100), "use_cache": False}


def _loss_and_grads(model, kwargs) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(**kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _arms(model) -> list[tuple[str, str]]:
    return [(d.arm, d.reason) for d in autoragged.recent_decisions(model, 100)]


def _check(model, plain, kwargs, what: str) -> dict:
    """`model` (wrapped) gives `plain`'s loss and gradients, every batch on the ragged arm; returns the gradients."""
    plain64 = copy.deepcopy(plain).double()
    loss, ours = _loss_and_grads(model, kwargs)
    want_loss, want = _loss_and_grads(plain, kwargs)
    loss64, want64 = _loss_and_grads(plain64, kwargs)
    assert _arms(model) and all(arm == "ragged" for arm, _ in _arms(model)), _arms(model)
    assert_within_torch_error(loss, want_loss, loss64, f"{what} loss")
    assert_gradients_within(ours, want, want64, what)
    return ours


# -- HF's gradient checkpointing -------------------------------------------------------------------------------------
def _saved_bytes(model, kwargs) -> int:
    """The bytes autograd keeps for the backward of one forward (each saved tensor's size)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**kwargs)
    return total


@pytest.mark.parametrize(
    "family, reentrant, side",
    [("bert", False, "left"), ("bert", True, "right"), ("llama", False, "right"), ("llama", True, "left"),
     ("gpt2", False, "left"), ("gpt2", True, "right"), ("modernbert", False, "right"), ("modernbert", True, "right")],
)  # fmt: skip
def test_gradient_checkpointing_trains_ragged_and_recomputes_each_layer(family, reentrant, side):
    """`gradient_checkpointing_enable()` after `wrap` (transformers' default use_reentrant=False, and the reentrant
    kind): the ragged arm runs each layer inside the checkpoint function the model gave it, so it keeps for the
    backward at most twice what the original keeps (which is under a quarter of what it keeps without), and gives
    the original's loss and gradients. (Before: BERT's batches ran padded for the hook `enable_input_require_grads`
    puts on the embeddings, and Llama's ragged arm kept every activation: 4.8 times the original's. GPT-2's own
    layers recomputed with the model's own attention across the packed rows: the reentrant kind's gradients were
    19 off, the other raised on the recomputed shapes.)"""
    kwargs = _batch(family, side)
    model = _model(family)
    plain = copy.deepcopy(model)
    autoragged.wrap(model, db=False, policy="ragged")
    full_original = _saved_bytes(plain, kwargs)
    for m in (model, plain):
        m.gradient_checkpointing_enable({"use_reentrant": reentrant})
    kept, kept_original = _saved_bytes(model, kwargs), _saved_bytes(plain, kwargs)
    assert kept_original < full_original / 4, "checkpointing frees most of the original's activations"
    assert kept <= 2 * kept_original, (kept, kept_original)
    _check(model, plain, kwargs, f"{family} checkpointed (use_reentrant={reentrant}) {side}")


def test_a_hook_on_the_embeddings_runs_on_every_ragged_batch():
    """The ragged arm calls BERT's embedding modules as the original does, so a forward hook there (the one
    `enable_input_require_grads` registers, or a user's probe) runs once a batch and keeps no batch padded; it keeps
    the call from a CUDA graph, whose capture alone would run it. A hook on a layer still runs the batch padded."""
    kwargs = {k: v for k, v in _batch("bert", "left").items() if k != "labels"}
    model = autoragged.wrap(_model("bert").eval(), db=False, policy="ragged")
    seen = []
    model.bert.embeddings.word_embeddings.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    with torch.no_grad():
        for _ in range(2):
            model(**kwargs)
    assert seen == [(*kwargs["input_ids"].shape, 64)] * 2
    assert _arms(model) == [("ragged", "policy=ragged")] * 2, _arms(model)
    runtime = model.bert._autoragged
    call = model.bert.forward.call_type(runtime.body, model.bert, dict(kwargs), None)
    assert "forward hooks on the embeddings" in call.eager_only
    model.bert.encoder.layer[0].register_forward_hook(lambda module, args, out: None)
    with torch.no_grad():
        model(**kwargs)
    assert _arms(model)[-1] == ("padded", "forward hooks on submodules"), _arms(model)


# -- peft's LoRA -------------------------------------------------------------------------------------------------------
def _lora(model, family: str, **extra):
    """LoRA adapters whose update is not zero (peft's default initialisation makes B zero: an adapter a ragged arm
    ignored would go unseen)."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(target_modules=LORA_TARGETS[family], r=4, lora_dropout=0.0, init_lora_weights=False,
                             **extra)  # fmt: skip
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize(
    "family, order, side, checkpointing",
    [("bert", "after", "left", False), ("bert", "before", "right", True), ("llama", "after", "right", True),
     ("llama", "before", "left", False), ("qwen2", "after", "left", False)],
)  # fmt: skip
def test_lora_adapters_train_ragged_with_the_original_gradients(family, order, side, checkpointing):
    """peft's LoRA on the linears (BERT's every one; the decoders' attention), the model wrapped after `get_peft_model` or before it (a change of
    structure: the wrapped base model binds anew), with and without reentrant gradient checkpointing (the usual
    adapter setup: frozen layers, the embeddings' output made to require grad): the adapters run on the packed rows as
    their own modules, so the loss and the adapters' gradients are the peft model's, on the ragged arm. (Before:
    BERT's ragged arm multiplied by the base weights alone, dropping the adapters, and the decoders' LoRA batches
    trained padded.)"""
    kwargs = _batch(family, side)
    base = _model(family)
    if checkpointing:
        base.gradient_checkpointing_enable({"use_reentrant": True})
    plain = _lora(copy.deepcopy(base), family)
    if order == "before":
        model = _lora(autoragged.wrap(base, db=False, policy="ragged"), family)
    else:
        model = autoragged.wrap(_lora(base, family), db=False, policy="ragged")
    model.load_state_dict(plain.state_dict())
    grads = _check(model, plain, kwargs, f"{family} LoRA wrapped {order} {side}")
    assert grads and all("lora_" in name for name in grads), sorted(grads)


def test_lora_on_some_layers_in_eval_with_its_adapter_states():
    """Inference of a LoRA'd BERT (no autograd: the ragged arm lays each plain layer's q/k/v out as one product): an
    adapted layer keeps its three linears as modules, the plain one is fused; the logits are the peft model's with the
    adapters on, disabled (`disable_adapter()`) and merged (`merge_adapter()`)."""
    kwargs = {k: v for k, v in _batch("bert", "left").items() if k != "labels"}
    base = _model("bert").eval()
    plain = _lora(copy.deepcopy(base), "bert", layers_to_transform=[0])
    model = autoragged.wrap(_lora(base, "bert", layers_to_transform=[0]), db=False, policy="ragged")
    model.load_state_dict(plain.state_dict())
    plain64 = copy.deepcopy(plain).double()

    def logits(m):
        with torch.no_grad():
            return m(**kwargs).logits

    def check(what):
        assert_within_torch_error(logits(model), logits(plain), logits(plain64), what)

    check("adapted")
    assert len(model.base_model.model.bert._autoragged.body._qkv.buffers) == 1  # layer 1's q/k/v
    adapted = logits(model)
    with model.disable_adapter(), plain.disable_adapter(), plain64.disable_adapter():
        assert not torch.allclose(logits(model), adapted), "the adapters change the logits (else this says nothing)"
        check("adapters disabled")
    for m in (model, plain, plain64):
        m.merge_adapter()
    check("adapters merged")
    assert all(arm == "ragged" for arm, _ in _arms(model)), _arms(model)


# -- torch.compile -----------------------------------------------------------------------------------------------------
def _step(model, kwargs) -> torch.Tensor:
    loss = model(**kwargs).loss
    loss.backward()
    return loss.detach()


def test_a_compiled_training_step_gives_the_original_and_compiles_once():
    """`torch.compile(step, backend="aot_eager")` of forward, loss and backward around a wrapped BERT: the wrapped
    forward and its kernels' backward run eagerly (a graph break), the head and the loss compiled; the loss and every
    gradient are the original's, on the ragged arm, and batches of other lengths compile nothing new after the second
    (dynamo's one recompile to dynamic shapes). (Before: dynamo traced the dispatch into Triton's interpreter and
    failed; on the PyTorch reference path it compiled the dispatch anew for every batch.)"""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model = _model("bert")
    plain = copy.deepcopy(model)
    plain64 = copy.deepcopy(model).double()
    autoragged.wrap(model, db=False, policy="ragged")
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(_step, backend=counter)
    frames = []
    for lengths, side in (((9, 4, 1, 7), "left"), ((3, 11, 6, 2), "right"), ((5, 5, 1, 8), "left")):
        kwargs = _batch("bert", side, lengths)
        model.zero_grad(set_to_none=True)
        loss = step(model, kwargs)
        frames.append(counter.frame_count)
        ours = {n: p.grad for n, p in model.named_parameters()}
        want_loss, want = _loss_and_grads(plain, kwargs)
        loss64, want64 = _loss_and_grads(plain64, kwargs)
        assert_within_torch_error(loss, want_loss, loss64, f"compiled step {lengths} loss")
        largest = max(g.abs().max().item() for g in want64.values())
        for name in want:
            assert_within_torch_error(ours[name], want[name], want64[name], f"compiled step {lengths} d{name}", largest)
    assert frames[0] > 0 and frames[-1] == frames[1], frames
    assert len(_arms(model)) == 3 and all(arm == "ragged" for arm, _ in _arms(model)), _arms(model)


def test_a_compiled_wrapped_model_runs_its_forward_eagerly():
    """`torch.compile(wrapped model, backend="aot_eager")`: a wrapped BERT (train mode and eval) and a wrapped
    `nn.TransformerEncoder` give the original's outputs on the ragged arm."""
    torch._dynamo.reset()
    kwargs = _batch("bert", "left")
    model = _model("bert")
    plain, plain64 = copy.deepcopy(model), copy.deepcopy(model).double()
    compiled = torch.compile(autoragged.wrap(model, db=False, policy="ragged"), backend="aot_eager")
    with torch.no_grad():
        assert_within_torch_error(compiled(**kwargs).loss, plain(**kwargs).loss, plain64(**kwargs).loss, "train loss")
        for m in (model, plain, plain64):
            m.eval()
        assert_within_torch_error(
            compiled(**kwargs).logits, plain(**kwargs).logits, plain64(**kwargs).logits, "eval logits"
        )
    assert len(_arms(model)) == 2 and all(arm == "ragged" for arm, _ in _arms(model)), _arms(model)

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 2, 96, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    original, original64 = copy.deepcopy(encoder), copy.deepcopy(encoder).double()
    x = torch.randn(len(LENGTHS), max(LENGTHS), 64)
    pads = torch.arange(max(LENGTHS))[None] >= torch.tensor(LENGTHS)[:, None]
    compiled = torch.compile(autoragged.wrap(encoder, db=False, policy="ragged"), backend="aot_eager")
    with torch.no_grad():
        ours = compiled(x, src_key_padding_mask=pads)[~pads]
        want = original(x, src_key_padding_mask=pads)[~pads]
        want64 = original64(x.double(), src_key_padding_mask=pads)[~pads]
    assert_within_torch_error(ours, want, want64, "compiled nn.TransformerEncoder")
    assert _arms(encoder) == [("ragged", "policy=ragged")], _arms(encoder)
