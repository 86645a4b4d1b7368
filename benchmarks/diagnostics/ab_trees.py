"""A/B a benchmark between code trees in one lease: runs alternated in a given order, each from its own
tree, then each numeric column compared per row.

    python benchmarks/diagnostics/ab_trees.py export 534b06d          # here: the revision's tree, under .ab/534b06d
    python benchmarks/diagnostics/ab_trees.py run --trees new=. old=.ab/534b06d --order old new new old \\
        --results $OUT/ab -- benchmarks/cora_table.py --columns auto auto_lengths

`export` writes what the runtime and the benchmarks import (autoragged/, kernels/, tuning_db/, benchmarks/,
pyproject.toml) of each revision to `.ab/<revision>` (a slash as _) with its full hash in `REVISION` there: a lent
machine's copy of the checkout has no usable git, so the trees are made here and carried there (`carry=[".ab"]`).

`run` checks that each tree imports its own `autoragged` and `autoragged.kernels` (an editable install of another
tree must not stand in), then runs the script once per name of `--order`, from that tree, with `--results
<results>/<i>_<name>`; an exported tree's runs get `$AUTORAGGED_REVISION`, so its JSONL line says which code ran.
Last it prints, per numeric column of the scripts' rows, each tree's geomean over the rows of its runs' means, and
the per-row ratio of the first tree named in `--trees` over each other tree (geomean and range), alongside the
spread between one tree's own runs: a difference inside that spread is noise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks._common import geomean  # noqa: E402

PARTS = ("autoragged", "kernels", "tuning_db", "benchmarks", "pyproject.toml")
KEYS = ("dataset", "batch", "model", "input")  # what names a row, where a script's rows have them


def export(revisions: list[str], into: pathlib.Path) -> list[pathlib.Path]:
    """Each revision's tree under `into`/<revision> (replaced if there), with its full hash in REVISION."""
    trees = []
    for rev in revisions:
        full = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                              capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        tree = into / rev.replace("/", "_")  # (a branch's name may hold slashes)
        if tree.exists():
            shutil.rmtree(tree)
        tree.mkdir(parents=True)
        listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", full], capture_output=True,
                                text=True, check=True).stdout.split()  # fmt: skip
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", full, *(p for p in PARTS if p in listed)],
                                 capture_output=True, check=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        (tree / "REVISION").write_text(full + "\n")
        trees.append(tree)
    return trees


def tree_revision(tree: pathlib.Path) -> str:
    """The revision a tree holds: its REVISION file (an exported tree), else $AUTORAGGED_REVISION (as the benchmarks
    read it: a lent machine's copy), else its checkout's HEAD."""
    stamp = tree / "REVISION"
    if stamp.is_file():
        return stamp.read_text().strip()
    if os.environ.get("AUTORAGGED_REVISION"):
        return os.environ["AUTORAGGED_REVISION"]
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def environment(tree: pathlib.Path) -> dict[str, str]:
    """The runs' environment: the tree first on the path; an exported tree's revision named (a checkout's own git
    names its revision, "-dirty" included)."""
    env = dict(os.environ)
    if (tree / "REVISION").is_file():
        env["AUTORAGGED_REVISION"] = tree_revision(tree)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def check_imports(tree: pathlib.Path) -> None:
    """Raise unless `tree`'s own autoragged and kernels are what a process started in it imports."""
    probe = "import autoragged, autoragged.kernels as k; print(autoragged.__file__); print(k.__file__)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=tree, env=environment(tree), capture_output=True,
                          text=True)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{tree}: importing autoragged failed:\n{done.stderr[-2000:]}")
    for path in done.stdout.split():
        if not pathlib.Path(path).resolve().is_relative_to(tree.resolve()):
            raise SystemExit(f"{tree}: a process there imports {path}, another tree's code (an editable install?)")


def rows_of(results: pathlib.Path) -> list[dict]:
    lines = [json.loads(line) for p in sorted(results.glob("*.jsonl")) for line in p.read_text().splitlines()]
    if len(lines) != 1:
        raise SystemExit(f"{results}: expected one JSON line from the run, found {len(lines)}")
    return lines[0]["rows"]


def row_key(row: dict) -> tuple:
    return tuple(row[k] for k in KEYS if k in row)


def compare(runs: list[tuple[str, list[dict]]], names: list[str], only: list[str] | None = None) -> list[str]:
    """Lines of text: per numeric column (of `only`, where given), each tree's geomean and the first tree's per-row
    ratio to each other's."""
    by_tree: dict[str, dict[tuple, dict[str, list[float]]]] = {name: {} for name in names}
    for name, rows in runs:
        for row in rows:
            cells = by_tree[name].setdefault(row_key(row), {})
            for column, value in row.items():
                wanted = column not in KEYS and (only is None or column in only)
                if wanted and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                    if math.isfinite(value):
                        cells.setdefault(column, []).append(float(value))
    columns = sorted({c for rows in by_tree.values() for cells in rows.values() for c in cells})
    lines = []
    for column in columns:
        shared = [k for k in by_tree[names[0]] if all(column in by_tree[n].get(k, {}) for n in names)]
        if not shared:
            continue
        means = {n: {k: statistics.fmean(by_tree[n][k][column]) for k in shared} for n in names}
        parts = [f"{n} {geomean(list(means[n].values())):.4g}" for n in names]
        lines.append(f"{column}: geomean over {len(shared)} rows: " + ", ".join(parts))
        for other in names[1:]:
            ratios = [means[names[0]][k] / means[other][k] for k in shared]
            lines.append(f"  {names[0]} / {other} per row: geomean {geomean(ratios):.3f} "
                         f"({min(ratios):.3f}-{max(ratios):.3f})")  # fmt: skip
        for n in names:
            spreads = [max(v) / min(v) for k in shared if len(v := by_tree[n][k][column]) > 1]
            if spreads:
                lines.append(f"  {n}'s own runs per row: max / min at most {max(spreads):.3f}")
    return lines


def run(args) -> int:
    bad = [spec for spec in args.trees if "=" not in spec or spec.startswith("=")]
    if bad:
        raise SystemExit(f"--trees takes NAME=PATH (new=. old=.ab/534b06d), got {bad}")
    trees = {name: pathlib.Path(path).resolve() for name, path in (spec.split("=", 1) for spec in args.trees)}
    unknown = [n for n in args.order if n not in trees]
    if unknown:
        raise SystemExit(f"--order names {unknown}, not among --trees {list(trees)}")
    script, *script_args = args.command
    for tree in trees.values():
        if not (tree / script).is_file():
            raise SystemExit(f"{tree} has no {script} (the script's path is relative to each tree)")
        check_imports(tree)
    results = pathlib.Path(args.results).resolve()
    runs = []
    for i, name in enumerate(args.order, 1):
        tree, out = trees[name], results / f"{i}_{name}"
        out.mkdir(parents=True, exist_ok=True)
        print(f"=== run {i}: {name} ({tree_revision(tree)[:12]}, {tree})", flush=True)
        done = subprocess.run([sys.executable, str(tree / script), *script_args, "--results", str(out)], cwd=tree,
                              env=environment(tree))  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"run {i} ({name}) exited {done.returncode}")
        runs.append((name, rows_of(out)))
    print("\n## " + " / ".join(trees) + ", runs in the order " + " ".join(args.order))
    print("\n".join(compare(runs, [n for n in trees if n in args.order], args.columns)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("export", help="write each revision's tree under .ab/ (run here, where git is)")
    p.add_argument("revisions", nargs="+")
    p.add_argument("--into", default=str(ROOT / ".ab"), help="where the trees go (default .ab/)")
    p = sub.add_parser("run", help="run a benchmark from each tree in the order given, then compare")
    p.add_argument("--trees", nargs="+", required=True, metavar="NAME=PATH", help="the trees, the reference first")
    p.add_argument("--order", nargs="+", required=True, metavar="NAME", help="one run per name, in this order")
    p.add_argument("--results", required=True, help="each run's JSONL goes to <results>/<i>_<name>/")
    p.add_argument("--columns", nargs="+", help="the row columns to compare (default: every numeric one)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS]: a script path inside each tree")
    args = parser.parse_args(argv)
    if args.step == "export":
        for tree in export(args.revisions, pathlib.Path(args.into)):
            print(f"{tree} ({tree_revision(tree)[:12]})")
        return 0
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("run needs -- SCRIPT [ARGS] after its options")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
