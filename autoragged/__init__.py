"""autoragged: per-batch choice between padded and padding-free execution of transformer encoders."""

from kernels._config import KernelConfig

from ._ragged import RaggedTensor, lengths_from_mask, restore_padding, strip_padding

__all__ = ["RaggedTensor", "KernelConfig", "lengths_from_mask", "strip_padding", "restore_padding"]
__version__ = "0.1.0"
