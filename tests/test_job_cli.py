"""`python -m autoragged.job`: a tiny BERT and its tokenizer saved to a directory, a JSONL file of texts; the
command under `torchrun --nproc-per-node 2` (gloo) writes what one process writes, in input order; a rerun over
kept shards computes nothing; bad input gets one clear line and exit status 2; `--help` says what it does."""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from _torchrun import torchrun  # noqa: E402

import autoragged  # noqa: E402
from autoragged import job as _job  # noqa: E402
from autoragged import ops  # noqa: E402
from autoragged.jobs import cli  # noqa: E402
from autoragged.ragged import tensor as _ragged  # noqa: E402

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(95)]


@pytest.fixture(autouse=True)
def _reference(monkeypatch):
    monkeypatch.setattr(ops, "use_triton", lambda t: False)
    monkeypatch.setattr(_ragged, "use_triton", lambda t: False)
    log = logging.getLogger("autoragged")
    handlers, level = list(log.handlers), log.level
    yield
    log.handlers[:], log.level = handlers, level  # the command's handler writes to this test's captured stderr


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """A tiny BERT (head dim 32) and a WordPiece tokenizer over WORDS, saved as a model directory."""
    path = tmp_path_factory.mktemp("tiny_bert")
    (path / "vocab.txt").write_text("\n".join(WORDS))
    transformers.BertTokenizerFast(vocab_file=str(path / "vocab.txt")).save_pretrained(path)
    config = transformers.BertConfig(vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=1, num_attention_heads=1,
                                     intermediate_size=64, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """11 texts of 1 to 40 words as JSONL (objects with ids, one bare string, a blank line)."""
    path = tmp_path_factory.mktemp("texts") / "texts.jsonl"
    lines = [json.dumps({"id": f"t{i}", "text": " ".join(f"w{(i * 7 + j) % 95}" for j in range(n))})
             for i, n in enumerate([3, 40, 1, 12, 25, 7, 2, 30, 9, 17])]  # fmt: skip
    path.write_text("\n".join([*lines[:4], "", json.dumps("w5 w6 [MASK] w7"), *lines[4:]]) + "\n")
    return path


def run(*args) -> int:
    return cli.main([*map(str, args), "--no-progress"])


def test_torchrun_two_ranks_write_what_one_process_writes(bert_dir, texts, tmp_path):
    out2 = tmp_path / "two.jsonl"
    torchrun("-m", "autoragged.job", "--model", str(bert_dir), "--input", str(texts), "--output", str(out2),
             "--output-kind", "mean", "--max-tokens", "48", "--align", "4", "--no-progress",
             db=tmp_path / "torchrun.sqlite")  # fmt: skip
    assert not (tmp_path / "two.jsonl.shards").exists()  # merged, then removed
    two = [json.loads(line) for line in out2.read_text().splitlines()]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each torchrun rank: the same float32 sums, bit for bit
    try:
        assert run("--model", bert_dir, "--input", texts, "--output", tmp_path / "one.jsonl", "--output-kind", "mean",
                   "--max-tokens", 48, "--align", 4) == 0  # fmt: skip
        assert run("--model", bert_dir, "--input", texts, "--output", tmp_path / "one.npy", "--output-kind", "mean",
                   "--max-tokens", 48, "--align", 4) == 0  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    one = [json.loads(line) for line in (tmp_path / "one.jsonl").read_text().splitlines()]
    assert len(two) == 11 and two == one  # every value equal, in input order
    assert [r["index"] for r in two] == list(range(11))
    assert [r["id"] for r in two] == ["t0", "t1", "t2", "t3", None, "t4", "t5", "t6", "t7", "t8", "t9"]
    array = np.load(tmp_path / "one.npy")
    assert array.dtype == np.float32 and array.shape == (11, 32)
    assert np.array_equal(array, np.array([r["mean"] for r in one], dtype=np.float32))


def test_a_rerun_over_kept_shards_computes_nothing_and_writes_the_same(bert_dir, texts, tmp_path, monkeypatch):
    out = tmp_path / "cls.jsonl"
    args = ("--model", bert_dir, "--input", texts, "--output", out, "--output-kind", "pooler", "--max-tokens", 48)
    assert run(*args, "--keep-shards") == 0
    first = out.read_text()
    assert len(first.splitlines()) == 11 and list((tmp_path / "cls.jsonl.shards").glob("*.pt"))
    out.unlink()
    monkeypatch.setattr(_job, "_run_bin", lambda job, staged: pytest.fail("a held document ran again"))
    assert run(*args) == 0
    assert out.read_text() == first and not (tmp_path / "cls.jsonl.shards").exists()


def test_bad_input_gets_one_clear_line(bert_dir, texts, tmp_path, caplog):
    cases = [
        (("--output", tmp_path / "o.csv", "--output-kind", "mean"), "write .jsonl, .npy, .parquet"),
        (("--output", tmp_path / "o.npy", "--output-kind", "hidden"), "gives a different length per text"),
        (("--output", tmp_path / "no" / "o.jsonl", "--output-kind", "mean"), "does not exist"),
        (("--output", tmp_path / "o.jsonl", "--output-kind", "token_logprobs"), "is a decoder's; .* bert encoder"),
    ]
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        cases.append((("--output", tmp_path / "o.parquet", "--output-kind", "mean"), r"autoragged\[parquet\]"))
    bad = tmp_path / "bad.jsonl"
    for content, message in [('{"text": "w1"}\n{"text": \n', "bad.jsonl line 2: not JSON"),
                             ('{"body": "w1"}\n', "line 1: no 'text' field .* --text-field"),
                             ('{"text": 5}\n', "line 1: the text is a int"), ("\n\n", "holds no texts")]:  # fmt: skip
        path = tmp_path / f"bad{len(cases)}.jsonl"
        path.write_text(content)
        cases.append((("--input", path, "--output", tmp_path / "o.jsonl", "--output-kind", "mean"),
                       message.replace("bad.jsonl", path.name)))  # fmt: skip
    for args, message in cases:
        base = ("--model", bert_dir) + (() if "--input" in args else ("--input", texts))
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="autoragged"):
            assert run(*base, *args) == 2, args
        assert caplog.records and re.search(message, caplog.records[-1].getMessage()), (args, caplog.text)
    assert not bad.exists() and not list(tmp_path.glob("o.*"))  # nothing written on an error


def test_help_says_what_the_command_does(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    words = ["python -m autoragged.job", "torchrun --nproc-per-node", "one result per text", "--output-kind", "mean",
             "token_logprobs", ".parquet", "pip install 'autoragged[parquet]'", "--shards", "resum"]  # fmt: skip
    assert [w for w in words if w not in text] == []


def test_a_decoder_directory_gives_each_texts_token_logprobs(bert_dir, texts, tmp_path):
    """A tiny Llama saved beside the same tokenizer: the command's JSONL holds run_job's log-probabilities."""
    llama = tmp_path / "llama"
    config = transformers.LlamaConfig(vocab_size=len(WORDS), hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=64, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(llama)
    transformers.AutoTokenizer.from_pretrained(bert_dir).save_pretrained(llama)
    out = tmp_path / "lp.jsonl"
    assert run("--model", llama, "--input", texts, "--output", out, "--output-kind", "token_logprobs") == 0
    got = [json.loads(line)["token_logprobs"] for line in out.read_text().splitlines()]
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama)
    docs = tokenizer([json.loads(line) if line.startswith('"') else json.loads(line)["text"]
                      for line in texts.read_text().splitlines() if line])["input_ids"]  # fmt: skip
    model = autoragged.wrap(transformers.AutoModelForCausalLM.from_pretrained(llama).eval(), db=False)
    want = list(_job.run_job(model, docs, output="token_logprobs", progress=False))
    assert [len(g) for g in got] == [len(d) - 1 for d in docs]
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g), w, rtol=1e-5, atol=1e-6)
