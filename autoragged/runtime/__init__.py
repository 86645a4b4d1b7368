"""The runtime every model family shares: per batch lengths -> stats -> plan -> arm -> record
(core.py), the CUDA-graph arms (graphs.py), and the decision records (records.py)."""
