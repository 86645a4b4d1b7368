"""`torchrun --standalone --nproc-per-node 2` from a test, on the CPU (gloo): not a test module."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchrun(*args: str, db: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node 2 ARGS` in the repository root: PyTorch's reference ops (no Triton
    interpreter), one thread per rank, the tuning database `db`; its output in the assertion where it fails."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "AUTORAGGED_DB": str(db)}  # fmt: skip
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"torchrun failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done
