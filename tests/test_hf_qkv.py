"""One q/k/v product per layer (autoragged/adapters/_qkv.py): `wrap` lays each BERT-family layer's q, k and v
parameters out in one buffer, as views; the parameters, their values and every route of updating them stay."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from test_hf import batch, check_close, last, model_of, use_reference  # noqa: E402

import autoragged  # noqa: E402
from autoragged.models.hf_encoder import FAMILIES  # noqa: E402


def triples(model):
    return FAMILIES[model.config.model_type].qkv(model)


def shares_one_storage(triple) -> bool:
    return all(
        len({getattr(lin, name).untyped_storage().data_ptr() for lin in triple}) == 1 for name in ("weight", "bias")
    )


def fused_layers(model) -> int:
    return len(model._autoragged.body._qkv.buffers)


@pytest.mark.parametrize("family", ["bert", "roberta", "electra", "albert", "distilbert"])
def test_wrap_lays_q_k_v_out_in_one_buffer_same_parameters_same_values(family, monkeypatch):
    use_reference(monkeypatch)
    model = model_of(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    assert not any(shares_one_storage(t) for t in triples(model))
    autoragged.wrap(model, db=False, policy="ragged")
    assert all(shares_one_storage(t) for t in triples(model))
    # ALBERT runs its one group's two inner layers for every layer: two buffers, not one per layer run
    assert fused_layers(model) == len({id(t[0]) for t in triples(model)}) == 2
    assert all(p is params[name] for name, p in model.named_parameters())
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    kwargs, keep = batch(token_types=family != "distilbert")
    with torch.no_grad():
        out = model(**kwargs)
    assert last(model).arm == "ragged"
    with torch.no_grad():  # (under autograd the three parameters run: the buffer is no parameter)
        specs = model._autoragged.body._layer_specs()
    assert all(len(s.qkv) == 1 and s.qkv[0][0].shape[0] == 3 * s.qkv[0][0].shape[1] for s in specs)
    check_close(family, out, model, kwargs, keep)


def test_in_place_updates_by_any_route_reach_the_one_product(monkeypatch):
    use_reference(monkeypatch)
    model = autoragged.wrap(model_of("bert"), db=False, policy="ragged")
    kwargs, keep = batch()
    attention = model.encoder.layer[1].attention.self
    with torch.no_grad():
        first = model(**kwargs).last_hidden_state
        attention.key.weight.data.copy_(torch.randn(64, 64) / 8)  # past autograd's version counter
        attention.value.bias.add_(torch.linspace(-1.0, 1.0, 64))
        model.encoder.layer[0].attention.self.query.load_state_dict(
            {"weight": torch.randn(64, 64) / 8, "bias": torch.zeros(64)}
        )
        out = model(**kwargs)
    assert last(model).arm == "ragged"
    assert (out.last_hidden_state[keep] - first[keep]).abs().max() > 1e-2
    check_close("bert", out, model, kwargs, keep)


def test_parameters_given_new_storage_after_wrap_are_laid_out_again(monkeypatch):
    use_reference(monkeypatch)
    model = autoragged.wrap(model_of("bert"), db=False, policy="ragged")
    kwargs, keep = batch()
    key = model.encoder.layer[0].attention.self.key
    with torch.no_grad():
        model(**kwargs)
        key.weight.data = key.weight.data * 1.5 + 0.01  # its own storage now, and new values
        assert not shares_one_storage(triples(model)[0])
        out = model(**kwargs)
    assert last(model).arm == "ragged"
    assert shares_one_storage(triples(model)[0])
    check_close("bert", out, model, kwargs, keep)
    twin = copy.deepcopy(model)  # a copy lays its own parameters out
    with torch.no_grad():
        check_close("bert", twin(**kwargs), twin, kwargs, keep)
    assert all(shares_one_storage(t) for t in triples(twin))


def test_unwrap_gives_each_parameter_its_own_storage(tmp_path, monkeypatch):
    safetensors = pytest.importorskip("safetensors.torch")
    use_reference(monkeypatch)
    model = model_of("bert")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    autoragged.wrap(model, db=False)
    autoragged.unwrap(model)
    for triple in triples(model):
        for name in ("weight", "bias"):
            assert len({getattr(lin, name).untyped_storage().data_ptr() for lin in triple}) == 3
    safetensors.save_file(model.state_dict(), tmp_path / "m.safetensors")
    loaded = safetensors.load_file(tmp_path / "m.safetensors")
    assert all(torch.equal(loaded[k], before[k]) for k in before)


def test_a_wrapped_models_state_dict_saves_with_safetensors(tmp_path, monkeypatch):
    """The q/k/v views share one storage while wrapped; safetensors (>= 0.8, as transformers 5.17 requires)
    saves such non-overlapping views, and they load back equal."""
    safetensors = pytest.importorskip("safetensors.torch")
    use_reference(monkeypatch)
    model = autoragged.wrap(model_of("bert"), db=False)
    assert all(shares_one_storage(t) for t in triples(model))
    state = model.state_dict()
    safetensors.save_file(state, tmp_path / "m.safetensors")
    loaded = safetensors.load_file(tmp_path / "m.safetensors")
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)


def test_a_layer_whose_q_and_k_are_one_parameter_runs_three_products(monkeypatch):
    use_reference(monkeypatch)
    model = model_of("bert")
    attention = model.encoder.layer[0].attention.self
    attention.key.weight = attention.query.weight  # tied: no buffer can hold both as blocks
    autoragged.wrap(model, db=False, policy="ragged")
    assert fused_layers(model) == 1 and not shares_one_storage(triples(model)[0])
    kwargs, keep = batch()
    with torch.no_grad():
        out = model(**kwargs)
    assert last(model).arm == "ragged"
    check_close("bert", out, model, kwargs, keep)


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_wrap_under_inference_mode_leaves_a_model_every_grad_mode_can_run(family, monkeypatch):
    """Serving code often wraps inside `torch.inference_mode()`. The one q/k/v buffer `wrap` lays out must
    still be a plain tensor: the padded arm (left padding, policy="padded"), no_grad, grad mode with a backward
    pass, and the model after `unwrap` all run, and no parameter becomes an inference tensor."""
    use_reference(monkeypatch)
    model = model_of(family)
    for policy in ("auto", "padded", "ragged"):
        with torch.inference_mode():
            autoragged.wrap(model, db=False, policy=policy)  # (again: unwrapped and wrapped under inference_mode)
        assert all(shares_one_storage(t) for t in triples(model))
        assert not any(p.is_inference() for p in model.parameters())
        for side in ("right", "left"):
            kwargs, keep = batch(side=side)
            with torch.no_grad():
                out = model(**kwargs)
            check_close(family, out, model, kwargs, keep)
            with torch.inference_mode():
                model(**kwargs)
            model.zero_grad()
            model(**kwargs).last_hidden_state[keep].square().sum().backward()
            assert model.encoder.layer[0].attention.self.query.weight.grad is not None
    autoragged.unwrap(model)
    assert not any(p.is_inference() for p in model.parameters())
    kwargs, _ = batch(side="left")
    model(**kwargs).last_hidden_state.sum().backward()


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_a_model_made_under_inference_mode_keeps_its_three_q_k_v_parameters(family, monkeypatch):
    """A model whose parameters are inference tensors (made, loaded or deep-copied under `torch.inference_mode()`)
    keeps its q, k and v parameters as they are: made views of one plain buffer, they broke the model's own
    forward, the padded arm ("Inference tensors do not track version counter"). Both arms compute the
    original's function on real tokens, for either padding side."""
    use_reference(monkeypatch)
    plain = model_of(family)
    with torch.inference_mode():
        model = copy.deepcopy(plain)
    assert all(p.is_inference() for p in model.parameters())
    with torch.inference_mode():
        autoragged.wrap(model, db=False)
    assert fused_layers(model) == 0 and not any(shares_one_storage(t) for t in triples(model))
    assert all(p.is_inference() for p in model.parameters())
    for policy in ("padded", "ragged"):
        for side in ("right", "left"):
            kwargs, keep = batch(side=side)
            with torch.inference_mode(), model._autoragged.forcing(policy):
                out = model(**kwargs)
            assert last(model).arm == policy, last(model).reason
            reference = autoragged.wrap(copy.deepcopy(plain), db=False)  # (check_close unwraps a copy of it)
            check_close(family, out, reference, kwargs, keep)
