"""The runtime every model family shares: per batch lengths -> stats -> plan -> arm -> record
(core.py), the CUDA-graph arms (capture.py) and their cache (graphs.py), the decision records (records.py)."""
