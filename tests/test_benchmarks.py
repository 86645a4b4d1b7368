"""The benchmarks of record run: each --smoke run (a tiny model on the CPU) prints its table and appends one JSON line
with its rows to <--results>/<script>.jsonl; without a GPU a real run exits 2. RESULTS.md keeps a section per script,
and diagnostics/ab_trees.py runs a script from other code trees."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(script: str, *args: str, gpu: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the CPU path: PyTorch's reference ops
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run([sys.executable, f"benchmarks/{script}.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def smoke(script: str, tmp_path, *args: str) -> dict:
    """The one line a --smoke run appended, after checking it exited 0."""
    done = run(script, "--smoke", "--results", str(tmp_path), *args)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (tmp_path / f"{script}.jsonl").read_text().splitlines()
    assert len(lines) == 1
    line = json.loads(lines[0])
    assert line["script"] == script and line["revision"] and line["env"]["device"].startswith("cpu")
    assert line["env"]["torch"] and line["argv"][0] == "--smoke" and line["args"]["smoke"] is True
    return line


def test_cora_table_smoke(tmp_path):
    line = smoke("cora_table", tmp_path)
    assert [(r["dataset"], r["batch"]) for r in line["rows"]] == [("CoLA", 2), ("MRPC", 2)]
    for r in line["rows"]:
        assert all(r[c] > 0 for c in ("nofast", "fast", "compile", "auto", "auto_lengths", "ragged"))
        assert r["auto_err"] < 1e-4 and r["best_over_auto"] > 0 and r["compile_s"] >= 0
        assert sum(r["ragged_arms"].values()) == 3 and set(r["ragged_arms"]) == {"ragged"}
    assert line["summary"]["geomean_best_over_auto"] > 0


def test_hf_table_smoke_with_warmup(tmp_path):
    pytest.importorskip("transformers")
    line = smoke("hf_table", tmp_path, "--warmup")
    assert [(r["model"], r["dataset"], r["batch"]) for r in line["rows"]] == [("bert-base", "CoLA", 2),
                                                                              ("bert-base", "MRPC", 2)]  # fmt: skip
    for r in line["rows"]:
        assert all(r[c] > 0 for c in ("eager", "compile", "auto1", "auto2", "warm1", "warm2"))
        assert r["second_over_first"] == pytest.approx(r["auto2"] / r["auto1"])
        assert sum(r["auto_arms"].values()) == 32  # both passes of 16 batches
    summary = line["summary"]["bert-base"]
    assert summary["warmup_s"] > 0 and set(summary["misses"]) == {
        "auto_vs_compile below 1.0", "second_over_first above 1.05", "warm_first_over_second above 1.2"
    }  # fmt: skip


def test_stream_table_smoke(tmp_path):
    line = smoke("stream_table", tmp_path)
    assert [(r["model"], r["dataset"], r["batch"]) for r in line["rows"]] == [("cora", "CoLA", 2), ("cora", "MRPC", 2)]
    for r in line["rows"]:
        assert all(r[c] > 0 for c in ("fast", "compile", "ragged", "auto", "auto_lengths", "auto2"))
        assert r["auto_over_best_forced"] == pytest.approx(r["auto"] / min(r["ragged"], r["auto_lengths"]))
    assert line["summary"]["cora"]["max_auto_over_best_forced"] > 0


def test_train_table_smoke(tmp_path):
    pytest.importorskip("transformers")
    line = smoke("train_table", tmp_path)
    assert [(r["dataset"], r["batch"]) for r in line["rows"]] == [("CoLA", 2), ("MRPC", 2)]
    for r in line["rows"]:
        assert all(r[f"{c}{n}"] > 0 for c in ("padded", "auto", "ragged") for n in (1, 2))
        assert r["ragged_arms"] == {"ragged": r["ragged_arms"]["ragged"]}, r["ragged_reasons"]
        assert r["ragged_loss_err"] <= 2 * r["padded_loss_err"] + 1e-6  # within bf16 autocast's own error
    assert line["summary"]["bert-base"]["min_auto_vs_padded"] > 0


@pytest.mark.parametrize("model", ["qwen2.5-0.5b", "gpt2"])
def test_train_table_sft_smoke(tmp_path, model):
    pytest.importorskip("transformers")
    line = smoke("train_table", tmp_path, "--models", model)
    (row,) = line["rows"]
    assert all(row[f"{c}2"] > 0 for c in ("padded", "packed", "auto", "auto_packed"))
    assert row["packed_loss_diff"] < 1e-4 and row["auto_packed_loss_diff"] < 1e-4  # the same targets, the same loss


def test_encode_smoke(tmp_path):
    pytest.importorskip("sentence_transformers")
    line = smoke("encode", tmp_path)
    plain, wrapped = line["rows"]
    assert (plain["mode"], wrapped["mode"]) == ("plain", "wrapped") and wrapped["max_abs_diff"] < 1e-4
    assert all(r[c] > 0 for r in line["rows"] for c in ("cold_s", "warm_s", "numpy_warm_s", "speedup_warm"))


def test_multi_gpu_smoke(tmp_path):
    """Each task on one and on two gloo ranks: the two-rank job results and DDP losses are the one-rank run's."""
    pytest.importorskip("transformers")
    line = smoke("multi_gpu", tmp_path)
    rows = {(r["task"], r["gpus"]): r for r in line["rows"]}
    assert set(rows) == {(t, g) for t in ("embed", "score", "ddp") for g in (1, 2)}
    assert all(r["rate"] > 0 and r["speedup"] > 0 for r in rows.values())
    assert rows["embed", 2]["identical"] and rows["score", 2]["identical"]
    assert rows["ddp", 2]["compared"] == 4 and rows["ddp", 2]["max_diff"] < 1e-5


def test_a_run_of_record_needs_a_gpu(tmp_path):
    done = run("cora_table", "--quick", "--results", str(tmp_path), gpu=False)
    assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr
    assert not (tmp_path / "cora_table.jsonl").exists()


def test_compile_column_compiles_in_this_process():
    """The compile column's model compiles in the calling process, one compile at a time: inductor's worker pool,
    started at its first compile, disturbed the columns timed after it (benchmarks/RESULTS.md)."""
    import torch
    import torch._inductor.config as inductor_config

    sys.path.insert(0, str(ROOT))
    from benchmarks._common import compiled

    before = inductor_config.compile_threads
    try:
        inductor_config.compile_threads = None
        model = torch.nn.Linear(4, 4)
        assert compiled(model, smoke=False) is not model
        assert inductor_config.compile_threads == 1
        inductor_config.compile_threads = None
        compiled(model, smoke=True)  # the eager backend: no inductor compiles to place
        assert inductor_config.compile_threads is None
    finally:
        inductor_config.compile_threads = before


def check_results_md(text: str, scripts: list[str]) -> None:
    """RESULTS.md has a section per script of record, and every table row is a line of its own."""
    headers = [line for line in text.splitlines() if line.startswith("## ")]
    for script in scripts:
        assert any(f"`benchmarks/{script}.py" in h for h in headers), f"no section for benchmarks/{script}.py"
    for n, line in enumerate(text.splitlines(), 1):
        if "|---|" in line or " | | " in line:
            assert line.startswith("|"), f"RESULTS.md line {n}: a table row inside a paragraph: {line[:80]!r}"


def test_results_md_keeps_a_section_per_benchmark_and_its_tables():
    """A reflow of RESULTS.md once swallowed two sections and their tables into one bullet."""
    scripts = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.stem.startswith("_"))
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    check_results_md(text, scripts)
    # a table's header and rule joined onto the paragraph line above it, as the reflow did
    reflowed = re.sub(r"\n\n(\| dataset[^\n]*)\n(\|---[^\n]*)\n", r" \1 \2\n", text, count=1)
    with pytest.raises(AssertionError, match="a table row inside a paragraph"):
        check_results_md(reflowed, scripts)
    with pytest.raises(AssertionError, match="no section for benchmarks/soak.py"):
        check_results_md(text.replace("## Tuning database soak: `benchmarks/soak.py`", "Soak"), scripts)


def test_ab_trees_runs_each_tree_in_order_from_its_own_code(tmp_path, capsys, monkeypatch):
    """diagnostics/ab_trees.py: an exported tree's runs carry its revision, the checkout's its own; a tree whose
    processes would import another tree's autoragged is refused."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "diagnostics"))
    import ab_trees

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    (tree,) = ab_trees.export(["HEAD"], tmp_path / "trees")
    assert (tree / "REVISION").read_text().strip() == head.strip() and (tree / "kernels" / "config.py").is_file()
    ab = tmp_path / "ab"
    code = ab_trees.main(["run", "--trees", f"new={ROOT}", f"old={tree}", "--order", "old", "new", "--results",
                          str(ab), "--columns", "auto", "--", "benchmarks/cora_table.py", "--smoke", "--columns",
                          "auto"])  # fmt: skip
    assert code == 0
    lines = {run: json.loads((ab / run / "cora_table.jsonl").read_text()) for run in ("1_old", "2_new")}
    assert lines["1_old"]["revision"] == head.strip()  # the exported tree's, in full
    own = lines["2_new"]["revision"].removesuffix("-dirty")  # the checkout's short hash, from its own git
    assert 7 <= len(own) < 40 and head.startswith(own)
    out = capsys.readouterr().out
    assert "auto: geomean over 2 rows: new " in out and "new / old per row: geomean" in out
    bare = tmp_path / "bare"  # a tree without its own autoragged: the installed one would stand in
    (bare / "benchmarks").mkdir(parents=True)
    with pytest.raises(SystemExit, match="another tree's code|importing autoragged failed"):
        ab_trees.check_imports(bare)
