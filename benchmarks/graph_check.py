"""Do the CUDA-graph arms replay what the eager arms compute? (GPU diagnostic)

    python benchmarks/graph_check.py

For post/pre-norm and batch-first/sequence-first encoders, several batches per bucket, each bucket
replayed again after other graphs and eager runs have allocated memory: the max abs error on real
tokens between the padded graph and the eager padded arm, and between the ragged graph and the eager
ragged arm. Prints a table and writes benchmarks/results/graph_check.json.

History: the padded graph once replayed wrong results (error ~4) because a buffer it read (the mask
positions) was held only by the capture closure; freed after capture, it was reused by the next
allocation. `_warm_and_capture` now keeps the closure alive with the graph.
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from autoragged.tuning_db import BatchStats  # noqa: E402

import autoragged  # noqa: E402
from autoragged._costmodel import PADDED, PADDED_GRAPH, Arm  # noqa: E402
from autoragged._planner import default_ragged_config  # noqa: E402
from autoragged.adapters.torch_encoder import TorchCall  # noqa: E402
from benchmarks._common import environment, header, require_cuda, table, write_json  # noqa: E402

BATCHES = [[37, 5, 100, 1], [64, 64, 3], [17] * 9, [200, 1, 1, 1, 1, 90], [90, 50, 100, 2]]


def max_err(enc, arm_a, arm_b, lengths, batch_first, seed):
    torch.manual_seed(seed)
    L = max(lengths)
    x = torch.randn(len(lengths), L, 256, device="cuda", dtype=torch.float16)
    x = x if batch_first else x.transpose(0, 1).contiguous()
    mask = torch.arange(L, device="cuda")[None, :] >= torch.tensor(lengths, device="cuda")[:, None]
    stats = BatchStats.from_lengths(tuple(lengths), padded_len=L)
    outs = []
    churn = [torch.randn(1 << 16, device="cuda") for _ in range(8)]  # reuse freed blocks between replays
    del churn
    for arm in (arm_a, arm_b):
        with torch.inference_mode():
            rt = enc._autoragged
            y, note = rt._execute(enc, TorchCall(rt.body, x, None, mask, None, None), arm, tuple(lengths), stats, None)
        assert note is None, note
        y = y if batch_first else y.transpose(0, 1)
        outs.append(torch.cat([y[i, :n] for i, n in enumerate(lengths)]).float())
    return (outs[0] - outs[1]).abs().max().item()


def main() -> int:
    require_cuda("benchmarks/graph_check.py")
    env = environment()
    header("padded / ragged CUDA graphs vs eager", env)
    rows = []
    for norm_first in (False, True):
        for batch_first in (True, False):
            layer = torch.nn.TransformerEncoderLayer(256, 4, 512, dropout=0.0, batch_first=batch_first,
                                                     norm_first=norm_first)  # fmt: skip
            enc = torch.nn.TransformerEncoder(layer, 2).to("cuda", torch.float16).eval()
            autoragged.wrap(enc, db=False)
            enc._autoragged.graph_min_seen = 1
            cfg = default_ragged_config(64, 128)
            batches = list(enumerate(BATCHES * 3))  # later passes replay graphs captured earlier
            padded = max(max_err(enc, PADDED_GRAPH, PADDED, b, batch_first, i) for i, b in batches)
            graph, eager = Arm("ragged_graph", cfg), Arm("ragged", cfg)
            ragged = max(max_err(enc, graph, eager, b, batch_first, i) for i, b in batches)
            rows.append({
                "norm_first": norm_first, "batch_first": batch_first,
                "padded_graph_err": padded, "ragged_graph_err": ragged,
            })  # fmt: skip
            print(rows[-1], flush=True)
    columns = [
        ("norm_first", "pre-norm", ""), ("batch_first", "batch first", ""),
        ("padded_graph_err", "padded graph err", ".2e"), ("ragged_graph_err", "ragged graph err", ".2e"),
    ]  # fmt: skip
    print(table(rows, columns))
    write_json("graph_check.json", {"env": env, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
