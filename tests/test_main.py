"""`python -m autoragged`: the line saying what the ragged arm runs is what `autoragged.ops` chooses, and the line
about the tuning database says what state the file is in."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch
from _broken_db import damaged_db, deny_writes
from autoragged.tuning_db import TuningDB

from autoragged import __main__ as cli

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _python(args: list[str], interpret: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": interpret}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU lines: on a GPU the Triton kernels always run compiled")
@pytest.mark.parametrize("interpret", ["0", "1"])
def test_ragged_arm_line_names_the_backend_ops_uses(interpret):
    check = "import torch; from autoragged.ragged.backend import use_triton; print(use_triton(torch.empty(0)))"
    triton = _python(["-c", check], interpret).strip() == "True"
    assert triton == (interpret == "1")  # on CPU, the interpreter only where asked for before the import
    line = next(x for x in _python(["-m", "autoragged"], interpret).splitlines() if x.startswith("ragged arm runs"))
    runs = line.removeprefix("ragged arm runs").strip()
    if triton:
        assert runs.startswith("Triton kernels in Triton's interpreter")
    else:
        assert runs.startswith("PyTorch reference ops")
    assert "linears on PyTorch's CPU matmul" in runs and "cuBLAS" not in runs


def _database_line(capsys) -> str:
    assert cli.main([]) == 0
    return next(x for x in capsys.readouterr().out.splitlines() if x.startswith("tuning database"))


def test_the_database_line_says_what_state_the_file_is_in(tmp_path, monkeypatch, capsys):
    """It printed the path alone, as if a damaged or read-only file were fine."""
    path = tmp_path / "t.sqlite"
    monkeypatch.setenv("AUTORAGGED_DB", str(path))
    assert _database_line(capsys).endswith(f"{path}: not created yet (the first wrapped model or tune run makes it)")
    assert not path.exists()
    TuningDB.open(path).close()
    assert _database_line(capsys).endswith(f"{path}: fine")
    with monkeypatch.context() as mp:
        deny_writes(mp, path)
        assert _database_line(capsys).endswith(f"{path}: read-only (its cost model is read, nothing is recorded)")
    damaged_db(path)
    line = _database_line(capsys)
    assert f"{path}: damaged" in line and "move it away" in line
    monkeypatch.setenv("AUTORAGGED_DB", str(tmp_path))
    assert f"{tmp_path}: a directory" in _database_line(capsys)
    monkeypatch.delenv("AUTORAGGED_DB")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    default = tmp_path / "home" / ".cache" / "autoragged" / "tuning.sqlite"
    assert _database_line(capsys).endswith(f"{default} (default): not created yet (the first wrapped model or tune "
                                           "run makes it)")  # fmt: skip
