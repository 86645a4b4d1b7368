"""`python -m autoragged`: what this machine gives autoragged (versions, device, kernel path, database)."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m autoragged",
        description="Print the versions, device, kernel path and tuning database autoragged would use here.",
        epilog="example: python -m autoragged",
    )
    parser.parse_args(argv)
    import torch

    import autoragged

    from .kernels._config import interpreting
    from .kernels._triton import HAS_TRITON

    if torch.cuda.is_available():
        device = f"cuda: {torch.cuda.get_device_name()}"
        path = "Triton kernels (compiled)"
    else:
        device = "cpu"
        path = "Triton kernels (interpreter)" if HAS_TRITON and interpreting() else "PyTorch reference ops"
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
        ("ragged arm runs", path),
        ("tuning database", os.environ.get("AUTORAGGED_DB", "~/.cache/autoragged/tuning.sqlite (default)")),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
