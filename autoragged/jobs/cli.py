"""`python -m autoragged.job`: a model directory over a file of texts, one result per text, in token-budget bins;
under `torchrun` the ranks take the bins between them (`autoragged.job.run_job`) and rank 0 writes the output.

The texts go in chunks of --chunk-texts: a background thread tokenizes chunk k + 1 while chunk k runs (an HF fast
tokenizer releases the GIL while it encodes a batch), and each chunk is one run_job call with its own shard
directory (OUTPUT.shards/chunk-00003/), so a rerun after a crash computes only what those directories lack."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .ranks import Ranks

log = logging.getLogger("autoragged")

_FORMATS = (".jsonl", ".npy", ".parquet")
_VECTOR_KINDS = ("mean", "cls", "pooler", "last_hidden", "last_logits")  # one vector per document
_KINDS = ("mean", "cls", "pooler", "last_hidden", "last_logits", "token_logprobs", "hidden")
_LM_KINDS = ("last_logits", "token_logprobs")  # need the model's LM head: AutoModelForCausalLM
# Texts per chunk: 16384 texts of ~275 tokens are some 300 bins of 16k tokens, so a run_job call's own cost (a probe
# forward where the budget is measured, a few barriers) is spread thin; only chunk 0's tokenization is not hidden
# behind the GPU, and it overlaps the model load. Not tuned by a measurement.
_CHUNK_TEXTS = 16384
_MANIFEST = "chunks.json"  # the shard directory's record of how the input was chunked

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
chunks:  the texts are tokenized in chunks of --chunk-texts (16384) on a background thread, one chunk ahead of the
         model: chunk k + 1 is tokenized while chunk k runs. Each chunk is binned on its own.
resuming: results go to --shards (default OUTPUT.shards), one directory per chunk (chunk-00000, ...), as they come;
         after a crash, the same command (the same --chunk-texts) computes only what the shards lack. The shards
         are deleted once OUTPUT is written (--keep-shards keeps them).
Under torchrun, every rank reads and tokenizes the input, takes each chunk's bins one at a time as it goes,
and rank 0 writes OUTPUT once all are done; the progress bar counts the texts done: rank 0's as they come, every
rank's at the end of each chunk."""


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
    p.add_argument("--chunk-texts", type=_positive, default=_CHUNK_TEXTS, metavar="N",
                   help=f"tokenize and run the texts N at a time, the next chunk tokenized while one runs (default: "
                   f"{_CHUNK_TEXTS}); a rerun resumes only with the same N")  # fmt: skip
    p.add_argument("--shards", help="the directory results are written to as they come, one directory per chunk "
                   "(default: OUTPUT.shards)")  # fmt: skip
    p.add_argument("--keep-shards", action="store_true", help="keep the shards once OUTPUT is written")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a positive number of texts, got {text!r}")
    return value


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
        _run_chunks(args, texts, ids)
    finally:
        if owned:
            dist.destroy_process_group()
    autoragged.flush()  # this run's decisions into the tuning database now, while the log handler is ours
    shards = _shards(args)
    if rank == 0 and shards is not None and not args.keep_shards:
        shutil.rmtree(shards, ignore_errors=True)
    return 0


def _run_chunks(args, texts: list[str], ids: list | None) -> None:
    """The job, chunk by chunk (tokenized on a thread from the start, the model loading meanwhile); rank 0 writes
    the output."""
    import transformers

    from .ranks import Ranks

    ranks = Ranks.current()
    chunking = _Chunking(len(texts), args.chunk_texts, args.output_kind)
    _check_shards(_shards(args), chunking)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    with _Tokenized(tokenizer, texts, args.chunk_texts, _limit(args, tokenizer), args.input) as chunks:
        model = _load(args)
        _record_shards(_shards(args), chunking, ranks)
        with _progress(args, len(texts), ranks.rank) as bar:
            results = _results(args, model, chunks, bar)
            if ranks.rank == 0:
                _write(Path(args.output), args.output_kind, results, ids)
                log.info("autoragged.job: wrote %d results to %s", len(texts), args.output)
            else:
                for _ in results:  # (a collective: rank 0 yields, the others run their share)
                    pass


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
    """The wrapped model on its device, from the model directory."""
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
    return autoragged.wrap(model)


def _limit(args, tokenizer) -> int | None:
    """The tokens a text is truncated to: --max-length, else the tokenizer's model_max_length where it sets one."""
    return args.max_length or (tokenizer.model_max_length if tokenizer.model_max_length < 1_000_000 else None)


# -- chunks: tokenized on a thread, one run_job call each, one shard directory each ---------------------------------
class _Chunking(NamedTuple):
    """How a job's texts are chunked: what the shard directory records, and a rerun must match to resume."""

    texts: int
    chunk_texts: int
    output_kind: str

    def manifest(self) -> dict:
        return {"format": 1, **self._asdict()}


class _Chunk(NamedTuple):
    """One chunk of the input, tokenized."""

    index: int  # the chunk's number, from 0: its shard directory
    start: int  # its first text's index in the input
    documents: dict  # run_job's documents: "input_ids" (and "token_type_ids") per text

    @property
    def end(self) -> int:
        return self.start + len(self.documents["input_ids"])


def _tokenize(tokenizer, texts: list[str], start: int, limit: int | None, source: str) -> dict:
    """run_job's documents of the texts (which begin at text `start` of the input `source`)."""
    encoded = tokenizer(texts, truncation=limit is not None, max_length=limit)
    empty = next((i for i, doc in enumerate(encoded["input_ids"]) if not doc), None)
    if empty is not None:
        raise ValueError(f"text {start + empty} of {source} has no tokens (an empty text, and no special tokens added)")
    return {key: encoded[key] for key in ("input_ids", "token_type_ids") if key in encoded}


class _Tokenized:
    """The input's chunks, tokenized in order on one background thread, one chunk ahead of their reader.

    A context manager: the thread starts on entry (on chunk 0) and ends on exit, after the one chunk it may be
    tokenizing; an error on the thread is raised by the reader, at the chunk that caused it."""

    def __init__(self, tokenizer, texts: list[str], size: int, limit: int | None, source: str):
        self.tokenizer, self.texts, self.size, self.limit, self.source = tokenizer, texts, size, limit, source
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: Future | None = None

    def __enter__(self) -> _Tokenized:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autoragged-tokenize")
        self._ahead = self._submit(0)
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._ahead = None

    def _submit(self, start: int) -> Future | None:
        if start >= len(self.texts):
            return None
        texts = self.texts[start : start + self.size]
        return self._pool.submit(_tokenize, self.tokenizer, texts, start, self.limit, self.source)

    def __iter__(self) -> Iterator[_Chunk]:
        for index, start in enumerate(range(0, len(self.texts), self.size)):
            documents = self._ahead.result()  # (the thread's error, if any, raised here)
            self._ahead = self._submit(start + self.size)  # the next chunk tokenizes while this one runs
            yield _Chunk(index, start, documents)


def _check_shards(path: Path, chunking: _Chunking) -> None:
    """A clear error where the shard directory `path` holds anything but chunks of this job (each chunk's own
    directory then checks its documents: run_job's fingerprint of their token ids)."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"--shards {path} is a file; pass a directory")
    manifest = path / _MANIFEST
    found = _read_manifest(manifest)
    want = chunking.manifest()
    if found is None and path.is_dir() and any(not p.name.endswith(".tmp") for p in path.iterdir()):
        raise ValueError(f"--shards {path} holds files but no {_MANIFEST} (an older command's shards, or another "
                         "directory): pass another --shards directory, or delete this one to start over")  # fmt: skip
    if found is not None and found != want:
        same_but_size = {**found, "chunk_texts": chunking.chunk_texts} == want
        hint = f"rerun with --chunk-texts {found.get('chunk_texts')} to resume, or " if same_but_size else ""
        raise ValueError(
            f"--shards {path} holds the shards of another job ({found.get('texts')} texts in chunks of "
            f"{found.get('chunk_texts')}, --output-kind {found.get('output_kind')}; this job: {chunking.texts} texts "
            f"in chunks of {chunking.chunk_texts}, --output-kind {chunking.output_kind}): {hint}pass another --shards "
            "directory, or delete this one to start over"
        )


def _record_shards(path: Path, chunking: _Chunking, ranks: Ranks) -> None:
    """The job's chunking into the shard directory `path` where it is not there yet, once every rank has
    checked the directory (`_check_shards`; barriers around rank 0's write)."""
    manifest = path / _MANIFEST
    ranks.barrier()
    if ranks.rank == 0 and not manifest.is_file():
        path.mkdir(parents=True, exist_ok=True)
        tmp = manifest.with_name(f"{_MANIFEST}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(chunking.manifest(), indent=1))
        os.replace(tmp, manifest)
    ranks.barrier()  # the manifest is there before any rank writes a chunk


def _read_manifest(manifest: Path) -> dict | None:
    if not manifest.is_file():
        return None
    try:
        found = json.loads(manifest.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{manifest} is not JSON ({e}): delete its directory to start over") from None
    if not isinstance(found, dict):
        raise ValueError(f"{manifest} is not a record of chunks: delete its directory to start over")
    return found


def _progress(args, texts: int, rank: int):
    """Rank 0's bar over the job's texts (run_job advances it by rank 0's documents)."""
    from tqdm.auto import tqdm

    return tqdm(total=texts, unit="text", desc="autoragged.job", disable=args.no_progress or rank != 0)


def _results(args, model, chunks: _Tokenized, bar) -> Iterator:
    """Every text's result in input order (on rank 0; nothing on the others): one run_job call per chunk, in
    order on every rank (its gathering is a collective), each with its own shard directory."""
    from ..job import run_job

    root = _shards(args)
    for chunk in chunks:
        yield from run_job(model, chunk.documents, output=args.output_kind, max_tokens=args.max_tokens,
                           align=args.align, progress=bar, shards=root / f"chunk-{chunk.index:05d}")  # fmt: skip
        bar.update(chunk.end - bar.n)  # every rank's texts (and those held from an earlier run) are done


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
