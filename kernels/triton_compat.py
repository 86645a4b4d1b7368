"""Import Triton where it exists (Linux); elsewhere give the kernel files enough to define themselves.

Without Triton, `@triton.jit` bodies are kept as plain functions that nothing calls, and every op
takes its PyTorch reference path (`autoragged.ops` checks `HAS_TRITON`).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on platforms without Triton
    import types

    HAS_TRITON = False

    def _jit(fn=None, **_kwargs):
        return fn if fn is not None else (lambda f: f)

    def _cdiv(a: int, b: int) -> int:
        return -(-a // b)

    triton = types.SimpleNamespace(jit=_jit, cdiv=_cdiv)
    tl = types.SimpleNamespace(constexpr=int)

__all__ = ["HAS_TRITON", "triton", "tl"]
