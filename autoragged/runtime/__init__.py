"""The runtime every model family shares: per batch lengths -> stats -> choice -> arm -> record (core.py), the
policy that chooses (policy.py), the decision records and timers (records.py), the recorder that writes them to the
tuning database (recorder.py), and the registration counter that tells a structure change (epoch.py)."""
