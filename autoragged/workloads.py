"""Length distributions: the CoRa datasets of record and the families the tuner samples.

The CoRa statistics are those of shared/workloads/cora.json (CoRa, Fegade et al., MLSys 2022, Table 3),
kept here so the package carries them (tests check the copy against the shared file when present).
PyCoRa's recipe: length = min + (max - min) * Beta(a, b) with a + b = 5 and the mean matched,
m = (mean - min) / (max - min), a = 5 m, b = 5 (1 - m); rounded and clipped to [min, max].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "CORA", "CORA_MODEL", "CORA_BATCH_SIZES", "Dataset", "sample_cora", "sample", "FAMILIES", "HF_SHAPES", "hf_config",
    "LLM_SHAPES", "llm_config", "DOCUMENT_MIXES", "sample_documents",
]  # fmt: skip


@dataclass(frozen=True)
class Dataset:
    name: str
    min: int
    mean: int
    max: int


CORA = {
    d.name: d
    for d in (
        Dataset("RACE", 80, 364, 512),
        Dataset("Wiki512", 12, 371, 512),
        Dataset("SQuAD", 39, 192, 384),
        Dataset("Wiki128", 14, 117, 128),
        Dataset("MNLI", 9, 43, 128),
        Dataset("XNLI", 9, 70, 128),
        Dataset("MRPC", 21, 59, 102),
        Dataset("CoLA", 6, 13, 37),
    )
}
CORA_MODEL = {"layers": 6, "d_model": 512, "heads": 8, "ff": 2048}
CORA_BATCH_SIZES = (32, 64, 128)


def sample_cora(dataset: Dataset | str, batch: int, rng: np.random.Generator) -> list[int]:
    """B lengths from PyCoRa's Beta recipe for a CoRa dataset."""
    d = CORA[dataset] if isinstance(dataset, str) else dataset
    return _beta(d.min, d.mean, d.max, batch, rng)


def _beta(lo: int, mean: float, hi: int, batch: int, rng: np.random.Generator) -> list[int]:
    if hi == lo:
        return [lo] * batch
    m = min(max((mean - lo) / (hi - lo), 0.02), 0.98)
    draws = lo + (hi - lo) * rng.beta(5 * m, 5 * (1 - m), size=batch)
    return np.clip(np.rint(draws), lo, hi).astype(int).tolist()


def _lognormal(batch: int, rng: np.random.Generator, median: float, sigma: float, hi: int) -> list[int]:
    return np.clip(np.rint(rng.lognormal(np.log(median), sigma, size=batch)), 1, hi).astype(int).tolist()


def _bimodal(batch: int, rng: np.random.Generator, short: tuple[int, int], long: tuple[int, int], p_long: float):
    is_long = rng.random(batch) < p_long
    lo = np.where(is_long, long[0], short[0])
    hi = np.where(is_long, long[1], short[1])
    return (lo + np.floor(rng.random(batch) * (hi - lo + 1))).astype(int).tolist()


def sample(family: str, batch: int, max_len: int, rng: np.random.Generator) -> list[int]:
    """B lengths in [1, max_len] from one of the tuner's families (see FAMILIES)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown length family {family!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[family](batch, max_len, rng)


# Each family takes (batch, max_len, rng); parameters are drawn too, so one family covers a range of
# shapes (the tuner wants many distinct padding fractions, not eight fixed points).
FAMILIES = {
    "cora_beta": lambda b, L, r: _beta(lo := int(r.integers(1, max(2, L // 4))), r.uniform(lo, L), L, b, r),
    "lognormal": lambda b, L, r: _lognormal(b, r, median=r.uniform(0.05, 0.6) * L, sigma=r.uniform(0.2, 0.9), hi=L),
    "bimodal": lambda b, L, r: _bimodal(
        b, r, short=(1, max(1, L // 8)), long=(max(1, L * 3 // 4), L), p_long=float(r.uniform(0.05, 0.5))
    ),
    "uniform": lambda b, L, r: (1 + np.floor(r.random(b) * r.uniform(0.1, 1.0) * L)).astype(int).tolist(),
    "equal": lambda b, L, r: [int(r.integers(1, L + 1))] * b,
}


# -- HuggingFace encoder shapes (random weights: nothing is downloaded) -------------------------------------
# name -> (model_type, hidden, layers, heads, ff, vocab); the dims of the public checkpoints of those names
HF_SHAPES = {
    "bert-base": ("bert", 768, 12, 12, 3072, 30522),
    "bert-large": ("bert", 1024, 24, 16, 4096, 30522),
    "roberta-base": ("roberta", 768, 12, 12, 3072, 50265),
    "MiniLM-L12-H384": ("bert", 384, 12, 12, 1536, 30522),
    "bge-small": ("bert", 384, 12, 12, 1536, 30522),
}


def hf_config(name: str):
    """A transformers config for one of HF_SHAPES or LLM_SHAPES, or read from a config.json path (transformers is
    imported here, lazily: it is an optional dependency)."""
    import json
    import os

    try:
        import transformers
    except ImportError as e:
        raise ImportError("HF model shapes need transformers: pip install 'autoragged[transformers]'") from e
    if name in LLM_SHAPES:
        return llm_config(name)
    if name in HF_SHAPES:
        model_type, hidden, layers, heads, ff, vocab = HF_SHAPES[name]
        extra = {}
        if model_type == "roberta":  # positions start at padding_idx + 1 = 2
            extra = {"max_position_embeddings": 514, "pad_token_id": 1, "type_vocab_size": 1}
        return transformers.AutoConfig.for_model(
            model_type, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            intermediate_size=ff, vocab_size=vocab, **extra,
        )  # fmt: skip
    if os.path.isfile(name) or os.path.isfile(os.path.join(name, "config.json")):
        path = name if os.path.isfile(name) else os.path.join(name, "config.json")
        with open(path) as f:
            data = json.load(f)
        if "model_type" not in data:
            raise ValueError(f"{path} has no model_type: not a transformers config.json")
        return transformers.AutoConfig.for_model(**data)
    known = sorted(HF_SHAPES) + sorted(LLM_SHAPES)
    raise ValueError(f"unknown HF model {name!r}: one of {known} or a config.json path")


# -- decoder LLM shapes and document mixes (random weights and token ids: nothing is downloaded) ---------------
# name -> Qwen2 config fields of the public checkpoint of that name (its config.json)
LLM_SHAPES = {
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}  # fmt: skip


def llm_config(name: str, layers: int | None = None):
    """A transformers Qwen2Config of one of LLM_SHAPES (rope theta 1e6, 32K positions, no sliding window, as
    the checkpoints), optionally with fewer layers."""
    import transformers

    fields = dict(LLM_SHAPES[name], rope_theta=1e6, max_position_embeddings=32768, rms_norm_eps=1e-6,
                  pad_token_id=151643, bos_token_id=151643, eos_token_id=151643, use_sliding_window=False)  # fmt: skip
    if layers is not None:
        fields["num_hidden_layers"] = layers
    return transformers.Qwen2Config(**fields)


# WarpGroup-backend's two document corpora (word counts; 1.3 tokens a word): "bimodal" mixes 45-130-word and
# 1,820-2,000-word texts half and half (48% of tokens were padding at batch 8 in their report), "uniform" draws
# 50-1,900 words
DOCUMENT_MIXES = {"bimodal": ((45, 130), (1820, 2000)), "uniform": ((50, 1900),)}
TOKENS_PER_WORD = 1.3


def sample_documents(mix: str, n: int, rng: np.random.Generator) -> list[int]:
    """n document lengths in tokens from one of DOCUMENT_MIXES, in random (data) order."""
    if mix not in DOCUMENT_MIXES:
        raise ValueError(f"unknown document mix {mix!r}; known: {sorted(DOCUMENT_MIXES)}")
    ranges = DOCUMENT_MIXES[mix]
    which = rng.integers(0, len(ranges), size=n)
    lo = np.array([ranges[i][0] for i in which])
    hi = np.array([ranges[i][1] for i in which])
    words = lo + np.floor(rng.random(n) * (hi - lo + 1))
    return np.maximum(1, np.rint(words * TOKENS_PER_WORD)).astype(int).tolist()
