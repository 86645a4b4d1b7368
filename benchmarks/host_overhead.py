"""Host-side cost of the pieces of a batch: what a launch-bound batch pays before the GPU works.

    python benchmarks/host_overhead.py

Each row is the median host microseconds of one call over many calls on tiny inputs (the GPU is never
the bottleneck): Triton launches through `kernel[grid](...)`, PyTorch ops, and the runtime's own steps
(graph metadata, the pinned copy, the parameter check, lengths from a mask). Prints a table and writes
benchmarks/results/host_overhead.json.
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from autoragged.kernels import ragged_add_layer_norm as k_ln  # noqa: E402
from autoragged.kernels import ragged_attention as k_attn  # noqa: E402
from autoragged.kernels import ragged_pack  # noqa: E402
from autoragged.kernels.graph_layout import layout_ref as _host_meta  # noqa: E402
from autoragged.kernels.graph_layout import meta_size  # noqa: E402

from autoragged import RaggedTensor  # noqa: E402
from autoragged._ragged import mask_lengths  # noqa: E402
from autoragged.runtime.graphs import GraphCache  # noqa: E402
from benchmarks._common import environment, header, require_cuda, table, write_json  # noqa: E402


def host_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> int:
    require_cuda("benchmarks/host_overhead.py")
    env = environment()
    header("host cost per call (microseconds, median)", env)
    dev = torch.device("cuda")
    x = torch.randn(64, 512, device=dev, dtype=torch.float16)
    w = torch.ones(512, device=dev, dtype=torch.float16)
    lengths = [13, 20, 7, 31] * 8
    rt = RaggedTensor.from_padded(torch.randn(32, 37, 3 * 512, device=dev, dtype=torch.float16), lengths)
    q, k, v = rt.values.view(-1, 3, 8, 64).unbind(1)
    offsets, dev_lengths = rt.layout.device_meta(dev)
    cfg = k_attn.default_config(64, 37)
    gm, bo = rt.prelude(cfg.block_m)
    padded = torch.randn(32, 37, 512, device=dev, dtype=torch.float16)
    layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, 6).to(dev, torch.float16).eval()
    cache = GraphCache()
    params = list(enc.parameters())  # the runtime keeps this list (re-made when anything registers)
    mask = torch.arange(37, device=dev)[None, :] >= torch.tensor(lengths, device=dev)[:, None]
    meta_static = torch.zeros(meta_size(32, 64), dtype=torch.int32, device=dev)

    def attention():
        return k_attn.ragged_attention(q, k, v, offsets, dev_lengths, gm, bo, config=cfg)

    def pinned_meta_copy():
        host = torch.from_numpy(_host_meta(lengths, 1, 64, 32, 64)[0]).pin_memory()
        return meta_static.copy_(host, non_blocking=True)

    rows = [
        ("Triton add_layer_norm launch", lambda: k_ln.add_layer_norm(x, x, w, w, 1e-5)),
        ("Triton ragged_attention launch", attention),
        ("Triton pack launch", lambda: ragged_pack.pack(padded, offsets, dev_lengths, rt.layout.rows, 31)),
        ("PyTorch add + layer_norm (2 ops)", lambda: F.layer_norm(x + x, (512,), w, w)),
        ("PyTorch F.linear", lambda: F.linear(x, torch.ones(512, 512, device=dev, dtype=torch.float16))),
        ("PyTorch padded encoder layer (eager)", lambda: layer.to(dev, torch.float16).eval()(padded)),
        ("graph metadata on the host (numpy; graphs now build it)", lambda: _host_meta(lengths, 1, 64, 32, 64)),
        ("metadata on the host + pinned copy", pinned_meta_copy),
        ("parameter-storage check (6 layers)", lambda: cache._check_params(params)),
        ("lengths from a CUDA mask (one copy)", lambda: mask_lengths(mask)),
    ]  # fmt: skip
    out = []
    with torch.inference_mode():
        for name, fn in rows:
            out.append({"step": name, "host_us": host_us(fn)})
            print(f"  {name}: {out[-1]['host_us']:.1f} us", flush=True)
    print("\n## host cost per call\n")
    print(table(out, [("step", "step", ""), ("host_us", "us", ".1f")]))
    write_json("host_overhead.json", {"env": env, "rows": out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
