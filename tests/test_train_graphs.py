"""Training graphs' host side (graphs/train.py), on the CPU: the keys, the static layout a replay fills, which calls
a graph may replay, when a key is captured, the pool's memory rule, what `graph_stats` counts. Their replays are
tested on the GPU (test_train_graphs_cuda.py)."""

import dataclasses

import numpy as np
import pytest
import torch
from autoragged.kernels import ragged_attention_backward as k_attn_bwd
from torch import nn

import autoragged
from autoragged.graphs import train as train_graphs
from autoragged.models import fused_decoder
from autoragged.planning.buckets import cublas_rows
from autoragged.ragged.layout import Layout

transformers = pytest.importorskip("transformers")


def test_keys_take_the_eager_arms_row_rungs_and_keep_a_component_for_the_spare_rows():
    for rows in (1, 300, 512, 513, 2433, 8192, 9000):
        assert train_graphs.graph_key(rows, 3).rows == cublas_rows(rows) >= rows
    floor = train_graphs.MIN_COMPONENTS
    assert train_graphs.graph_key(512, 3).components == floor
    assert train_graphs.graph_key(512, floor - 1).components == floor  # and the spare rows' component
    assert train_graphs.graph_key(8192, floor).components == 2 * floor
    assert train_graphs.graph_key(8192, 2 * floor + 5).components == 4 * floor


def test_the_static_layout_holds_the_batch_the_spare_rows_and_exiting_programs():
    key, blocks = train_graphs.TrainGraphKey(256, 16), (32, 64)  # (any rows: the layout takes the key as given)
    meta = train_graphs.static_meta((3, 70, 1), key, blocks)
    layout = train_graphs._StaticLayout(torch.from_numpy(meta), key, blocks)
    offsets, lengths = (t.numpy() for t in layout.device_meta("cpu"))
    want = np.array([3, 70, 1, 182] + [0] * 12)
    assert (lengths == want).all() and (offsets == np.concatenate([[0], np.cumsum(want)])).all()
    for bm in blocks:
        grid, block_offsets = (t.numpy() for t in layout.prelude(bm, "cpu"))
        counts = -(-want // bm)
        assert (block_offsets == np.concatenate([[0], np.cumsum(counts)])).all()
        real = int(counts.sum())
        assert (grid[:real] == np.repeat(np.arange(16), counts)).all() and (grid[real:] == -1).all()
        assert len(grid) == 256 // bm + 16  # room for any batch of the key
    with pytest.raises(ValueError, match="prelude"):
        layout.prelude(128, "cpu")
    with pytest.raises(ValueError, match="do not fit"):
        train_graphs.static_meta((200, 100), key, blocks)
    with pytest.raises(ValueError, match="do not fit"):
        train_graphs.static_meta((1,) * 16, key, blocks)
    assert k_attn_bwd.backward_config(64, key.rows).block_m in blocks


def _stack(**extra):
    config = transformers.Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, **extra)  # fmt: skip
    model = transformers.Qwen2Model(config).train()
    return fused_decoder.DecoderStack(list(model.layers), model.norm, lambda attn: None), model


def test_only_calls_a_replay_repeats_exactly_are_graphed():
    stack, model = _stack()
    x, layout = torch.zeros(4, 32), Layout.make((3, 1))
    assert fused_decoder.why_not_graphed(stack, x, layout) == "not a CUDA training call"
    fake_cuda = type("T", (), {"is_cuda": True, "device": torch.device("cpu")})()
    assert fused_decoder.why_not_graphed(stack, fake_cuda, layout) is None
    assert fused_decoder.why_not_graphed(stack, fake_cuda, Layout.make((3, 1), align=16)) == ("not a packed layout")
    with torch.no_grad():
        assert fused_decoder.why_not_graphed(stack, fake_cuda, layout) == "not a CUDA training call"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fused_decoder.why_not_graphed(stack, fake_cuda, layout) == "autocast"
    dropped, _ = _stack(attention_dropout=0.1)
    assert fused_decoder.why_not_graphed(dropped, fake_cuda, layout) is None  # (its seed is drawn on the device)
    model.gradient_checkpointing_enable()
    assert fused_decoder.why_not_graphed(stack, fake_cuda, layout) == "gradient checkpointing"


def test_only_encoder_calls_a_replay_repeats_exactly_are_graphed():
    from autoragged.models import encoder, hf_encoder

    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, attention_probs_dropout_prob=0.0)  # fmt: skip
    model = transformers.BertModel(config).train()
    specs = hf_encoder.FAMILIES["bert"].layers(model)
    fake_cuda = type("T", (), {"is_cuda": True, "device": torch.device("cpu")})()
    layout = Layout.make((3, 1))
    assert encoder.why_not_graphed(specs, torch.zeros(4, 32), layout) == "not a CUDA training call"
    assert encoder.why_not_graphed(specs, fake_cuda, layout) is None  # hidden dropout: drawn anew per replay
    spare = Layout((3, 1), 1, (0, 3, 4), 8, canonical=False)  # the eager arm's cuBLAS rung: 4 spare rows
    assert spare.packed and encoder.why_not_graphed(specs, fake_cuda, spare) is None
    gap = Layout.from_offsets((0, 4, 5), (3, 1), 5)  # a row between the components
    assert not gap.packed and encoder.why_not_graphed(specs, fake_cuda, gap) == "not a packed layout"
    assert encoder.why_not_graphed(specs, fake_cuda, Layout.make((3, 1), align=16)) == ("not a packed layout")
    assert encoder.why_not_graphed(specs, fake_cuda, Layout.with_query_rows((3, 1), torch.device("cpu"))) == (
        "not a packed layout"
    )
    with torch.no_grad():
        assert encoder.why_not_graphed(specs, fake_cuda, layout) == "not a CUDA training call"
    dropped = hf_encoder.FAMILIES["bert"].layers(transformers.BertModel(transformers.BertConfig(**{
        **config.to_dict(), "attention_probs_dropout_prob": 0.1})))  # fmt: skip
    assert encoder.why_not_graphed(dropped, fake_cuda, layout) is None  # (its seed is drawn on the device)
    adapted = [dataclasses.replace(specs[0], out=nn.Linear(32, 32))]  # (a peft linear: a module)
    assert encoder.why_not_graphed(adapted, fake_cuda, layout) == "an adapter layer"
    assert {id(t) for s in specs for t in encoder.spec_tensors(s)} <= {id(p) for p in model.encoder.parameters()}


class _FakeGraph:
    """Stands for a captured graph (the capture needs a GPU)."""

    def __init__(self, key):
        self.key = key


def test_a_key_is_captured_once_it_recurs_and_all_anew_when_the_trained_parameters_change(monkeypatch):
    stack, model = _stack()
    holder = train_graphs.StackModule(lambda *a: None, [*stack.layers, stack.final_norm])
    graphs = train_graphs.TrainGraphs(holder)
    captured = []

    def capture(key, config, head_dim, x, tables, amp):
        captured.append(key)
        graphs.graphs[key] = graph = _FakeGraph(key)
        return graph

    monkeypatch.setattr(graphs, "_capture", capture)
    monkeypatch.setattr(train_graphs._Replay, "apply", staticmethod(lambda graphs, graph, *rest: graph))

    def run(rows, mode=()):
        x, tables = torch.zeros(rows, 32), (torch.zeros(rows, 16), torch.zeros(rows, 16))
        return graphs.run(x, (rows,), None, 16, tables, mode)

    first_key = train_graphs.graph_key(300, 1)
    assert run(300) is None and not captured  # seen once: eager
    first = run(300)
    assert isinstance(first, _FakeGraph) and captured == [first_key]  # seen again: captured, replayed
    assert train_graphs.graph_key(350, 1) == first_key and run(350) is first and len(captured) == 1  # one key
    keys = [1000, 1600, 2100, 5000]  # four more keys, each twice: every recurring key is captured
    for rows in keys:
        assert run(rows) is None
        assert run(rows).key == train_graphs.graph_key(rows, 1)
    assert len(captured) == 1 + len(keys) and len(graphs.graphs) == 1 + len(keys)
    graphs.refused.add(train_graphs.graph_key(7000, 1))  # a key whose activations did not fit: never captured
    assert run(7000) is None and run(7000) is None and len(captured) == 1 + len(keys)
    model.layers[0].mlp.up_proj.weight.requires_grad_(False)  # other trained parameters: every graph goes
    assert run(300) is None and not graphs.graphs and not graphs.refused
    assert run(300) is not first and captured[-1] == first_key and list(graphs.graphs) == [first_key]
    assert len(graphs.params) == len(list(holder.parameters())) - 1
    assert run(300, mode=(0.1,)) is None and not graphs.graphs  # another mode (a dropout probability): anew
    assert run(300, mode=(0.1,)) is not None and run(300) is None and not graphs.graphs
    model.norm.weight.data = model.norm.weight.data.double()  # parameters of two dtypes share no gradient buffer
    n = len(captured)
    assert run(300) is None and run(300) is None and len(captured) == n and not graphs.graphs
    for p in model.parameters():
        p.requires_grad_(False)
    assert run(300) is None  # nothing to train: eager


def test_a_capture_on_the_callers_thread_makes_its_batch_no_timing():
    from autoragged.graphs.worker import worker
    from autoragged.runtime.records import quiet_mark

    before = quiet_mark()
    worker.note()
    assert quiet_mark() != before


def test_the_pool_leaves_room_for_an_eager_step_and_starts_over_for_a_larger_key():
    GB = 2**30
    fit = train_graphs.pool_fit
    assert fit(0, 4 * GB, True, 8 * GB) == "record"  # the key's activations, and an eager step's beside them
    assert fit(0, 4 * GB, True, 8 * GB - 1) == "refuse"  # no room for the eager step
    assert fit(6 * GB, 5 * GB, False, 0) == "record"  # a smaller key: the blocks larger ones freed
    assert fit(6 * GB, 7 * GB, True, 14 * GB) == "record"  # a larger key grows the pool
    # where the growth would leave no room, the graphs start over in a pool sized by the new key alone
    assert fit(6 * GB, 7 * GB, True, 8 * GB) == "start over"
    assert fit(6 * GB, 7 * GB, True, 8 * GB - 1) == "refuse"


def test_graph_stats_counts_a_models_training_graphs():
    config = transformers.Qwen2Config(vocab_size=100, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    model = autoragged.wrap(transformers.Qwen2ForCausalLM(config).train(), db=False)
    ((name, before),) = autoragged.graph_stats(model).items()
    assert (before.training, before.training_refused, before.training_bytes) == (0, 0, 0)
    body = model.model._autoragged.body
    stack, _ = _stack()
    body.train_graphs = graphs = train_graphs.TrainGraphs(train_graphs.StackModule(lambda *a: None, stack.layers))
    graphs.graphs = {train_graphs.graph_key(300, 1): _FakeGraph(None), train_graphs.graph_key(900, 1): _FakeGraph(None)}
    graphs.refused.add(train_graphs.graph_key(5000, 1))
    graphs.reserved_bytes = 3 << 30
    after = autoragged.graph_stats(model)[name]
    assert (after.training, after.training_refused, after.training_bytes) == (2, 1, 3 << 30)


def test_a_bert_body_graphs_its_layers_with_their_dropouts_as_the_mode(monkeypatch):
    from autoragged.models import hf_encoder

    config = transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, attention_probs_dropout_prob=0.0, num_labels=2)  # fmt: skip
    model = autoragged.wrap(transformers.BertForSequenceClassification(config).train(), db=False, policy="ragged")
    body = model.bert._autoragged.body
    calls = []
    monkeypatch.setattr(hf_encoder, "why_not_graphed", lambda *a: None)  # (as on a GPU)
    monkeypatch.setattr(train_graphs.TrainGraphs, "run", lambda self, *a, **kw: calls.append((self, kw)))
    batch = {"input_ids": torch.randint(1, 100, (2, 5)), "labels": torch.tensor([0, 1])}
    model(**batch).loss.backward()
    ((graphs, kw),) = calls
    assert graphs is body.train_graphs and graphs.failed is None
    assert kw["mode"] == (True, *(hf_encoder.Dropouts(attn_out=0.1, ff_out=0.1),) * 2)  # train mode, BERT's dropouts
    assert {id(p) for p in graphs.holder.parameters()} == {id(p) for p in model.bert.encoder.layer.parameters()}
    body.train_graphs = None
    body._list = body._list[:1]  # a layer outside the list the graphs swap parameters in: never captured
    model(**batch).loss.backward()
    assert body.train_graphs.failed is not None and len(calls) == 2
