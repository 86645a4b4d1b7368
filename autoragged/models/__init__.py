"""Model families: each file finds the modules of its family in a model, reads their calls and runs their layers
on packed rows (an adapter: `Body` and `Call`, base.py).

    torch_encoder  nn.TransformerEncoder / nn.TransformerEncoderLayer
    hf_encoder     HuggingFace encoders (BERT family, ModernBERT) and the models that hold them
                   (task heads, sentence-transformers: sentence.py)
    hf_decoder     HuggingFace decoder LLMs (Llama, Mistral, Qwen2/3, Gemma, Phi-3, GPT-2) for prefill-style
                   work, and the models that hold them (...ForCausalLM, ...ForSequenceClassification); the fused
                   decoder layers (fused_decoder.py)
    hf             what the HF families share (dispatch, calls, our attention in transformers' interface)
    encoder        the fused encoder layer stack both encoder families run (family-agnostic)
    qkv            one q/k/v product per layer for the BERT family

An adapter never imports another adapter; the runtime never imports transformers (an adapter does, and
only once transformers was imported by the caller: a model cannot be a HuggingFace one before that).
"""

from __future__ import annotations

import sys

from torch import nn

__all__ = ["adapters_for"]


def adapters_for(model: nn.Module) -> list:
    """The adapters to consult for `model`, in order."""
    from .torch_encoder import ADAPTER as torch_encoder

    found = [torch_encoder]
    if "transformers" in sys.modules:
        from .hf_decoder import ADAPTER as hf_decoder
        from .hf_encoder import ADAPTER as hf_encoder

        found += [hf_encoder, hf_decoder]
    return found
