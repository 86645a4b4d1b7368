"""`autoragged.wrap()`: make each supported module of a model choose an arm per batch.

A model-family adapter (autoragged/models/) finds the modules it can wrap (PyTorch's encoder modules,
HuggingFace encoders, ...) and makes each one dispatch; each wrapped module holds its `Runtime`
(autoragged/runtime/core.py) as the attribute `_autoragged` (a plain object, not a submodule): lengths ->
stats -> choice -> arm -> record, the same for every family.
"""

from __future__ import annotations

import logging
from pathlib import Path

from torch import nn

from .kernels.config import KernelConfig
from .models import adapters_for
from .runtime.core import POLICIES, Options, Runtime
from .runtime.recorder import RECORDER
from .tuning_db import Decision, default_path

__all__ = ["wrap", "unwrap", "recent_decisions", "graph_stats", "flush", "find_targets", "POLICIES"]

log = logging.getLogger("autoragged")


# -- public API -----------------------------------------------------------------------------------
def _resolve_db(db) -> Path | None:
    if db is False:
        return None
    if db is None:
        return default_path()
    path = Path(db).expanduser().resolve()
    RECORDER.open_db(path)  # an explicit path that cannot be used is an error now, not a warning later
    return path


def wrap(
    model: nn.Module,
    *,
    db: str | Path | None | bool = None,
    policy: str = "auto",
    sample_every: int = 32,
    validate_lengths: bool = True,
    config: KernelConfig | None = None,
    graphs: bool = True,
    graph_cap: int | None = None,
) -> nn.Module:
    """Make every module of `model` that an adapter can run choose, per batch, between its own padded forward
    and our ragged kernels: `nn.TransformerEncoder` (and `nn.TransformerEncoderLayer` outside one), and the base
    model of HuggingFace encoders (BERT family, ModernBERT; inside task models and sentence-transformers) and
    decoders. Returns `model` (changed in place: same object, parameters and state_dict; `unwrap` undoes it).
    Modules that will always run padded, and models found but not wrapped, are named in one WARNING log line.

    db:        the tuning database (default `$AUTORAGGED_DB` or ~/.cache/autoragged/tuning.sqlite) where
               decisions and timed latencies are recorded and the calibrated cost model is read;
               False records nothing and uses the analytic prior.
    policy:    "auto" (runtime/policy.py: predicted, then timed costs), "padded" or "ragged" (forced, for
               benchmarks and debugging; batches the ragged arm cannot run still go padded, with the reason).
    sample_every: once an arm of a shape has three timings, time every n-th batch of the shape (CUDA events, or
               the host clock on a CPU; 0: never time, and the policy decides on predictions alone).
    validate_lengths: when both `lengths=` and a padding mask are given, check they agree, real tokens first
               (one device->host copy); set False to trust `lengths` and skip the copy.
    config:    with policy="ragged", the `KernelConfig` to force (default: the untuned default).
    graphs:    on CUDA, also run the layers as CUDA graphs (one per batch size and width, captured in the background
               where the policy wants one: graphs/).
    graph_cap: graphs kept per module, least recently used out; None (default): as many as fit a tenth of the
               device memory obtainable at the module's first capture (`autoragged.graph_stats` shows them).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap expects an nn.Module, got {type(model).__name__}")
    if not isinstance(sample_every, int) or sample_every < 0:
        raise ValueError(f"sample_every must be an int >= 0, got {sample_every!r}")
    if graph_cap is not None and (not isinstance(graph_cap, int) or graph_cap < 1):
        raise ValueError(f"graph_cap must be None (sized from memory) or an int >= 1, got {graph_cap!r}")
    name = type(model).__name__  # (before an adapter swaps the class of a module it wraps)
    targets, skipped = find_targets(model)
    if not targets:
        raise ValueError(
            f"wrap found nothing it can run in {type(model).__name__}: autoragged wraps nn.TransformerEncoder / "
            "nn.TransformerEncoderLayer (their exact classes) and HuggingFace encoders and decoders "
            "(see the README's list of families)" + (f"; not wrapped: {'; '.join(skipped)}" if skipped else "")
        )
    db_path = _resolve_db(db)
    options = Options(policy, db_path, sample_every, validate_lengths, config, graphs, graph_cap)
    padded_forever = []
    for adapter, module in targets:
        for inner in module.modules():  # modules wrapped on their own earlier now run inside this one
            if inner is not module and hasattr(inner, "_autoragged"):
                _unwrap_one(inner)
        if hasattr(module, "_autoragged"):
            _unwrap_one(module)
        runtime = Runtime(module, adapter, options)
        module._autoragged = runtime
        if runtime.static_reason:
            padded_forever.append(f"{type(module).__name__} ({runtime.sig_key}): {runtime.static_reason}")
        adapter.install(module)
        runtime.preload()
    for adapter in {id(a): a for a, _ in targets}.values():  # containers of the wrapped modules (sentence-transformers)
        if hasattr(adapter, "install_container"):
            adapter.install_container(model)
    if padded_forever or skipped:
        lines = [f"{m}: always runs padded" for m in padded_forever] + [f"not wrapped: {m}" for m in skipped]
        log.warning("autoragged.wrap(%s): %s", name, "; ".join(lines))
    return model


def find_targets(model: nn.Module) -> tuple[list, list[str]]:
    """([(adapter, module)] to wrap, in module order, none inside another; [why a module is not wrapped])."""
    found, skipped = [], []
    for adapter in adapters_for(model):
        found += [(adapter, m) for m in adapter.targets(model)]
        skipped += adapter.skipped(model)
    taken = {id(m) for _, m in found}
    skipped = [why for m, why in skipped if id(m) not in taken]
    inside: set[int] = set()
    order = {id(m): i for i, m in enumerate(model.modules())}
    kept = []
    for adapter, module in sorted(found, key=lambda am: order[id(am[1])]):
        if id(module) in inside:
            continue
        kept.append((adapter, module))
        inside.update(id(m) for m in module.modules())
    return kept, skipped


def _unwrap_one(module: nn.Module) -> None:
    runtime = module.__dict__.pop("_autoragged", None)
    if runtime is not None:
        runtime.harvest(wait=True)  # timed batches still in flight get their timings recorded
        runtime.adapter.uninstall(module)


def unwrap(model: nn.Module) -> nn.Module:
    """Put the original classes back (recorded decisions are flushed). Returns `model`."""
    for adapter in adapters_for(model):
        if hasattr(adapter, "uninstall_container"):
            adapter.uninstall_container(model)
    for module in list(model.modules()):
        if hasattr(module, "_autoragged"):
            _unwrap_one(module)
    flush()
    return model


def recent_decisions(model: nn.Module, n: int = 100) -> list[Decision]:
    """The latest `n` decisions of every wrapped module in `model`, oldest first."""
    records = [r for m in model.modules() if hasattr(m, "_autoragged") for r in m._autoragged.ring]
    records.sort(key=lambda r: r.time)
    return [r.decision() for r in records[-n:]] if n > 0 else []


def graph_stats(model: nn.Module) -> dict:
    """{module name: `GraphStats`} for every wrapped module in `model`: CUDA graphs kept, their estimated bytes and
    budget, captures and their ms, captures pending, failed, evictions; training graphs kept and refused."""
    from .graphs.cache import GraphStats

    out = {}
    for name, m in model.named_modules():
        runtime = m.__dict__.get("_autoragged")
        if runtime is not None:
            graphs = runtime.graphs
            stats = graphs.stats() if graphs is not None else GraphStats(cap=runtime.options.graph_cap)
            training = runtime.body.train_graphs
            if training is not None:
                stats.training, stats.training_refused = len(training.graphs), len(training.refused)
                stats.training_bytes = training.reserved_bytes
            out[name or type(m).__name__] = stats
    return out


def flush() -> int:
    """Write recorded decisions and latencies to the tuning database now; returns rows written."""
    return RECORDER.flush()
