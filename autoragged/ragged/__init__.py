"""The ragged building blocks: `RaggedTensor` and pad/unpad (tensor.py), the host-side `Layout` of a batch
(layout.py), and which implementation an op takes for a tensor (backend.py)."""
