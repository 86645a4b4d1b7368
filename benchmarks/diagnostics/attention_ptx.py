"""Compile the ragged attention kernel for sm_90a on any host (no GPU needed): shared memory, registers, spills.

    python benchmarks/diagnostics/attention_ptx.py                  # the table below, from ptxas -v
    python benchmarks/diagnostics/attention_ptx.py --against HEAD~3 # also: is the plain/causal PTX that revision's?

Triton lowers the kernel to PTX for a Hopper target (pointers and strides marked 16-divisible, as a launch on
contiguous-headed tensors specializes them), and the ptxas shipped with Triton reports registers and spill
stores. With --against, the kernel file of that git revision is compiled the same way and the PTX
instruction streams of the plain and causal cases are compared (parameter declarations and debug info
aside): equal streams mean the new features compile away when off. Speeds are not measured here.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from typing import NamedTuple

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU target, not for the interpreter
ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


class Case(NamedTuple):
    """One compile of the forward kernel: its element type, head dim and launch config."""

    dtype: str
    head_dim: int
    block_m: int
    block_n: int
    warps: int
    stages: int
    causal: bool
    group: int  # GQA heads per key/value head
    window: bool


CASES = [
    Case("fp16", 64, 64, 64, 4, 2, False, 1, False),
    Case("fp16", 64, 64, 64, 4, 2, True, 1, False),
    Case("bf16", 128, 128, 64, 8, 3, True, 1, False),
    Case("bf16", 128, 64, 64, 4, 2, True, 7, True),
    Case("bf16", 256, 64, 32, 8, 2, False, 1, False),
    Case("bf16", 256, 64, 32, 8, 2, True, 2, True),
    Case("bf16", 256, 64, 32, 4, 2, False, 1, False),
    Case("bf16", 256, 64, 64, 8, 2, False, 1, False),
    Case("fp32", 256, 64, 32, 8, 1, False, 1, False),
    Case("fp32", 256, 32, 64, 8, 1, False, 1, False),
]


def _ptxas() -> str:
    import triton

    bin_dir = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in ("ptxas-blackwell", "ptxas"):  # the newer one reads the PTX version Triton 3.9 writes
        if (bin_dir / name).exists():
            return str(bin_dir / name)
    raise SystemExit(f"no ptxas under {bin_dir}")


# the kernel's pointer parameters that are not of the case's dtype; every other non-constexpr is an int32 but these
_POINTERS = {"offsets": "*i32", "lengths": "*i32", "grid_mapping": "*i32", "block_offsets": "*i32",
             "key_lengths": "*i32", "Lse": "*fp32", "DropSeed": "*i64"}  # fmt: skip
_FLOATS = ("qk_scale", "drop_p")


def compile_case(fn, case: Case):
    """(compiled kernel, registers, spill bytes) of `fn` for one case (the features a case does not name off)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(fn.arg_names)
    constexprs = dict(
        HEAD_DIM=case.head_dim, BLOCK_D=triton.next_power_of_2(case.head_dim), BLOCK_M=case.block_m,
        BLOCK_N=case.block_n, CAUSAL=case.causal, PRECISION="tf32", UPCAST=False, GQA_GROUP=case.group,
        WINDOW=case.window, KEYS=False, STORE_LSE=False, DROPOUT=False, PDL=False,
    )  # fmt: skip
    constexprs = {c: v for c, v in constexprs.items() if c in names}  # an older kernel has fewer
    sig = {}
    for n in names:
        if n in constexprs:
            sig[n] = "constexpr"
        elif n in ("Q", "K", "V", "Out"):
            sig[n] = "*" + case.dtype
        else:
            sig[n] = _POINTERS.get(n, "fp32" if n in _FLOATS else "i32")
    aligned = [i for i, n in enumerate(names) if sig[n].startswith("*") or n.startswith("stride_")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    positions = {(names.index(c),): v for c, v in constexprs.items()}
    source = ASTSource(fn=fn, signature=sig, constexprs=positions, attrs=attrs)
    options = {"num_warps": case.warps, "num_stages": case.stages}
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    try:
        report = subprocess.run(
            [_ptxas(), "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True
        ).stderr
    finally:
        os.unlink(f.name)
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    if not registers or not spills:
        raise RuntimeError(f"ptxas said: {report[-400:]}")
    return kernel, int(registers.group(1)), int(spills.group(1))


def instructions(ptx: str) -> list[str]:
    """The PTX without parameter declarations, debug sections and locations."""
    body = ptx.split(".section\t.debug", 1)[0]
    lines = (re.sub(r"//.*", "", line).strip() for line in body.splitlines())
    skip = (".loc", ".file", ".param")
    return [line for line in lines if line and not line.startswith(skip) and "param_" not in line]


def kernel_at(revision: str):
    """The attention kernel as the file stood at `revision` (with that revision's helpers)."""
    folder = pathlib.Path(tempfile.mkdtemp()) / "attention_at_rev"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    git = ["git", "-C", str(ROOT)]
    names = subprocess.run([*git, "ls-tree", "--name-only", revision, "kernels/"], capture_output=True, text=True,
                           check=True).stdout.split()  # fmt: skip
    # every module but the package's own (ours is empty: the revision's imports every op and what they register)
    for name in (n for n in names if n.endswith(".py") and n != "kernels/__init__.py"):
        text = subprocess.run([*git, "show", f"{revision}:{name}"], capture_output=True, text=True, check=True).stdout
        (folder / pathlib.Path(name).name).write_text(text)
    sys.path.insert(0, str(folder.parent))
    return importlib.import_module("attention_at_rev.ragged_attention")._ragged_attn_fwd_kernel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", metavar="REV", help="compare the plain and causal PTX with this git revision")
    args = parser.parse_args(argv)
    from autoragged.kernels import ragged_attention as k_attn

    titles = [*Case._fields, "smem KB", "registers", "spill B"]
    print("| " + " | ".join(titles) + " |\n" + "|---" * len(titles) + "|")
    for case in CASES:
        kernel, registers, spills = compile_case(k_attn._ragged_attn_fwd_kernel, case)
        print("| " + " | ".join(map(str, case)) + f" | {kernel.metadata.shared / 1024:.0f} | {registers} | {spills} |")
    if args.against:
        old = kernel_at(args.against)
        for case in (c for c in CASES if c.group == 1 and not c.window):
            new_ptx = compile_case(k_attn._ragged_attn_fwd_kernel, case)[0].asm["ptx"]
            old_ptx = compile_case(old, case)[0].asm["ptx"]
            same = instructions(new_ptx) == instructions(old_ptx)
            print(f"{case}: PTX instructions {'identical to' if same else 'DIFFER from'} {args.against}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
