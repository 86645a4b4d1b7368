"""Test setup. Without CUDA, Triton kernels run in the interpreter: TRITON_INTERPRET must be set before
any kernel module is imported (Triton chooses the interpreter when a kernel is decorated)."""

import os

import torch

if not torch.cuda.is_available():  # does not create a CUDA context
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from autoragged.kernels.config import interpreting  # noqa: E402
from autoragged.kernels.triton_compat import HAS_TRITON  # noqa: E402

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


BACKENDS = [(d, b) for d in DEVICES for b in ("triton", "reference") if b == "reference" or triton_available(d)]


@pytest.fixture(params=BACKENDS, ids=[f"{d}-{b}" for d, b in BACKENDS])
def backend(request, monkeypatch):
    """One conformance suite, several backends: the Triton kernels (compiled on CUDA, interpreted on CPU)
    and the PyTorch reference path. Returns the device; the reference path is forced by monkeypatching."""
    from autoragged import ops
    from autoragged.ragged import tensor as _ragged

    device, impl = request.param
    if impl == "reference":
        monkeypatch.setattr(ops, "use_triton", lambda t: False)
        monkeypatch.setattr(_ragged, "use_triton", lambda t: False)
    return torch.device(device)


@pytest.fixture
def device_masks(monkeypatch):
    """Masks count as device masks (reading one is a sync, so the runtime reads only where its arm needs lengths);
    returns the list of reads, one entry each."""
    from autoragged.runtime import core

    reads = []
    real = core.mask_lengths
    monkeypatch.setattr(core, "_on_device", lambda mask: True)
    monkeypatch.setattr(core, "mask_lengths", lambda *a, **k: reads.append(1) or real(*a, **k))
    return reads
