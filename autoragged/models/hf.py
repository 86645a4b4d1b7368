"""What every HuggingFace family shares: making a model dispatch, reading its call, and our attention
registered with transformers' attention interface. Imported only by the HF adapters (it imports
transformers).

Dispatch: a wrapped base model (`BertModel`, the `bert` inside `BertForSequenceClassification`, the
`auto_model` inside a SentenceTransformer) gets an instance attribute `forward` (class, `state_dict`,
`save_pretrained` and transformers' per-class output capturing unchanged); `uninstall` deletes it. Its
`__signature__` is the model's own plus `lengths=`, so callers that read the signature (sentence-transformers
filters its features by it) see the same parameters. Under `torch.compile` the wrapped forward runs eagerly (a
graph break; the rest of the step compiles): its dispatch reads each batch's lengths on the host, and traced, every
new batch compiled anew (1 to 14 s a batch for a two-layer BERT's training step on a CPU).

Attention: our varlen kernel is registered as "autoragged" (a name with neither "flash" nor "/": those make
transformers take other paths). A body that runs the model's own layer modules on packed rows switches its
config's `_attn_implementation` to it for the duration of the ragged arm (eager, or a CUDA-graph capture),
with the layout in a context variable; any other call that reaches the function while a config is switched
(another thread's padded call) runs the implementation the config had, and the mask function likewise. A
ragged arm may also hand each attention module's keys and values to a sink (a decoder's KV cache).

The call being run: `current_call()` is the HFCall whose forward is running in this context (set by the
wrapped forward and by `HFCall.scope()`), for a body that needs more of the call than its packed values
(a decoder's position ids as the original derives them for the padded input).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import sys

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..ops import attention_values
from .base import Body, Call, EpochCache, GraphInputs
from .sentence import hinted_lengths

__all__ = ["NAME", "install", "uninstall", "HFCall", "ragged_attention_of", "hidden_hooked", "current_call",
           "positions", "is_base", "HFBody"]  # fmt: skip

NAME = "autoragged"
# (layout, config, sink) of the ragged arm running in this context; None: not inside one
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("autoragged_ragged_arm", default=None)
# the HFCall whose forward runs in this context; None: none
_CALL: contextvars.ContextVar = contextvars.ContextVar("autoragged_hf_call", default=None)
_SWITCHED: dict[int, str] = {}  # id(config) -> the implementation it had, while switched to NAME


def _original(module) -> str:
    return _SWITCHED.get(id(getattr(module, "config", None)), "sdpa")


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function convention: q (1, H, rows, Dh), k/v (1, Hkv, rows, Dh) -> (out
    (1, rows, H, Dh), None); `sliding_window` comes among the kwargs. Outside a ragged arm: the implementation the
    module's config had."""
    active = _ACTIVE.get()
    if active is None:
        impl = _original(module)
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        fn = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager)
        return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    layout, config, sink = active
    if sink is not None:
        sink(module, key, value)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (rows, heads, Dh) views, no copies
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", False)))
    sliding_window = kwargs.get("sliding_window")
    left = -1 if sliding_window is None else sliding_window - 1
    window = (left, 0 if causal else left)
    # (HF passes the module's dropout probability in training, 0 in eval)
    out = attention_values(q, k, v, layout, window=window, scale=scaling, config=config, dropout=float(dropout or 0.0))
    return out[None], None


def _mask(*args, **kwargs):
    """The mask function paired with `_attention`: a ragged arm needs none (the layout is the mask); any
    other call gets its config's original implementation's mask."""
    if _ACTIVE.get() is not None:
        return None
    config = kwargs.get("config")
    impl = _SWITCHED.get(id(config), "sdpa")
    return ALL_MASK_ATTENTION_FUNCTIONS[impl if impl in ALL_MASK_ATTENTION_FUNCTIONS else "sdpa"](*args, **kwargs)


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        AttentionInterface.register(NAME, _attention)
        AttentionMaskInterface.register(NAME, _mask)
        _registered = True


@contextlib.contextmanager
def ragged_attention_of(config, layout, kernel_config, sink=None):
    """Run the model's own attention modules as our varlen kernel over `layout` inside this block; `sink`,
    if given, is called as sink(module, key, value) with each module's keys and values (1, Hkv, rows, Dh)
    before its attention runs."""
    _register()
    token = _ACTIVE.set((layout, kernel_config, sink))
    key = id(config)
    before = config._attn_implementation_internal
    nested = key in _SWITCHED
    if not nested:
        _SWITCHED[key] = before
    config._attn_implementation_internal = NAME
    try:
        yield
    finally:
        if not nested:
            config._attn_implementation_internal = before
            del _SWITCHED[key]
        _ACTIVE.reset(token)


def is_base(m) -> bool:
    """An HF base model: a PreTrainedModel that is its own `base_model` (what an HF adapter wraps)."""
    from transformers import PreTrainedModel

    return isinstance(m, PreTrainedModel) and m.base_model is m


def current_call():
    """The HFCall running in this context (see the module docstring), or None."""
    return _CALL.get()


def positions(layout, rows: int, device) -> torch.Tensor:
    """(1, rows) int64: each packed row's position within its sequence (rows past the batch: anything).
    No device sync: CUDA-graph capturable (the offsets may be a graph's static layout)."""
    offsets = layout.device_meta(device)[0].to(torch.int64)
    row = torch.arange(rows, device=device)
    comp = torch.searchsorted(offsets[1:].contiguous(), row, right=True).clamp_(max=offsets.shape[0] - 2)
    return (row - offsets[comp])[None]


def hidden_hooked(hook_dicts) -> bool:
    """True when a hook other than transformers' own output capturing sits on a watched submodule (those
    are inert outside a capturing forward: the ragged arm builds hidden states itself)."""
    if not any(hook_dicts):  # the common case, at C speed
        return False
    for hooks in hook_dicts:
        if hooks:
            for hook in hooks.values():
                if getattr(hook, "__name__", "") != "output_capturing_hook":
                    return True
    return False


class HFBody(Body):
    """What the bodies of HF base models share: the model, its family (an adapter's table entry), its layer
    list watched for structure changes, the padded arm as the class's own forward, and the embedding step."""

    batch_first = True

    def __init__(self, module, family, layer_list):
        super().__init__(module)
        self.module, self.config, self.family = module, module.config, family
        self.forward_of = functools.partial(type(module).forward.__get__)
        self._list = layer_list
        self._list_dict, self._count = layer_list._modules, len(layer_list)
        self._probe = EpochCache(lambda: next(self.module.parameters()))

    def probe(self) -> torch.Tensor:
        return self._probe.get()

    def hooked(self) -> bool:
        return hidden_hooked(self._hook_dicts)

    def layers_moved(self, module) -> bool:
        return self._list._modules is not self._list_dict or len(self._list) != self._count

    def restructured(self, module) -> bool:
        if super().restructured(module):
            return True
        self._list_dict, self._count = self._list._modules, len(self._list)
        return False

    @property
    def max_tokens(self) -> int | None:
        """The longest sequence the model's position embeddings take (RoBERTa's start at padding_idx + 1)."""
        limit = getattr(self.config, "max_position_embeddings", None)
        if limit is not None and self.config.model_type in ("roberta", "xlm-roberta", "camembert"):
            limit -= (self.config.pad_token_id or 0) + 1
        return limit

    def synthetic(self, lengths, L: int, device, mask: bool = True) -> tuple[tuple, dict]:
        """(args, kwargs) of a call of this base model on `lengths` padded to L (right padding): token ids
        within the vocabulary, and the attention mask (1 = token) or `lengths=` (`autoragged.warmup`); no KV
        cache asked for where the forward takes `use_cache` (a scoring call)."""
        from ..ragged.tensor import pad_mask

        token = min(5, self.config.vocab_size - 1)
        ids = torch.full((len(lengths), L), token, dtype=torch.long, device=device)
        kwargs = {"input_ids": ids}
        if "use_cache" in inspect.signature(type(self.module).forward).parameters:
            kwargs["use_cache"] = False
        if mask:
            kwargs["attention_mask"] = (~pad_mask(tuple(lengths), L, torch.device(device))).long()
        else:
            kwargs["lengths"] = list(lengths)
        return (), kwargs

    def embed(self, module, kwargs) -> torch.Tensor:
        """(B, L, D): the first layer's input on the padded call, as the original computes it."""
        return self.family.embed(module, kwargs)


# -- dispatch --------------------------------------------------------------------------------------------
class _Forward:
    """The instance-level `forward` of a wrapped HF base model."""

    def __init__(self, module, call_type, params: tuple[str, ...]):
        self.module, self.call_type, self.params = module, call_type, params
        sig = inspect.signature(type(module).forward)
        parameters = [p for name, p in sig.parameters.items() if name != "self"]
        lengths = inspect.Parameter("lengths", inspect.Parameter.KEYWORD_ONLY, default=None)
        tail = [p for p in parameters if p.kind == inspect.Parameter.VAR_KEYWORD]
        head = [p for p in parameters if p.kind != inspect.Parameter.VAR_KEYWORD]
        self.__signature__ = sig.replace(parameters=[*head, lengths, *tail])

    @torch.compiler.disable  # (the module docstring says why)
    def __call__(self, *args, lengths=None, **kwargs):
        module = self.module
        runtime = module._autoragged.ready(module)
        if args:
            if len(args) > len(self.params):
                raise TypeError(f"{type(module).__name__}.forward takes {len(self.params)} positional arguments")
            kwargs.update(zip(self.params, args))
        if lengths is None:  # sentence-transformers' tokenizer may have read the mask's lengths on the host
            lengths = hinted_lengths(kwargs.get("attention_mask"))
        call = self.call_type(runtime.body, module, kwargs, lengths)
        token = _CALL.set(call)  # as call.scope(), without a generator's overhead on the hot path
        try:
            return runtime.run(module, call)
        finally:
            _CALL.reset(token)


def install(module, call_type) -> None:
    params = tuple(
        name
        for name, p in inspect.signature(type(module).forward).parameters.items()
        if name != "self" and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.POSITIONAL_ONLY)
    )
    module.forward = _Forward(module, call_type, params)


def uninstall(module) -> None:
    module.__dict__.pop("forward", None)


# -- calls --------------------------------------------------------------------------------------------------
_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds")
# num_items_in_batch: the loss's token count (transformers' Trainer passes it down); the base model computes nothing
_FLAGS = ("return_dict", "output_hidden_states", "output_attentions", "use_cache", "num_items_in_batch")


class HFCall(Call):
    """A call of a wrapped HF base model: its keyword arguments, read once.

    kwargs the ragged arm takes: input_ids or inputs_embeds (B, L), attention_mask (B, L) with HF's
    convention (1 / True = real token, any padding side), token_type_ids, position_ids, output_hidden_states,
    return_dict, use_cache=False / None; `lengths=` (host ints, right padding) or a RaggedTensor of token
    ids as input_ids. Anything else that is not None (output_attentions=True, a KV cache, cross-attention
    inputs, packed-sequence kwargs, ...) runs the padded arm with the argument named as the reason."""

    __slots__ = ("body", "module", "kwargs", "B", "L", "kpm", "lengths", "reason", "passthrough", "device", "dtype",
                 "requires_grad", "wants_hidden", "eager_only", "return_dict", "_x", "ragged_in")  # fmt: skip

    any_padding = True
    causal = False
    extra_inputs: tuple[str, ...] = ()  # more keyword arguments a family's ragged arm takes (a decoder's cache)

    def __init__(self, body, module, kwargs: dict, lengths):
        self.body, self.module, self.kwargs, self.lengths = body, module, kwargs, lengths
        self.ragged_in = None
        self.reason = self.passthrough = self.eager_only = self.kpm = self._x = None
        config = module.config
        ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
        first = ids if ids is not None else embeds
        self.return_dict = kwargs.get("return_dict", getattr(config, "return_dict", True))
        hidden = kwargs.get("output_hidden_states", getattr(config, "output_hidden_states", False))
        self.wants_hidden = bool(hidden)
        if self.wants_hidden:
            self.eager_only = "hidden states asked for (the graph arm returns the last one only)"
        if not isinstance(first, torch.Tensor) or first.dim() != (2 if ids is not None else 3) or first.is_nested:
            self.passthrough = "input is not a batched (B, L) input_ids or (B, L, D) inputs_embeds tensor"
            self.B = self.L = 0
            return
        self.B, self.L = first.shape[0], first.shape[1]
        self.device = first.device
        self.dtype = embeds.dtype if embeds is not None else body.probe().dtype
        self.requires_grad = embeds is not None and embeds.requires_grad
        mask = kwargs.get("attention_mask")
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.shape != (self.B, self.L):
                self.reason = "attention_mask is not a (B, L) padding mask"
            else:
                self.kpm = ~mask if mask.dtype == torch.bool else mask == 0
        if self.reason is None:
            self.reason = self._unsupported(config, hidden)

    def empty_row(self, row: int) -> str:
        return f"row {row} has no real tokens (the original computes its pads, attending over them)"

    def _unsupported(self, config, hidden) -> str | None:
        kwargs = self.kwargs
        if kwargs.get("output_attentions", getattr(config, "output_attentions", False)):
            return "output_attentions (the ragged arm computes no attention weights)"
        cache = self._cache_reason(config)
        if cache is not None:
            return cache
        if not isinstance(hidden, bool) and hidden is not None:
            return "output_hidden_states names layers"
        for name, value in kwargs.items():
            if value is not None and name not in _INPUTS and name not in _FLAGS and name not in self.extra_inputs:
                return f"argument {name} (not supported by the ragged arm)"
        return None

    def _cache_reason(self, config) -> str | None:
        """Why the call's KV-cache arguments keep it padded (an encoder builds no cache), or None."""
        if self.kwargs.get("use_cache"):
            return "use_cache (a KV cache; pass use_cache=False for scoring)"
        return None

    @contextlib.contextmanager
    def scope(self):
        """This call as `current_call()` inside the block (the wrapped forward does this; so must anything that
        runs the runtime's arms on a call directly, e.g. `autoragged.measure.ArmRunner`)."""
        token = _CALL.set(self)
        try:
            yield self
        finally:
            _CALL.reset(token)

    @property
    def x(self):
        """The padded (B, L, D) hidden states the ragged arm packs (the body's embedding step), made once."""
        if self._x is None:
            self._x = self.body.embed(self.module, self.kwargs)
        return self._x

    def original(self, module):
        return self.body.forward_of(module)(**self.kwargs)

    def padded(self, module, lens, stats):
        if self.kwargs.get("attention_mask") is None and stats.total < stats.batch * self.L:
            # lengths= without a mask: the padded model needs one (built on the device from the host lengths)
            from ..ragged.tensor import pad_mask

            mask = ~pad_mask(lens, self.L, self.device)
            return self.body.forward_of(module)(**{**self.kwargs, "attention_mask": mask})
        return self.original(module)

    def padded_mask(self, module):
        return self.original(module)

    def graph_inputs(self) -> GraphInputs | None:
        """GraphInputs("ids" or "ids_tt", input_ids, token_type_ids or None) when the body's embeddings may run
        inside the graph ("ids_tt" for models whose embeddings take token types, given or not): input_ids given as
        (B, L) int64, no inputs_embeds and no position_ids (the graph derives the positions as the original does,
        from the columns or from the ids); None otherwise."""
        if not self.body.embeds_in_graph:
            return None
        kwargs = self.kwargs
        ids = kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.long or kwargs.get("inputs_embeds") is not None:
            return None
        if kwargs.get("position_ids") is not None:
            return None
        types = kwargs.get("token_type_ids")
        if not self.body.embeds_token_types:
            return GraphInputs("ids", ids, None) if types is None else None
        if types is not None and (
            not isinstance(types, torch.Tensor) or types.dtype != torch.long or types.shape != ids.shape
        ):
            return None
        # one graph for calls with token types and without (a tokenizer gives them, `warmup()` does not): None
        # is zeros, the embeddings' own default (a non-persistent zeros buffer)
        return GraphInputs("ids_tt", ids, types)

    def finish(self, y, hidden=None):
        return self.body.output(self.module, self, y, hidden)
