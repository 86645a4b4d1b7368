"""SentenceTransformer.encode, plain against wrapped: sentences per second end to end, tokenizing included.

    python benchmarks/encode.py                          # 20,000 sentences, bert-base, batch 64
    python benchmarks/encode.py --model minilm --sentences 50000
    python benchmarks/encode.py --quick                  # 4,000 sentences
    python benchmarks/encode.py --smoke                  # a tiny BERT on the CPU: checks the script

The sentences: lengths drawn from the eight CoRa distributions in equal shares (PyCoRa's Beta recipe), made of
synthetic words of a word-level vocabulary, so each word is one token. The model: a random-weight BertModel of the
shape (benchmarks/hf_table.py's shapes) saved with a BertTokenizerFast for it, loaded by SentenceTransformer (mean
pooling), fp16 on the GPU. Per mode, three encode() calls of every sentence at --batch: cold (the first: the
process's start-up costs and, wrapped, its kernels and graphs), warm, and warm with numpy output (a copy to the host
per batch, encode()'s default); `convert_to_tensor=True` otherwise. Modes: plain, and wrapped
(`autoragged.wrap(st, db=False)`). Also the largest |wrapped - plain| of the embeddings. Appends a line to
benchmarks/results/encode.jsonl.
"""

from __future__ import annotations

import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import autoragged  # noqa: E402
from autoragged.workloads import CORA, hf_config, sample_cora  # noqa: E402
from benchmarks._common import device_of, header, parser, record, sync, table  # noqa: E402
from benchmarks.hf_table import SHAPES, TINY  # noqa: E402

WORDS = 20000


def sentences_of(n: int) -> list[str]:
    """n sentences of synthetic words, their token counts (with [CLS] and [SEP]) drawn from the CoRa datasets."""
    rng = np.random.default_rng(7)
    lengths = [k for name in CORA for k in sample_cora(name, -(-n // len(CORA)), rng)][:n]
    return [" ".join(f"w{(i * 131 + j * 7) % WORDS}" for j in range(max(k - 2, 1))) for i, k in enumerate(lengths)]


def save_model(folder: str, name: str, smoke: bool) -> None:
    """A random-weight BertModel of the shape and a word-level tokenizer for it, saved in `folder`."""
    import transformers

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(WORDS)]
    pathlib.Path(folder, "vocab.txt").write_text("\n".join(words))
    transformers.BertTokenizerFast(vocab_file=str(pathlib.Path(folder, "vocab.txt"))).save_pretrained(folder)
    config = transformers.BertConfig(**TINY) if smoke else hf_config(SHAPES[name])
    config.vocab_size = len(words)
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(folder)


def encode_s(st, sentences, batch: int, device, numpy: bool = False) -> tuple[float, torch.Tensor]:
    """(wall seconds of one encode() of every sentence, the embeddings on the CPU)."""
    sync(device)
    t0 = time.perf_counter()
    emb = st.encode(sentences, batch_size=batch, convert_to_tensor=not numpy)
    sync(device)
    return time.perf_counter() - t0, torch.as_tensor(emb).float().cpu()


def bench_mode(mode: str, folder: str, sentences, args, device) -> tuple[dict, torch.Tensor]:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(folder, device=str(device))
    st = (st.half() if device.type == "cuda" else st).eval()
    st.max_seq_length = 512
    if mode == "wrapped":
        autoragged.wrap(st, db=False)
    cold, _ = encode_s(st, sentences, args.batch, device)
    warm, emb = encode_s(st, sentences, args.batch, device)
    numpy_warm, _ = encode_s(st, sentences, args.batch, device, numpy=True)
    row = {"mode": mode, "cold_s": cold, "warm_s": warm, "numpy_warm_s": numpy_warm,
           "sentences_per_s": len(sentences) / warm}  # fmt: skip
    print(f"  {mode}: cold {cold:.2f} s, warm {warm:.2f} s, numpy output {numpy_warm:.2f} s", flush=True)
    return row, emb


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--model", choices=list(SHAPES), default="bert-base")
    p.add_argument("--sentences", type=int, default=20000)
    p.add_argument("--batch", type=int, default=64, help="encode()'s batch_size (default 64)")
    args = p.parse_args(argv)
    args.sentences = 200 if args.smoke else 4000 if args.quick else args.sentences
    device = device_of(args, "benchmarks/encode.py")
    header(f"SentenceTransformer.encode, {args.model}" + (", smoke: tiny, CPU" if args.smoke else " (fp16)"))
    sentences = sentences_of(args.sentences)
    rows, embeddings = [], {}
    with tempfile.TemporaryDirectory() as folder:
        save_model(folder, args.model, args.smoke)
        for mode in ("plain", "wrapped"):
            row, embeddings[mode] = bench_mode(mode, folder, sentences, args, device)
            rows.append(row)
    plain = rows[0]
    for row in rows:
        row["speedup_warm"] = plain["warm_s"] / row["warm_s"]
        row["speedup_numpy_warm"] = plain["numpy_warm_s"] / row["numpy_warm_s"]
    rows[1]["max_abs_diff"] = (embeddings["wrapped"] - embeddings["plain"]).abs().max().item()
    print(f"\n## encode() of {len(sentences)} sentences, batch {args.batch}\n")
    print(table(rows, [("mode", "mode", ""), ("cold_s", "cold s", ".2f"), ("warm_s", "warm s", ".2f"),
                       ("numpy_warm_s", "numpy warm s", ".2f"), ("sentences_per_s", "sentences/s", ",.0f"),
                       ("speedup_warm", "x plain", ".2f"), ("speedup_numpy_warm", "x plain (numpy)", ".2f"),
                       ("max_abs_diff", "max diff", ".1e")]))  # fmt: skip
    record("encode", args, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
