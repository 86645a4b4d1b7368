"""What each arm costs: the arms and the analytic prior (costmodel.py), the learned model fit offline and
evaluated from arrays (learned.py), read and validated from the tuning database (load.py, payload.py), the
predictions per batch (planner.py), shape arithmetic (buckets.py) and the device key (device.py)."""
