"""Deprecated location of :mod:`lightning_dp_strategies.strategies.checkpoint_io` (a Lightning plugin, so it lives
with the code that imports Lightning); the old names still resolve, with a ``DeprecationWarning``."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_MOVED = ("AtomicCheckpointIO", "with_atomic_default")


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"`lightning_dp_strategies.checkpoint_io.{name}` moved to `lightning_dp_strategies.strategies.checkpoint_io`"
        f" (also `lightning_dp_strategies.{name}`); the old path will be removed in 0.3.",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module("lightning_dp_strategies.strategies.checkpoint_io"), name)
