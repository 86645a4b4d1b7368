"""`python -m autoragged.job`: a tiny BERT and its tokenizer saved to a directory, a JSONL file of texts; the
command under `torchrun --nproc-per-node 2` (gloo) writes what one process writes, in input order; the input in
chunks (tokenized on a thread, one run_job call each) writes what one chunk writes; a rerun over kept shards
computes nothing, and one after a crash only the chunks it lacks; a tokenizer's error on the thread is the
command's; bad input gets one clear line and exit status 2; `--help` says what it does."""

from __future__ import annotations

import json
import logging
import re
import threading

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


@pytest.fixture(scope="module")
def llama_dir(bert_dir, tmp_path_factory):
    """A tiny Llama saved beside the same tokenizer."""
    path = tmp_path_factory.mktemp("tiny_llama")
    config = transformers.LlamaConfig(vocab_size=len(WORDS), hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=64, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(bert_dir).save_pretrained(path)
    return path


def run(*args) -> int:
    return cli.main([*map(str, args), "--no-progress"])


def tokenizing_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("autoragged-tokenize")]


def test_torchrun_two_ranks_write_what_one_process_writes(bert_dir, texts, tmp_path):
    out2 = tmp_path / "two.jsonl"
    torchrun("-m", "autoragged.job", "--model", str(bert_dir), "--input", str(texts), "--output", str(out2),
             "--output-kind", "mean", "--max-tokens", "48", "--align", "4", "--chunk-texts", "4", "--no-progress",
             db=tmp_path / "torchrun.sqlite")  # fmt: skip  # 3 chunks (4, 4, 3 texts), each split over 2 ranks
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
    assert len(two) == 11 and two == one  # every value equal, in input order (one chunk against three)
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
    assert len(first.splitlines()) == 11 and list((tmp_path / "cls.jsonl.shards").glob("chunk-00000/*.pt"))
    out.unlink()
    monkeypatch.setattr(_job, "_run_bin", lambda job, staged: pytest.fail("a held document ran again"))
    assert run(*args) == 0
    assert out.read_text() == first and not (tmp_path / "cls.jsonl.shards").exists()


def test_bad_input_gets_one_clear_line(bert_dir, texts, tmp_path, caplog, capsys):
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
    for size in ("0", "many"):
        with pytest.raises(SystemExit) as e:
            run("--model", bert_dir, "--input", texts, "--output", tmp_path / "o.jsonl", "--output-kind", "mean",
                "--chunk-texts", size)  # fmt: skip
        message = f"--chunk-texts: a positive number of texts, got '{size}'"
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_help_says_what_the_command_does(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    words = ["python -m autoragged.job", "torchrun --nproc-per-node", "one result per text", "--output-kind", "mean",
             "token_logprobs", ".parquet", "pip install 'autoragged[parquet]'", "--shards", "resum", "--chunk-texts", "16384", "chunk-00000"]  # fmt: skip
    assert [w for w in words if w not in text] == []


def test_a_decoder_directory_gives_each_texts_token_logprobs(llama_dir, texts, tmp_path):
    """The command's JSONL holds run_job's log-probabilities."""
    llama = llama_dir
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


@pytest.mark.parametrize(
    "model, kind, suffix",
    [("bert_dir", "mean", ".npy"), ("bert_dir", "hidden", ".jsonl"), ("bert_dir", "cls", ".parquet"),
     ("bert_dir", "pooler", ".npy"), ("llama_dir", "token_logprobs", ".jsonl"), ("llama_dir", "last_hidden", ".npy"),
     ("llama_dir", "last_logits", ".npy")],
)  # fmt: skip
def test_chunks_write_what_one_chunk_writes(model, kind, suffix, texts, tmp_path, request):
    """11 texts in chunks of 3 (3, 3, 3, 2: four run_job calls, each binned on its own) against one chunk of 11:
    the same file, byte for byte (parquet: the same table). But pooler and last_logits: their head is a Linear
    over the bin's B picked rows, and the CPU GEMM's sum order depends on B, so a document in another bin can
    differ in the last bits (1.2e-7 seen), as on a resumed run: a few float32 roundings apart, at most."""
    if suffix == ".parquet":
        pq = pytest.importorskip("pyarrow.parquet")
    model = request.getfixturevalue(model)
    files = [tmp_path / f"one{suffix}", tmp_path / f"four{suffix}"]
    for out, size in zip(files, (16384, 3)):
        assert run("--model", model, "--input", texts, "--output", out, "--output-kind", kind, "--max-tokens", 48,
                   "--align", 4, "--chunk-texts", size) == 0  # fmt: skip
    if suffix == ".parquet":
        one, four = (pq.read_table(f) for f in files)
        assert one.num_rows == 11 and one.equals(four)
    elif kind in ("pooler", "last_logits"):
        one, four = (torch.from_numpy(np.load(f)) for f in files)
        assert one.shape[0] == 11
        ulp = torch.finfo(torch.float32).eps * float(one.abs().max())  # the GEMM's rounding at its output's scale
        torch.testing.assert_close(four, one, rtol=0, atol=4 * ulp)
    else:
        assert files[0].read_bytes() == files[1].read_bytes()
    assert not list(tmp_path.glob("*.shards"))
    assert tokenizing_threads() == []


def test_a_rerun_after_a_crash_computes_only_the_missing_chunks(bert_dir, texts, tmp_path, monkeypatch, caplog):
    """A crash in chunk 2 of 4 (chunks of 3 texts) keeps chunks 0 and 1; the rerun reads them (their files
    untouched), runs the 5 texts of chunks 2 and 3, and writes what an uninterrupted run writes. A rerun with
    another --chunk-texts, or over a changed text, is a clear error, never mixed results."""
    base = ("--model", bert_dir, "--input", texts, "--output-kind", "mean", "--max-tokens", 48, "--chunk-texts", 3)
    assert run(*base, "--output", tmp_path / "want.jsonl") == 0
    out, shards = tmp_path / "out.jsonl", tmp_path / "out.jsonl.shards"
    ran: list[tuple[str, int]] = []  # (chunk directory, texts) per bin run
    chunk = [None]
    run_job, run_bin = _job.run_job, _job._run_bin

    def counting_run_job(model, documents, **kw):
        chunk[0] = kw["shards"].name
        return run_job(model, documents, **kw)

    def crashing_run_bin(job, staged):
        if chunk[0] == "chunk-00002":
            raise RuntimeError("simulated crash")
        ran.append((chunk[0], len(staged.members)))
        return run_bin(job, staged)

    monkeypatch.setattr(_job, "run_job", counting_run_job)
    monkeypatch.setattr(_job, "_run_bin", crashing_run_bin)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(*base, "--output", out)
    assert not out.exists() and tokenizing_threads() == []
    kept = {f: f.stat().st_mtime_ns for f in shards.glob("chunk-*/*.pt")}
    assert {f.parent.name for f in kept} == {"chunk-00000", "chunk-00001"}

    changed = tmp_path / "changed.jsonl"  # text 4 (in chunk 1) is another: chunk 1's shards are another job's
    lines = texts.read_text().splitlines()
    changed.write_text("\n".join(lines[:5] + [json.dumps("w9 w9")] + lines[6:]) + "\n")
    for args, message in [(("--chunk-texts", 4), "rerun with --chunk-texts 3 to resume"),
                          (("--input", changed), "chunk-00001 holds shards of another job")]:  # fmt: skip
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="autoragged"):
            assert run(*base, "--output", out, *args) == 2
        assert message in caplog.records[-1].getMessage()
        assert not out.exists()

    ran.clear()
    monkeypatch.setattr(_job, "_run_bin", lambda job, staged: ran.append((chunk[0], len(staged.members))) or
                        run_bin(job, staged))  # fmt: skip
    assert run(*base, "--output", out, "--keep-shards") == 0
    done = {}
    for name, count in ran:
        done[name] = done.get(name, 0) + count
    assert done == {"chunk-00002": 3, "chunk-00003": 2}  # only the chunks the crash lost
    assert {f: f.stat().st_mtime_ns for f in kept} == kept  # chunks 0 and 1: read, not rewritten
    assert {f.parent.name for f in shards.glob("chunk-*/*.pt")} == {f"chunk-0000{k}" for k in range(4)}
    assert out.read_bytes() == (tmp_path / "want.jsonl").read_bytes()


def test_a_tokenizer_error_on_the_thread_is_the_commands(bert_dir, texts, tmp_path, monkeypatch, caplog):
    """The background thread's error comes out of the command with its message (a ValueError: exit status 2
    and one line; another: the exception itself), no thread left behind; an empty text names its index in the
    whole input, not in its chunk."""
    tokenizer_class = type(transformers.AutoTokenizer.from_pretrained(bert_dir))
    call = tokenizer_class.__call__
    threads: list[str] = []

    def failing(error):
        def tokenize(self, texts, **kw):
            threads.append(threading.current_thread().name)
            if len(threads) == 2:
                raise error
            return call(self, texts, **kw)

        return tokenize

    base = ("--model", bert_dir, "--input", texts, "--output", tmp_path / "o.jsonl", "--output-kind", "mean",
            "--chunk-texts", 3, "--max-tokens", 48)  # fmt: skip
    monkeypatch.setattr(tokenizer_class, "__call__", failing(ValueError("the tokenizer broke")))
    with caplog.at_level(logging.ERROR, logger="autoragged"):
        assert run(*base) == 2
    assert "autoragged.job: the tokenizer broke" in caplog.records[-1].getMessage()
    threads.clear()
    monkeypatch.setattr(tokenizer_class, "__call__", failing(RuntimeError("the tokenizer broke again")))
    with pytest.raises(RuntimeError, match="the tokenizer broke again"):
        run(*base)
    assert threads and all(name.startswith("autoragged-tokenize") for name in threads)  # not the main thread
    assert tokenizing_threads() == [] and not (tmp_path / "o.jsonl").exists()
    assert list(tmp_path.glob("o.jsonl.shards/chunk-00000/*.pt"))  # chunk 0 ran before chunk 1 failed: kept

    bare = tmp_path / "bare.jsonl"  # no special tokens added: the empty text 4 has no tokens
    bare.write_text("\n".join(json.dumps(t) for t in ["w1", "w2 w3", "w4", "w5", "", "w6"]) + "\n")
    bare_call = lambda self, texts, **kw: call(self, texts, add_special_tokens=False, **kw)
    monkeypatch.setattr(tokenizer_class, "__call__", bare_call)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="autoragged"):
        assert run("--model", bert_dir, "--input", bare, "--output", tmp_path / "bare.npy", "--output-kind", "mean",
                   "--chunk-texts", 3, "--max-tokens", 48) == 2  # fmt: skip
    assert f"text 4 of {bare} has no tokens" in caplog.records[-1].getMessage()
    assert tokenizing_threads() == [] and not (tmp_path / "bare.npy").exists()


def test_the_next_chunk_tokenizes_while_one_runs(bert_dir, texts, tmp_path, monkeypatch):
    """Chunk 0's first bin waits (10 s at most) for the tokenizer to start on chunk 1: it does, on its thread, so
    chunk k + 1 is tokenized while chunk k runs, not after it."""
    tokenizer_class = type(transformers.AutoTokenizer.from_pretrained(bert_dir))
    call, run_bin = tokenizer_class.__call__, _job._run_bin
    started: list[threading.Event] = [threading.Event() for _ in range(4)]
    overlapped: list[bool] = []

    def tokenize(self, batch, **kw):
        started[sum(e.is_set() for e in started)].set()
        return call(self, batch, **kw)

    def waiting_run_bin(job, staged):
        if not overlapped:
            overlapped.append(started[1].wait(timeout=10))
        return run_bin(job, staged)

    monkeypatch.setattr(tokenizer_class, "__call__", tokenize)
    monkeypatch.setattr(_job, "_run_bin", waiting_run_bin)
    assert run("--model", bert_dir, "--input", texts, "--output", tmp_path / "o.npy", "--output-kind", "mean",
               "--max-tokens", 48, "--chunk-texts", 3) == 0  # fmt: skip
    assert overlapped == [True] and all(e.is_set() for e in started)  # 4 chunks, each tokenized once
