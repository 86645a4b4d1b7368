"""`python -m autoragged`: the line saying what the ragged arm runs is what `autoragged.ops` chooses."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]

if torch.cuda.is_available():
    pytest.skip("the CPU lines: on a GPU the Triton kernels always run compiled", allow_module_level=True)


def _python(args: list[str], interpret: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": interpret}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_ragged_arm_line_names_the_backend_ops_uses(interpret):
    check = "import torch; from autoragged._backend import use_triton; print(use_triton(torch.empty(0)))"
    triton = _python(["-c", check], interpret).strip() == "True"
    assert triton == (interpret == "1")  # on CPU, the interpreter only where asked for before the import
    line = next(x for x in _python(["-m", "autoragged"], interpret).splitlines() if x.startswith("ragged arm runs"))
    runs = line.removeprefix("ragged arm runs").strip()
    if triton:
        assert runs.startswith("Triton kernels in Triton's interpreter")
    else:
        assert runs.startswith("PyTorch reference ops")
    assert "linears on PyTorch's CPU matmul" in runs and "cuBLAS" not in runs
