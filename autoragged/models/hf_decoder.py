"""HuggingFace decoder LLMs for prefill-style work (scoring, classification, embedding, eval harnesses): Llama,
Mistral, Qwen2, Qwen3, Gemma, Phi-3 and GPT-2, and every model that holds one (`...ForCausalLM`,
`...ForSequenceClassification`, `...ForTokenClassification`, ...).

What is wrapped is the base model (`LlamaModel`; the `model` of `LlamaForCausalLM`; GPT-2's `transformer`):
heads outside it (the LM head, the last-real-token score of `...ForSequenceClassification`, whatever
`logits_to_keep` selects) run as before on its padded output, which is exact on real tokens. The padded arm
is the base model's own forward, untouched. One exception: with labels, a Llama, Mistral or Qwen2/3 causal LM
computes its LM head and loss on the real tokens alone (causal_lm.py).

The ragged arm unpads once and repads once:
- the first layer's input on the padded call, as the original computes it: token embeddings (Gemma's scaled
  ones), GPT-2's learned positions from the original's `position_ids` (arange(L) for every row unless given,
  so a left-padded row's positions are shifted in the original too, and here);
- Llama-style layers (Llama, Mistral, Qwen2, Qwen3 with their own RMSNorm, linear and silu modules) run by
  our kernels (fused_decoder.py): the model's linear weights through cuBLAS on packed rows, fused
  add + RMSNorm, rotary and silu * up kernels rounded as HF's modules round, our causal varlen attention;
  other layers (Gemma, Phi-3, GPT-2, anything replaced or unknown: `body.unfused` says why) run as the model's
  own decoder layer modules on the packed real tokens (1, rows, D), with our causal varlen kernel as their
  attention through transformers' attention interface (hf.py). Grouped-query and multi-query heads
  pass straight to the kernel, sliding windows (Mistral, Qwen2/3 sliding layers, Phi-3) as the modules pass
  them;
- rotary embeddings computed by the model's own `rotary_emb` on the position ids the original derives for
  the padded input (arange(L), or the call's `position_ids`), then gathered for each packed row from its
  padded column: bit-identical cos/sin for every padding side and rope type;
- the final norm; last_hidden_state and every hidden state repadded (zeros at pads).

No CUDA graph runs a decoder (its body is not `fused`): a batch takes the padded arm or the eager ragged one.

KV cache: a call that asks for one (`use_cache=True`, which most configs default to, so a plain
`model(input_ids, attention_mask)` asks too; `generate()`'s prefill with its empty `DynamicCache`) gets the
cache the padded arm returns: a `DynamicCache(config=...)` filled layer by layer with the ragged arm's own
keys and values, repadded to (B, Hkv, L, Dh) (post-rotary keys, as the original caches them; zeros at pad
positions, where the original holds the pads' keys, which the mask hides from every later step). Building it
costs a (B, L)-sized copy per layer and the cache's memory, as in the original. Pass `use_cache=False` for
scoring to skip it. A cache that already holds tokens (decoding steps) runs padded with that reason.

A `RaggedTensor` of token ids as `input_ids` (values (rows,) int, each component one sequence from position 0)
runs packed with no padded tensor at all: the output's last_hidden_state (and hidden states) are
RaggedTensors of that layout, and no KV cache is built. `autoragged.packing.run_job` feeds token-budget bins
this way.

The packed format (DataCollatorWithFlattening's: position_ids restarting within a row, no attention mask, no cache)
runs each sequence as a component, as transformers' own packed path attends within each (`HFDecoderCall._init_packed`).

Training: every family runs the ragged arm under autograd: the fused ones by our kernels' backward, the module path
(Gemma, Phi-3, GPT-2) as the model's own layer modules (their dropouts included) with our attention's backward;
attention dropout is drawn in the kernel.

Always padded, with the reason: attention logit softcapping (Gemma-2), head dims the kernel lacks,
cross-attention, bidirectional-configured Gemma.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers import modeling_outputs as outputs

from ..graphs import train as _train_graphs
from ..kernels import ragged_attention as k_attn
from ..ragged.layout import Layout
from ..ragged.tensor import RaggedTensor, mask_rows, pad_mask, padded_from_ragged, ragged_from_padded
from ..tuning_db import ModuleSignature
from . import causal_lm as _causal_lm
from . import fused_decoder as _fused_decoder
from . import hf as _hf
from . import sentence as _sentence
from ._modules import own_layers

__all__ = ["ADAPTER", "FAMILIES"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Llama-style layers run by our fused kernels where they can (fused_decoder.py); False: always the model's own
# modules (benchmarks/diagnostics/llm_layers.py compares the two)
FUSED_LAYERS = True


# -- where each family keeps what the ragged arm needs ---------------------------------------------------
def _embed_tokens(base, kw) -> torch.Tensor:
    embeds = kw.get("inputs_embeds")
    return embeds if embeds is not None else base.embed_tokens(kw["input_ids"])


def _embed_tokens_packed(base, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return base.embed_tokens(ids)


def _gpt2_embed(base, kw) -> torch.Tensor:
    """GPT2Model.forward's embedding step: wte + wpe(position_ids or arange(L)) (+ wte(token_type_ids)), dropout."""
    embeds = kw.get("inputs_embeds")
    h = embeds if embeds is not None else base.wte(kw["input_ids"])
    position_ids = kw.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(h.shape[1], device=h.device)[None]
    h = h + base.wpe(position_ids).to(h.device)
    token_types = kw.get("token_type_ids")
    if token_types is not None:
        h = h + base.wte(token_types.view(-1, h.shape[1]))
    return base.drop(h)


def _gpt2_embed_packed(base, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return base.drop(base.wte(ids) + base.wpe(positions))


@dataclass(frozen=True)
class Family:
    """Where a decoder family keeps what the ragged arm needs."""

    embed: Callable  # (base, call kwargs) -> (B, L, D): the first layer's input on the padded call
    embed_packed: Callable  # (base, ids (rows,), positions (rows,)) -> (rows, D): the same, packed
    layers: Callable  # base -> the nn.ModuleList of decoder layers
    norm: Callable  # base -> the final norm module
    output: type  # the ModelOutput class the base model returns
    rotary: bool = True  # layers take position_embeddings=(cos, sin) from base.rotary_emb
    token_types: bool = False  # the base model takes token_type_ids
    unsupported: str | None = None  # why the ragged arm never runs this family
    # Llama-style layers our fused kernels may run (fused_decoder.py): attention module -> its sliding
    # window or None, as the module passes it to the attention interface; None: the family's layers never do
    window_of: Callable | None = None


_ROPE = Family(
    _embed_tokens, _embed_tokens_packed, lambda b: b.layers, lambda b: b.norm, outputs.BaseModelOutputWithPast
)
FAMILIES: dict[str, Family] = {
    "llama": replace(_ROPE, window_of=lambda attn: None),
    "mistral": replace(_ROPE, window_of=lambda attn: getattr(attn.config, "sliding_window", None)),
    "qwen2": replace(_ROPE, window_of=lambda attn: attn.sliding_window),
    "qwen3": replace(_ROPE, window_of=lambda attn: attn.sliding_window),
    "gemma": _ROPE,  # (1 + weight) norms and a gelu MLP: the model's own modules
    "phi3": _ROPE,  # fused qkv and gate-up projections: the model's own modules
    "gpt2": Family(
        _gpt2_embed,
        _gpt2_embed_packed,
        lambda b: b.h,
        lambda b: b.ln_f,
        outputs.BaseModelOutputWithPastAndCrossAttentions,
        rotary=False,
        token_types=True,
    ),  # fmt: skip
    "gemma2": Family(
        _embed_tokens,
        _embed_tokens_packed,
        lambda b: b.layers,
        lambda b: b.norm,
        outputs.BaseModelOutputWithPast,
        unsupported="attention logit softcapping (the ragged attention kernel has none)",
    ),  # fmt: skip
}


def _repad(t: torch.Tensor, flat: torch.Tensor, B: int, L: int) -> torch.Tensor:
    """Keys or values (1, H, rows, Dh) of packed rows -> (B, H, L, Dh) at their padded positions, zeros at pads.
    flat: (rows,) int64, each row's padded position b * L + column (B * L for rows of no sequence)."""
    rows = t[0].transpose(0, 1)  # (rows, H, Dh)
    out = rows.new_zeros((B * L + 1, *rows.shape[1:]))
    out.index_copy_(0, flat, rows)
    return out[: B * L].view(B, L, *rows.shape[1:]).transpose(1, 2)


def _stack_run(stack, x, layout, config, tables):
    """The fused stack as a training graph runs it (graphs/train.py `StackModule`): tables are the rows' (cos, sin)."""
    return _fused_decoder.run(stack, x, layout, config, tuple(t[None] for t in tables))


class HFDecoderBody(_hf.HFBody):
    fused = False
    mask_graph = False  # causal batches read their lengths
    causal = True

    def __init__(self, module: PreTrainedModel):
        family = FAMILIES[module.config.model_type]
        super().__init__(module, family, family.layers(module))
        # the ragged arm calls the embedding modules as the original does, on the padded ids: their hooks (e.g.
        # `enable_input_require_grads`, which trainers register) run on either arm, so they need not keep it padded
        called = {
            id(m) for name in ("wte", "wpe", "drop") if hasattr(module, name) for m in getattr(module, name).modules()
        }
        called |= {id(m) for m in module.get_input_embeddings().modules()}
        watched = [m for m in module.modules() if m is not module and id(m) not in called]
        self._hook_dicts = [m._forward_hooks for m in watched] + [m._forward_pre_hooks for m in watched]
        config = module.config
        heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.d_model = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or self.d_model // heads
        self.has_dropout = getattr(config, "attention_dropout", 0.0) > 0 or any(
            m.p > 0 for m in module.modules() if isinstance(m, nn.Dropout)
        )
        self.static_reason = self._static_reason(module)
        # why the decoder layers run as the model's own modules rather than our fused kernels (None: fused)
        self.unfused = self._unfused_reason(module)
        self.trains = True  # fused kernels' backward, or the model's own modules with our attention's
        ff = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * self.d_model
        act = getattr(config, "hidden_act", None) or getattr(config, "activation_function", None) or "unknown"
        first = self._list[0] if len(self._list) else None
        bias = first is not None and any(name.endswith("bias") for name, _ in first.named_parameters())
        self.sig = ModuleSignature(
            kind=f"hf-{config.model_type}", layers=config.num_hidden_layers, d_model=self.d_model, heads=heads, ff=ff,
            activation=str(act), norm_first=True, dtype=str(self.probe().dtype).replace("torch.", ""), bias=bias,
            final_norm=True,
        )  # fmt: skip

    def autocast_reason(self, dtype, cast) -> str | None:
        """Parameters of autocast's dtype compute as without it (the norms upcast by hand, rotary tables come in the
        hidden state's dtype): the ragged arm runs as it would; other parameters run padded."""
        if dtype != cast:
            return f"autocast to {str(cast)[6:]} over {str(dtype)[6:]} parameters (load the model in {str(cast)[6:]})"
        return None

    def _static_reason(self, module) -> str | None:
        family, config = self.family, module.config
        if family.unsupported:
            return f"{config.model_type}: {family.unsupported}"
        if getattr(config, "add_cross_attention", False):
            return "cross-attention layers (add_cross_attention)"
        if getattr(config, "use_bidirectional_attention", False):
            return "bidirectional attention configured (use_bidirectional_attention)"
        dtype = self.probe().dtype
        if dtype not in _DTYPES:
            return f"parameters of dtype {dtype} (supported: float16, bfloat16, float32)"
        why = k_attn.supports(
            self.head_dim, heads=config.num_attention_heads, kv_heads=self.kv_heads,
            softcap=getattr(config, "attn_logit_softcapping", None),
        )  # fmt: skip
        return f"the ragged attention kernel: {why}" if why else None

    def _unfused_reason(self, module) -> str | None:
        family, config = self.family, module.config
        if family.window_of is None:
            return f"{config.model_type} layers are not Llama-style"
        if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
            return "partial rotary embeddings"
        layers = self._list[: config.num_hidden_layers]
        return _fused_decoder.why_not(layers, family.norm(module), config, self.probe().dtype)

    def embed_packed(self, ids: RaggedTensor) -> torch.Tensor:
        """(rows, D): the first layer's input for packed token ids, each sequence from position 0."""
        positions = _hf.positions(ids.layout, ids.values.shape[0], ids.device)[0]
        return self.family.embed_packed(self.module, ids.values, positions)

    def values(self, x, layout, config, causal, hidden=None):
        """The decoder layers and the final norm on packed values x (rows, D) of `layout` -> (rows, D)."""
        base, family = self.module, self.family
        rows = x.shape[0]
        call = _hf.current_call()
        # eager arms get host layouts and may read the call (its padded positions, its cache); a graph's static
        # layout is replayed for other batches, so it counts positions from the lengths alone
        if not (isinstance(layout, Layout) and isinstance(call, HFDecoderCall) and call.module is base):
            call = None
        if hidden is not None:
            hidden.append(x)
        h = x[None]
        kwargs = {"position_embeddings": self._rope(h, layout, rows, call)} if family.rotary else {}
        sink = call.cache_sink(layout) if call is not None else None
        if self.unfused is None and FUSED_LAYERS and not torch.compiler.is_compiling():
            stack = _fused_decoder.DecoderStack(
                self._list[: self.config.num_hidden_layers], family.norm(base), family.window_of
            )
            if sink is None and hidden is None:
                y = self._graphed(stack, x, layout, config, kwargs["position_embeddings"])
                if y is not None:
                    return y
            return _fused_decoder.run(stack, x, layout, config, kwargs["position_embeddings"], sink, hidden)
        attention = functools.partial(_hf.ragged_attention_of, base.config, layout, config, sink)
        layers = self._list[: self.config.num_hidden_layers]
        h = own_layers(layers, h, attention, lambda layer: kwargs, hidden, fills_cache=sink is not None)
        return family.norm(base)(h)[0]

    def _graphed(self, stack, x, layout, config, position_embeddings) -> torch.Tensor | None:
        """The stack's output through a training graph (graphs/train.py), or None where none serves this call."""
        if not _train_graphs.ENABLED or _fused_decoder.why_not_graphed(stack, x, layout) is not None:
            return None
        if self.train_graphs is None:
            parts = [*stack.layers, stack.final_norm]
            holder = _train_graphs.StackModule(functools.partial(_stack_run, stack), parts)
            self.train_graphs = _train_graphs.TrainGraphs(holder)
        tables = tuple(t[0] for t in position_embeddings)  # (cos, sin)
        head_dim = stack.layers[0].self_attn.head_dim
        attns = [layer.self_attn for layer in stack.layers]
        mode = tuple(getattr(a, "attention_dropout", 0.0) if a.training else 0.0 for a in attns)  # (captured in)
        return self.train_graphs.run(x, layout.lengths, config, head_dim, tables, mode)

    def _rope(self, h: torch.Tensor, layout, rows: int, call) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (1, rows, rotary dim): the model's rotary_emb on the position table the original uses,
        gathered for each packed row. With a call: the call's table and each row's padded column; without
        (a graph, a RaggedTensor input): arange(longest) and each row's position in its sequence."""
        source = call.rope_source(layout) if call is not None else None
        if source is None:
            table = torch.arange(max(layout.max_len, 1), device=h.device)[None]
            index = _hf.positions(layout, rows, h.device)[0].clamp_(0, table.shape[1] - 1)
        else:
            table, index = source
        cos, sin = self.module.rotary_emb(h, table)  # (1 or B, L, d)
        d = cos.shape[-1]
        return cos.reshape(-1, d).index_select(0, index)[None], sin.reshape(-1, d).index_select(0, index)[None]

    def output(self, call, y, hidden):
        """The base model's output from the ragged arm's y (padded (B, L, D), or a RaggedTensor) and hidden."""
        fields = {"last_hidden_state": y}
        if call.use_cache:
            fields["past_key_values"] = call.finished_cache()
        if hidden is not None:
            if isinstance(y, RaggedTensor):
                hidden = [y.with_values(v) for v in hidden[:-1]] + [y]
            fields["hidden_states"] = (*hidden[:-1], y)
        out = self.family.output(**fields)
        return out if call.return_dict else out.to_tuple()


class HFDecoderCall(_hf.HFCall):
    """A call of a wrapped HF decoder base model (see HFCall for the arguments the ragged arm takes); also
    use_cache / an empty DynamicCache as past_key_values (the ragged arm fills the cache), and a RaggedTensor of
    token ids as input_ids."""

    __slots__ = ("use_cache", "cache", "_flat", "ids", "_packed")
    causal = True
    # the flash-attention kwargs of a packed row and TRL's seq_idx (DataCollatorWithFlattening, padding_free): they say
    # what its position_ids say, and sdpa reads the position_ids; so does `_init_packed`
    extra_inputs = ("past_key_values", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")

    def __init__(self, body: HFDecoderBody, module, kwargs: dict, lengths):
        self.use_cache, self.cache, self._flat, self._packed = False, None, None, None
        ids = self.ids = kwargs.get("input_ids")
        if isinstance(ids, RaggedTensor):
            self._init_ragged(body, module, kwargs, lengths, ids)
            return
        self.ids = None
        super().__init__(body, module, kwargs, lengths)
        if self.passthrough is not None:
            return
        self.reason = self._decoding() or self.reason  # a decoding step's mask is longer than its input: say why
        if self.reason is not None:
            return
        self.reason = self._decoder_reason(body)
        if self.reason is None:
            self._init_packed(lengths)

    def _decoder_reason(self, body) -> str | None:
        kwargs = self.kwargs
        if kwargs.get("token_type_ids") is not None and not body.family.token_types:
            return "argument token_type_ids (the model takes none)"
        position_ids = kwargs.get("position_ids")
        if position_ids is not None and (
            not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2
            or position_ids.shape[1] != self.L or position_ids.shape[0] not in (1, self.B)
        ):  # fmt: skip
            return "position_ids is not a (B, L) or (1, L) tensor"
        return None

    def _init_packed(self, lengths) -> None:
        """The packed format (DataCollatorWithFlattening: position_ids restarting within a row, no attention mask, no
        cache): transformers then attends within each sequence, split where the positions do not step by one
        (masking_utils.find_packed_sequence_indices). The ragged arm runs those sequences as its components: the
        rows' tokens are already back to back, so no gather. One device->host copy of position_ids, on every call
        with position_ids and neither mask nor cache: transformers' own check (`.all()` on the device) syncs there
        too, and a decoder's call reads its mask's lengths anyway when it has one."""
        kwargs = self.kwargs
        position_ids = kwargs.get("position_ids")
        if position_ids is None or self.kpm is not None or self.use_cache or kwargs.get("past_key_values") is not None:
            return
        B, L = self.B, self.L
        positions = position_ids.expand(B, L).cpu().numpy()
        starts = np.ones((B, L), dtype=bool)
        starts[:, 1:] = np.diff(positions, axis=1) != 1
        first = np.flatnonzero(starts)
        if len(first) == B:  # one sequence a row: the call as it is
            return
        if lengths is not None:
            raise ValueError("lengths= with packed position_ids (several sequences a row): the positions say where "
                             "each sequence starts; pass one or the other")  # fmt: skip
        self._packed = (B, L)
        segments = tuple(np.diff(np.append(first, B * L)).tolist())
        self.ragged_in = RaggedTensor(self.x.reshape(B * L, -1), Layout.make(segments))

    def _cache_reason(self, config) -> str | None:
        kwargs, module = self.kwargs, self.module
        use = kwargs.get("use_cache")
        if use is None:  # as transformers' merge_with_config_defaults
            use = getattr(config, "use_cache", False)
        if use and getattr(module, "gradient_checkpointing", False) and module.training:
            use = False
        self.use_cache = bool(use)
        past = kwargs.get("past_key_values")
        if past is None:
            return None
        if type(past) is not DynamicCache:
            return f"past_key_values is a {type(past).__name__} (the ragged arm fills an empty DynamicCache only)"
        if not self.use_cache:
            return "past_key_values given with use_cache=False"
        return self._decoding()

    def _decoding(self) -> str | None:
        """Why a call continuing a cache runs padded (a decoding step), or None."""
        past = self.kwargs.get("past_key_values")
        held = past.get_seq_length() if isinstance(past, DynamicCache) else 0
        return f"past_key_values holds {held} tokens (decoding steps run padded)" if held else None

    def _init_ragged(self, body: HFDecoderBody, module, kwargs: dict, lengths, ids: RaggedTensor) -> None:
        """A RaggedTensor of token ids: B components, L the longest; no mask, no padded tensor, no KV cache."""
        if lengths is not None:
            raise ValueError("lengths= with a RaggedTensor input: the RaggedTensor holds its lengths already")
        if ids.values.dim() != 1 or ids.values.dtype.is_floating_point:
            raise ValueError(
                f"input_ids as a RaggedTensor must hold token ids, values (rows,) of an int dtype; got {ids!r}"
            )
        config = module.config
        self.body, self.module, self.kwargs, self.lengths = body, module, kwargs, None
        self.kpm = self._x = self.passthrough = self.eager_only = None
        self.B, self.L = ids.batch_size, ids.max_len
        self.device, self.dtype, self.requires_grad = ids.device, body.probe().dtype, False
        self.return_dict = kwargs.get("return_dict", getattr(config, "return_dict", True))
        hidden = kwargs.get("output_hidden_states", getattr(config, "output_hidden_states", False))
        self.wants_hidden = bool(hidden)
        others = {k: v for k, v in kwargs.items() if k not in ("input_ids", "use_cache") and v is not None}
        self.kwargs = {"input_ids": ids, **others}
        self.reason = super()._unsupported(config, hidden)
        self.use_cache = False  # a RaggedTensor call builds no cache (there is no padded layout to give it)
        self.ragged_in = RaggedTensor(body.embed_packed(ids), ids.layout)

    # -- what the body reads ---------------------------------------------------------------------------------
    def _flat_rows(self, layout) -> torch.Tensor:
        """(rows,) int64: each packed row's padded position b * L + column (B * L for rows of no sequence),
        for the packing the runtime did (by the mask, any pattern; or right-padded by lengths). Made once."""
        if self._flat is None or self._flat[0] is not layout:
            B, L, device = self.B, self.L, self.device
            kpm = self.kpm if self.kpm is not None else pad_mask(layout.lengths, L, device)
            slots = mask_rows(kpm, layout)  # (B * L,) the packed row of each padded position, pads: layout.rows
            flat = torch.full((layout.rows + 1,), B * L, dtype=torch.int64, device=device)
            flat.index_copy_(0, slots, torch.arange(B * L, device=device))
            self._flat = (layout, flat[: layout.rows])
        return self._flat[1]

    def rope_source(self, layout) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(position table (1 or B, L), (rows,) int64 index into its flattened rows): the original's positions
        for the padded call, or None for a RaggedTensor input (each sequence from 0)."""
        if self.ids is not None:
            return None
        table = self.kwargs.get("position_ids")
        if table is None:
            table = torch.arange(self.L, device=self.device)[None]
        if self._packed is not None:  # the packed rows are the call's positions in order
            flat = torch.arange(self.B * self.L, device=self.device)
            return table, (flat % self.L if table.shape[0] == 1 else flat)
        flat = self._flat_rows(layout)
        index = flat % self.L if table.shape[0] == 1 else flat.clamp(max=self.B * self.L - 1)
        return table, index

    def cache_sink(self, layout):
        """sink(module, key, value) filling this call's KV cache with each layer's repadded keys and values, or
        None when the call asks for no cache."""
        if not self.use_cache:
            return None
        flat, B, L = self._flat_rows(layout), self.B, self.L
        cache = self.cache = self.kwargs.get("past_key_values") or DynamicCache(config=self.module.config)

        def sink(module, key, value):
            cache.update(_repad(key, flat, B, L), _repad(value, flat, B, L), module.layer_idx)

        return sink

    def finished_cache(self):
        if self.cache is None:
            if self.body.config.num_hidden_layers:
                raise RuntimeError(
                    "internal error: the ragged arm ran outside its call's scope (HFCall.scope()), so no KV cache "
                    "was built; run it through the wrapped forward"
                )
            self.cache = self.kwargs.get("past_key_values") or DynamicCache(config=self.module.config)
        return self.cache

    # -- arms ------------------------------------------------------------------------------------------------
    def padded(self, module, lens, stats):
        if self._packed is not None:  # transformers' own packed path
            return self.original(module)
        if self.ids is None:
            return super().padded(module, lens, stats)
        ids = self.ids  # a RaggedTensor input on the padded arm: pad it, run the original, pack its output
        padded_ids = padded_from_ragged(ids, 0, self.L, 1)
        mask = ~pad_mask(lens, self.L, self.device)
        out = self.body.forward_of(module)(**{**self.kwargs, "input_ids": padded_ids, "attention_mask": mask,
                                              "use_cache": False, "return_dict": True})  # fmt: skip
        fields = {"last_hidden_state": ragged_from_padded(out.last_hidden_state, lens, ids.align, 1)}
        if out.get("hidden_states") is not None:
            fields["hidden_states"] = tuple(ragged_from_padded(h, lens, ids.align, 1) for h in out.hidden_states)
        if out.get("attentions") is not None:
            fields["attentions"] = out.attentions
        result = self.body.family.output(**fields)
        return result if self.return_dict else result.to_tuple()

    def finish(self, y, hidden=None):
        if self._packed is not None and isinstance(y, RaggedTensor):  # back to the call's (B, L) rows
            B, L = self._packed
            y = y.values.view(B, L, -1)
            hidden = None if hidden is None else [h.view(B, L, -1) for h in hidden]
        elif self._flat is not None and not isinstance(y, RaggedTensor):  # a causal LM's head may run on them
            _causal_lm.note_rows(self.module, self._flat[1])
        return self.body.output(self, y, hidden)


class HFDecoderAdapter:
    name = "hf_decoder"

    def targets(self, model: nn.Module) -> list[nn.Module]:
        """Base models (a model that is its own `base_model`) of the families above, in module order."""
        return [m for m in model.modules() if _hf.is_base(m) and m.config.model_type in FAMILIES]

    def skipped(self, model: nn.Module) -> list[tuple[nn.Module, str]]:
        return []  # HF base models of other families are named by hf_encoder's `skipped`

    def bind(self, module) -> HFDecoderBody:
        return HFDecoderBody(module)

    def install(self, module) -> None:
        _hf.install(module, HFDecoderCall)

    def uninstall(self, module) -> None:
        _hf.uninstall(module)

    def install_container(self, model: nn.Module) -> None:
        """sentence-transformers' input module around a wrapped base model: host lengths from its tokenizer; a
        causal LM around one: its loss on the real tokens (causal_lm.py)."""
        _sentence.install(model)
        _causal_lm.install(model)

    def uninstall_container(self, model: nn.Module) -> None:
        _sentence.uninstall(model)
        _causal_lm.uninstall(model)


ADAPTER = HFDecoderAdapter()
