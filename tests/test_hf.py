"""HuggingFace encoders through `autoragged.wrap()`: the wrapped model computes the original's function on
real tokens, for every family, padding side and forced policy, with no leakage between sequences.

Tiny random models built from config objects (no hub). On CPU the ragged arm runs our Triton kernels in
the interpreter ("triton") or the PyTorch references ("reference"); both are checked, the interpreter on
fewer cases (it is slow)."""

from __future__ import annotations

import copy
import logging
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
from _tolerance import assert_within_torch_error  # noqa: E402

import autoragged  # noqa: E402
from autoragged import ops  # noqa: E402
from autoragged.ragged import tensor as _ragged  # noqa: E402

COMMON = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
              pad_token_id=1)  # fmt: skip
CONFIGS = {
    "bert": lambda: transformers.BertConfig(**COMMON),
    "roberta": lambda: transformers.RobertaConfig(**COMMON, max_position_embeddings=40),
    "xlm-roberta": lambda: transformers.XLMRobertaConfig(**COMMON, max_position_embeddings=40),
    "camembert": lambda: transformers.CamembertConfig(**COMMON, max_position_embeddings=40),
    "electra": lambda: transformers.ElectraConfig(**COMMON, embedding_size=32),
    "albert": lambda: transformers.AlbertConfig(
        **COMMON, embedding_size=32, num_hidden_groups=1, inner_group_num=2, hidden_act="gelu_new"
    ),  # fmt: skip
    "distilbert": lambda: transformers.DistilBertConfig(
        vocab_size=100, dim=64, n_layers=2, n_heads=2, hidden_dim=128, pad_token_id=1
    ),  # fmt: skip
    "modernbert": lambda: transformers.ModernBertConfig(
        **COMMON,
        global_attn_every_n_layers=1,
        local_attention=16,
        bos_token_id=2,
        eos_token_id=3,
        cls_token_id=2,
        sep_token_id=3,
    ),  # fmt: skip
    # local layers with a +-2 token window (layer 0 global, layer 1 local): the window bites on these lengths
    "modernbert-local": lambda: transformers.ModernBertConfig(
        **COMMON,
        global_attn_every_n_layers=2,
        local_attention=4,
        bos_token_id=2,
        eos_token_id=3,
        cls_token_id=2,
        sep_token_id=3,
    ),  # fmt: skip
}
POOLED = {"bert", "roberta", "xlm-roberta", "camembert", "albert"}  # their pooler reads column 0
LENGTHS = (12, 7, 1, 9)


def model_of(family: str, cls=None, **extra):
    config = CONFIGS[family]()
    for k, v in extra.items():
        setattr(config, k, v)
    torch.manual_seed(0)
    return (cls(config) if cls is not None else transformers.AutoModel.from_config(config)).eval()


def batch(lengths=LENGTHS, side="right", L=None, seed=0, token_types=False):
    """(kwargs of one HF call, keep mask (B, L) bool) with real tokens on `side`."""
    g = torch.Generator().manual_seed(seed)
    L = L or max(lengths)
    lens = torch.tensor(lengths)
    cols = torch.arange(L)[None]
    keep = cols < lens[:, None] if side == "right" else cols >= L - lens[:, None]
    ids = torch.randint(4, 100, (len(lengths), L), generator=g).masked_fill(~keep, 1)
    kwargs = {"input_ids": ids, "attention_mask": keep.long()}
    if token_types:
        kwargs["token_type_ids"] = (cols >= lens[:, None] // 2).long() * keep
    return kwargs, keep


def use_reference(monkeypatch):
    monkeypatch.setattr(ops, "use_triton", lambda t: False)
    monkeypatch.setattr(_ragged, "use_triton", lambda t: False)


def last(model) -> autoragged.Decision:
    return autoragged.recent_decisions(model, 1)[-1]


def check_close(family, ours, model, kwargs, keep, field="last_hidden_state"):
    """ours vs the original model in float32, both against the original in float64, on real tokens."""
    plain = _unwrapped(model)
    with torch.no_grad():
        want = plain(**kwargs)
        want64 = copy.deepcopy(plain).double()(**kwargs)
    a, b, c = getattr(ours, field), getattr(want, field), getattr(want64, field)
    if tuple(a.shape[:2]) == tuple(keep.shape):  # per token: real tokens only
        a, b, c = a[keep], b[keep], c[keep]
    assert_within_torch_error(a, b, c, f"{family} {field}")


def _unwrapped(model):
    twin = copy.deepcopy(model)
    autoragged.unwrap(twin)
    return twin


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_every_family_computes_the_original_on_real_tokens(family, side, monkeypatch):
    use_reference(monkeypatch)
    model = model_of(family)
    kwargs, keep = batch(side=side, token_types=family not in ("distilbert", "modernbert", "modernbert-local"))
    autoragged.wrap(model, db=False, policy="ragged")
    with torch.no_grad():
        out = model(**kwargs)
    padded_left = side == "left" and family.startswith("modernbert")  # its windows see column 0 where it is
    assert last(model).arm == ("padded" if padded_left else "ragged"), last(model).reason
    if padded_left:
        assert "column 0" in last(model).reason
    check_close(family, out, model, kwargs, keep)
    if family in POOLED:
        check_close(family, out, model, kwargs, keep, "pooler_output")
    if side == "left" and not padded_left:  # column 0 of each padded row: a pad the original computes
        first = keep.clone()
        first[:, 0] = True
        check_close(family, out, model, kwargs, first)
        assert (out.last_hidden_state[~first] == 0).all()  # the other pads: zeros
    elif not padded_left:
        assert (out.last_hidden_state[~keep] == 0).all()


@pytest.mark.parametrize("family", ["bert", "distilbert", "modernbert-local"])
def test_the_triton_kernels_in_the_interpreter(family):
    model = model_of(family)
    kwargs, keep = batch(lengths=(9, 3, 5), side="right" if family != "distilbert" else "left")
    autoragged.wrap(model, db=False, policy="ragged")
    with torch.no_grad():
        out = model(**kwargs)
    assert last(model).arm == "ragged"
    check_close(family, out, model, kwargs, keep)


# the spare rows hold whatever attention left there (it writes the sequences' rows only, as in a graph's spare
# rows), and the interpreter's numpy warns when a layer norm of such a row overflows: nothing reads them
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_the_eager_arm_on_spare_cublas_rows_gives_the_original(kernels, monkeypatch):
    """On the GPU the eager arm with cuBLAS linears runs a rung of rows (`autoragged.planning.buckets.cublas_rows`),
    the rows past the tokens in no sequence; forced here on the CPU. Outputs, hidden states and the pooler
    are the original's, and one sequence's tokens still leave the others' outputs bit-identical."""
    from autoragged.planning.buckets import cublas_rows
    from autoragged.runtime import core

    if kernels == "reference":
        use_reference(monkeypatch)
    seen = []
    from_padded = core.ragged_from_padded

    def spy(x, lens, align, seq_axis, rows=None):
        rt = from_padded(x, lens, align, seq_axis, rows)
        seen.append((rt.layout.rows, sum(lens)))
        return rt

    monkeypatch.setattr(core, "_eager_rows", lambda config, x, causal, total: cublas_rows(total))
    monkeypatch.setattr(core, "ragged_from_padded", spy)
    model = autoragged.wrap(model_of("bert"), db=False, policy="ragged")
    kwargs, keep = batch(lengths=(9, 3, 5), token_types=True)
    with torch.no_grad():
        out = model(**kwargs, output_hidden_states=True)
    assert last(model).arm == "ragged" and seen == [(256, 17)]
    check_close("bert", out, model, kwargs, keep)
    check_close("bert", out, model, kwargs, keep, "pooler_output")
    for i in range(len(out.hidden_states)):
        a, b = out.hidden_states[i][keep], _unwrapped(model)(**kwargs, output_hidden_states=True).hidden_states[i]
        torch.testing.assert_close(a, b[keep], atol=1e-4, rtol=1e-4)
    other = {k: v.clone() for k, v in kwargs.items()}
    other["input_ids"][1, :3] = torch.randint(4, 100, (3,))
    with torch.no_grad():
        changed = model(**other).last_hidden_state
    for i in (0, 2):
        assert torch.equal(changed[i], out.last_hidden_state[i])


@pytest.mark.parametrize("cheapest", ["padded", "ragged"])
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", ["bert", "distilbert", "modernbert"])
def test_batches_whose_mask_is_not_read_give_the_original(family, side, cheapest, device_masks, monkeypatch):
    """A mask on the GPU is read only where the arm that runs needs lengths (`device_masks`: every mask counts as
    on the device). With the padded arm cheapest, a shape's later batches run unread: the original on the call as
    given, and each record gets the batch's own stats; with the eager arm cheapest, each batch is read."""
    from _fakes import Fixed

    from autoragged.planning.planner import Planner

    use_reference(monkeypatch)
    model = autoragged.wrap(model_of(family), db=False, sample_every=0)
    (rt,) = [m._autoragged for m in model.modules() if "_autoragged" in m.__dict__]
    rt.planners[torch.device("cpu")] = Planner(rt.sig, Fixed({cheapest: 1.0}))
    seqs = [(12, 7, 1, 9), (12, 12, 3, 2), (5, 12, 8, 8)]  # one shape: B = 4, L = 12
    calls = [batch(lens, side=side, seed=i) for i, lens in enumerate(seqs)]
    with torch.no_grad():
        outs = [model(**kwargs) for kwargs, _ in calls]
    padded_left = side == "left" and family == "modernbert"  # runs padded once read (its windows see column 0)
    assert len(device_masks) == (1 if cheapest == "padded" else 3)
    for out, (kwargs, keep) in zip(outs, calls):
        check_close(family, out, model, kwargs, keep)
    decisions = autoragged.recent_decisions(model, 3)
    assert [d.arm for d in decisions] == ["padded" if cheapest == "padded" or padded_left else "ragged"] * 3
    assert [d.stats.total for d in decisions] == [sum(lens) for lens in seqs]


@pytest.mark.parametrize("policy", ["padded", "ragged", "auto"])
def test_every_policy_gives_the_original(policy, monkeypatch):
    use_reference(monkeypatch)
    model = model_of("bert")
    kwargs, keep = batch(token_types=True)
    autoragged.wrap(model, db=False, policy=policy)
    with torch.no_grad():
        for _ in range(3):
            out = model(**kwargs)
    check_close("bert", out, model, kwargs, keep)
    check_close("bert", out, model, kwargs, keep, "pooler_output")


@pytest.mark.parametrize("family", ["bert", "roberta", "modernbert"])
def test_changing_one_sequence_leaves_the_others_bit_identical(family, monkeypatch):
    use_reference(monkeypatch)
    model = autoragged.wrap(model_of(family), db=False, policy="ragged")
    kwargs, keep = batch()
    other = {k: v.clone() for k, v in kwargs.items()}
    other["input_ids"][1, : LENGTHS[1]] = torch.randint(4, 100, (LENGTHS[1],))
    with torch.no_grad():
        a, b = model(**kwargs).last_hidden_state, model(**other).last_hidden_state
    assert (a[1] != b[1]).any()
    for i in (0, 2, 3):
        assert torch.equal(a[i], b[i]), f"sequence {i} changed when only sequence 1 did"


@pytest.mark.parametrize(
    ("cls", "field"),
    [
        ("BertForSequenceClassification", "logits"),
        ("BertForTokenClassification", "logits"),
        ("BertForMaskedLM", "logits"),
        ("BertForQuestionAnswering", "start_logits"),
        ("RobertaForSequenceClassification", "logits"),
        ("DistilBertForSequenceClassification", "logits"),
        ("ElectraForSequenceClassification", "logits"),
    ],
)
def test_task_models_keep_their_heads_on_the_repadded_output(cls, field, monkeypatch):
    use_reference(monkeypatch)
    family = {"Bert": "bert", "Roberta": "roberta", "DistilBert": "distilbert", "Electra": "electra"}[
        cls.split("For")[0]
    ]
    model = model_of(family, getattr(transformers, cls), num_labels=2)
    kwargs, keep = batch()
    autoragged.wrap(model, db=False, policy="ragged")
    with torch.no_grad():
        out = model(**kwargs)
    assert last(model).arm == "ragged"
    check_close(family, out, model, kwargs, keep, field)


HEADS = {
    "AutoModelForSequenceClassification": ("logits",),
    "AutoModelForTokenClassification": ("logits",),
    "AutoModelForQuestionAnswering": ("start_logits", "end_logits"),
    "AutoModelForMaskedLM": ("logits",),
}


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("family", [f for f in CONFIGS if f != "modernbert-local"])
def test_every_task_head_gives_the_original_for_either_padding_side(family, head, monkeypatch):
    """Task heads read the base model's repadded output, column 0 included (a sequence classifier's first
    token, a pad in a left-padded row that the original computes): every head, both padding sides, auto and
    ragged, equals the original on real tokens (per row for a sequence head)."""
    use_reference(monkeypatch)
    extra = {"num_labels": 2 if head == "AutoModelForQuestionAnswering" else 3}
    if family == "modernbert":
        extra["classifier_pooling"] = "cls"
    model = model_of(family, lambda config: getattr(transformers, head).from_config(config), **extra)
    for policy in ("ragged", "auto"):
        autoragged.wrap(model, db=False, policy=policy)
        for side in ("right", "left"):
            kwargs, keep = batch(side=side)
            with torch.no_grad():
                out = model(**kwargs)
            for field in HEADS[head]:
                check_close(f"{family} {head} {policy} {side}", out, model, kwargs, keep, field)
            if policy == "ragged" and family != "modernbert":
                assert last(model).arm == "ragged", last(model).reason
        autoragged.unwrap(model)


@pytest.mark.parametrize("policy", ["auto", "ragged"])
def test_a_row_without_real_tokens_runs_padded_and_says_which(policy, monkeypatch):
    """The original computes an all-pad row (attending over its pads); the ragged arm would give zeros. With
    the lengths read, such a batch runs padded, the row named in the reason."""
    use_reference(monkeypatch)
    model = autoragged.wrap(model_of("bert"), db=False, policy=policy)
    kwargs, keep = batch(lengths=(5, 0, 3))
    with torch.no_grad():
        out = model(**kwargs)
    assert last(model).arm == "padded" and "row 1 has no real tokens" in last(model).reason
    plain = _unwrapped(model)
    with torch.no_grad():
        want = plain(**kwargs)
    assert torch.equal(out.pooler_output, want.pooler_output)
    assert torch.equal(out.last_hidden_state, want.last_hidden_state)


def test_hidden_states_and_tuples(monkeypatch):
    use_reference(monkeypatch)
    model = autoragged.wrap(model_of("albert"), db=False, policy="ragged")
    kwargs, keep = batch()
    plain = _unwrapped(model)
    with torch.no_grad():
        out = model(**kwargs, output_hidden_states=True)
        want = plain(**kwargs, output_hidden_states=True)
        as_tuple = model(**kwargs, return_dict=False)
        want_tuple = plain(**kwargs, return_dict=False)
    assert len(out.hidden_states) == len(want.hidden_states) == 5  # the input, then each of 2 x 2 shared layers
    for ours, theirs in zip(out.hidden_states, want.hidden_states):
        torch.testing.assert_close(ours[keep], theirs[keep], rtol=1e-4, atol=1e-5)
    assert isinstance(as_tuple, tuple) and len(as_tuple) == len(want_tuple) == 2
    torch.testing.assert_close(as_tuple[1], want_tuple[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("call", "reason"),
    [
        (lambda m, kw: m(**kw, output_attentions=True), "output_attentions"),
        (lambda m, kw: m(**kw, encoder_hidden_states=torch.zeros(4, 3, 64)), "argument encoder_hidden_states"),
        (lambda m, kw: m(**kw, cu_seq_lens_q=torch.tensor([0, 3])), "argument cu_seq_lens_q"),
        (
            lambda m, kw: m(**{**kw, "attention_mask": (kw["attention_mask"][:, None, None, :] - 1.0) * 1e4}),
            "not a (B, L) padding",
        ),
    ],
)
def test_unsupported_arguments_run_padded_with_their_reason(call, reason, monkeypatch):
    use_reference(monkeypatch)
    model = autoragged.wrap(model_of("bert"), db=False, policy="ragged")
    kwargs, _ = batch()
    with torch.no_grad():
        try:
            call(model, kwargs)
        except (TypeError, ValueError, RuntimeError):  # the original model may refuse the argument itself
            pass
    assert last(model).arm == "padded" and reason in last(model).reason


def test_families_without_the_interface_and_small_heads_always_run_padded(caplog, monkeypatch):
    use_reference(monkeypatch)
    mpnet = transformers.MPNetModel(transformers.MPNetConfig(**COMMON)).eval()
    tiny = model_of("bert", num_attention_heads=8)  # head dim 8
    kwargs, keep = batch()
    with caplog.at_level(logging.WARNING, logger="autoragged"):
        for m in (mpnet, tiny):
            autoragged.wrap(m, db=False, policy="ragged")
    assert "relative-position bias" in caplog.text and "head dim 8" in caplog.text
    with torch.no_grad():
        mpnet(**kwargs)
        out = tiny(**kwargs)
    assert last(mpnet).arm == "padded" and "mpnet" in last(mpnet).reason
    assert last(tiny).arm == "padded" and "head dim 8" in last(tiny).reason
    check_close("bert", out, tiny, kwargs, keep)


def test_lengths_keyword_and_no_mask(monkeypatch):
    use_reference(monkeypatch)
    model = autoragged.wrap(model_of("bert"), db=False, policy="ragged")
    kwargs, keep = batch()
    with torch.no_grad():
        out = model(input_ids=kwargs["input_ids"], attention_mask=kwargs["attention_mask"], lengths=list(LENGTHS))
        assert last(model).stats.total == sum(LENGTHS)
        check_close("bert", out, model, kwargs, keep)
        for policy in ("padded", "ragged"):  # lengths= alone: no mask to read; the padded arm builds one
            model._autoragged.policy = policy
            alone = model(input_ids=kwargs["input_ids"], lengths=list(LENGTHS))
            assert last(model).arm == policy
            check_close("bert", alone, model, kwargs, keep)
        full = model(input_ids=kwargs["input_ids"])  # no mask: every token is real
        assert last(model).stats.total == kwargs["input_ids"].numel()
        check_close("bert", full, model, {"input_ids": kwargs["input_ids"]}, torch.ones_like(keep))
        left, _ = batch(side="left")
        with pytest.raises(ValueError, match="not right-padded"):
            model(**left, lengths=list(LENGTHS))


def test_unwrap_restores_and_config_is_untouched(monkeypatch):
    use_reference(monkeypatch)
    model = model_of("modernbert")
    before = model.config._attn_implementation
    plain = copy.deepcopy(model)
    autoragged.wrap(model, db=False, policy="ragged")
    kwargs, keep = batch()
    with torch.no_grad():
        model(**kwargs)
        assert model.config._attn_implementation == before  # switched only inside the ragged arm
        autoragged.unwrap(model)
        assert "forward" not in model.__dict__ and not hasattr(model, "_autoragged")
        torch.testing.assert_close(model(**kwargs).last_hidden_state, plain(**kwargs).last_hidden_state)
    model.set_attn_implementation("eager")  # still settable
    assert model.config._attn_implementation == "eager"


def test_the_signature_stays_the_models_own():
    import inspect

    model = autoragged.wrap(model_of("bert"), db=False)
    params = inspect.signature(model.forward).parameters
    assert list(params)[:5] == ["input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds"]
    assert "lengths" in params
    kwargs, keep = batch()
    with torch.no_grad():  # positional arguments bind to the model's own names
        out = model(kwargs["input_ids"], kwargs["attention_mask"])
    check_close("bert", out, model, kwargs, keep)


def _sentence_model(tmp_path, cls_name):
    from sentence_transformers import CrossEncoder, SentenceTransformer

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(95)]
    (tmp_path / "vocab.txt").write_text("\n".join(words))
    tokenizer = transformers.BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt"))
    config = transformers.BertConfig(**{**COMMON, "pad_token_id": 0}, num_labels=1)
    torch.manual_seed(0)
    if cls_name == "SentenceTransformer":
        transformers.BertModel(config).save_pretrained(tmp_path)
    else:
        transformers.BertForSequenceClassification(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return (SentenceTransformer if cls_name == "SentenceTransformer" else CrossEncoder)(str(tmp_path), device="cpu")


@pytest.mark.parametrize("cls_name", ["SentenceTransformer", "CrossEncoder"])
def test_sentence_transformers_encode_and_predict_are_unchanged(cls_name, tmp_path, monkeypatch):
    pytest.importorskip("sentence_transformers")
    use_reference(monkeypatch)
    model = _sentence_model(tmp_path, cls_name)
    sentences = [" ".join(f"w{(i * 7 + j) % 95}" for j in range(n)) for i, n in enumerate([3, 17, 8, 30, 1, 12])]
    if cls_name == "SentenceTransformer":
        run = lambda: model.encode(sentences, convert_to_tensor=True, batch_size=4)  # noqa: E731
    else:
        run = lambda: model.predict(list(zip(sentences, sentences[1:])), convert_to_tensor=True,  # noqa: E731
                                    activation_fn=torch.nn.Identity())  # fmt: skip
    want = run()
    autoragged.wrap(model, db=False, policy="ragged")
    got = run()
    arms = {d.arm for d in autoragged.recent_decisions(model)}
    assert arms == {"ragged"}
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_deepcopy_of_a_wrapped_model_runs_its_own_weights(monkeypatch):
    use_reference(monkeypatch)
    model = autoragged.wrap(model_of("bert"), db=False, policy="ragged")
    twin = copy.deepcopy(model)
    kwargs, keep = batch()
    with torch.no_grad():
        twin.encoder.layer[0].output.dense.bias.add_(torch.linspace(-1.0, 1.0, 64))  # not a constant: LayerNorm
        a, b = model(**kwargs).last_hidden_state, twin(**kwargs).last_hidden_state
    assert last(twin).arm == "ragged" and (a[keep] - b[keep]).abs().max() > 1e-2
    check_close("bert", twin(**kwargs), twin, kwargs, keep)


def test_the_report_shows_hf_modules_like_any_other(tmp_path, monkeypatch):
    from autoragged import report

    use_reference(monkeypatch)
    db = tmp_path / "hf.sqlite"
    model = autoragged.wrap(model_of("bert"), db=db, policy="ragged")
    kwargs, _ = batch()
    with torch.no_grad():
        for _ in range(3):
            model(**kwargs)
    autoragged.flush()
    text = report.render_text(report.summary(db))
    assert "hf-bert:2x64/2h/ff128:gelu:post:float32" in text and "ragged" in text


@pytest.mark.parametrize(
    "family,embedding", [("bert", "module"), ("albert", "module"), ("roberta", "module"), ("bert", "tables"),
                         ("roberta", "tables"), ("distilbert", "tables")],
)  # fmt: skip
def test_the_mask_graphs_pass_pools_column_0_of_left_padded_rows_as_the_original(family, embedding):
    """The ragged graph fed a mask (graphs/capture.py, "mask") never reads lengths. It computes column 0 of a
    left-padded row (a pad, which the original computes and its pooler or a task head reads) as a query-only row:
    here its pass runs eagerly, Triton kernels in the interpreter, on left-padded, right-padded, holed, one-token
    and all-pad rows; pooler_output, real tokens and each left-padded row's column 0 must be the original's, the
    pads it reports the mask's, and the all-pad row NaN (the original computes it; the graph cannot). Its
    embedding step: the model's module on the padded ids, then pack; or, from the family's tables, the real
    tokens' embeddings straight into their packed rows (kernels/masked_embed.py: RoBERTa's positions from the ids,
    DistilBERT's without token types)."""
    from autoragged.kernels import graph_layout, masked_embed, masked_pack

    from autoragged.graphs.capture import _StaticLayout, mask_pass
    from autoragged.planning.planner import graph_config

    model = autoragged.wrap(model_of(family), db=False, policy="ragged")
    body = model._autoragged.ready(model).body
    assert body.mask_graph and body.first_column
    L = 9
    keep = torch.zeros(5, L, dtype=torch.bool)
    keep[0, 3:] = True  # left padded
    keep[1, :6] = True  # right padded
    keep[2, [2, 3, 5, 8]] = True  # holes, column 0 a pad
    keep[3, L - 1] = True  # one token, left padded
    ids = torch.randint(4, 100, (5, L), generator=torch.Generator().manual_seed(3)).masked_fill(~keep, 1)
    kwargs = {"input_ids": ids, "attention_mask": keep.long()}  # row 4: all pads
    with torch.no_grad():
        x = body.embed(model, kwargs)
        B, D = x.shape[0], x.shape[2]
        batch, width = B + 1, L + 3  # a spare row and spare columns, as a bucket has
        config = graph_config(body.head_dim, width, "triton")
        programs = batch * width // config.block_m + batch
        meta = torch.zeros(graph_layout.meta_size(batch, programs, True), dtype=torch.int32)
        layout = _StaticLayout(meta, batch, programs, config.block_m, 1, width)
        layout.key_lengths = graph_layout.key_lengths(meta, batch, programs)
        values = torch.zeros(batch * width, D, dtype=x.dtype)
        out = torch.full_like(x, float("nan"))
        mask = ~keep
        pads = torch.full((B,), -1, dtype=torch.int32)
        args = torch.tensor([x.data_ptr(), out.data_ptr(), *x.stride()[:2], *out.stride()[:2], B, L,
                             mask.data_ptr(), *mask.stride(), pads.data_ptr()], dtype=torch.int64)  # fmt: skip
        ran = []

        def values_fn(v, layout, config, causal):
            ran.append((v.shape[0], config.backend))
            return body.values(v, layout, config, causal)

        pack = masked_pack.pack_masked
        if embedding == "tables":
            tables = body.embed_tables(model)
            types = torch.zeros_like(ids) if tables.token_type is not None else None  # the graph's static zeros

            def pack(args, values, offsets, batch, width, first):
                masked_embed.embed_masked(args, ids, types, tables, values, offsets, batch, width, first)

        mask_pass(values_fn, args, values, layout, config, False, pack)
        pooled = body.family.pool(model, out) if body.family.pool is not None else None
        plain = _unwrapped(model)
        want, want64 = plain(**kwargs), copy.deepcopy(plain).double()(**kwargs)
    assert layout.live[0] == 20
    assert ran == [(batch * width, "triton")]
    assert pads.tolist() == [width - n for n in keep.sum(1).tolist()]
    rows = torch.tensor([True, True, True, True, False])  # an all-pad row has no real token to pool
    field = "last_hidden_state"
    assert_within_torch_error(out[keep], want.last_hidden_state[keep], want64.last_hidden_state[keep], field)
    left = torch.tensor([0, 2, 3])
    ours0, want0, want0_64 = (t[left, 0] for t in (out, want.last_hidden_state, want64.last_hidden_state))
    assert_within_torch_error(ours0, want0, want0_64, "column 0 of left-padded rows")
    if pooled is not None:
        p, p64 = want.pooler_output, want64.pooler_output
        assert_within_torch_error(pooled[rows], p[rows], p64[rows], "pooler_output")
    assert (out[1, 6:] == 0).all()  # pads are zeros but a left-padded row's column 0
    assert out[4].isnan().all()  # the original computes an all-pad row's pads; this graph says it cannot


def test_the_mask_graph_takes_token_ids_only_where_it_derives_what_the_original_does():
    """The ragged graph fed a mask runs the embeddings itself from static token ids (`Call.graph_inputs`) when
    the call gives input_ids (and token types) and nothing it would have to derive differently: no
    position_ids, no inputs_embeds. ModernBERT's layers are not fused: it has no mask graph at all."""
    from autoragged.models.hf_encoder import HFEncoderCall

    def inputs(family, **extra):
        model = autoragged.wrap(model_of(family), db=False)
        body = model._autoragged.ready(model).body
        kwargs, _ = batch(token_types=extra.pop("types", False))
        kwargs.update(extra)
        got = HFEncoderCall(body, model, kwargs, None).graph_inputs()
        return None if got is None else (got.mode, got.ids is kwargs.get("input_ids"), got.types is not None)

    # one graph mode whether the call gives token types or not (None: zeros, the embeddings' default)
    assert inputs("bert") == ("ids_tt", True, False)
    assert inputs("roberta", types=True) == ("ids_tt", True, True)
    assert inputs("distilbert") == ("ids", True, False)  # no token types at all
    assert inputs("bert", position_ids=torch.arange(max(LENGTHS))[None].expand(len(LENGTHS), -1)) is None
    assert inputs("bert", token_type_ids=torch.zeros(2, 3, dtype=torch.long)) is None  # not the ids' shape
    assert inputs("modernbert") is None
    model = autoragged.wrap(model_of("bert"), db=False)
    body = model._autoragged.ready(model).body
    embeds = {"inputs_embeds": torch.randn(2, 5, 64), "attention_mask": torch.ones(2, 5, dtype=torch.long)}
    assert HFEncoderCall(body, model, embeds, None).graph_inputs() is None


def test_a_call_with_token_ids_is_keyed_to_and_replayed_on_a_graph_that_embeds_them():
    """The runtime's side of the graph arm, on the CPU (the graph a stand-in that records what it is given): a BERT
    call that gives input_ids and an attention mask is keyed to a mask graph fed ids ("ids_tt": one graph whether
    types come or not), and its replay hands that graph the call's own ids and mask, and no x."""
    from autoragged.graphs.capture import GraphKey
    from autoragged.models.hf_encoder import HFEncoderCall
    from autoragged.planning.buckets import mask_width
    from autoragged.runtime.policy import ShapeKey

    model = autoragged.wrap(model_of("bert"), db=False)
    runtime = model._autoragged.ready(model)
    kwargs, keep = batch()
    call = HFEncoderCall(runtime.body, model, kwargs, None)

    class OnCuda:  # the call as the runtime reads it on a GPU
        device = torch.device("cuda")

        def __getattr__(self, name):
            return getattr(call, name)

    B, L = keep.shape
    key = runtime._graph_key(OnCuda(), ShapeKey(B, mask_width(L), True))
    assert key == GraphKey(B, mask_width(L), "mask", "ids_tt", False)

    given = []

    class Graph:
        def run_mask(self, x, mask, ids, types, pads_to):
            given.append((x, mask, ids, types, pads_to))
            return torch.zeros(B, L, model.config.hidden_size)

    Graph.key = key
    out, slot = runtime._replay(call, Graph(), tuple(keep.sum(1).tolist()))
    ((x, mask, ids, types, pads_to),) = given
    assert x is None and ids is kwargs["input_ids"] and types is None and pads_to == 0 and slot is None
    assert torch.equal(mask, ~keep) and out.last_hidden_state.shape == (B, L, model.config.hidden_size)


def test_the_embedding_step_is_read_as_tables_only_where_it_is_transformers_own_sum_and_norm():
    """The mask graph computes the embeddings from tables (kernels/masked_embed.py) only for transformers' own
    BERT-family embedding modules with nothing after them; a projection (ELECTRA's, ALBERT's mapping), a
    subclass, or a family of another kind keeps the module (the graph runs it on the padded ids)."""

    def tables(family, **extra):
        model = autoragged.wrap(model_of(family, **extra), db=False)
        return model._autoragged.ready(model).body.embed_tables(model)

    bert = tables("bert")
    assert bert.pad_position is None and bert.token_type is not None and bert.eps == 1e-12
    assert tables("roberta").pad_position == 1  # positions counted from the ids, from padding_idx + 1
    assert tables("distilbert").token_type is None
    assert tables("electra", embedding_size=64) is not None
    assert tables("electra") is None  # embedding_size 32: a projection to the hidden size follows
    assert tables("albert") is None and tables("modernbert") is None

    class Scaled(transformers.models.bert.modeling_bert.BertEmbeddings):
        def forward(self, *args, **kwargs):
            return 2 * super().forward(*args, **kwargs)

    model = model_of("bert")
    model.embeddings.__class__ = Scaled
    wrapped = autoragged.wrap(model, db=False)
    assert wrapped._autoragged.ready(wrapped).body.embed_tables(wrapped) is None


@pytest.mark.parametrize("policy", ["padded", "ragged", "auto"])
def test_an_empty_batch_does_what_the_original_does(policy, monkeypatch):
    use_reference(monkeypatch)
    model = autoragged.wrap(model_of("bert"), db=False, policy=policy)
    kwargs = {"input_ids": torch.zeros(0, 6, dtype=torch.long), "attention_mask": torch.zeros(0, 6, dtype=torch.long)}
    try:
        with torch.no_grad():
            want = _unwrapped(model)(**kwargs).last_hidden_state.shape
    except Exception as e:  # noqa: BLE001 - whatever the original raises, the wrapped model raises too
        with torch.no_grad(), pytest.raises(type(e)):
            model(**kwargs)
    else:
        with torch.no_grad():
            assert model(**kwargs).last_hidden_state.shape == want
    assert "an empty batch" in last(model).reason
