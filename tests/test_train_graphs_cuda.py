"""Training graphs on the GPU (graphs/train.py): a Qwen2.5-0.5B-shaped causal LM (random weights, 4 of its 24
layers) in bf16 trains on packed rows and on padded batches with the fused stack's forward and backward replayed,
and every loss and gradient is the eager ragged arm's to the bit: the same kernels on the same rows. Also: several
backwards accumulated before a step, a backward whose forward a later replay of its own key or another overwrote
(recomputed), keys refused for memory (eager), and the keys' graphs sharing one pool and one gradient buffer."""

import copy

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
transformers = pytest.importorskip("transformers")

import autoragged  # noqa: E402
from autoragged.graphs import train as train_graphs  # noqa: E402
from autoragged.models import hf_decoder  # noqa: E402
from autoragged.workloads import llm_config  # noqa: E402

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


def _train(model, batches, graphs: bool, accumulate: int = 1):
    """Losses and the gradients after each optimizer-free step (grads zeroed between steps)."""
    before = hf_decoder.TRAIN_GRAPHS
    hf_decoder.TRAIN_GRAPHS = graphs
    try:
        out = []
        for i in range(0, len(batches), accumulate):
            losses = []
            for kwargs in batches[i : i + accumulate]:
                loss = model(**kwargs).loss
                loss.backward()
                losses.append(loss.detach())
            out.append((losses, {n: p.grad.clone() for n, p in model.named_parameters()}))
            model.zero_grad(set_to_none=True)
        return out
    finally:
        hf_decoder.TRAIN_GRAPHS = before


def _body(model):
    return model.model._autoragged.body


def _assert_equal(eager, graphed):
    assert len(eager) == len(graphed)
    for (losses_e, grads_e), (losses_g, grads_g) in zip(eager, graphed):
        assert all(torch.equal(a, b) for a, b in zip(losses_e, losses_g)), (losses_e, losses_g)
        for name, g in grads_e.items():
            assert torch.equal(g, grads_g[name]), name


def _trained_alike(make, accumulate: int = 1):
    """(eager, graphed): two wrapped copies of one model trained on DOCS with the graphs off and on, which gave the
    same losses and gradients at every step."""
    plain = _plain()
    batches = [make(lengths, seed) for seed, lengths in enumerate(DOCS)]
    eager = autoragged.wrap(copy.deepcopy(plain), db=False, policy="ragged")
    graphed = autoragged.wrap(copy.deepcopy(plain), db=False, policy="ragged")
    _assert_equal(_train(eager, batches, False, accumulate), _train(graphed, batches, True, accumulate))
    return eager, graphed


@pytest.mark.parametrize("make", [_packed, _padded], ids=["packed", "padded"])
def test_replayed_steps_are_the_eager_steps(make):
    eager, graphed = _trained_alike(make)
    graphs = _body(graphed).train_graphs
    keys = {train_graphs.graph_key(sum(d), len(d)) for d in DOCS if DOCS.count(d) > 1}
    assert set(graphs.graphs) == keys and len(keys) == 2, "the recurring keys were captured"
    assert graphs.generation == 3, "and replayed (the third 300-row batch and the second of the other two)"
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
    hf_decoder.TRAIN_GRAPHS = False
    try:
        first, second = (eager(**_packed(d, seed)).loss for d, seed in zip(docs, (10, 11)))
        (first + second).backward()
    finally:
        hf_decoder.TRAIN_GRAPHS = True
    stack = {n for n, _ in graphed.model.layers.named_parameters(prefix="model.layers")} | {"model.norm.weight"}
    for name, p in eager.named_parameters():
        if name in stack:  # the replayed and the recomputed backward: each the eager one's, their sum commutes
            assert torch.equal(got[name], p.grad), name
        else:  # (the tied embedding sums four terms in the engine's order: not to the bit)
            torch.testing.assert_close(got[name], p.grad, rtol=0, atol=1e-2 * p.grad.abs().max().item(), msg=name)
