"""What `pip install autoragged` puts on a machine: everything under the `autoragged` namespace, beside
HuggingFace's `kernels` (the import name transformers uses for hub kernels) without touching it."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
HF_KERNELS = "kernels==0.17.2"


def _pip(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    done = _pip("wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(out))
    assert done.returncode == 0, done.stderr
    (path,) = out.glob("autoragged-*.whl")
    return path


def test_every_package_folder_is_installed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    for name, folder in config["package-dir"].items():
        for module in (ROOT / folder).rglob("*.py"):
            package = ".".join((name, *module.parent.relative_to(ROOT / folder).parts))
            assert package in listed, f"{module.parent} is not listed in pyproject's packages (as {package})"
            assert (module.parent / "__init__.py").exists(), f"{module.parent} has no __init__.py"


def test_the_wheel_holds_only_the_autoragged_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"autoragged"}
    assert "autoragged/kernels/ragged_attention.py" in names
    assert "autoragged/tuning_db/_db.py" in names


def test_hf_kernels_and_autoragged_install_side_by_side(wheel, tmp_path):
    """Both wheels into one folder, then both imported from a directory that is not the checkout."""
    downloads = tmp_path / "downloads"
    got = _pip("download", "-q", "--no-deps", "-d", str(downloads), HF_KERNELS, timeout=120)
    if got.returncode != 0:
        pytest.skip(f"the package index is not reachable for {HF_KERNELS}: {got.stderr.strip()[-200:]}")
    site = tmp_path / "site"
    done = _pip("install", "-q", "--no-deps", "--target", str(site), *map(str, downloads.glob("*.whl")), str(wheel))
    assert done.returncode == 0, done.stderr
    probe = (
        "import kernels, autoragged, autoragged.kernels, autoragged.tuning_db\n"
        "from kernels import LayerRepository, get_kernel\n"  # HF's API, not ours
        "from autoragged.kernels.ragged_attention import ragged_attention_ref\n"
        "from autoragged import KernelConfig, wrap\n"
        "print(kernels.__file__); print(autoragged.kernels.__file__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    hf, ours = out.stdout.split()
    assert Path(hf) == site / "kernels" / "__init__.py"
    assert Path(ours) == site / "autoragged" / "kernels" / "__init__.py"


def test_every_public_submodule_is_an_attribute_of_the_package():
    """`import autoragged` then `autoragged.packing.run_job` etc., as the README writes them, in a fresh
    interpreter (an earlier import in this process would have set the attributes already)."""
    probe = (
        "import autoragged\n"
        "assert callable(autoragged.packing.run_job) and callable(autoragged.report.summary)\n"
        "assert autoragged.workloads.CORA and callable(autoragged.tune.main) and callable(autoragged.ops.linear_values)\n"
        "assert autoragged.nn.__name__ == 'autoragged.nn' and autoragged.kernels.__name__ == 'autoragged.kernels'\n"
        "assert autoragged.tuning_db.__name__ == 'autoragged.tuning_db'\n"
        "assert callable(autoragged.strip_padding) and callable(autoragged.warmup)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
