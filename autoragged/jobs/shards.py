"""A job's results as ordered shard files, written whole or not at all: a rerun resumes from them."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from .ranks import Ranks

__all__ = ["ShardStore", "JobIdentity", "read_shards"]

log = logging.getLogger("autoragged")


# A shard file holds at least this many documents (fewer for a rank's last): at 4096 a BERT-base job writes a
# 12 MiB file of means every few seconds on a GPU, and a crash loses at most that per rank.
_SHARD_DOCS = 4096
_SHARD_SECONDS = 300.0  # ... or every 5 minutes of work, whichever comes first (long documents, slow models)
_MANIFEST = "job.json"
_SHARD = re.compile(r"^run(\d+)-rank(\d+)-chunk(\d+)\.pt$")


def _shard_files(path: Path) -> list[Path]:
    """The finished shard files in `path`, by name (a crash's *.tmp leftovers are not among them)."""
    return sorted(p for p in path.iterdir() if _SHARD.match(p.name))


def _read_manifest(path: Path) -> dict | None:
    try:
        text = (path / _MANIFEST).read_text()
    except FileNotFoundError:
        return None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path / _MANIFEST} is not JSON ({e}): not a shard directory of run_job") from e
    if not isinstance(manifest, dict) or not isinstance(manifest.get("documents"), int):
        raise ValueError(f"{path / _MANIFEST} is not the manifest of a run_job shard directory")
    return manifest


def _load_shard(file: Path, n: int):
    """(indices (k,) int64 numpy, results list) of one shard file, checked (tensors only: weights_only)."""
    try:
        data = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        indices = data["indices"].numpy()
        results = _unpack(data) if "values" in data else data["results"]
    except Exception as e:  # noqa: BLE001 - any unreadable file: say which, and what to do
        raise ValueError(f"shard {file} cannot be read ({type(e).__name__}: {e}): delete it to recompute it") from e
    if len(indices) != len(results) or (len(indices) and (indices.min() < 0 or indices.max() >= n)):
        raise ValueError(f"shard {file} does not belong to a job of {n} documents: delete it to recompute them")
    return indices, results


class JobIdentity(NamedTuple):
    """What a shard directory records of its job: the documents' count, a digest of their token ids and the
    output, and the output's name."""

    documents: int
    fingerprint: str
    output: str


class ShardStore:
    """A job's shard directory: the documents it holds already, and this rank's writer."""

    def __init__(self, path: Path, run: int, rank: int, todo: np.ndarray):
        self.path, self.run, self.rank, self.todo = path, run, rank, todo

    @classmethod
    def open(cls, directory, job: JobIdentity, ranks: Ranks) -> ShardStore:
        """Read what `directory` holds (every rank, before any writes: a barrier), checking it is this job's."""
        path = Path(directory)
        if path.exists() and not path.is_dir():
            raise ValueError(f"shards={str(directory)!r} is a file; pass a directory")
        path.mkdir(parents=True, exist_ok=True)
        n = job.documents
        manifest = {"format": 1, "documents": n, "fingerprint": job.fingerprint, "output": job.output}
        found = _read_manifest(path)
        if found is not None and found != manifest:
            raise ValueError(
                f"{path} holds shards of another job ({found.get('documents')} documents, output "
                f"{found.get('output')!r}, fingerprint {found.get('fingerprint')}; this job: {n}, "
                f"{manifest['output']!r}, {manifest['fingerprint']}): pass a new directory, or delete this one to "
                "start over"
            )
        files = _shard_files(path)
        done = np.zeros(n, dtype=bool)
        for file in files:
            indices, _ = _load_shard(file, n)
            if done[indices].any():
                raise ValueError(f"shard {file} repeats documents of another shard: delete one of them")
            done[indices] = True
        run = 1 + max((int(_SHARD.match(f.name).group(1)) for f in files), default=0)
        if found is None and ranks.rank == 0:
            _replace(path / _MANIFEST, lambda tmp: tmp.write_text(json.dumps(manifest, indent=1)))
        ranks.barrier()  # every rank has read the directory before any rank writes to it: the same todo everywhere
        if done.any():
            log.info("run_job: %s holds %d of %d documents already; computing the other %d", path, int(done.sum()),
                     n, n - int(done.sum()))  # fmt: skip
        return cls(path, run, ranks.rank, np.flatnonzero(~done))

    def write(self, pairs: Iterator[tuple[list[int], list]]) -> None:
        """Write (members, results) pairs as they come, one file per chunk of `_SHARD_DOCS` documents or
        `_SHARD_SECONDS` of work."""
        indices: list[int] = []
        results: list = []
        chunk, since = 0, time.monotonic()
        for members, values in pairs:
            indices += members
            results += values
            if len(indices) >= _SHARD_DOCS or time.monotonic() - since >= _SHARD_SECONDS:
                self._flush(chunk, indices, results)
                chunk, since, indices, results = chunk + 1, time.monotonic(), [], []
        if indices:
            self._flush(chunk, indices, results)

    def _flush(self, chunk: int, indices: list[int], results: list) -> None:
        bad = next((i for i, r in zip(indices, results) if not isinstance(r, torch.Tensor)), None)
        if bad is not None:
            kind = type(results[indices.index(bad)]).__name__
            raise TypeError(f"shards hold tensors; the output function gave a {kind} for document {bad}")
        data = {"indices": torch.tensor(indices, dtype=torch.int64), **_pack(results)}
        name = f"run{self.run:03d}-rank{self.rank:03d}-chunk{chunk:05d}.pt"
        _replace(self.path / name, lambda tmp: torch.save(data, tmp))


def _pack(results: list[torch.Tensor]) -> dict:
    """A chunk's results as one flat tensor and their shapes, where they share a dtype and a number of dims (every
    built-in output): one tensor to save and load, where a list of 4096 small ones takes ten times as long to
    read back. Otherwise the list itself."""
    first = results[0]
    if any(r.dtype != first.dtype or r.dim() != first.dim() for r in results):
        return {"results": results}
    shapes = torch.tensor([r.shape for r in results], dtype=torch.int64).reshape(len(results), first.dim())
    return {"values": torch.cat([r.reshape(-1) for r in results]), "shapes": shapes}


def _unpack(data: dict) -> list[torch.Tensor]:
    """The results `_pack` packed: views of its flat tensor."""
    values, shapes = data["values"], data["shapes"]
    if len(shapes) and bool((shapes == shapes[0]).all()):  # one shape: a view of them all, then its rows
        return list(values.view(len(shapes), *shapes[0].tolist()).unbind(0))
    sizes = shapes.prod(dim=1).tolist()
    return [v.view(shape) for v, shape in zip(values.split(sizes), shapes.tolist())]


def _replace(file: Path, write: Callable[[Path], object]) -> None:
    """Write `file` whole or not at all: to a temporary name beside it, then renamed over it."""
    tmp = file.with_name(file.name + f".{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, file)


def read_shards(directory: str | os.PathLike) -> Iterator:
    """Every document's result, in input order, from the shard directory of a finished `run_job(...,
    shards=directory)` (files of any number of ranks and reruns); a ValueError naming the missing documents
    where the job has not finished. Tensors are memory-mapped from the files (torch.load mmap=True)."""
    path = Path(directory)
    manifest = _read_manifest(path) if path.is_dir() else None
    if manifest is None:
        raise ValueError(f"{path} is not a shard directory of run_job (no {_MANIFEST})")
    n = manifest["documents"]
    results: list = [None] * n
    have = np.zeros(n, dtype=bool)
    for file in _shard_files(path):
        indices, values = _load_shard(file, n)
        if have[indices].any():
            raise ValueError(f"shard {file} repeats documents of another shard: delete one of them")
        have[indices] = True
        for i, value in zip(indices.tolist(), values):
            results[i] = value
    missing = np.flatnonzero(~have)
    if len(missing):
        some = ", ".join(map(str, missing[:5].tolist())) + (", ..." if len(missing) > 5 else "")
        raise ValueError(
            f"{path} holds the results of {n - len(missing)} of {n} documents (missing: {some}): rerun the job with "
            f"shards={str(path)!r} to compute the rest"
        )
    return iter(results)
