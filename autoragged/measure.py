"""Measuring arms: build an encoder for a signature, make a batch, time one arm exactly as the runtime
runs it (through the dispatcher's own execute path). Shared by the tuner and the benchmarks."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .planning.costmodel import Arm
from .tuning_db.records import BatchStats, ModuleSignature

__all__ = [
    "build_encoder",
    "build_hf",
    "make_batch",
    "Timing",
    "time_ms",
    "time_interleaved",
    "close_to_best",
    "time_close_calls",
    "ArmRunner",
]

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def build_encoder(sig: ModuleSignature, device: torch.device, seed: int = 0) -> nn.TransformerEncoder:
    """An eval-mode `nn.TransformerEncoder` of `sig`'s shape, built the way users build one."""
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(
        sig.d_model, sig.heads, sig.ff, dropout=0.0, activation=sig.activation, batch_first=True,
        norm_first=sig.norm_first, bias=sig.bias,
    )  # fmt: skip
    norm = nn.LayerNorm(sig.d_model, bias=sig.bias) if sig.final_norm else None
    enc = nn.TransformerEncoder(layer, sig.layers, norm=norm, enable_nested_tensor=sig.nested)
    return enc.to(device=device, dtype=_DTYPES[sig.dtype]).eval()


def build_hf(name: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """An eval-mode HF base model of one of `workloads.HF_SHAPES` (or a config.json path), random weights."""
    import transformers

    from .workloads import hf_config

    torch.manual_seed(seed)
    config = hf_config(name)
    config._attn_implementation = "sdpa"
    return transformers.AutoModel.from_config(config).to(device=device, dtype=dtype).eval()


def make_batch(lengths: Sequence[int], d_model: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """(x (B, max(lengths), D) random, key padding mask (B, L) True = pad), padded to the batch's longest."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    L = max(lengths)
    x = torch.randn(len(lengths), L, d_model, generator=g).to(device=device, dtype=dtype)
    mask = (torch.arange(L)[None, :] >= torch.tensor(list(lengths))[:, None]).to(device)
    return x, mask


@dataclass
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    reps: int
    samples: tuple[float, ...] = ()  # the timings themselves, where kept (time_interleaved)

    @classmethod
    def of(cls, samples: Sequence[float]) -> Timing:
        t = sorted(samples)
        n = len(t)
        return cls(statistics.median(t), t[n // 10], t[min(n - 1, n * 9 // 10)], n, tuple(samples))


def time_ms(fn: Callable[[], object], device: torch.device, *, warmup: int = 2, reps: int = 5) -> Timing:
    """Median / p10 / p90 of `reps` calls after `warmup`: CUDA events on a GPU, the host clock on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return Timing.of(times)


def time_interleaved(fns: Sequence[Callable[[], object]], device: torch.device, *, warmup: int = 2, reps: int = 5):
    """Time several calls round-robin (rep 1 of each, then rep 2 of each, ...) so slow drifts of the
    host or the clocks hit every arm alike: what the planner needs is their ratio. Returns a Timing each."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            times[i].append(time_ms(fn, device, warmup=0, reps=1).median_ms)
    return [Timing.of(t) for t in times]


def close_to_best(timings: Sequence[Timing], margin: float = 0.03) -> list[int]:
    """Indices of the arms the measurement cannot tell from the fastest: the fastest itself, and every arm
    whose median is within `margin` of its median or whose p10 reaches its p90."""
    best = min(range(len(timings)), key=lambda i: timings[i].median_ms)
    b = timings[best]
    return [i for i, t in enumerate(timings)
            if i == best or t.median_ms <= b.median_ms * (1 + margin) or t.p10_ms <= b.p90_ms]  # fmt: skip


def time_close_calls(fns: Sequence[Callable[[], object]], device: torch.device, *, reps: int, extra_reps: int,
                     max_extra_ms: float = 250.0, screen_reps: int = 0, far: float = 1.5) -> list[Timing]:  # fmt: skip
    """`time_interleaved`, then, for the arms `close_to_best` cannot separate, `extra_reps` more interleaved
    calls each (fewer if they would take over `max_extra_ms` in all), pooled with the first ones. A batch's
    label is its fastest arm; near ties are where host noise picks it (on small batches the arms' p10-p90
    spreads often overlap).

    With `screen_reps` (fewer than `reps`), the first round is a screen of `screen_reps` calls each after one
    warm-up call: an arm whose median is over `far` times the fastest's keeps those timings, the others are
    timed up to `reps`. A label never comes from an arm that far behind, and such arms take most of a
    calibration's timed calls: on tiny batches the eager arms take 10-20x the graph's time on an H100."""
    if 0 < screen_reps < reps:
        timings = time_interleaved(fns, device, warmup=1, reps=screen_reps)
        best = min(t.median_ms for t in timings)
        kept = [i for i, t in enumerate(timings) if t.median_ms <= far * best]
        more = time_interleaved([fns[i] for i in kept], device, warmup=0, reps=reps - screen_reps)
        for i, t in zip(kept, more):
            timings[i] = Timing.of(timings[i].samples + t.samples)
    else:
        timings = time_interleaved(fns, device, warmup=2, reps=reps)
    close = close_to_best(timings)
    if len(close) < 2 or extra_reps <= 0:
        return timings
    per_round = sum(timings[i].median_ms for i in close)
    extra = min(extra_reps, int(max_extra_ms / max(per_round, 1e-6)))
    if extra < 2:
        return timings
    more = time_interleaved([fns[i] for i in close], device, warmup=0, reps=extra)
    for i, t in zip(close, more):
        timings[i] = Timing.of(timings[i].samples + t.samples)
    return timings


class ArmRunner:
    """Runs any arm on a wrapped model through the runtime's own execute path (what the runtime runs): a torch
    encoder (`run`: padded x and its key padding mask) or an HF encoder (`run_call` of `hf_call(kwargs)`);
    `batch_runner` makes a random batch of either kind. A graph arm's graph is captured at its first run."""

    def __init__(self, model: nn.Module):
        from .wrapper import wrap

        self.encoder = wrap(model, db=False, policy="auto", sample_every=0)
        self.module = next(m for m in self.encoder.modules() if hasattr(m, "_autoragged"))
        self.runtime = self.module._autoragged
        self.sig = self.runtime.sig
        self.hf = not isinstance(self.module, (nn.TransformerEncoder, nn.TransformerEncoderLayer))

    def arms(self, arms: Sequence[Arm]) -> list[Arm]:
        """The arms of `arms` this model's body can run: the padded arm, the eager ragged arm, and the ragged graph
        (Triton linears) where the layers run as fused specs."""
        body = self.runtime.body
        return [
            a for a in arms
            if a.kind in ("padded", "ragged")
            or (a.kind == "ragged_graph" and a.config is not None and a.config.backend == "triton" and body.fused)
        ]  # fmt: skip

    def batch_runner(self, lengths: tuple[int, ...], stats: BatchStats, seed: int = 0) -> Callable[[Arm], object]:
        """A random right-padded batch of `lengths` for this model, and `run(arm)` on it."""
        body = self.runtime.body
        dtype = body.probe().dtype
        if not self.hf:
            x, mask = make_batch(lengths, body.d_model, dtype, body.probe().device, seed=seed)
            return lambda arm: self.run(arm, x, mask, lengths, stats)
        kwargs = self._hf_kwargs(lengths, seed)
        return lambda arm: self.run_call(arm, self.hf_call(kwargs), lengths, stats)

    def _hf_kwargs(self, lengths: tuple[int, ...], seed: int) -> dict:
        """Random right-padded token ids of `lengths` and their mask on the model's device (a decoder: no cache)."""
        g = torch.Generator(device="cpu").manual_seed(seed)
        keep = torch.arange(max(lengths))[None, :] < torch.tensor(list(lengths))[:, None]
        vocab, device = self.module.config.vocab_size, self.runtime.body.probe().device
        ids = torch.randint(min(5, vocab - 1), vocab, keep.shape, generator=g)
        kwargs = {"input_ids": ids.masked_fill(~keep, self.module.config.pad_token_id or 0).to(device),
                  "attention_mask": keep.long().to(device)}  # fmt: skip
        if self.runtime.adapter.name == "hf_decoder":
            kwargs["use_cache"] = False  # a scoring call: no KV cache is built
        return kwargs

    def train_step_runner(self, lengths: tuple[int, ...], seed: int = 0) -> Callable[[str], None]:
        """A random right-padded batch of `lengths`, and `step(kind)`: the wrapped model's forward in train mode
        with arm `kind` forced ("padded" or "ragged"), a loss, its backward, the gradients dropped (no optimizer:
        the step's own cost is what `tune --train` prices)."""
        self.encoder.train()
        body = self.runtime.body
        device, dtype = body.probe().device, body.probe().dtype
        if not self.hf:
            x, mask = make_batch(lengths, body.d_model, dtype, device, seed=seed)
            forward = lambda: self.encoder(x, src_key_padding_mask=mask)  # noqa: E731
        else:
            kwargs = self._hf_kwargs(lengths, seed)
            forward = lambda: self.encoder(**kwargs).last_hidden_state  # noqa: E731

        def step(kind: str) -> None:
            with self.runtime.forcing(kind), torch.enable_grad():
                forward().float().square().mean().backward()
            self.encoder.zero_grad(set_to_none=True)

        return step

    def run(self, arm: Arm, x: torch.Tensor, mask: torch.Tensor, lengths: tuple[int, ...], stats: BatchStats):
        from .models.torch_encoder import TorchCall

        return self.run_call(arm, TorchCall(self.runtime.body, x, None, mask, None, None), lengths, stats)

    def hf_call(self, kwargs: dict):
        """The call of the wrapped HF base model (encoder or decoder) on `kwargs` (input_ids, attention_mask, ...),
        as its adapter reads it."""
        return self.module.forward.call_type(self.runtime.body, self.module, dict(kwargs), None)

    def run_call(self, arm: Arm, call, lengths: tuple[int, ...], stats: BatchStats):
        scope = getattr(call, "scope", None)  # an HF call: the body may read it (hf_decoder's positions)
        with torch.inference_mode(), scope() if scope is not None else contextlib.nullcontext():
            return self.runtime.execute(self.module, call, arm, lengths, stats)
