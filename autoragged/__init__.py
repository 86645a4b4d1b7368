"""autoragged: per-batch choice between padded and padding-free execution of transformer models.

    model = autoragged.wrap(model)            # same call signature as before
    y = model(x, src_key_padding_mask=mask)   # each batch goes to the predicted-fastest arm

Public modules, each an attribute of the package once it is imported: `autoragged.ops` (ragged kernels on
RaggedTensors), `autoragged.nn` (ragged encoder modules), `autoragged.packing` (token-budget batching, `run_job`),
`autoragged.workloads` (length distributions), `autoragged.tune` and `autoragged.report` (command-line entry
points, `python -m ...`; `report.summary()`), `autoragged.kernels`, `autoragged.tuning_db`.

The repository's `kernels/` and `tuning_db/` folders are installed as `autoragged.kernels` and
`autoragged.tuning_db` (`kernels` is the import name of HuggingFace's hub-kernels package). Attributes
are imported on first use, so `import autoragged.tuning_db` pulls in no torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

__version__ = "0.1.0"


class _CheckoutFinder:
    """Finds `autoragged.kernels` / `autoragged.tuning_db` in a source checkout that was not installed (the
    repository root on sys.path, as on a machine that runs the tree as it is): there they are the
    repository's top-level folders, not folders inside this package."""

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        name = fullname.partition("autoragged.")[2]
        if fullname.startswith("autoragged.") and name in ("kernels", "tuning_db"):
            folder = os.path.join(cls.root, name)
            return importlib.util.spec_from_file_location(
                fullname, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
            )
        return None


if not os.path.isdir(os.path.join(os.path.dirname(__file__), "kernels")) and os.path.isfile(
    os.path.join(_CheckoutFinder.root, "kernels", "config.py")
):
    if not any(f is _CheckoutFinder for f in sys.meta_path):
        sys.meta_path.insert(0, _CheckoutFinder)  # before an editable install's finder of another tree

# name -> (module, attribute or None for the module itself)
_LAZY = {
    "RaggedTensor": (".ragged.tensor", "RaggedTensor"),
    "lengths_from_mask": (".ragged.tensor", "lengths_from_mask"),
    "strip_padding": (".ragged.tensor", "strip_padding"),
    "restore_padding": (".ragged.tensor", "restore_padding"),
    "KernelConfig": (".kernels.config", "KernelConfig"),
    "BatchStats": (".tuning_db.records", "BatchStats"),
    "Decision": (".tuning_db.records", "Decision"),
    "Measurement": (".tuning_db.records", "Measurement"),
    "ModuleSignature": (".tuning_db.records", "ModuleSignature"),
    "wrap": (".wrapper", "wrap"),
    "unwrap": (".wrapper", "unwrap"),
    "recent_decisions": (".wrapper", "recent_decisions"),
    "graph_stats": (".wrapper", "graph_stats"),
    "warmup": ("._warmup", "warmup"),
    "flush": (".wrapper", "flush"),
    "nn": (".nn", None),
    "ops": (".ops", None),
    "packing": (".packing", None),
    "workloads": (".workloads", None),
    "report": (".report", None),
    "tune": (".tune", None),
    "kernels": (".kernels", None),
    "tuning_db": (".tuning_db", None),
}
__all__ = list(_LAZY)


def __getattr__(name: str):
    try:
        module_name, attribute = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'autoragged' has no attribute {name!r}") from None
    module = importlib.import_module(module_name, __name__)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
