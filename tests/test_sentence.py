"""sentence-transformers around a wrapped base model (autoragged/adapters/_sentence.py): encode() and predict()
give the same results, their batches reach the runtime with host lengths (the mask is never read back), and
tokenizing straight from the encodings gives exactly the tokenizer's own tensors or is turned off."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentence_transformers")

import autoragged  # noqa: E402
from autoragged import ops  # noqa: E402
from autoragged.models import sentence as _sentence  # noqa: E402
from autoragged.ragged import tensor as _ragged  # noqa: E402
from autoragged.runtime import core  # noqa: E402

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(95)]
SENTENCES = [
    " ".join(f"w{(i * 7 + j) % 95}" for j in range(n)) for i, n in enumerate([3, 17, 8, 30, 1, 12, 70, 0, 5])
] + ["w1 [PAD] w2", "Ünïcödé w3 ?!", "   "]  # fmt: skip


@pytest.fixture(autouse=True)
def _reference(monkeypatch):
    monkeypatch.setattr(ops, "use_triton", lambda t: False)
    monkeypatch.setattr(_ragged, "use_triton", lambda t: False)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def bert_tokenizer(tmp_path, **kwargs):
    (tmp_path / "vocab.txt").write_text("\n".join(WORDS))
    return transformers.BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt"), **kwargs)


def bpe_tokenizer(tmp_path, **kwargs):
    """A RoBERTa-style byte-level BPE tokenizer (no type ids; <s> ... </s> special tokens)."""
    chars = sorted({c for s in SENTENCES for c in s.replace(" ", "Ġ")} | set("Ġw0123456789"))
    vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>", "<mask>"] + chars + ["Ġw", "w1"])}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\nĠ w\nw 1\n")
    return transformers.RobertaTokenizerFast(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"), **kwargs)


def sentence_model(tmp_path, cls_name="SentenceTransformer", max_len=48):
    from sentence_transformers import CrossEncoder, SentenceTransformer

    config = transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, pad_token_id=0, num_labels=1)  # fmt: skip
    torch.manual_seed(0)
    cls = transformers.BertModel if cls_name == "SentenceTransformer" else transformers.BertForSequenceClassification
    cls(config).save_pretrained(tmp_path)
    bert_tokenizer(tmp_path).save_pretrained(tmp_path)
    model = (SentenceTransformer if cls_name == "SentenceTransformer" else CrossEncoder)(str(tmp_path), device="cpu")
    model.max_seq_length = max_len  # the 70-word sentence is truncated
    return model


def run(model, cls_name):
    if cls_name == "SentenceTransformer":
        return model.encode(SENTENCES, convert_to_tensor=True, batch_size=4)
    pairs = list(zip(SENTENCES, SENTENCES[1:]))
    return model.predict(pairs, convert_to_tensor=True, batch_size=4, activation_fn=torch.nn.Identity())


@pytest.mark.parametrize("cls_name", ["SentenceTransformer", "CrossEncoder"])
def test_encode_and_predict_take_host_lengths_and_never_read_the_mask(cls_name, tmp_path, monkeypatch):
    model = sentence_model(tmp_path, cls_name)
    want = run(model, cls_name)
    autoragged.wrap(model, db=False, policy="ragged")

    def no_read(*args, **kwargs):
        raise AssertionError("the runtime read a padding mask back from the device")

    monkeypatch.setattr(core, "mask_lengths", no_read)
    got = run(model, cls_name)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    decisions = autoragged.recent_decisions(model)
    assert len(decisions) == -(-(len(SENTENCES) - (cls_name == "CrossEncoder")) // 4)
    assert {d.arm for d in decisions} == {"ragged"}
    hooks = model[0]._autoragged_st
    assert hooks.fast and hooks.checked == _sentence._CHECKS


def test_a_left_padding_tokenizer_reads_its_masks_and_gives_the_same_results(tmp_path, monkeypatch):
    model = sentence_model(tmp_path)
    model[0].processor.padding_side = "left"
    want = run(model, "SentenceTransformer")
    autoragged.wrap(model, db=False, policy="ragged")
    reads = []
    read = core.mask_lengths
    monkeypatch.setattr(core, "mask_lengths", lambda *a, **k: reads.append(1) or read(*a, **k))
    got = run(model, "SentenceTransformer")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert len(reads) == 3  # no host lengths for left-padded rows: each batch read its mask


@pytest.mark.parametrize("make", [bert_tokenizer, bpe_tokenizer], ids=["wordpiece", "byte-bpe"])
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("max_length", [None, 6])
def test_fast_tokenizing_equals_the_tokenizers_own_call(make, side, max_length, tmp_path):
    tok = make(tmp_path, padding_side=side)
    tok.model_max_length = 40
    kwargs = {"padding": True, "truncation": "longest_first", "return_tensors": "pt"}
    if max_length is not None:
        kwargs["max_length"] = max_length
    for batch in (SENTENCES, SENTENCES[:1], list(zip(SENTENCES, SENTENCES[::-1]))):
        texts = [t for t, _ in batch] if isinstance(batch[0], tuple) else batch
        pairs = [p for _, p in batch] if isinstance(batch[0], tuple) else None
        want = tok(texts, pairs, **kwargs)
        got = _sentence.fast_tokenize(tok, batch, kwargs)
        assert _sentence._difference(got, want) is None
        assert list(got.keys()) == list(want.keys())
    assert _sentence._difference({**want, "input_ids": want["input_ids"] + 1}, want) == "input_ids differs"


def test_a_fast_path_that_differs_is_turned_off_with_a_warning(tmp_path, monkeypatch, caplog):
    model = sentence_model(tmp_path)
    want = run(model, "SentenceTransformer")
    autoragged.wrap(model, db=False, policy="ragged")
    real = _sentence.fast_tokenize

    def off_by_one(tok, batch, kwargs):
        out = real(tok, batch, kwargs)
        out["input_ids"] = out["input_ids"].clone()
        out["input_ids"][0, 1] += 1
        return out

    monkeypatch.setattr(_sentence, "fast_tokenize", off_by_one)
    with caplog.at_level(logging.WARNING, logger="autoragged"):
        got = run(model, "SentenceTransformer")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not model[0]._autoragged_st.fast
    name = type(model[0].processor).__name__
    assert sum(f"is not {name}'s own call here (input_ids differs)" in r.message for r in caplog.records) == 1


def test_a_fast_path_that_fails_is_turned_off_with_a_warning(tmp_path, monkeypatch, caplog):
    model = sentence_model(tmp_path)
    want = run(model, "SentenceTransformer")
    autoragged.wrap(model, db=False, policy="ragged")

    def gone(*args):
        raise AttributeError("'BertTokenizer' object has no attribute '_get_padding_truncation_strategies'")

    monkeypatch.setattr(_sentence, "fast_tokenize", gone)
    with caplog.at_level(logging.WARNING, logger="autoragged"):
        got = run(model, "SentenceTransformer")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not model[0]._autoragged_st.fast
    assert sum("(AttributeError:" in r.message for r in caplog.records) == 1


def test_other_tokenizer_calls_use_sentence_transformers_own_path(tmp_path, monkeypatch):
    model = sentence_model(tmp_path)
    autoragged.wrap(model, db=False, policy="ragged")
    used = []
    real = _sentence.fast_tokenize
    monkeypatch.setattr(_sentence, "fast_tokenize", lambda *a: used.append(1) or real(*a))
    own = model.preprocess(SENTENCES[:3], processing_kwargs={"text": {"padding": "max_length", "max_length": 40}})
    assert own["input_ids"].shape == (3, 40) and not used
    model.preprocess(SENTENCES[:3])
    assert used == [1]


def test_host_lengths_of_cpu_masks():
    right = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    assert _sentence.mask_lengths_on_host(right) == (2, 3, 0)
    assert isinstance(_sentence.mask_lengths_on_host(right.bool()), autoragged.ragged.layout.HostLengths)
    assert _sentence.mask_lengths_on_host(torch.tensor([[0, 1, 1], [1, 1, 1]])) is None  # left padding
    assert _sentence.mask_lengths_on_host(torch.tensor([[1, 0, 1]])) is None  # a hole
    assert _sentence.mask_lengths_on_host(torch.ones(2, 3, 1)) is None
    assert _sentence.mask_lengths_on_host(None) is None


def test_hinted_lengths_are_taken_once_and_only_for_the_same_shape():
    mask = torch.ones(2, 5, dtype=torch.long)
    token = _sentence._HINT.set(((2, 5), autoragged.ragged.layout.HostLengths((5, 3))))
    try:
        assert _sentence.hinted_lengths(torch.ones(2, 6)) is None
        assert _sentence.hinted_lengths(mask) == (5, 3)
        assert _sentence.hinted_lengths(mask) is None
    finally:
        _sentence._HINT.reset(token)


def test_unwrap_removes_the_hooks_and_rewrap_installs_them_once(tmp_path):
    model = sentence_model(tmp_path)
    autoragged.wrap(model, db=False)
    autoragged.wrap(model, db=False)
    assert set(_sentence._ATTRS) <= set(model[0].__dict__)
    autoragged.unwrap(model)
    assert not (set(_sentence._ATTRS) | {"_autoragged_st"}) & set(model[0].__dict__)
    features = model.preprocess(SENTENCES[:2])
    assert _sentence._KEY not in features


def test_an_instance_attribute_the_input_module_had_is_called_and_put_back(tmp_path):
    model = sentence_model(tmp_path)
    calls = []
    theirs = model[0].preprocess

    def patched(*args, **kwargs):  # e.g. another library's instance-level patch, installed before wrap
        calls.append(1)
        return theirs(*args, **kwargs)

    model[0].preprocess = patched
    autoragged.wrap(model, db=False, policy="ragged")
    assert _sentence._KEY in model.preprocess(SENTENCES[:2]) and calls == [1]
    autoragged.unwrap(model)
    assert model[0].__dict__["preprocess"] is patched


def test_the_multi_process_pool_runs_a_wrapped_model(tmp_path):
    """sentence-transformers' pool (`start_multi_process_pool`, `encode(pool=...)`) pickles the wrapped model to each
    worker process: each binds its copy anew on its first call, and the embeddings are the unwrapped model's."""
    model = sentence_model(tmp_path)
    want = model.encode(SENTENCES, convert_to_tensor=True, batch_size=4)
    autoragged.wrap(model, db=False, policy="ragged")
    pool = model.start_multi_process_pool(["cpu", "cpu"])
    try:
        got = model.encode(SENTENCES, pool=pool, convert_to_tensor=True, batch_size=4, chunk_size=4)
    finally:
        model.stop_multi_process_pool(pool)
    torch.testing.assert_close(torch.as_tensor(got), want, rtol=1e-5, atol=1e-5)
    # what a worker receives: the pickled model, still wrapped, running the ragged arm
    import pickle

    copy = pickle.loads(pickle.dumps(model))
    copy.encode(SENTENCES[:4], batch_size=4)
    assert [d.arm for d in autoragged.recent_decisions(copy, 1)] == ["ragged"]
