"""The window convention of `ragged_attention`, checked against PyTorch and against transformers.

`kernels.ragged_attention` defines windows as flash-attention does: query row i sees keys j with
i - left <= j <= i + right (-1 unbounded), and j <= i when causal; `window_from_hf` maps a transformers
config's `sliding_window` onto that. Here the rule meets
- PyTorch: the reference equals per-sequence `scaled_dot_product_attention` with a boolean mask written out
  element by element (and torch's own GQA), so the reference is not only checked against itself;
- transformers 5.x: the masks its padded path builds (`masking_utils.create_sliding_window_causal_mask` for
  Mistral and Qwen2, `create_bidirectional_sliding_window_mask` for ModernBERT) and the `window_size` its
  flash path passes (`_process_flash_attention_kwargs`) equal ours, and its padded SDPA attention on real
  tokens equals our op on the ragged batch.
"""

import types

import pytest
import torch
import torch.nn.functional as F
from autoragged.kernels import ragged_attention as k_attn

import autoragged.ops as ops
from autoragged import RaggedTensor

LENGTHS = [9, 1, 5, 14, 3]  # right-padded to 14 in the transformers tests


def rule_mask(n: int, left: int, right: int, causal: bool) -> torch.Tensor:
    """The window rule written out element by element (independent of `window_mask`'s tensor algebra)."""
    rows = [
        [(left < 0 or j >= i - left) and (right < 0 or j <= i + right) and (not causal or j <= i) for j in range(n)]
        for i in range(n)
    ]
    return torch.tensor(rows, dtype=torch.bool).reshape(n, n)


CASES = [((-1, -1), False), ((-1, -1), True), ((2, 2), False), ((3, 1), False), ((0, 0), False), ((-1, 2), False)]
CASES += [((4, 0), True), ((2, 5), True), ((20, 20), False), ((0, -1), True)]


@pytest.mark.parametrize("window, causal", CASES, ids=[f"{w[0]}_{w[1]}{'-causal' if c else ''}" for w, c in CASES])
@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (4, 2), (3, 1)], ids=["mha", "gqa", "mqa"])
def test_reference_equals_sdpa_with_an_explicit_mask(window, causal, heads, kv_heads):
    offsets = [0]
    for n in LENGTHS:
        offsets.append(offsets[-1] + n)
    q = torch.randn(offsets[-1], heads, 16, dtype=torch.float64)
    k, v = (torch.randn(offsets[-1], kv_heads, 16, dtype=torch.float64) for _ in "kv")
    ours = k_attn.ragged_attention_ref(q, k, v, offsets, LENGTHS, causal=causal, window=window)
    for start, n in zip(offsets, LENGTHS):
        keep = rule_mask(n, *window, causal)
        assert torch.equal(k_attn.window_mask(n, window, causal), keep)
        qi, ki, vi = (t[start : start + n].transpose(0, 1) for t in (q, k, v))
        dense = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=keep, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(ours[start : start + n], dense, rtol=1e-12, atol=1e-12)


# -- transformers -----------------------------------------------------------------------------------
def _small(config_cls, **kwargs):
    tokens = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = config_cls(hidden_size=64, intermediate_size=64, num_hidden_layers=3, vocab_size=100, **tokens, **kwargs)
    config._attn_implementation = "sdpa"
    return config


def _padded_inputs(hidden: int):
    L = max(LENGTHS)
    padding = (torch.arange(L)[None, :] < torch.tensor(LENGTHS)[:, None]).long()  # right padding
    return torch.zeros(len(LENGTHS), L, hidden), padding


def _mistral_like(sliding_window):
    from transformers import MistralConfig

    return _small(MistralConfig, num_attention_heads=4, num_key_value_heads=2, sliding_window=sliding_window)


def _qwen2_like(sliding_window):
    from transformers import Qwen2Config

    config = _small(
        Qwen2Config, num_attention_heads=4, num_key_value_heads=1, use_sliding_window=True,
        sliding_window=sliding_window, max_window_layers=0,
    )  # fmt: skip
    assert config.layer_types[0] == "sliding_attention"
    return config


def _modernbert_like(local_attention):
    from transformers import ModernBertConfig

    config = _small(ModernBertConfig, num_attention_heads=4, local_attention=local_attention, cls_token_id=1)
    config.sep_token_id = 2
    assert config.sliding_window == local_attention // 2 and "sliding_attention" in config.layer_types
    return config


def _hf_mask(config, causal: bool) -> torch.Tensor:
    """The (B, 1, L, L) boolean mask transformers' padded SDPA path uses for a sliding layer."""
    from transformers.masking_utils import create_bidirectional_sliding_window_mask, create_sliding_window_causal_mask

    embeds, padding = _padded_inputs(config.hidden_size)
    if causal:
        mask = create_sliding_window_causal_mask(
            config=config, inputs_embeds=embeds, attention_mask=padding, past_key_values=None
        )
    else:
        mask = create_bidirectional_sliding_window_mask(config=config, inputs_embeds=embeds, attention_mask=padding)
    assert mask is not None and mask.dtype == torch.bool and mask.shape == (len(LENGTHS), 1, *embeds.shape[1:2] * 2)
    return mask


HF_CASES = [
    ("mistral", _mistral_like, 4, True),
    ("mistral-wide", _mistral_like, 32, True),  # the window is longer than every sequence
    ("qwen2", _qwen2_like, 3, True),
    ("modernbert", _modernbert_like, 8, False),  # local_attention 8: sliding_window 4, window (4, 4)
    ("modernbert-odd", _modernbert_like, 5, False),  # local_attention 5: sliding_window 2
]


@pytest.mark.parametrize("make, size, causal", [c[1:] for c in HF_CASES], ids=[c[0] for c in HF_CASES])
def test_window_matches_transformers_padded_masks(make, size, causal):
    """For each sequence, the top-left n x n block of transformers' mask is our rule for window_from_hf."""
    pytest.importorskip("transformers")
    config = make(size)
    window = k_attn.window_from_hf(config.sliding_window, causal=causal)
    mask = _hf_mask(config, causal)
    for b, n in enumerate(LENGTHS):
        assert torch.equal(mask[b, 0, :n, :n], k_attn.window_mask(n, window, causal)), (b, n, window)
        assert not mask[b, 0, :n, n:].any(), "padded keys must be hidden"
    if config.sliding_window < max(LENGTHS):  # the test can fail: the window cuts keys off somewhere
        n = max(LENGTHS)
        assert not k_attn.window_mask(n, window, causal).equal(k_attn.window_mask(n, causal=causal))


@pytest.mark.parametrize("make, size, causal", [c[1:] for c in HF_CASES], ids=[c[0] for c in HF_CASES])
def test_window_matches_transformers_flash_window_size(make, size, causal):
    """transformers' flash path turns the attention module's `sliding_window` into flash's window_size; with
    its causal flag that window hides the same keys as ours (ModernBERT passes config.sliding_window + 1)."""
    pytest.importorskip("transformers")
    from transformers.modeling_flash_attention_utils import _process_flash_attention_kwargs

    config = make(size)
    if causal:
        module_window = config.sliding_window  # Mistral: getattr(config, "sliding_window"); Qwen2: the same
    else:
        from transformers.models.modernbert.modeling_modernbert import ModernBertAttention

        layer = config.layer_types.index("sliding_attention")
        module_window = ModernBertAttention(config, layer_idx=layer).sliding_window
    supported = dict.fromkeys(("dropout_p", "deterministic", "softcap", "s_aux", "learnable_sink"), False)
    supported.update(window_size=True, max_seqlen_q=False, max_seqlen_k=False)
    n = 4 * size + 3  # longer than the window: transformers passes no window_size otherwise
    flash = _process_flash_attention_kwargs(n, n, causal, sliding_window=module_window, supports_mapping=supported)
    assert flash["causal"] == causal
    ours = k_attn.window_from_hf(config.sliding_window, causal=causal)
    assert torch.equal(k_attn.window_mask(n, flash["window_size"], causal), k_attn.window_mask(n, ours, causal))
    if not causal:
        assert flash["window_size"] == ours


@pytest.mark.parametrize("make, size, causal", [c[1:] for c in HF_CASES[::3]], ids=[c[0] for c in HF_CASES[::3]])
def test_op_equals_transformers_padded_sdpa_attention(make, size, causal):
    """End to end on numbers: transformers' own sdpa_attention_forward on the padded batch with its sliding
    mask (GQA through the module's num_key_value_groups) against our op on the ragged batch (the Triton kernel
    where it runs, else the reference), on real tokens."""
    pytest.importorskip("transformers")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    config = make(size)
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    head_dim, L, B = 32, max(LENGTHS), len(LENGTHS)
    qp = torch.randn(B, heads, L, head_dim)
    kp, vp = (torch.randn(B, kv_heads, L, head_dim) for _ in "kv")
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=causal, training=False)
    padded, _ = sdpa_attention_forward(module, qp, kp, vp, _hf_mask(config, causal), scaling=head_dim**-0.5)

    q, k, v = (RaggedTensor.from_padded(t.transpose(1, 2).contiguous(), LENGTHS) for t in (qp, kp, vp))
    window = k_attn.window_from_hf(config.sliding_window, causal=causal)
    ours = ops.ragged_attention(q, k, v, causal=causal, window=window)
    for b, n in enumerate(LENGTHS):
        torch.testing.assert_close(ours.select(b), padded[b, :n], rtol=2e-5, atol=2e-5)
    plain = ops.ragged_attention(q, k, v, causal=causal)
    assert not torch.allclose(plain.values, ours.values, atol=1e-3), "the window must change something here"


def test_window_from_hf_edges():
    assert k_attn.window_from_hf(None, causal=True) == (-1, -1)
    assert k_attn.window_from_hf(4096, causal=True) == (4095, 0)  # Mistral-7B-v0.1
    assert k_attn.window_from_hf(64, causal=False) == (64, 64)  # ModernBERT: local_attention 128
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        k_attn.window_from_hf(0, causal=True)
