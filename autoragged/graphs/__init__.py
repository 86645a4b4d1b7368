"""The ragged CUDA graphs: one graph and its replays (capture.py), the graphs a wrapped module keeps (cache.py), and
the background thread that runs their warm-ups off the traffic's path (worker.py)."""
