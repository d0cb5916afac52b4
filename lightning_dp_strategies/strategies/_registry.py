"""Idempotent registration of this package's strategy names with Lightning's strategy registry."""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.strategies import Strategy

_PACKAGE = "lightning_dp_strategies"


def register_name(
    registry: _StrategyRegistry, name: str, strategy: type[Strategy], description: str, **init_params: Any
) -> None:
    """Register ``name`` for ``strategy``; re-registering our own name (a second import, a notebook reload) is a no-op.

    A name that another package already registered is left alone, with a warning, instead of being silently replaced.
    """
    if name in registry:
        owner = registry[name]["strategy"]
        if not getattr(owner, "__module__", "").startswith(_PACKAGE):
            rank_zero_warn(
                f"Strategy name {name!r} is already registered by {owner.__module__}.{owner.__qualname__}; "
                f"{_PACKAGE} leaves it alone. Pass `strategy={strategy.__name__}(...)` to the Trainer instead."
            )
            return
    registry.register(name, strategy, description=description, override=True, **init_params)
