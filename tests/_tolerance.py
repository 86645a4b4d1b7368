"""The tolerance rule of every numerical test (STYLE.md, flash-attention's rule):

    err(ours, fp64 reference) <= 2 * err(PyTorch in the same dtype, fp64 reference) + slack

err is the max abs error over the elements that matter (real rows). slack is two ulps of the output's
scale in the compared dtype, so that outputs where PyTorch happens to be exact (fp32 on tiny sums)
are not held to zero. Under Triton's interpreter, bf16 casts truncate instead of rounding to nearest
(Triton 3.9: 1 + 0.75 * 2**-7 casts to 1.0, not 1.0078125), which costs up to one more bf16 ulp.
"""

import torch
from autoragged.kernels.config import interpreting


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def assert_within_torch_error(
    ours: torch.Tensor, torch_same_dtype: torch.Tensor, ref64: torch.Tensor, what: str = "", scale: float = 0.0
):
    """`scale`: the slack's scale at least this (a gradient that is zero in exact arithmetic, such as a key bias's,
    is held to the ulps of its model's largest gradient, not to zero)."""
    dtype = ours.dtype
    assert not torch.isnan(ours).any(), f"{what}: NaN in the output (an element was not written?)"
    scale = max(ref64.abs().max().item() if ref64.numel() else 0.0, scale)
    ulp = torch.finfo(dtype).eps * max(scale, 1e-30)
    slack = 2 * ulp
    if dtype == torch.bfloat16 and interpreting() and ours.device.type == "cpu":
        slack += ulp
    e_ours = max_err(ours, ref64)
    e_torch = max_err(torch_same_dtype, ref64)
    assert e_ours <= 2 * e_torch + slack, f"{what}: error {e_ours:.3e} > 2 x torch's {e_torch:.3e} + {slack:.1e}"
    return e_ours, e_torch


def assert_gradients_within(ours: dict, want: dict, want64: dict, what: str) -> None:
    """Each named gradient of `ours` within 2x `want`'s error against `want64` (the same names in each), on the
    scale of the largest reference gradient."""
    assert ours.keys() == want.keys(), f"{what}: gradients of {sorted(set(want) ^ set(ours))} differ in presence"
    largest = max(g.abs().max().item() for g in want64.values())
    for name in want:
        assert_within_torch_error(ours[name], want[name], want64[name], f"{what} d{name}", largest)
