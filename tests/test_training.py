"""Training through `autoragged.wrap()`: in train mode, under autograd, the ragged arm runs our kernels' backward and
gives the original's loss and every parameter's gradient, for every BERT-family head and padding side, for PyTorch's
encoder and for the decoders (fused and module-path families, a causal LM's loss on its real tokens); hidden and
attention-probability dropout run ragged with a new mask each call; the policy times a training batch's forward and
backward.

Gradients follow the tolerance rule of every numerical test (tests/_tolerance.py): each against the original model
in float64, at most twice the original's own float32 error plus two ulps. The ragged arm runs the Triton kernels in
the interpreter on CPU (slow: tiny models)."""

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

_COMMON = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=96,
               pad_token_id=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
CONFIGS = {
    "bert": lambda: transformers.BertConfig(**_COMMON),
    "roberta": lambda: transformers.RobertaConfig(**_COMMON, max_position_embeddings=40),
    "electra": lambda: transformers.ElectraConfig(**_COMMON, embedding_size=32),
    "albert": lambda: transformers.AlbertConfig(**_COMMON, embedding_size=32, num_hidden_groups=1, inner_group_num=1),
    "distilbert": lambda: transformers.DistilBertConfig(
        vocab_size=100,
        dim=64,
        n_layers=2,
        n_heads=2,
        hidden_dim=96,
        pad_token_id=1,
        dropout=0.0,
        attention_dropout=0.0,
        seq_classif_dropout=0.0,
        qa_dropout=0.0,
    ),  # fmt: skip
}
HEADS = {
    "AutoModelForSequenceClassification": ("logits",),
    "AutoModelForTokenClassification": ("logits",),
    "AutoModelForQuestionAnswering": ("start_logits", "end_logits"),
    "AutoModelForMaskedLM": ("logits",),
}
LENGTHS = (9, 4, 1, 7)


def _model(family: str, head: str, **extra):
    config = CONFIGS[family]()
    config.num_labels = 2 if head == "AutoModelForQuestionAnswering" else 3
    for k, v in extra.items():
        setattr(config, k, v)
    torch.manual_seed(0)
    return getattr(transformers, head).from_config(config).train()


def _batch(side: str, lengths=LENGTHS):
    L = max(lengths)
    lens, cols = torch.tensor(lengths), torch.arange(L)[None]
    keep = cols < lens[:, None] if side == "right" else cols >= L - lens[:, None]
    ids = torch.randint(4, 100, (len(lengths), L), generator=torch.Generator().manual_seed(1)).masked_fill(~keep, 1)
    return {"input_ids": ids, "attention_mask": keep.long()}, keep


def _outputs(out, fields, keep) -> torch.Tensor:
    """The outputs that matter, flat: every row of a sequence head, real tokens of a token head (a pad's output is the
    original's own computation, which no loss reads)."""
    parts = []
    for f in fields:
        y = getattr(out, f)
        parts.append((y[keep] if tuple(y.shape[:2]) == tuple(keep.shape) else y).reshape(-1))
    return torch.cat(parts)


def _grads(model, kwargs, fields, keep):
    """(outputs, each parameter's gradient) of a fixed random projection of the outputs as the loss."""
    model.zero_grad(set_to_none=True)
    y = _outputs(model(**kwargs), fields, keep)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (y.double() * w).sum().backward()
    return y.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _check_training(model, kwargs, keep, fields, what):
    plain = copy.deepcopy(model)
    plain64 = copy.deepcopy(model).double()
    autoragged.wrap(model, db=False, policy="ragged")
    y, ours = _grads(model, kwargs, fields, keep)
    want_y, want = _grads(plain, kwargs, fields, keep)
    y64, want64 = _grads(plain64, kwargs, fields, keep)
    assert_within_torch_error(y, want_y, y64, f"{what} outputs")
    assert_gradients_within(ours, want, want64, what)
    return model


def _arms(model) -> list[tuple[str, str]]:
    return [(d.arm, d.reason) for d in autoragged.recent_decisions(model, 100)]


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("family", list(CONFIGS))
def test_training_gives_the_original_loss_and_gradients(family, head):
    """Every head, both padding sides: loss and every parameter's gradient as the original's (a left-padded
    sequence head reads column 0, a pad the original computes: the ragged arm computes it as a query-only row)."""
    for side in ("right", "left"):
        kwargs, keep = _batch(side)
        model = _check_training(_model(family, head), kwargs, keep, HEADS[head], f"{family} {head} {side}")
        assert all(arm == "ragged" for arm, _ in _arms(model)), _arms(model)


@pytest.mark.parametrize("norm_first", [False, True])
def test_pytorch_encoder_trains_ragged(norm_first):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 2, 96, dropout=0.0, batch_first=True, norm_first=norm_first)
    model = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(64) if norm_first else None, enable_nested_tensor=False)
    model.train()
    lens = torch.tensor(LENGTHS)
    x = torch.randn(len(LENGTHS), max(LENGTHS), 64, requires_grad=True)
    kpm = torch.arange(max(LENGTHS))[None] >= lens[:, None]
    weights = torch.randn(x.shape, dtype=torch.float64)

    def grads(m, dtype):
        xi = x.detach().to(dtype).requires_grad_()
        m.zero_grad(set_to_none=True)
        y = m(xi, src_key_padding_mask=kpm)
        ((y.double() * weights)[~kpm]).sum().backward()
        return [xi.grad] + [p.grad for p in m.parameters()]

    plain, plain64 = copy.deepcopy(model), copy.deepcopy(model).double()
    autoragged.wrap(model, db=False, policy="ragged")
    ours, want, want64 = grads(model, torch.float32), grads(plain, torch.float32), grads(plain64, torch.float64)
    largest = max(g.abs().max().item() for g in want64)
    for i, (a, b, c) in enumerate(zip(ours, want, want64)):
        assert_within_torch_error(a, b, c, f"gradient {i}", largest)
    assert all(arm == "ragged" for arm, _ in _arms(model)), _arms(model)


@pytest.mark.parametrize("dropout", ["hidden_dropout_prob", "attention_probs_dropout_prob"])
def test_dropout_trains_ragged_with_a_new_mask_each_call(dropout):
    """Hidden dropout on the packed rows, attention-probability dropout in the attention kernel (its mask checked
    against the fp64 reference in tests/test_backward_attention.py): both train ragged, draw a new mask each call,
    repeat under the same torch.manual_seed, and are off in eval mode."""
    kwargs, _ = _batch("right")
    _check_dropout(_model("bert", "AutoModelForSequenceClassification", **{dropout: 0.3}), kwargs)


def _check_dropout(model, kwargs) -> None:
    """Wrapped, in training: a new mask each call, the same under the same seed, a backward; in eval, none; ragged."""
    autoragged.wrap(model, db=False, policy="ragged")
    torch.manual_seed(5)
    a = model(**kwargs).logits
    b = model(**kwargs).logits
    torch.manual_seed(5)
    again = model(**kwargs).logits
    assert not torch.equal(a, b) and torch.equal(a, again)
    a.sum().backward()
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(**kwargs).logits, model(**kwargs).logits)
    assert all(arm == "ragged" for arm, _ in _arms(model)), _arms(model)


def test_a_second_derivative_through_the_ragged_arm_is_an_error():
    """Our kernels' backward gives first derivatives only: a gradient of gradients (`create_graph=True`, a gradient
    penalty) through the ragged arm raises, where before it came back without the kernels' second-order terms (a
    query weight's 27% off, against the original with eager attention)."""
    model = autoragged.wrap(_model("bert", "AutoModelForSequenceClassification"), db=False, policy="ragged")
    kwargs, _ = _batch("right")
    params = [p for p in model.parameters() if p.requires_grad]
    loss = model(**kwargs, labels=torch.tensor([0, 1, 2, 0])).loss
    grads = torch.autograd.grad(loss, params, create_graph=True)
    penalty = sum((g * g).sum() for g in grads if g.requires_grad)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        penalty.backward()


def test_the_policy_times_a_training_batch_forward_and_backward(tmp_path):
    """Timed training batches teach the policy their forward plus backward; their measurements are marked as
    training ones (the calibration's fit of forward costs leaves them out)."""
    db = tmp_path / "t.sqlite"
    model = autoragged.wrap(_model("bert", "AutoModelForSequenceClassification"), db=db, sample_every=1)
    kwargs, _ = _batch("right")
    for _ in range(6):
        model(**kwargs).logits.sum().backward()
    runtime = model.bert._autoragged
    runtime.harvest(wait=True)
    (key, state), *others = runtime.shapes.items()
    assert key.train and not others and state.timed, runtime.shapes
    timed = [r for r in runtime.ring if r.measured_ms is not None]
    assert len(timed) == 6 and all(r.arm.kind in ("padded", "ragged") for r in timed)
    assert sum(len(samples) for samples in state.timed.values()) == 6


def _first_training_arm(model, kwargs) -> str:
    model(**kwargs).logits.sum().backward()
    return autoragged.recent_decisions(model, 1)[0].arm


def test_training_prices_start_from_the_recorded_training_costs(tmp_path):
    """Timed training batches are stored with the forward-only prediction each was priced against; a model wrapped
    later on the same database starts its training prices from them (`tune --train` stores the same), so where
    they say the ragged arm's step costs 40 times its prediction and the padded arm's 1, its first training batch
    runs padded, where a model without them runs the arm the bare prediction ranks first (ragged)."""
    from autoragged.tuning_db import BatchStats, Measurement, TuningDB

    from autoragged.planning.device import device_key
    from autoragged.runtime.recorder import RECORDER

    db = tmp_path / "t.sqlite"
    plain = _model("bert", "AutoModelForSequenceClassification")
    kwargs, _ = _batch("right", (9, 1, 1, 1))  # 75% padding: the prior ranks the ragged arm first
    model = autoragged.wrap(copy.deepcopy(plain), db=db, sample_every=1)
    for _ in range(4):
        model(**kwargs).logits.sum().backward()
    runtime = model.bert._autoragged
    runtime.harvest(wait=True)
    RECORDER.flush()
    key, sig = device_key(torch.device("cpu")), runtime.sig
    with TuningDB.open(db) as tdb:
        rows = [m for m in tdb.measurements(device=key.key, signature=sig.key) if m.extra.get("train")]
    assert len(rows) == 4 and all(m.extra["predicted"] > 0 for m in rows), [m.extra for m in rows]
    again = autoragged.wrap(copy.deepcopy(plain), db=db)
    seeded = again.bert._autoragged.train_scales.ratios
    for kind in {m.arm for m in rows}:
        want = [m.median_ms / m.extra["predicted"] for m in rows if m.arm == kind]
        assert list(seeded[kind]) == pytest.approx(want)

    assert _first_training_arm(autoragged.wrap(copy.deepcopy(plain), db=False), kwargs) == "ragged"
    stats = BatchStats.from_lengths((9, 1, 1, 1))
    costs = [Measurement(key.key, sig.key, arm, None, stats, ratio, ratio, ratio, 1, 1.0, source="tune",
                         extra={"train": True, "predicted": 1.0}) for arm, ratio in (("padded", 1.0), ("ragged", 40.0))]  # fmt: skip
    other = tmp_path / "costs.sqlite"
    with TuningDB.open(other) as tdb:
        tdb.register_device(key)
        tdb.add_measurements(costs)
    assert _first_training_arm(autoragged.wrap(copy.deepcopy(plain), db=other), kwargs) == "padded"


def test_training_under_autocast_matches_the_original_under_autocast():
    """float32 weights, bfloat16 autocast (the usual fine-tuning setup): the linears and attention in bfloat16, the
    residual stream and LayerNorms in float32, as the original's; gradients within twice the original's own error."""
    kwargs, keep = _batch("left")
    model = _model("bert", "AutoModelForSequenceClassification")
    plain, plain64 = copy.deepcopy(model), copy.deepcopy(model).double()
    autoragged.wrap(model, db=False, policy="ragged")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, ours = _grads(model, kwargs, ("logits",), keep)
        want_y, want = _grads(plain, kwargs, ("logits",), keep)
    y64, want64 = _grads(plain64, kwargs, ("logits",), keep)
    assert _arms(model)[-1][0] == "ragged", _arms(model)
    assert_within_torch_error(y.float(), want_y.float(), y64, "autocast logits")
    largest = max(g.abs().max().item() for g in want64.values())
    for name in want:
        assert_within_torch_error(ours[name], want[name], want64[name], f"autocast d{name}", largest)


# -- decoders ------------------------------------------------------------------------------------------------------
_DECODER = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=96, pad_token_id=0, max_position_embeddings=64)  # fmt: skip
DECODERS = {
    "llama": lambda: transformers.LlamaConfig(**_DECODER),
    # GQA; layer 1 slides over 4 tokens, shorter than the lengths
    "qwen2": lambda: transformers.Qwen2Config(
        **_DECODER, use_sliding_window=True, sliding_window=4, max_window_layers=1
    ),
    "qwen3": lambda: transformers.Qwen3Config(**_DECODER, head_dim=32),
}


def _decoder(family: str):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(DECODERS[family]()).train()


def _check_decoder(model, kwargs, keep, what):
    """Per-token logits on real tokens and every gradient, as the original's (use_cache=False: a training call)."""
    plain, plain64 = copy.deepcopy(model), copy.deepcopy(model).double()
    autoragged.wrap(model, db=False, policy="ragged")
    kwargs = {**kwargs, "use_cache": False}
    y, ours = _grads(model, kwargs, ("logits",), keep)
    want_y, want = _grads(plain, kwargs, ("logits",), keep)
    y64, want64 = _grads(plain64, kwargs, ("logits",), keep)
    assert _arms(model)[-1][0] == "ragged", _arms(model)
    assert_within_torch_error(y, want_y, y64, f"{what} logits")
    assert ours.keys() == want.keys()
    largest = max(g.abs().max().item() for g in want64.values())
    for name in want:
        assert_within_torch_error(ours[name], want[name], want64[name], f"{what} d{name}", largest)


@pytest.mark.parametrize("family", list(DECODERS))
def test_decoders_train_ragged_with_the_original_gradients(family):
    """Llama-style decoders (GQA, sliding layers, Qwen3's head norms): padded batches of either side train on the
    fused ragged path, our kernels' backward for attention, RMSNorm, rotary and silu*up."""
    for side in ("right", "left"):
        kwargs, keep = _batch(side)
        _check_decoder(_decoder(family), kwargs, keep, f"{family} {side}")


def _lm_batch(side: str, lengths=LENGTHS):
    """A causal LM's training batch of `side` padding: labels the ids, -100 at pads (as HF's and TRL's collators)."""
    kwargs, keep = _batch(side, lengths)
    return {**kwargs, "labels": kwargs["input_ids"].masked_fill(~keep, -100), "use_cache": False}, keep


def _right(kwargs: dict, keep: torch.Tensor) -> dict:
    """The same documents right-padded (a left-padded batch's rows moved to the front)."""
    order = torch.sort((~keep).int(), dim=1, stable=True).indices
    return {k: v.gather(1, order) if isinstance(v, torch.Tensor) and v.dim() == 2 else v for k, v in kwargs.items()}


def _loss_and_grads(model, kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**kwargs)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", list(DECODERS))
def test_a_causal_lm_computes_its_loss_on_the_real_tokens(family):
    """With labels, the LM head and the loss run on the real tokens only (the head sees (rows, D), not (B, L, D)):
    the loss and every gradient are the original's on the right-padded batch, for either padding side, with the
    mean or a given token count; the logits are the original's on real tokens and zeros at pads."""
    for side in ("right", "left"):
        for count in (None, torch.tensor(13)):
            kwargs, keep = _lm_batch(side)
            if count is not None:
                kwargs["num_items_in_batch"] = count
            model = _decoder(family)
            plain, plain64 = copy.deepcopy(model), copy.deepcopy(model).double()
            autoragged.wrap(model, db=False, policy="ragged")
            seen = []
            model.lm_head.register_forward_hook(lambda m, args, out, seen=seen: seen.append(tuple(args[0].shape)))
            out, ours = _loss_and_grads(model, kwargs)
            want_out, want = _loss_and_grads(plain, _right(kwargs, keep))
            out64, want64 = _loss_and_grads(plain64, _right(kwargs, keep))
            what = f"{family} {side} count={count}"
            assert seen == [(int(keep.sum()), model.config.hidden_size)], (what, seen)
            assert _arms(model)[-1][0] == "ragged", _arms(model)
            assert_within_torch_error(out.loss[None], want_out.loss[None], out64.loss[None], f"{what} loss")
            assert_gradients_within(ours, want, want64, what)
            right = _right({"keep": keep}, keep)["keep"]
            assert_within_torch_error(out.logits[keep], want_out.logits[right], out64.logits[right], f"{what} logits")
            assert torch.equal(out.logits[~keep], torch.zeros_like(out.logits[~keep])), what


def test_a_causal_lm_runs_its_own_head_where_the_base_model_ran_padded():
    """The padded arm, a tuple output, logits_to_keep and no labels: the original forward's head and loss, exactly;
    unwrap gives the class's forward back."""
    kwargs, keep = _lm_batch("right")
    model = _decoder("qwen2")
    plain = copy.deepcopy(model)
    autoragged.wrap(model, db=False, policy="padded")
    torch.testing.assert_close(model(**kwargs).loss, plain(**kwargs).loss, rtol=0, atol=0)
    autoragged.wrap(model, db=False, policy="ragged")
    ours, want = model(**kwargs, return_dict=False), plain(**kwargs, return_dict=False)
    assert isinstance(ours, tuple) and len(ours) == len(want)
    unlabelled = {k: v for k, v in kwargs.items() if k != "labels"}
    last = model(**unlabelled, logits_to_keep=1)
    assert last.logits.shape == (len(LENGTHS), 1, model.config.vocab_size)
    assert model(**unlabelled).loss is None
    assert "forward" in model.__dict__
    autoragged.unwrap(model)
    assert "forward" not in model.__dict__


_MODERNBERT = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=96,
                   pad_token_id=1, bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3,
                   global_attn_every_n_layers=2, local_attention=4)  # fmt: skip


def test_modernbert_trains_ragged_with_the_original_gradients():
    """ModernBERT's own layer modules around our attention, global and local (+-2 tokens) layers: every head's
    loss and gradients as the original's on right-padded batches. Left padding runs padded (its local windows and
    rotary positions count a row's pads; the reason says so), with the original's gradients as a matter of course."""
    for head, fields in HEADS.items():
        for side in ("right", "left"):
            c = transformers.ModernBertConfig(**_MODERNBERT, num_labels=2 if "Question" in head else 3)
            torch.manual_seed(0)
            model = getattr(transformers, head).from_config(c).train()
            kwargs, keep = _batch(side)
            model = _check_training(model, kwargs, keep, fields, f"modernbert {head} {side}")
            arms = {arm for arm, _ in _arms(model)}
            assert arms == ({"ragged"} if side == "right" else {"padded"}), _arms(model)


@pytest.mark.parametrize("dropout", ["attention_dropout", "mlp_dropout", "embedding_dropout"])
def test_modernbert_dropout_trains_ragged_with_a_new_mask_each_call(dropout):
    """ModernBERT's dropouts in its own modules (the attention's probability handed to our kernel, which draws it)."""
    kwargs, _ = _batch("right")
    torch.manual_seed(0)
    config = transformers.ModernBertConfig(**_MODERNBERT, num_labels=3, **{dropout: 0.3})
    _check_dropout(transformers.ModernBertForSequenceClassification(config).train(), kwargs)


# decoders whose layers run as the model's own modules, with our attention (and its backward) inside
MODULE_DECODERS = {
    "gemma": lambda: transformers.GemmaConfig(**_DECODER, head_dim=32),
    "phi3": lambda: transformers.Phi3Config(**_DECODER),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=100, n_embd=64, n_layer=2, n_head=2, n_positions=64,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}  # fmt: skip


@pytest.mark.parametrize("family", list(MODULE_DECODERS))
def test_decoders_of_the_module_path_train_ragged_with_the_original_gradients(family):
    """Gemma, Phi-3 and GPT-2 layers run as the model's own modules on the packed rows, our attention inside them:
    under autograd too, with the original's gradients, for either padding side."""
    for side in ("right", "left"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(MODULE_DECODERS[family]()).train()
        kwargs, keep = _batch(side)
        _check_decoder(model, kwargs, keep, f"{family} {side}")


def test_a_module_path_decoder_draws_attention_dropout_in_the_kernel():
    """GPT-2's attention dropout (no other dropout on): a new mask each call in training, the same under the same seed,
    none in eval. The attention function transformers calls gets the probability and hands it to the kernel."""
    kwargs, _ = _batch("right")
    config = MODULE_DECODERS["gpt2"]()
    config.attn_pdrop = 0.3
    torch.manual_seed(0)
    _check_dropout(transformers.AutoModelForCausalLM.from_config(config).train(), {**kwargs, "use_cache": False})


def test_the_packed_format_attends_within_each_sequence():
    """DataCollatorWithFlattening's rows: one row of several sequences, position_ids restarting, no mask. transformers
    attends within each sequence there; so does the ragged arm, which runs them as its components (before, it attended
    across the row: logits 0.4 off)."""
    docs = (5, 9, 1, 4)
    ids = torch.randint(3, 100, (1, sum(docs)), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(n) for n in docs])[None]
    keep = torch.ones(1, sum(docs), dtype=torch.bool)
    model = _decoder("qwen2")
    _check_decoder(model, {"input_ids": ids, "position_ids": positions}, keep, "packed")
    assert autoragged.recent_decisions(model, 1)[-1].stats.batch == len(docs)


def test_hf_trainer_runs_a_wrapped_model_unchanged(tmp_path):
    """transformers' Trainer fine-tunes a wrapped model as it is: the same loss curve as the unwrapped model's from the
    same seed (dropout off), every step on the ragged arm."""
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(7)
    lengths = [int(n) for n in torch.randint(2, 12, (24,), generator=g)]
    data = [{"input_ids": torch.randint(4, 100, (n,), generator=g).tolist(), "labels": i % 3} for i, n in
            enumerate(lengths)]  # fmt: skip

    def collate(samples):  # DataCollatorWithPadding's output, without a tokenizer
        L = max(len(s["input_ids"]) for s in samples)
        ids = torch.tensor([s["input_ids"] + [1] * (L - len(s["input_ids"])) for s in samples])
        return {
            "input_ids": ids,
            "attention_mask": (ids != 1).long(),
            "labels": torch.tensor([s["labels"] for s in samples]),
        }

    def losses(model, out):
        args = TrainingArguments(output_dir=str(tmp_path / out), max_steps=4, per_device_train_batch_size=6,
                                 learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True, seed=0,
                                 save_strategy="no", dataloader_num_workers=0)  # fmt: skip
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    model = _model("bert", "AutoModelForSequenceClassification")
    plain = copy.deepcopy(model)
    autoragged.wrap(model, db=False, policy="ragged")
    ours, want = losses(model, "wrapped"), losses(plain, "plain")
    assert len(ours) == len(want) == 4
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(want), rtol=1e-4, atol=1e-4)
    assert all(arm == "ragged" for arm, _ in _arms(model)), _arms(model)


def test_a_decoder_of_autocast_dtype_trains_ragged_under_autocast():
    """Parameters already of autocast's dtype (a model loaded in bf16, then autocast by a trainer): autocast changes
    nothing the fused path computes, so the batch trains ragged; float32 parameters under autocast train padded."""
    kwargs, keep = _batch("right")
    model = _decoder("llama").to(torch.bfloat16)
    plain, plain64 = copy.deepcopy(model), copy.deepcopy(model).double()
    autoragged.wrap(model, db=False, policy="ragged")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, ours = _grads(model, {**kwargs, "use_cache": False}, ("logits",), keep)
        want_y, want = _grads(plain, {**kwargs, "use_cache": False}, ("logits",), keep)
    y64, want64 = _grads(plain64, {**kwargs, "use_cache": False}, ("logits",), keep)
    assert _arms(model)[-1][0] == "ragged", _arms(model)
    assert_within_torch_error(y.float(), want_y.float(), y64, "bf16 autocast logits")
    fp32 = autoragged.wrap(_decoder("llama"), db=False, policy="ragged")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fp32(**kwargs, use_cache=False)
    assert _arms(fp32)[-1] == ("padded", "autocast to bfloat16 over float32 parameters (load the model in bfloat16)")


def _tiny_tokenizer():
    """A word-level tokenizer over the tiny models' 100 ids, built without downloads."""
    from tokenizers import Tokenizer, models

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, 100)}}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), pad_token="<pad>", eos_token="<eos>",
        unk_token="<unk>",
    )  # fmt: skip


@pytest.mark.parametrize("padding_free", [False, True])
def test_trl_sft_trainer_runs_a_wrapped_decoder_unchanged(padding_free, tmp_path):
    """TRL's SFTTrainer on pre-tokenized documents, padded batches or padding-free rows (position_ids and the
    flash-attention kwargs, no mask): the wrapped model's loss curve is the unwrapped one's, every step ragged."""
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    g = torch.Generator().manual_seed(7)
    rows = [{"input_ids": torch.randint(3, 100, (int(n),), generator=g).tolist()}
            for n in torch.randint(3, 20, (24,), generator=g)]  # fmt: skip
    data = datasets.Dataset.from_list(rows)

    def losses(model, out):
        args = trl.SFTConfig(output_dir=str(tmp_path / out), max_steps=3, per_device_train_batch_size=6,
                             learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True, seed=0, bf16=False,
                             save_strategy="no", padding_free=padding_free, max_length=None)  # fmt: skip
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=_tiny_tokenizer())
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    model = _decoder("qwen2")
    plain = copy.deepcopy(model)
    autoragged.wrap(model, db=False, policy="ragged")
    ours, want = losses(model, "wrapped"), losses(plain, "plain")
    assert len(ours) == len(want) == 3
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(want), rtol=1e-4, atol=1e-4)
    assert all(arm == "ragged" for arm, _ in _arms(model)), _arms(model)


def test_a_300_step_fine_tune_tracks_the_padded_loss_curve():
    """300 steps of a one-layer BERT classifier on a learnable task (the label is the first token's id mod 3), hidden
    dropout on: the wrapped model's loss curve stays within the spread of two padded runs that differ only in data
    order (the mean distance of their 20-step means). The ragged arm runs the PyTorch references here (300 steps in the interpreter would take
    minutes); its kernels' gradients are checked above."""
    from autoragged import ops
    from autoragged.ragged import tensor as ragged_tensor

    def run(order_seed: int, wrapped: bool) -> torch.Tensor:
        model = _model("bert", "AutoModelForSequenceClassification", hidden_dropout_prob=0.1, num_hidden_layers=1)
        if wrapped:
            autoragged.wrap(model, db=False, policy="ragged")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = torch.Generator().manual_seed(11)
        ids = torch.randint(4, 100, (2400, 12), generator=data)
        lengths = torch.randint(2, 13, (2400,), generator=data)
        order = torch.randperm(2400, generator=torch.Generator().manual_seed(order_seed))
        torch.manual_seed(order_seed)
        out = []
        for step in range(300):
            rows = order[step * 8 : (step + 1) * 8]
            keep = torch.arange(12)[None] < lengths[rows][:, None]
            batch = {"input_ids": ids[rows].masked_fill(~keep, 1), "attention_mask": keep.long(),
                     "labels": ids[rows, 0] % 3}  # fmt: skip
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        if wrapped:
            assert all(arm == "ragged" for arm, _ in _arms(model)), _arms(model)
        return torch.tensor(out).view(15, 20).mean(1)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops, "use_triton", lambda t: False)
        mp.setattr(ragged_tensor, "use_triton", lambda t: False)
        padded, reordered, ours = run(0, False), run(1, False), run(0, True)
    assert padded[-1] < 0.5 * padded[0], "the task is learnt (else the curves say nothing)"
    spread = (padded - reordered).abs().mean()  # over the 15 windows
    assert (ours - padded).abs().mean() <= spread, (ours, padded, reordered)
