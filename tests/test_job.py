"""`run_job` on wrapped HF encoders, its split over ranks, and its shards: each document's pooled output equals the
padded original's ("cls", "mean", the model's own pooler), in input order, for every encoder family and through a
SentenceTransformer; a forward hook sends bins to the padded arm with the same results; ranks take bins from a
shared counter, each once (or, without a store, a deterministic, token-balanced partition); shards resume after a
crash and refuse another job's directory.

Tiny random models from config objects (no hub); the ragged arm runs the PyTorch references."""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from _tolerance import assert_within_torch_error  # noqa: E402
from test_hf import COMMON  # noqa: E402
from test_hf import CONFIGS as HF_CONFIGS  # noqa: E402

import autoragged  # noqa: E402
from autoragged import job as _job  # noqa: E402
from autoragged import ops  # noqa: E402
from autoragged.jobs import ranks as ranks_module  # noqa: E402
from autoragged.jobs import shards as shards_module  # noqa: E402
from autoragged.jobs.ranks import Ranks  # noqa: E402
from autoragged.packing import ffd_pack, read_shards, run_job  # noqa: E402
from autoragged.ragged import tensor as _ragged  # noqa: E402

# test_hf's encoders; ModernBERT's layer 1 attends within +-2 tokens: the window bites on these lengths
CONFIGS = {name: HF_CONFIGS[name] for name in ("bert", "roberta", "xlm-roberta", "electra", "albert", "distilbert")}
CONFIGS["modernbert"] = HF_CONFIGS["modernbert-local"]


@pytest.fixture(autouse=True)
def _reference(monkeypatch):
    monkeypatch.setattr(ops, "use_triton", lambda t: False)
    monkeypatch.setattr(_ragged, "use_triton", lambda t: False)


def model_of(family: str, cls=None):
    torch.manual_seed(0)
    config = CONFIGS[family]()
    return (cls(config) if cls is not None else transformers.AutoModel.from_config(config)).eval()


def documents(n=9, seed=3, longest=30, pad_inside=True):
    """Token id lists of lengths 1, `longest` and random ones between; one holds the pad id (1) inside its text
    (RoBERTa's positions skip it)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1, longest, *torch.randint(2, longest, (n - 2,), generator=g).tolist()]
    docs = [torch.randint(2, 100, (k,), generator=g).tolist() for k in lengths]
    if pad_inside:
        docs[1][5] = 1
    return docs


def padded_outputs(plain, docs, output, types=None):
    """The original's `output` per document on one right-padded batch: (float32 (n, D), float64 (n, D))."""
    L = max(map(len, docs))
    ids = torch.ones(len(docs), L, dtype=torch.long)
    mask = torch.zeros(len(docs), L, dtype=torch.long)
    for i, d in enumerate(docs):
        ids[i, : len(d)], mask[i, : len(d)] = torch.tensor(d), 1
    kwargs = {"input_ids": ids, "attention_mask": mask}
    if types is not None:
        kwargs["token_type_ids"] = torch.zeros_like(ids)
        for i, t in enumerate(types):
            kwargs["token_type_ids"][i, : len(t)] = torch.tensor(t)
    wants = []
    for model in (plain, copy.deepcopy(plain).double()):
        with torch.no_grad():
            out = model(**kwargs)
        h = out.last_hidden_state
        if output == "cls":
            wants.append(h[:, 0])
        elif output == "pooler":
            wants.append(out.pooler_output)
        else:
            wants.append((h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True))
    return wants


def check_documents(what, got, want, want64):
    assert len(got) == len(want)
    for i, g in enumerate(got):
        assert g.shape == want[i].shape and g.dtype == want[i].dtype, f"{what} document {i}"
        assert_within_torch_error(g, want[i], want64[i], f"{what} document {i}")


def unwrapped(model):
    twin = copy.deepcopy(model)
    autoragged.unwrap(twin)
    return twin


# -- encoders ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("family", "output"),
    [("bert", "cls"), ("bert", "pooler"), ("roberta", "mean"), ("xlm-roberta", "pooler"), ("electra", "mean"),
     ("albert", "pooler"), ("distilbert", "cls"), ("modernbert", "mean"), ("modernbert", "cls")],
)  # fmt: skip
def test_encoder_job_gives_each_documents_pooled_output_in_input_order(family, output):
    model = autoragged.wrap(model_of(family), db=False)
    plain = unwrapped(model)
    docs = documents()
    got = list(run_job(model, docs, output=output, max_tokens=40, align=4, progress=False))
    assert {d.arm for d in autoragged.recent_decisions(model)} == {"ragged"}  # several bins, every one packed
    assert len(autoragged.recent_decisions(model)) > 1
    assert model._autoragged.policy == "auto"  # forced to ragged only while a bin runs
    check_documents(f"{family} {output}", got, *padded_outputs(plain, docs, output))


def test_encoder_job_takes_a_task_model_a_tokenizers_mapping_with_token_types_and_a_function():
    model = autoragged.wrap(model_of("bert", transformers.BertForSequenceClassification), db=False)
    plain = unwrapped(model).bert
    docs = documents(n=6, pad_inside=False)
    types = [[0] * (len(d) // 2) + [1] * (len(d) - len(d) // 2) for d in docs]
    got = list(run_job(model, {"input_ids": docs, "token_type_ids": types}, output="mean", max_tokens=32,
                       align=1, progress=False))  # fmt: skip
    check_documents("mean with token types", got, *padded_outputs(plain, docs, "mean", types))
    lengths = list(run_job(model, docs, output=lambda hidden, ids: torch.tensor(hidden.lengths), max_tokens=32,
                           progress=False))  # fmt: skip
    assert lengths == [torch.tensor(len(d)) for d in docs]
    means = list(run_job(model, docs, max_tokens=32, progress=False))  # an encoder's default output: "mean"
    check_documents("default output", means, *padded_outputs(plain, docs, "mean"))
    with pytest.raises(ValueError, match="do not match input_ids: document 0 has 1 ids but 2 token types"):
        list(run_job(model, {"input_ids": docs, "token_type_ids": [[0, 0]] + types[1:]}, progress=False))


def test_a_hooked_encoder_runs_its_bins_padded_with_the_same_results():
    model = autoragged.wrap(model_of("roberta"), db=False)
    plain = unwrapped(model)
    seen = []
    model.encoder.layer[0].register_forward_hook(lambda m, i, o: seen.append(o[0].shape))
    docs = documents(n=5)
    got = list(run_job(model, docs, output="pooler", max_tokens=40, align=4, progress=False))
    decisions = autoragged.recent_decisions(model)
    assert {d.arm for d in decisions} == {"padded"} and "hook" in decisions[0].reason
    assert len(seen) == len(decisions)  # the hook saw each bin, padded
    check_documents("hooked pooler", got, *padded_outputs(plain, docs, "pooler"))


def test_a_sentence_transformers_job_equals_its_encode(tmp_path):
    pytest.importorskip("sentence_transformers")
    from sentence_transformers import SentenceTransformer

    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] +
                                                  [f"w{i}" for i in range(95)]))  # fmt: skip
    tokenizer = transformers.BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt"))
    config = transformers.BertConfig(**{**COMMON, "pad_token_id": 0})
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    st = SentenceTransformer(str(tmp_path), device="cpu")  # (mean pooling, no normalisation)
    texts = [" ".join(f"w{(i * 7 + j) % 95}" for j in range(n)) for i, n in enumerate([3, 17, 8, 30, 1, 12])]
    want = st.encode(texts, convert_to_tensor=True, batch_size=4)
    autoragged.wrap(st, db=False)
    got = list(run_job(st, st.tokenizer(texts)["input_ids"], output="mean", max_tokens=48, progress=False))
    torch.testing.assert_close(torch.stack(got), want, rtol=1e-5, atol=1e-5)


def test_encoder_job_errors_say_what_is_wrong():
    distil = autoragged.wrap(model_of("distilbert"), db=False)
    with pytest.raises(ValueError, match="needs the model's own pooler; DistilBertModel has none"):
        list(run_job(distil, [[5, 6]], output="pooler", progress=False))
    with pytest.raises(ValueError, match="'token_logprobs' is not one that an HF encoder"):
        list(run_job(distil, [[5, 6]], output="token_logprobs", progress=False))
    roberta = autoragged.wrap(model_of("roberta"), db=False)  # 40 positions from padding_idx + 1: 38 tokens
    with pytest.raises(ValueError, match="document 1 has 39 tokens but RobertaModel takes at most 38"):
        list(run_job(roberta, [[5] * 38, [5] * 39], output="cls", progress=False))
    llama = transformers.LlamaConfig(vocab_size=100, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=128)  # fmt: skip
    decoder = autoragged.wrap(transformers.LlamaModel(llama).eval(), db=False)
    with pytest.raises(ValueError, match="'pooler' is not one that an HF decoder"):
        list(run_job(decoder, [[5, 6]], output="pooler", progress=False))
    with pytest.raises(ValueError, match="wrap"):
        list(run_job(model_of("bert"), [[5, 6]], output="cls", progress=False))
    with pytest.raises(ValueError, match="gather must be 'rank0' or None"):
        list(run_job(distil, [[5, 6]], output="cls", gather="all", progress=False))
    with pytest.raises(ValueError, match="gather=None keeps no result: pass shards"):
        list(run_job(distil, [[5, 6]], output="cls", gather=None, progress=False))


# -- ranks ---------------------------------------------------------------------------------------------------
class _Store:
    """A process group's store as BinClaims uses it: an atomic add on a key."""

    def __init__(self):
        self.values = {}

    def add(self, key, n):
        self.values[key] = self.values.get(key, 0) + n
        return self.values[key]


def test_bin_claims_give_each_bin_to_one_rank_in_order_and_a_slow_rank_fewer():
    """Ranks take bins one at a time from a shared counter: every bin once, each rank's in order, and a rank that
    takes a bin for every three the other takes ends with about a quarter of them."""
    bins = [[i] for i in range(12)]
    store = _Store()
    fast, slow = iter(_job.BinClaims(bins, store, "k")), iter(_job.BinClaims(bins, store, "k"))
    got = {"fast": [], "slow": []}
    for step in range(20):
        rank, claims = ("slow", slow) if step % 4 == 3 else ("fast", fast)
        b = next(claims, None)
        if b is not None:
            got[rank].append(b[0])
    assert sorted(got["fast"] + got["slow"]) == list(range(12))
    assert got["fast"] == sorted(got["fast"]) and got["slow"] == sorted(got["slow"])
    assert len(got["slow"]) == 3
    assert list(_job.BinClaims(bins, store, "k")) == []  # every bin taken: a late rank gets none
    assert list(_job.BinClaims(bins, store, "other")) == bins  # another job's counter


def test_rank_shares_split_every_bin_once_deterministically_and_balanced_by_tokens():
    g = np.random.default_rng(0)
    lengths = g.integers(1, 300, 400)
    bins = ffd_pack(lengths, 1024, 16)
    aligned = (lengths + 15) // 16 * 16
    costs = [int(aligned[b].sum()) for b in bins]
    for world in (1, 2, 3, 4, 7):
        shares = _job.rank_shares(bins, lengths, world, 16)
        assert shares == _job.rank_shares(bins, lengths, world, 16)
        assert len(shares) == world and sorted(i for s in shares for i in s) == list(range(len(bins)))
        assert all(s == sorted(s) for s in shares)  # each rank runs its bins in FFD order: longest first
        loads = [sum(costs[i] for i in s) for s in shares]
        assert max(loads) - min(loads) <= max(costs)
    assert _job.rank_shares([[0]], [5], 3) == [[0], [], []]  # fewer bins than ranks: the others idle
    with pytest.raises(ValueError, match="world must be a positive int"):
        _job.rank_shares(bins, lengths, 0)


def test_a_process_with_torchruns_environment_but_no_group_runs_the_whole_job_and_says_so(monkeypatch, caplog):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(ranks_module, "_ENV_WARNED", False)
    model = autoragged.wrap(model_of("distilbert"), db=False)
    with caplog.at_level(logging.WARNING, logger="autoragged"):
        got = list(run_job(model, documents(n=4), output="cls", max_tokens=64, progress=False))
    assert len(got) == 4 and "init_distributed" in caplog.text


def test_ranks_with_other_documents_are_refused_on_every_rank(monkeypatch):
    ranks = Ranks(0, 2)
    docs = _job._documents(documents(n=4))
    key = (4, _job._fingerprint(docs, "mean"))
    assert key[1] == _job._fingerprint(_job._documents(documents(n=4)), "mean")
    assert key[1] != _job._fingerprint(docs, "cls") != _job._fingerprint(_job._documents(documents(n=4, seed=4)), "cls")
    monkeypatch.setattr(Ranks, "all", lambda self, obj: [obj, obj])
    ranks.check_same(key)
    monkeypatch.setattr(Ranks, "all", lambda self, obj: [obj, (4, "another digest")])
    with pytest.raises(ValueError, match="rank 1 has other documents than rank 0 .* the same documents"):
        ranks.check_same(key)


# -- shards ----------------------------------------------------------------------------------------------------
def test_shards_resume_after_a_crash_computing_only_what_they_lack(tmp_path, monkeypatch):
    model = autoragged.wrap(model_of("bert"), db=False)
    docs = documents(n=12)
    want = list(run_job(model, docs, output="mean", max_tokens=40, align=4, progress=False))
    monkeypatch.setattr(shards_module, "_SHARD_DOCS", 3)
    real, ran = _job._run_bin, []

    def crashing(job, staged):
        if len(ran) == 3:
            raise RuntimeError("the machine went away")
        ran.append(list(staged.members))
        return real(job, staged)

    monkeypatch.setattr(_job, "_run_bin", crashing)
    with pytest.raises(RuntimeError, match="went away"):
        list(run_job(model, docs, output="mean", max_tokens=40, align=4, shards=tmp_path, progress=False))
    written = sorted(p.name for p in tmp_path.glob("*.pt"))
    assert written and all(name.startswith("run001-rank000-chunk") for name in written)
    with pytest.raises(ValueError, match="missing: .*: rerun the job"):
        read_shards(tmp_path)
    held = {i for p in tmp_path.glob("*.pt") for i in torch.load(p, weights_only=True)["indices"].tolist()}
    assert len(held) >= 3  # at least one chunk of 3 documents was written before the crash
    monkeypatch.setattr(_job, "_run_bin", real)
    monkeypatch.setattr(_job, "_run_bin", lambda job, staged: (ran.append(list(staged.members)), real(job, staged))[1])
    ran.clear()
    got = list(run_job(model, docs, output="mean", max_tokens=40, align=4, shards=tmp_path, progress=False))
    assert sorted(i for b in ran for i in b) == sorted(set(range(12)) - held)  # nothing written is recomputed
    assert any(p.name.startswith("run002-") for p in tmp_path.glob("*.pt"))
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"document {i}")
    ran.clear()
    again = list(run_job(model, docs, output="mean", max_tokens=40, shards=tmp_path, gather="rank0", progress=False))
    assert ran == [] and all(torch.equal(a, b) for a, b in zip(again, got))  # all held: nothing runs
    assert [torch.equal(a, b) for a, b in zip(read_shards(tmp_path), got)] == [True] * 12


def test_shards_refuse_another_jobs_directory_and_hold_tensors_only(tmp_path):
    model = autoragged.wrap(model_of("distilbert"), db=False)
    docs = documents(n=4)
    list(run_job(model, docs, output="cls", max_tokens=64, shards=tmp_path, gather=None, progress=False))
    with pytest.raises(ValueError, match="holds shards of another job .* pass a new directory"):
        list(run_job(model, docs[:3], output="cls", max_tokens=64, shards=tmp_path, progress=False))
    with pytest.raises(ValueError, match="holds shards of another job"):
        list(run_job(model, docs, output="mean", max_tokens=64, shards=tmp_path, progress=False))
    with pytest.raises(TypeError, match="shards hold tensors; the output function gave a str for document"):
        list(run_job(model, docs, output=lambda h, ids: ["x"] * h.batch_size, shards=tmp_path / "f", progress=False))
    with pytest.raises(ValueError, match="not a shard directory"):
        read_shards(tmp_path / "nothing")
    (tmp_path / "run009-rank000-chunk00000.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="cannot be read .* delete it"):
        read_shards(tmp_path)


@pytest.mark.parametrize(
    "results",
    [
        [torch.randn(6) for _ in range(5)],  # one shape: means, cls, last_hidden
        [torch.randn(n) for n in (3, 0, 7, 1, 2)],  # token_logprobs (a one-token document has none)
        [torch.randn(n, 4) for n in (3, 1, 2, 5, 1)],  # hidden
        [torch.randn(3), torch.randn(3).half(), torch.randn(2, 2), torch.tensor(1.0), torch.randn(1)],  # mixed
    ],
)
def test_shards_read_back_every_result_as_written(results, tmp_path):
    """A chunk's results are saved as one flat tensor where they share a dtype and dims (read back as views), else
    as the list: either way each comes back with its shape, dtype and values, in input order."""
    n = len(results)
    store = shards_module.ShardStore.open(tmp_path, shards_module.JobIdentity(n, "f", "x"), Ranks(0, 1))
    store.write(iter([([4, 0], [results[4], results[0]]), ([2, 1, 3], [results[2], results[1], results[3]])]))
    back = list(read_shards(tmp_path))
    assert len(back) == n
    for want, got in zip(results, back):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
