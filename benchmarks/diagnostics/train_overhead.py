"""What the wrapper costs a BERT fine-tuning step where it runs the model's own padded forward.

    python benchmarks/diagnostics/train_overhead.py                          # Wiki128 B=128 and B=64, MNLI B=32
    python benchmarks/diagnostics/train_overhead.py --rows MNLI:32 CoLA:64 --repeats 3

train_table.py's model, steps and protocol (6 warm-up steps, 10 new, the same 10 twice more; ms per step), one
column at a time, each model freed before the next, the four columns taken in turn `--repeats` times: HF padded,
`wrap(model, policy="padded")` (the original model behind the wrapper: what the wrapper costs), `wrap(model)` (auto)
and `wrap(model, policy="ragged")`. A row where packing loses (Wiki128 B=128) shows whether auto stays within the
runs' spread of HF padded; a host-bound row (MNLI B=32) shows any host work or sync the wrapper adds to a step.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import autoragged  # noqa: E402
import benchmarks._common as common  # noqa: E402
import benchmarks.train_table as tt  # noqa: E402

COLUMNS = {"padded": None, "wrap_padded": "padded", "auto": "auto", "ragged": "ragged"}  # column -> wrap policy


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", default=["Wiki128:128", "Wiki128:64", "MNLI:32"], help="DATASET:B")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="a tiny BERT on the CPU: checks the script")
    args = p.parse_args(argv)
    device = torch.device("cpu") if args.smoke else common.require_cuda("train_overhead")
    common.WARM, common.TIMED = (2, 3) if args.smoke else (6, 10)
    common.header("wrapper overhead in BERT fine-tuning steps (ms per step: pass 1 new batches, pass 2 the same)")
    plain = tt.build(device, args.smoke)
    out = []
    for spec in args.rows:
        dataset, batch = spec.split(":")
        warm, timed = common.row_batches(dataset, int(batch), tt.token_batch, plain.config.vocab_size, device)
        for rep in range(args.repeats):
            for col, policy in COLUMNS.items():
                model = copy.deepcopy(plain)
                if policy is not None:
                    autoragged.wrap(model, db=False, policy=policy)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
                row = {"dataset": dataset, "batch": int(batch), "tokens": 1.0, "padding": 0.0}
                if col != "padded":  # (race() relates each column to a padded cell of its row)
                    row.update(padded1=1.0, padded2=1.0)
                tt.race({col: tt.Column(model, opt, warm, timed, tt.step)}, row, device)
                out.append((dataset, int(batch), rep, col, row[f"{col}1"], row[f"{col}2"]))
                del model, opt
                tt.free(device)
    print("\n| dataset | B | repeat | column | pass 1 | pass 2 |\n|---|---|---|---|---|---|")
    for dataset, batch, rep, col, first, second in out:
        print(f"| {dataset} | {batch} | {rep} | {col} | {first:.1f} | {second:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
