"""Cost models with known answers, for the planner in tests (`Planner(sig, model, candidates)`)."""

import numpy as np


class Prefers:
    """A cost model that makes one side cheapest (the padded arms, or the ragged ones), by far more than a
    mask read's host time: the read is timed, and the padded side wins when it beats the other side plus the
    read (with a gap of 1 ms, a busy CI host's slow first reads once made the padded side win)."""

    name = "fake"

    def __init__(self, padded: bool):
        self.padded = padded

    def predict_ms(self, sig, stats, arms):
        return np.array([1.0 if arm.kind.startswith("padded") == self.padded else 1000.0 for arm in arms])


class Fixed:
    """A cost model that predicts `ms[arm.kind]` for every batch (arm kinds it is not given: 1000 ms)."""

    name = "fake"

    def __init__(self, ms: dict[str, float]):
        self.ms = ms

    def predict_ms(self, sig, stats, arms):
        return np.array([self.ms.get(arm.kind, 1000.0) for arm in arms])
