"""What a model-family adapter gives the runtime: a `Body` per wrapped module and a `Call` per batch.

An adapter (one file per family: torch_encoder.py, hf_encoder.py, ...) knows how to find the modules it
wraps in a model, how to make each one dispatch (`install` / `uninstall`), and how to read one of the
module's own calls. The runtime (autoragged/runtime/core.py) knows nothing of any family: it reads a
`Call`, decides, and asks the `Body` to run the ragged arm and the `Call` to run the padded one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..runtime.epoch import param_epoch

__all__ = ["Body", "Call"]


class Body:
    """What the runtime needs of one wrapped module, bound at wrap (and anew when its structure changes).

    sig:            the ModuleSignature (cost-relevant shape; keys the calibration and the records)
    static_reason:  why the ragged arm can never run this module, or None
    batch_first:    the padded tensor the ragged arm packs is (B, L, D) (else (L, B, D))
    d_model, head_dim
    has_dropout:    training mode then runs padded, unless `trains`
    trains:         the ragged arm runs under autograd (the kernels' backward) and applies the hidden dropouts;
                    `train_reason` names what still keeps a training batch padded
    fused:          the layers run as fused-encoder specs (so a graph's Triton linears can run them)
    mask_graph:     the ragged graph fed a mask may run (its linears stop at the rows the device counts)
    first_column:   the output's column 0 is read even where it is a pad (a first-token pooler): the graph
                    fed a mask computes a left-padded row's column 0 as a query-only row (kernels/masked_pack.py)
    embeds_in_graph: the ragged graphs (fed a mask or host lengths) may compute the embeddings themselves from
                    the call's token ids (`Call.graph_inputs`): the host launches no embedding step before the
                    replay; `embed_tables` gives that step as tables where it is the BERT family's sum of tables
                    and LayerNorm (the mask graph then computes it for the real tokens only)
    causal:         its batches are causal (a decoder): the eager arm keeps its packed rows, and `warmup` warms
                    no cuBLAS rungs for it (runtime/core.py `_eager_rows`)
    train_graphs:   the training graphs of its layers (graphs/train.py `TrainGraphs`), or None
    """

    sig = None
    static_reason: str | None = None
    batch_first = True
    d_model = 0
    head_dim = 0
    has_dropout = False
    trains = False
    fused = False
    mask_graph = False
    first_column = False
    embeds_in_graph = False
    embeds_token_types = False  # (with embeds_in_graph) the embedding step takes token type ids
    causal = False
    train_graphs = None

    def __init__(self, module: torch.nn.Module):
        watched = [m for m in module.modules() if m is not module]
        # the hook dicts of every submodule the ragged arm bypasses (registering a hook mutates these)
        self._hook_dicts = [m._forward_hooks for m in watched] + [m._forward_pre_hooks for m in watched]
        self._bound_modules = tuple(module.modules())

    def probe(self) -> torch.Tensor:
        """A parameter whose dtype and device stand for the module's."""
        raise NotImplementedError

    def values(self, x: torch.Tensor, layout, config, causal: bool, hidden: list | None = None) -> torch.Tensor:
        """The ragged arm on packed values x (rows, D) -> (rows, D); `hidden`, a list, gets each layer's
        output values (for `output_hidden_states`)."""
        raise NotImplementedError

    def autocast_reason(self, dtype: torch.dtype, cast: torch.dtype) -> str | None:
        """Why a batch under autocast (to `cast`) runs padded with parameters of `dtype`, or None."""
        return "autocast"

    def train_reason(self, module: torch.nn.Module, grad: bool) -> str | None:
        """Why a batch in training mode (`module.training`) or under autograd (`grad`) runs padded, or None."""
        if grad and not self.trains:
            return "autograd is on (this family's ragged arm has no backward)"
        if module.training and self.has_dropout and not self.trains:
            return "training mode with dropout"
        return None

    def embed_tables(self, module: torch.nn.Module):
        """The embedding step as kernels/masked_embed.py's `Tables`, or None (see the class docstring)."""
        return None

    def hooked(self) -> bool:
        """True when a submodule has a forward hook (it would see packed rows, or nothing, on the ragged arm)."""
        return any(self._hook_dicts)

    def layers_moved(self, module) -> bool:
        """A cheap per-batch check for structure changes that register nothing (`del layers[i]`, insert)."""
        return False

    def restructured(self, module) -> bool:
        """True if the module's submodules are not the ones this body was bound to."""
        return tuple(module.modules()) != self._bound_modules


class GraphInputs(NamedTuple):
    """What a ragged graph computes the embeddings from (`Call.graph_inputs`): `mode` "ids" or "ids_tt" (the
    embeddings take token types, given or not), the (B, L) int64 token ids, and the token types or None (zeros)."""

    mode: str
    ids: torch.Tensor
    types: torch.Tensor | None


class Call:
    """One batch of a wrapped module, as its adapter read it from the module's own call.

    B, L:         batch size and padded length (a RaggedTensor input: its components and longest one)
    kpm:          (B, L) bool on the device, True = pad, or None (no mask)
    lengths:      host ints the caller gave (`lengths=`), or None
    causal:       causal self-attention
    ragged_in:    the RaggedTensor input, or None
    any_padding:  real tokens may sit anywhere in a mask row (left padding included); else only a prefix
                  runs ragged
    reason:       why this call must run padded (a family fact: an argument the ragged arm lacks), or None
    passthrough:  why the wrapper does not run this input at all (then `original` runs it), or None
    eager_only:   why the graph arm cannot run this call (then the eager ragged arm does), or None
    wants_hidden: the ragged arm must return every layer's output too
    device, dtype, requires_grad: of the input, against the module's parameters
    x:            the padded tensor the ragged arm packs (computed on first use)
    """

    __slots__ = ()
    kpm = None
    lengths = None
    causal = False
    ragged_in = None
    any_padding = False
    padding_note = ""  # said after "key padding mask row N is not right-padded" when any_padding is False
    reason = None
    passthrough = None
    eager_only = None
    wants_hidden = False
    requires_grad = False

    def no_tokens(self) -> str:
        """A batch whose every sequence is empty: raise a clear error, or return the reason it runs padded."""
        return "no real tokens in the batch"

    def empty_row(self, row: int) -> str | None:
        """Why a batch whose row `row` has no real tokens must run padded, or None: the ragged arm then gives that
        row zeros, as PyTorch's encoder fast path does."""
        return None

    def padded(self, module, lens: tuple[int, ...], stats):
        """The padded arm's output for this call (host lengths known)."""
        raise NotImplementedError

    def padded_mask(self, module):
        """The padded arm's output for a mask-only call whose lengths were not read."""
        raise NotImplementedError

    def finish(self, y, hidden: list | None = None):
        """The module's output from the ragged arm's result `y` (padded, zeros at pads; or a RaggedTensor
        for a RaggedTensor input) and, when asked for, each layer's padded output."""
        return y

    def graph_inputs(self) -> GraphInputs | None:
        """What the ragged graphs compute the embeddings from, where they may (`Body.embeds_in_graph`), or None: a
        graph then packs `x`."""
        return None

    def original(self, module):
        """The module's own forward on the call as given (for a passthrough)."""
        raise NotImplementedError


class EpochCache:
    """A value recomputed only when a parameter or module was registered anywhere (`param_epoch`)."""

    __slots__ = ("make", "value", "epoch")

    def __init__(self, make):
        self.make, self.value, self.epoch = make, None, -1

    def get(self):
        if self.epoch != param_epoch():
            self.value, self.epoch = self.make(), param_epoch()
        return self.value
