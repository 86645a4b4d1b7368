"""`python -m autoragged`: what this machine gives autoragged (versions, device, kernel path, database)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _ragged_arm(device) -> str:
    """What the ragged arm runs on `device`, as `autoragged.ops` chooses for a tensor there (`use_triton`):
    attention, norms and packing on Triton kernels or their PyTorch references; the linears of the
    default config on torch.nn.functional.linear (cuBLAS on a GPU)."""
    import torch

    from .kernels.triton_compat import HAS_TRITON
    from .ragged.backend import use_triton

    if device.type == "cuda":
        return "Triton kernels (compiled), linears on cuBLAS (Triton ones in the ragged graphs)"
    if use_triton(torch.empty(0, device=device)):
        return "Triton kernels in Triton's interpreter (TRITON_INTERPRET=1), linears on PyTorch's CPU matmul"
    other = "TRITON_INTERPRET=1: Triton's interpreter" if HAS_TRITON else "Triton is not installed"
    return f"PyTorch reference ops, linears on PyTorch's CPU matmul ({other})"


def _database_state(path: Path) -> str:
    """What state the tuning database at `path` is in, as a wrapped model would find it: not created yet, a
    directory, damaged, read-only (read, never written), fine, or unusable for another reason the error names.
    Opening it read-only checks its pages (`TuningDB.open`) and writes nothing."""
    from .tuning_db import DamagedDatabase, DatabaseError, ReadOnlyDatabase, TuningDB, check_location

    if path.is_dir():
        return f"a directory, not a file: set AUTORAGGED_DB to a file, e.g. {path / 'tuning.sqlite'}"
    if not path.exists():
        return "not created yet (the first wrapped model or tune run makes it)"
    try:
        TuningDB.open(path, readonly=True).close()
        check_location(path)
    except ReadOnlyDatabase:
        return "read-only (its cost model is read, nothing is recorded)"
    except DamagedDatabase as e:
        return f"damaged: {e}"
    except DatabaseError as e:
        return f"unusable: {e}"
    return "fine"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m autoragged",
        description="Print the versions, device, kernel path and tuning database autoragged would use here.",
        epilog="example: python -m autoragged",
    )
    parser.parse_args(argv)
    import torch

    import autoragged

    from .kernels.triton_compat import HAS_TRITON
    from .tuning_db import default_path

    path = default_path()
    cuda = torch.cuda.is_available()
    device = f"cuda: {torch.cuda.get_device_name()}" if cuda else "cpu"
    triton_version = "not installed"
    if HAS_TRITON:
        import triton

        triton_version = triton.__version__
    rows = [
        ("autoragged", autoragged.__version__),
        ("python", sys.version.split()[0]),
        ("torch", torch.__version__),
        ("triton", triton_version),
        ("device", device),
        ("ragged arm runs", _ragged_arm(torch.device("cuda" if cuda else "cpu"))),
        ("tuning database", f"{path}{'' if os.environ.get('AUTORAGGED_DB') else ' (default)'}: "
                            f"{_database_state(path)}"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
