"""HuggingFace encoders: the BERT family and ModernBERT, and every model that holds one (task heads,
sentence-transformers' `SentenceTransformer` and `CrossEncoder`).

What is wrapped is the base model (`BertModel`; the `bert` of `BertForSequenceClassification`; the
`auto_model` of a SentenceTransformer): task heads and poolers outside it run as before, on its padded
output. The padded arm is the base model's own forward, untouched (sdpa, or whatever it was loaded with).

The ragged arm unpads once and repads once:
- embeddings on the padded input, with the model's own embedding module: position ids, token types and
  RoBERTa's `padding_idx + 1` positions come out exactly as the original computes them, for any padding side;
- the layers on the packed real tokens;
- last_hidden_state repadded (zeros at pads), pooler_output recomputed from it, every hidden state repadded.
  A pooler or task head may read column 0, a pad in a left-padded row that the original computes: the fused
  families compute it as one more, query-only, row (`Layout.with_query_rows`; the mask graph:
  kernels/masked_pack.py); ModernBERT runs left-padded batches padded.

Two ways to run the layers:
- fused (BERT, RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA, ALBERT, DistilBERT): each layer as a spec of the
  fused ragged encoder (models/encoder.py) over the layer's own parameters, the same kernels as the
  PyTorch encoder: cuBLAS or Triton linears, our varlen attention, fused add+LayerNorm; the eager arm and
  the ragged graph, fed a mask or host lengths (its Triton linears stop at the rows the device counts); in
  training, the layers' forward and backward replayed as two CUDA graphs where their row rung recurs
  (graphs/train.py; not with adapters, checkpointing or hidden states);
- modules (ModernBERT: pre-norm, GeGLU, rotary, local windows): the model's own layer modules on (1, rows, D),
  with our varlen kernel as their attention through transformers' attention interface (hf.py),
  rotary positions counted within each sequence; the eager arm only (no graph: the linears are the model's),
  in training too (our attention's backward inside its modules).
MPNet and DeBERTa do not route attention through the interface (a relative-position bias inside their
attention): wrapped, they always run padded, with that reason.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import modeling_outputs as outputs
from transformers.activations import GELUActivation

from ..graphs import train as _train_graphs
from ..kernels.masked_embed import Tables
from ..kernels.ragged_attention import HEAD_DIMS
from ..tuning_db import ModuleSignature
from . import hf as _hf
from . import sentence as _sentence
from ._modules import adapted_linear, layer_checkpoint, own_layers
from .base import EpochCache
from .encoder import Dropouts, EncoderLayerSpec, autocast_reason, encoder_values, spec_tensors, why_not_graphed
from .qkv import FusedQKV, unfuse

__all__ = ["ADAPTER", "FAMILIES"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _ln(norm: nn.LayerNorm):
    return norm.weight, norm.bias, norm.eps


def _lin(linear: nn.Module):
    """A spec's linear: the weights of an nn.Linear; a peft adapter layer runs as itself (_modules.py)."""
    return linear if adapted_linear(linear) else (linear.weight, linear.bias)


def _activation(fn):
    """ "relu" / "gelu" when our linear's epilogue computes exactly `fn`, else `fn` itself (run after it)."""
    if isinstance(fn, nn.ReLU) or fn is F.relu:
        return "relu"
    if (isinstance(fn, GELUActivation) and fn.act is F.gelu) or (isinstance(fn, nn.GELU) and fn.approximate == "none"):
        return "gelu"
    return fn


def _act_name(act) -> str:
    return act if isinstance(act, str) else type(act).__name__


# -- the fused families: where each keeps its layers --------------------------------------------------------
def _bert_layer(layer) -> EncoderLayerSpec:
    s, o = layer.attention.self, layer.attention.output
    return EncoderLayerSpec(
        heads=s.num_attention_heads, qkv=(_lin(s.query), _lin(s.key), _lin(s.value)), out=_lin(o.dense),
        norm1=_ln(o.LayerNorm), ff1=_lin(layer.intermediate.dense),
        activation=_activation(layer.intermediate.intermediate_act_fn), ff2=_lin(layer.output.dense),
        norm2=_ln(layer.output.LayerNorm), scale=s.scaling,
        dropout=Dropouts(probs=s.dropout.p, attn_out=o.dropout.p, ff_out=layer.output.dropout.p),
    )  # fmt: skip


def _bert_layers(base):
    return [_bert_layer(layer) for layer in base.encoder.layer]


def _bert_qkv(base):
    return [(s.query, s.key, s.value) for s in (layer.attention.self for layer in base.encoder.layer)]


def _albert_layers(base):
    """ALBERT shares its layers: layer i runs group int(i / (layers / groups)), each group's inner layers."""
    config, groups = base.config, base.encoder.albert_layer_groups
    specs = []
    for i in range(config.num_hidden_layers):
        group = groups[int(i / (config.num_hidden_layers / config.num_hidden_groups))]
        for layer in group.albert_layers:
            a = layer.attention
            specs.append(EncoderLayerSpec(
                heads=a.num_attention_heads, qkv=(_lin(a.query), _lin(a.key), _lin(a.value)), out=_lin(a.dense),
                norm1=_ln(a.LayerNorm), ff1=_lin(layer.ffn), activation=_activation(layer.activation),
                ff2=_lin(layer.ffn_output), norm2=_ln(layer.full_layer_layer_norm), scale=a.scaling,
                dropout=Dropouts(probs=a.attention_dropout.p, attn_out=a.output_dropout.p),  # (layer.dropout: unused)
            ))  # fmt: skip
    return specs


def _albert_qkv(base):
    groups = base.encoder.albert_layer_groups
    return [(a.query, a.key, a.value) for g in groups for a in (layer.attention for layer in g.albert_layers)]


def _distilbert_layers(base):
    specs = []
    for layer in base.transformer.layer:
        a = layer.attention
        specs.append(EncoderLayerSpec(
            heads=a.n_heads, qkv=(_lin(a.q_lin), _lin(a.k_lin), _lin(a.v_lin)), out=_lin(a.out_lin),
            norm1=_ln(layer.sa_layer_norm), ff1=_lin(layer.ffn.lin1), activation=_activation(layer.ffn.activation),
            ff2=_lin(layer.ffn.lin2), norm2=_ln(layer.output_layer_norm), scale=a.scaling,
            dropout=Dropouts(probs=a.dropout.p, ff_out=layer.ffn.dropout.p),
        ))  # fmt: skip
    return specs


def _distilbert_qkv(base):
    return [(a.q_lin, a.k_lin, a.v_lin) for a in (layer.attention for layer in base.transformer.layer)]


def _bert_embed(base, kw):
    x = base.embeddings(input_ids=kw.get("input_ids"), token_type_ids=kw.get("token_type_ids"),
                        position_ids=kw.get("position_ids"), inputs_embeds=kw.get("inputs_embeds"))  # fmt: skip
    project = getattr(base, "embeddings_project", None)  # ELECTRA's embedding size -> hidden size
    return project(x) if project is not None else x


def _albert_embed(base, kw):
    """ALBERT's embeddings mapped to the hidden size, as its encoder's first step: the padded input every arm
    packs has the layers' width (a CUDA graph's values are d_model wide)."""
    return base.encoder.embedding_hidden_mapping_in(_bert_embed(base, kw))


def _distilbert_embed(base, kw):
    return base.embeddings(kw.get("input_ids"), kw.get("inputs_embeds"), kw.get("position_ids"))


# transformers' own embedding modules whose step is word + token type + position tables and a LayerNorm
_TABLE_EMBEDDINGS = {"BertEmbeddings", "RobertaEmbeddings", "XLMRobertaEmbeddings", "CamembertEmbeddings",
                     "ElectraEmbeddings", "Embeddings"}  # fmt: skip


def _embedding_tables(base) -> Tables | None:
    """The embedding step as the tables kernels/masked_embed.py reads, where it is transformers' own module of the
    BERT family (checked by class: a subclass may compute anything) with absolute positions and no projection
    after it; else None (the graph runs the module itself)."""
    emb = getattr(base, "embeddings", None)
    cls = type(emb)
    if cls.__name__ not in _TABLE_EMBEDDINGS or not cls.__module__.startswith("transformers.models."):
        return None
    if getattr(base, "embeddings_project", None) is not None or not isinstance(emb.LayerNorm, nn.LayerNorm):
        return None
    if getattr(emb, "position_embedding_type", "absolute") != "absolute" or emb.LayerNorm.weight is None:
        return None
    by_ids = hasattr(cls, "create_position_ids_from_input_ids")  # RoBERTa's positions: padding_idx + 1 on
    types = getattr(emb, "token_type_embeddings", None)
    types = types.weight if types is not None else None
    norm = emb.LayerNorm
    return Tables(emb.word_embeddings.weight, emb.position_embeddings.weight, types, norm.weight, norm.bias,
                  norm.eps, emb.padding_idx if by_ids else None)  # fmt: skip


def _embedding_modules(base) -> list[nn.Module]:
    """The modules the embedding step (`Family.embed`) calls, with their submodules."""
    tops = (getattr(base, "embeddings", None), getattr(base, "embeddings_project", None),
            getattr(getattr(base, "encoder", None), "embedding_hidden_mapping_in", None))  # fmt: skip
    return [m for top in tops if isinstance(top, nn.Module) for m in top.modules()]


def _layer_values(spec: EncoderLayerSpec, x, layout, config, causal, training) -> torch.Tensor:
    """One post-norm layer on values x (rows, D) (a checkpointed layer's function)."""
    return encoder_values([spec], None, x, layout, config, causal, None, training)


def _modernbert_embed(base, kw):
    return base.embeddings(input_ids=kw.get("input_ids"), inputs_embeds=kw.get("inputs_embeds"))


def _bert_pool(base, y):
    return base.pooler(y) if base.pooler is not None else None


def _albert_pool(base, y):
    return base.pooler_activation(base.pooler(y[:, 0])) if base.pooler is not None else None


@dataclass(frozen=True)
class Family:
    """Where a family keeps what the ragged arm needs."""

    embed: object  # (base, call kwargs) -> (B, L, D) embeddings on the padded input
    layers: object | None  # base -> [EncoderLayerSpec] (fused), or None: the model's own layer modules
    layer_list: object  # base -> the nn.ModuleList of its layers (structure checks)
    output: type  # the ModelOutput class the base model returns
    pool: object = None  # (base, padded last hidden state) -> pooler_output, or None
    unsupported: str | None = None  # why the ragged arm never runs this family
    qkv: object = None  # base -> each layer's (q, k, v) nn.Linears, laid out as one product (qkv.py)
    tables: object = None  # base -> the embedding step as tables (`_embedding_tables`), or None


_BERT = Family(
    _bert_embed,
    _bert_layers,
    lambda b: b.encoder.layer,
    outputs.BaseModelOutputWithPoolingAndCrossAttentions,
    _bert_pool,
    qkv=_bert_qkv,
    tables=_embedding_tables,
)
_NO_INTERFACE = "its attention adds a relative-position bias outside transformers' attention interface"
FAMILIES: dict[str, Family] = {
    "bert": _BERT,
    "roberta": _BERT,
    "xlm-roberta": _BERT,
    "camembert": _BERT,
    "electra": Family(
        _bert_embed,
        _bert_layers,
        lambda b: b.encoder.layer,
        outputs.BaseModelOutputWithPastAndCrossAttentions,
        qkv=_bert_qkv,
        tables=_embedding_tables,
    ),  # fmt: skip
    "albert": Family(
        _albert_embed,
        _albert_layers,
        lambda b: b.encoder.albert_layer_groups,
        outputs.BaseModelOutputWithPooling,
        _albert_pool,
        qkv=_albert_qkv,
    ),  # fmt: skip
    "distilbert": Family(
        _distilbert_embed,
        _distilbert_layers,
        lambda b: b.transformer.layer,
        outputs.BaseModelOutput,
        qkv=_distilbert_qkv,
        tables=_embedding_tables,
    ),  # fmt: skip
    "modernbert": Family(_modernbert_embed, None, lambda b: b.layers, outputs.BaseModelOutput),
    "mpnet": Family(
        None, None, lambda b: b.encoder.layer, outputs.BaseModelOutputWithPooling, unsupported=_NO_INTERFACE
    ),
    "deberta": Family(None, None, lambda b: b.encoder.layer, outputs.BaseModelOutput, unsupported=_NO_INTERFACE),
    "deberta-v2": Family(None, None, lambda b: b.encoder.layer, outputs.BaseModelOutput, unsupported=_NO_INTERFACE),
}


class HFEncoderBody(_hf.HFBody):
    def __init__(self, module: PreTrainedModel):
        family = FAMILIES[module.config.model_type]
        super().__init__(module, family, family.layer_list(module))
        # every arm calls the embedding step's modules as the original does: their hooks (e.g. the one
        # `enable_input_require_grads` registers for gradient checkpointing and peft) keep no batch padded; only a
        # graph, which runs them at its capture alone, is kept from a call while they have one (`embeds_hooked`)
        called = {id(m) for m in _embedding_modules(module)}
        watched = [(id(m) in called, hooks) for m in module.modules() if m is not module
                   for hooks in (m._forward_hooks, m._forward_pre_hooks)]  # fmt: skip
        self._hook_dicts = [hooks for embedding, hooks in watched if not embedding]
        self._embed_hook_dicts = [hooks for embedding, hooks in watched if embedding]
        config = module.config
        self._specs = EpochCache(self._make_specs)
        self.static_reason = self._static_reason(module)
        self.has_dropout = any(m.p > 0 for m in module.modules() if isinstance(m, nn.Dropout))
        self.fused = family.layers is not None
        # the fused families by our kernels' backward; ModernBERT's own layer modules around our attention's
        self.trains = True
        # a task head or pooler may read column 0 of the output, a pad in a left-padded row that the original
        # computes (a query over the row's real tokens): every ragged arm of the fused families computes it as a
        # query-only row of its own (`Layout.with_query_rows`, kernels/masked_pack.py), as the original does.
        # ModernBERT's local windows and rotary positions see that pad at its column: its left padding runs padded
        self.mask_graph = self.fused
        self.first_column = self.fused
        # the ragged graph runs the model's own embedding module on static token ids (graphs/capture.py)
        self.embeds_in_graph = self.fused
        embeddings = getattr(module, "embeddings", None)
        self.embeds_token_types = getattr(embeddings, "token_type_embeddings", None) is not None
        heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_heads", 1)
        d_model = getattr(config, "hidden_size", None) or getattr(config, "dim", 0)
        self.d_model, self.head_dim = d_model, d_model // max(heads, 1)
        ff = getattr(config, "intermediate_size", None) or getattr(config, "hidden_dim", 0)
        specs = self._specs.get() if family.layers is not None and not family.unsupported else []
        act = _act_name(specs[0].activation) if specs else str(getattr(config, "hidden_activation", "unknown"))
        self.sig = ModuleSignature(
            kind=f"hf-{config.model_type}", layers=len(specs) or getattr(config, "num_hidden_layers", 0),
            d_model=d_model, heads=heads, ff=ff, activation=act, norm_first=family.layers is None,
            dtype=str(self.probe().dtype).replace("torch.", ""), final_norm=family.layers is None,
        )  # fmt: skip
        # one q/k/v product per layer: the three parameters become views of one buffer (qkv.py)
        fusable = family.qkv is not None and family.layers is not None and self.static_reason is None
        self._qkv = FusedQKV(family.qkv(module)) if fusable else None

    def autocast_reason(self, dtype, cast):
        return autocast_reason(dtype) if self.fused else "autocast"

    def embed_tables(self, module) -> Tables | None:
        return self.family.tables(module) if self.family.tables is not None else None

    def embeds_hooked(self) -> bool:
        """True when a module of the embedding step has a forward hook (a graph would run it at its capture only)."""
        return _hf.hidden_hooked(self._embed_hook_dicts)

    def _make_specs(self):
        return self.family.layers(self.module) if self.family.layers is not None else None

    def _static_reason(self, module) -> str | None:
        family, config = self.family, module.config
        if family.unsupported:
            return f"{config.model_type}: {family.unsupported}"
        if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
            return "configured as a decoder (causal, cross-attention)"
        dtype = self.probe().dtype
        if dtype not in _DTYPES:
            return f"parameters of dtype {dtype} (supported: float16, bfloat16, float32)"
        heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_heads", 1)
        head_dim = (getattr(config, "hidden_size", None) or getattr(config, "dim", 0)) // heads
        if head_dim not in HEAD_DIMS:
            return f"head dim {head_dim} (the ragged attention kernel supports {HEAD_DIMS})"
        return None

    def _layer_specs(self) -> list:
        specs = self._specs.get()
        if self._qkv is None or torch.is_grad_enabled():  # the fused buffer is no parameter: autograd uses the three
            return specs
        return self._qkv.layers(specs)

    def values(self, x, layout, config, causal, hidden=None):
        family = self.family
        if hidden is not None:
            hidden.append(x)
        if family.layers is not None:
            specs, training = self._layer_specs(), self.module.training
            checkpoints = self._checkpoints(len(specs))
            if checkpoints is None:
                y = self._graphed(specs, x, layout, config, causal) if hidden is None else None
                return y if y is not None else encoder_values(specs, None, x, layout, config, causal, hidden, training)
            for spec, checkpoint in zip(specs, checkpoints):  # (post-norm layers: nothing crosses a layer but x)
                layer = functools.partial(_layer_values, spec, layout=layout, config=config, causal=causal,
                                          training=training)  # fmt: skip
                x = layer(x) if checkpoint is None else checkpoint(layer, x)
                if hidden is not None:
                    hidden.append(x)
            return x
        return self._module_values(x, layout, config, hidden)

    def _graphed(self, specs, x, layout, config, causal: bool) -> torch.Tensor | None:
        """The layers' output through a training graph (graphs/train.py), or None where none serves this call."""
        training = self.module.training
        if not _train_graphs.ENABLED or causal or why_not_graphed(specs, x, layout) is not None:
            return None
        if self.train_graphs is None:
            holder = _train_graphs.StackModule(functools.partial(_stack_run, self), list(self._list))
            self.train_graphs = _train_graphs.TrainGraphs(holder)
            held = {id(p) for p in holder.parameters()}
            if not all(id(t) in held for spec in specs for t in spec_tensors(spec)):
                # the specs read a parameter outside the layers, which a capture would not swap in
                self.train_graphs.failed = "a layer reads a parameter outside the layer list"
        mode = (training, *(spec.dropout for spec in specs))
        return self.train_graphs.run(x, layout.lengths, config, self.head_dim, mode=mode)

    def _checkpoints(self, layers: int) -> list | None:
        """Each layer's checkpoint function where HF's gradient checkpointing applies to this call (None for a layer
        it leaves out), or None where it applies to none (_modules.py)."""
        if not (self.module.training and torch.is_grad_enabled()) or len(self._list) != layers:
            return None  # (ALBERT's shared layers take no checkpointing in transformers)
        checkpoints = [layer_checkpoint(layer) for layer in self._list]
        return checkpoints if any(checkpoints) else None

    def _module_values(self, x, layout, config, hidden):
        """ModernBERT's own layer modules on (1, rows, D), our varlen kernel as their attention."""
        base = self.module
        h = x[None]
        positions = _hf.positions(layout, x.shape[0], x.device)
        rotary = {t: base.rotary_emb(h, positions, t) for t in set(base.config.layer_types)}
        attention = functools.partial(_hf.ragged_attention_of, base.config, layout, config)
        h = own_layers(base.layers, h, attention, lambda layer: {"attention_mask": None,
                       "position_embeddings": rotary[layer.attention_type]}, hidden)  # fmt: skip
        return base.final_norm(h)[0]

    def output(self, module, call, y, hidden):
        family = self.family
        fields = {"last_hidden_state": y}
        if family.pool is not None:
            fields["pooler_output"] = family.pool(module, y)
        if hidden is not None:
            fields["hidden_states"] = (*hidden[:-1], y)
        out = family.output(**fields)
        return out if call.return_dict else out.to_tuple()


def _stack_run(body: HFEncoderBody, x, layout, config, tables):
    """The fused layers as a training graph runs them (graphs/train.py `StackModule`): specs read afresh, from the
    parameters the capture swaps in (the training flag and the dropouts they apply: the graphs' mode)."""
    specs = body.family.layers(body.module)
    return encoder_values(specs, None, x, layout, config, False, None, body.module.training)


_PAD_COLUMN_NOTE = (
    " (its column 0 is then a pad that the original computes and a cls pooling reads; the ragged arm computes it"
    " only for the BERT family)"
)


class HFEncoderCall(_hf.HFCall):
    __slots__ = ("any_padding", "padding_note")

    def __init__(self, body: HFEncoderBody, module, kwargs, lengths):
        super().__init__(body, module, kwargs, lengths)
        if self.eager_only is None and body.embeds_hooked():
            self.eager_only = "forward hooks on the embeddings (a graph would run them at its capture only)"
        self.any_padding = body.first_column
        self.padding_note = "" if body.first_column else _PAD_COLUMN_NOTE


class HFEncoderAdapter:
    name = "hf_encoder"

    def targets(self, model: nn.Module) -> list[nn.Module]:
        """Base models (a model that is its own `base_model`) of the families above, in module order."""
        return [m for m in model.modules() if _hf.is_base(m) and m.config.model_type in FAMILIES]

    def skipped(self, model: nn.Module) -> list[tuple[nn.Module, str]]:
        """HF base models of other families, with why (`wrap` names those no adapter takes)."""
        return [
            (m, f"{type(m).__name__} (model_type {m.config.model_type!r}) is not a family autoragged runs")
            for m in model.modules()
            if _hf.is_base(m) and m.config.model_type not in FAMILIES
        ]

    def bind(self, module) -> HFEncoderBody:
        return HFEncoderBody(module)

    def install(self, module) -> None:
        _hf.install(module, HFEncoderCall)

    def uninstall(self, module) -> None:
        _hf.uninstall(module)
        family = FAMILIES[module.config.model_type]
        if family.qkv is not None:
            unfuse(family.qkv(module))  # each q/k/v parameter its own storage again, as before `wrap`

    def install_container(self, model: nn.Module) -> None:
        """sentence-transformers' input module around a wrapped base model: host lengths from its tokenizer."""
        _sentence.install(model)

    def uninstall_container(self, model: nn.Module) -> None:
        _sentence.uninstall(model)


ADAPTER = HFEncoderAdapter()
