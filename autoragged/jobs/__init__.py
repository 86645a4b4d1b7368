"""Whole jobs past one GPU: ranks (the split), shards (ordered, resumable results), the encoder family's side
of a job, and the command (`python -m autoragged.job`). The job itself is autoragged/job.py."""
