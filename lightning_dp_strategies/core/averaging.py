"""Averaging tensors across ranks: the names of :mod:`lightning_dp_strategies.local_sgd.averaging`, exported here."""

from lightning_dp_strategies.local_sgd.averaging import FlatAverager, PeriodicAverager, averageable

__all__ = ["FlatAverager", "PeriodicAverager", "averageable"]
