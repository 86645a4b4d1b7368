"""`python -m autoragged.job`: a model directory over a file of texts, one result per text, in token-budget bins;
under `torchrun` each rank runs its share (`autoragged.job.run_job`) and rank 0 writes the output."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger("autoragged")

_FORMATS = (".jsonl", ".npy", ".parquet")
_VECTOR_KINDS = ("mean", "cls", "pooler", "last_hidden", "last_logits")  # one vector per document
_KINDS = ("mean", "cls", "pooler", "last_hidden", "last_logits", "token_logprobs", "hidden")
_LM_KINDS = ("last_logits", "token_logprobs")  # need the model's LM head: AutoModelForCausalLM

_EPILOG = """examples:
  python -m autoragged.job --model ./my-bert --input texts.jsonl --output emb.npy --output-kind mean
  torchrun --nproc-per-node 4 -m autoragged.job --model ./my-qwen --input docs.jsonl \\
      --output scores.jsonl --output-kind token_logprobs

input:   one JSON value per line: an object holding the text under --text-field ("text"; its "id", if any, is
         copied to the output), or a bare string. Blank lines are skipped.
kinds:   encoders (BERT family, ModernBERT): mean, cls, pooler (the model's own), hidden (every token);
         decoders (Llama, Qwen2, Mistral, ...): mean, last_hidden, last_logits, token_logprobs, hidden.
output:  .jsonl  one object per text, in input order: {"index": i, "id": ..., "<kind>": [...]}
         .npy    float32 (texts, D), for kinds of one vector per text (mean, cls, pooler, last_hidden, last_logits)
         .parquet columns index, id, <kind> (a list of floats); needs pyarrow: pip install 'autoragged[parquet]'
resuming: results go to --shards (default OUTPUT.shards) as they come; after a crash, the same command computes
         only what the shards lack. The shards are deleted once OUTPUT is written (--keep-shards keeps them).
Under torchrun, every rank reads and tokenizes the input, runs its share of the bins (split by tokens), and
rank 0 writes OUTPUT once all are done; the progress bar is rank 0's share."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m autoragged.job",
        description="Run a HuggingFace model directory (its tokenizer and weights) over a JSONL file of texts and\n"
        "write one result per text (an embedding, a pooled vector, per-token log-probabilities), in input order.\n"
        "Texts run padding-free in token-budget bins on a wrapped model (autoragged.job.run_job); under torchrun\n"
        "the bins are split over the ranks.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="a local model directory (AutoTokenizer / AutoModel files)")
    p.add_argument("--input", required=True, help="a JSONL file of texts")
    p.add_argument("--output", required=True, help=f"the output file: {', '.join(_FORMATS)}")
    p.add_argument("--output-kind", required=True, choices=_KINDS, help="what to keep per text (see below)")
    p.add_argument("--text-field", default="text", help="the field of each input object holding the text")
    p.add_argument("--max-length", type=int, help="truncate texts to this many tokens (default: the tokenizer's "
                   "model_max_length where it sets one)")  # fmt: skip
    p.add_argument("--max-tokens", type=int, help="the bin budget in tokens (default: measured on the device)")
    p.add_argument("--align", type=int, help="bin alignment (default: the ragged arm's)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
                   help="the model's dtype (auto: as saved)")  # fmt: skip
    p.add_argument("--device", help="default: cuda:LOCAL_RANK where a GPU is visible, else cpu")
    p.add_argument("--shards", help="the directory results are written to as they come (default: OUTPUT.shards)")
    p.add_argument("--keep-shards", action="store_true", help="keep the shards once OUTPUT is written")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from ..tune import setup_logging

    setup_logging(args.verbose)
    try:
        return _run(args)
    except (ValueError, OSError) as e:  # bad input, files: one line, like every usage error
        log.error("autoragged.job: %s", e)
        return 2


def _run(args) -> int:
    import torch

    import autoragged

    from .ranks import init_distributed

    output = Path(args.output)
    _check_output(output, args.output_kind)
    texts, ids = _read_input(Path(args.input), args.text_field)
    dist = torch.distributed
    before = dist.is_available() and dist.is_initialized()
    rank, _ = init_distributed()
    owned = not before and dist.is_available() and dist.is_initialized()  # (torchrun's environment: ours to end)
    try:
        results = _results(args, texts)
        if rank == 0:
            _write(output, args.output_kind, results, ids)
            log.info("autoragged.job: wrote %d results to %s", len(texts), output)
        else:
            for _ in results:  # (a collective: rank 0 yields, the others run their share)
                pass
    finally:
        if owned:
            dist.destroy_process_group()
    autoragged.flush()  # this run's decisions into the tuning database now, while the log handler is ours
    shards = _shards(args)
    if rank == 0 and shards is not None and not args.keep_shards:
        shutil.rmtree(shards, ignore_errors=True)
    return 0


def _shards(args) -> Path:
    return Path(args.shards) if args.shards else Path(f"{args.output}.shards")


def _check_output(output: Path, kind: str) -> None:
    """A clear error before any work where the output cannot be written as asked."""
    if output.suffix not in _FORMATS:
        raise ValueError(f"--output {output}: write {', '.join(_FORMATS)} (by the file's suffix)")
    if output.suffix == ".npy" and kind not in _VECTOR_KINDS:
        raise ValueError(
            f"--output {output}: a .npy file holds one vector per text, but --output-kind {kind} gives a different "
            "length per text; write .jsonl or .parquet"
        )
    if output.suffix == ".parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ValueError(
                f"--output {output}: writing .parquet needs pyarrow: pip install 'autoragged[parquet]' (or pip install "
                "pyarrow), or write .jsonl / .npy"
            ) from None
    if not output.parent.is_dir():
        raise ValueError(f"--output {output}: the directory {output.parent} does not exist")


def _read_input(path: Path, field: str) -> tuple[list[str], list | None]:
    """(the texts, their "id" values or None where no record has one) of a JSONL file."""
    texts, ids = [], []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {number}: not JSON ({e})") from None
            if isinstance(record, dict):
                if field not in record:
                    raise ValueError(f"{path} line {number}: no {field!r} field (keys: {sorted(record)}); "
                                     "--text-field names the field holding the text")  # fmt: skip
                text, key = record[field], record.get("id")
            else:
                text, key = record, None
            if not isinstance(text, str):
                raise ValueError(f"{path} line {number}: the text is a {type(text).__name__}, not a string")
            texts.append(text)
            ids.append(key)
    if not texts:
        raise ValueError(f"{path} holds no texts")
    return texts, (ids if any(k is not None for k in ids) else None)


def _load(args):
    """(the wrapped model on its device, its tokenizer), from the model directory."""
    import torch
    import transformers

    import autoragged

    from ..models.hf_encoder import FAMILIES as ENCODERS

    config = transformers.AutoConfig.from_pretrained(args.model)
    encoder = config.model_type in ENCODERS
    if encoder and args.output_kind in _LM_KINDS + ("last_hidden",):
        raise ValueError(
            f"--output-kind {args.output_kind} is a decoder's; {args.model} holds a {config.model_type} encoder: "
            "use mean, cls, pooler or hidden"
        )
    if not encoder and args.output_kind in ("cls", "pooler"):
        raise ValueError(f"--output-kind {args.output_kind} is an encoder's; {args.model} holds a {config.model_type} "
                         "model: use mean, last_hidden, last_logits, token_logprobs or hidden")  # fmt: skip
    cls = transformers.AutoModelForCausalLM if args.output_kind in _LM_KINDS else transformers.AutoModel
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    device = args.device or (f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu")
    model = cls.from_pretrained(args.model, dtype=dtype).to(device).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    return autoragged.wrap(model), tokenizer


def _results(args, texts: list[str]):
    """run_job's results (on rank 0; nothing on the others) for the texts, tokenized with the model's tokenizer."""
    from ..job import run_job

    model, tokenizer = _load(args)
    limit = args.max_length or (tokenizer.model_max_length if tokenizer.model_max_length < 1_000_000 else None)
    encoded = tokenizer(texts, truncation=limit is not None, max_length=limit)
    empty = next((i for i, doc in enumerate(encoded["input_ids"]) if not doc), None)
    if empty is not None:
        raise ValueError(f"text {empty} of {args.input} has no tokens (an empty text, and no special tokens added)")
    documents = {key: encoded[key] for key in ("input_ids", "token_type_ids") if key in encoded}
    shards = _shards(args)
    return run_job(model, documents, output=args.output_kind, max_tokens=args.max_tokens, align=args.align,
                   progress=not args.no_progress, shards=shards)  # fmt: skip


def _write(output: Path, kind: str, results, ids: list | None) -> None:
    """The results, in input order, to `output` (whole or not at all: a temporary file renamed over it)."""
    tmp = output.with_name(output.name + f".{os.getpid()}.tmp")
    try:
        {".jsonl": _write_jsonl, ".npy": _write_npy, ".parquet": _write_parquet}[output.suffix](tmp, kind, results, ids)
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)


def _write_jsonl(path: Path, kind: str, results, ids) -> None:
    with path.open("w", encoding="utf-8") as f:
        for i, value in enumerate(results):
            record = {"index": i} if ids is None else {"index": i, "id": ids[i]}
            record[kind] = value.float().tolist()
            f.write(json.dumps(record) + "\n")


def _write_npy(path: Path, kind: str, results, ids) -> None:
    import numpy as np

    rows = [value.float().numpy() for value in results]
    with path.open("wb") as f:  # (np.save given a name would add ".npy" to it)
        np.save(f, np.stack(rows))


def _write_parquet(path: Path, kind: str, results, ids) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    values = [value.float().numpy() for value in results]
    columns = {"index": pa.array(range(len(values)), type=pa.int64())}
    if ids is not None:
        columns["id"] = pa.array(ids)
    columns[kind] = pa.array(values, type=pa.list_(pa.float32()))
    pq.write_table(pa.table(columns), path)
