"""Test setup. Without CUDA, Triton kernels run in the interpreter: TRITON_INTERPRET must be set before
any kernel module is imported (Triton chooses the interpreter when a kernel is decorated)."""

import os

import torch

if not torch.cuda.is_available():  # does not create a CUDA context
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels._config import interpreting  # noqa: E402
from kernels._triton import HAS_TRITON  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


def triton_available(device: str) -> bool:
    return HAS_TRITON and (device == "cuda" or interpreting())


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _fresh_db(tmp_path, monkeypatch):
    """Every test gets its own tuning database file; nothing writes to the user's cache."""
    monkeypatch.setenv("AUTORAGGED_DB", str(tmp_path / "tuning.sqlite"))
    yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
