"""Training graphs on the GPU (graphs/train.py): a Qwen2.5-0.5B-shaped causal LM (random weights, 4 of its 24
layers) in bf16 trains on packed rows and on padded batches with the fused stack's forward and backward replayed,
and every loss and gradient is the eager ragged arm's to the bit: the same kernels on the same rows. Also: several
backwards accumulated before a step, a backward whose forward a later replay of its own key or another overwrote
(its forward replayed again), two backwards of one forward, keys refused for memory (eager), and the keys' graphs
sharing one pool and one gradient buffer. A bert-base-shaped classifier (fp32 weights, bf16 autocast) the same way,
and with hidden and attention dropout: a replay draws new masks, and a forward replayed again for its backward the
same ones."""

import copy

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
transformers = pytest.importorskip("transformers")

import autoragged  # noqa: E402
from autoragged.graphs import train as train_graphs  # noqa: E402
from autoragged.workloads import hf_config, llm_config  # noqa: E402

DOCS = [(300, 41, 7, 120), (17, 260, 90, 500), (300, 41, 7, 120), (5, 5, 300, 33, 60, 900), (17, 260, 90, 500),
        (300, 41, 7, 120)]  # fmt: skip


def _plain():
    torch.manual_seed(0)
    config = llm_config("qwen2.5-0.5b", layers=4)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16).train()


def _packed(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, 150000, (1, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    kwargs = {"input_ids": ids, "position_ids": positions, "labels": ids.masked_fill(positions == 0, -100)}
    return {k: v.cuda() for k, v in kwargs.items()} | {"use_cache": False}


def _padded(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    keep = torch.arange(L)[None] < torch.tensor(lengths)[:, None]
    ids = torch.randint(100, 150000, (len(lengths), L), generator=g).masked_fill(~keep, 151643)
    kwargs = {"input_ids": ids, "attention_mask": keep.long(), "labels": ids.masked_fill(~keep, -100)}
    return {k: v.cuda() for k, v in kwargs.items()} | {"use_cache": False}


def _train(model, batches, graphs: bool, accumulate: int = 1, amp: torch.dtype | None = None):
    """Losses and the gradients after each optimizer-free step (grads zeroed between steps); `amp`: the forwards
    under autocast to it."""
    before = train_graphs.ENABLED
    train_graphs.ENABLED = graphs
    try:
        out = []
        for i in range(0, len(batches), accumulate):
            losses = []
            for kwargs in batches[i : i + accumulate]:
                with torch.autocast("cuda", amp or torch.float16, enabled=amp is not None):
                    loss = model(**kwargs).loss
                loss.backward()
                losses.append(loss.detach())
            out.append((losses, {n: p.grad.clone() for n, p in model.named_parameters()}))
            model.zero_grad(set_to_none=True)
        return out
    finally:
        train_graphs.ENABLED = before


def _body(model):
    base = model.base_model
    return base._autoragged.body


def _assert_equal(eager, graphed):
    assert len(eager) == len(graphed)
    for (losses_e, grads_e), (losses_g, grads_g) in zip(eager, graphed):
        assert all(torch.equal(a, b) for a, b in zip(losses_e, losses_g)), (losses_e, losses_g)
        for name, g in grads_e.items():
            assert torch.equal(g, grads_g[name]), name


def _trained_alike(make, accumulate: int = 1, plain=None, amp=None, docs=DOCS):
    """(eager, graphed): two wrapped copies of one model trained on `docs` with the graphs off and on, which gave
    the same losses and gradients at every step."""
    plain = _plain() if plain is None else plain
    batches = [make(lengths, seed) for seed, lengths in enumerate(docs)]
    eager = autoragged.wrap(copy.deepcopy(plain), db=False, policy="ragged")
    graphed = autoragged.wrap(copy.deepcopy(plain), db=False, policy="ragged")
    _assert_equal(_train(eager, batches, False, accumulate, amp), _train(graphed, batches, True, accumulate, amp))
    return eager, graphed


@pytest.mark.parametrize("make", [_packed, _padded], ids=["packed", "padded"])
def test_replayed_steps_are_the_eager_steps(make):
    eager, graphed = _trained_alike(make)
    graphs = _body(graphed).train_graphs
    keys = {train_graphs.graph_key(sum(d), len(d)) for d in DOCS if DOCS.count(d) > 1}
    assert set(graphs.graphs) == keys and len(keys) == 2, "the recurring keys were captured"
    # and replayed: the third 300-row batch and the second of the other two, a forward and a backward each
    assert graphs.generation == 6
    assert graphs.pool is not None and graphs.flat.numel() == sum(p.numel() for p in graphs.params)
    assert _body(eager).train_graphs is None


def test_keys_refused_for_memory_run_eagerly(monkeypatch):
    monkeypatch.setattr(train_graphs, "obtainable_bytes", lambda device: 0)  # a full device
    _, graphed = _trained_alike(_packed)
    graphs = _body(graphed).train_graphs
    assert not graphs.graphs and len(graphs.refused) == 2 and graphs.pool is None


@pytest.mark.parametrize("other", [0, 1], ids=["same key", "another key"])
def test_accumulated_backwards_and_a_replaced_forward_are_right(other):
    eager, graphed = _trained_alike(_packed, accumulate=2)
    # two forwards (of one key, or of two), then their backwards: the first's activations were replaced by the
    # second replay (the keys' graphs share one pool)
    graphs = _body(graphed).train_graphs
    docs = (DOCS[0], DOCS[1 if other else 0])
    assert all(train_graphs.graph_key(sum(d), len(d)) in graphs.graphs for d in docs)
    replays = graphs.generation
    first, second = (graphed(**_packed(d, seed)).loss for d, seed in zip(docs, (10, 11)))
    assert graphs.generation == replays + 2
    (first + second).backward()  # one of the two backwards finds its activations replaced: recomputed
    got = {n: p.grad.clone() for n, p in graphed.named_parameters()}
    train_graphs.ENABLED = False
    try:
        first, second = (eager(**_packed(d, seed)).loss for d, seed in zip(docs, (10, 11)))
        (first + second).backward()
    finally:
        train_graphs.ENABLED = True
    stack = {n for n, _ in graphed.model.layers.named_parameters(prefix="model.layers")} | {"model.norm.weight"}
    for name, p in eager.named_parameters():
        if name in stack:  # the replayed and the recomputed backward: each the eager one's, their sum commutes
            assert torch.equal(got[name], p.grad), name
        else:  # (the tied embedding sums four terms in the engine's order: not to the bit)
            torch.testing.assert_close(got[name], p.grad, rtol=0, atol=1e-2 * p.grad.abs().max().item(), msg=name)


def test_two_backwards_of_one_forward_are_right():
    eager, graphed = _trained_alike(_packed)
    grads = []
    for model, on in ((eager, False), (graphed, True)):
        train_graphs.ENABLED = on
        try:
            loss = model(**_packed(DOCS[0], 12)).loss
            loss.backward(retain_graph=True)  # the backward's replay reuses the forward's activations
            loss.backward()  # so the second replays the forward again
        finally:
            train_graphs.ENABLED = True
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    stack = {n for n, _ in graphed.model.layers.named_parameters(prefix="model.layers")}
    for name in stack:
        assert torch.equal(grads[0][name], grads[1][name]), name


# -- the BERT family's encoder stack ---------------------------------------------------------------------
BERT_DOCS = [tuple(min(n, 400) for n in d) for d in DOCS]  # (512 positions)


def _bert(dropout: float, attention: float = 0.0):
    torch.manual_seed(0)
    config = hf_config("bert-base")
    config.num_hidden_layers, config.num_labels = 4, 3
    config.hidden_dropout_prob, config.attention_probs_dropout_prob = dropout, attention
    config._attn_implementation = "sdpa"
    return transformers.BertForSequenceClassification(config).cuda().train()


def _classified(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    keep = torch.arange(L)[None] < torch.tensor(lengths)[:, None]
    ids = torch.randint(1000, 30000, (len(lengths), L), generator=g).masked_fill(~keep, 0)
    labels = torch.randint(0, 3, (len(lengths),), generator=g)
    return {k: v.cuda() for k, v in {"input_ids": ids, "attention_mask": keep.long(), "labels": labels}.items()}


def test_bert_replayed_steps_under_autocast_are_the_eager_steps():
    _, graphed = _trained_alike(_classified, plain=_bert(0.0), amp=torch.bfloat16, docs=BERT_DOCS)
    graphs = _body(graphed).train_graphs
    keys = {train_graphs.graph_key(sum(d), len(d)) for d in BERT_DOCS if BERT_DOCS.count(d) > 1}
    assert set(graphs.graphs) == keys and graphs.generation > 0, "the recurring keys were captured and replayed"
    assert graphs.mode[0] == torch.bfloat16 and graphs.flat.dtype == torch.float32  # autocast over fp32 weights


@pytest.mark.parametrize("attention", [0.0, 0.1], ids=["hidden", "hidden and attention"])
def test_bert_dropout_draws_new_masks_and_a_forward_replayed_again_the_same(attention):
    model = autoragged.wrap(_bert(0.1, attention), db=False, policy="ragged")
    batch, other = _classified(BERT_DOCS[0], 0), _classified(BERT_DOCS[0], 1)  # one key
    for _ in range(2):  # seen, then captured
        model(**batch).loss.backward()
    graphs = _body(model).train_graphs
    assert len(graphs.graphs) == 1
    model.zero_grad(set_to_none=True)

    def step(seed, interleave: bool):
        torch.cuda.manual_seed(seed)
        loss = model(**batch).loss
        if interleave:  # another replay takes the pool: this backward replays its forward again
            model(**other).loss.detach()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    replays = graphs.generation
    loss, grads = step(7, False)
    again, grads_again = step(7, True)
    assert graphs.generation == replays + 2 + 3, "every forward and backward replayed (the backward's forward too)"
    assert torch.equal(loss, again)
    for name, g in grads.items():
        assert torch.equal(g, grads_again[name]), name
    assert not torch.equal(step(8, False)[0], loss), "another seed, other masks"
