"""Idempotent registration of this package's strategy names with Lightning's strategy registries (Trainer, Fabric)."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.rank_zero import rank_zero_warn

_PACKAGE = "lightning_dp_strategies"

LAUNCHERS = (
    ("", "popen", "re-runs the script for each rank (scripts, torchrun, SLURM)"),
    ("_spawn", "spawn", "spawns fresh processes"),
    ("_notebook", "fork", "forks the current process (works inside Jupyter)"),
)
"""The launcher variants of a multi-process strategy's name: ``(suffix, start_method, what it does)``."""


def register_name(
    registry: _StrategyRegistry,
    name: str,
    strategy: type,
    description: str,
    where: str = "the Trainer",
    **init_params: Any,
) -> None:
    """Register ``name`` for ``strategy``; re-registering our own name (a second import, a notebook reload) is a no-op.

    A name that another package already registered is left alone, with a warning, instead of being silently replaced.
    ``where`` names what takes the strategy in that warning (``"the Trainer"``, ``"Fabric"``).
    """
    if name in registry:
        owner = registry[name]["strategy"]
        if not getattr(owner, "__module__", "").startswith(_PACKAGE):
            rank_zero_warn(
                f"Strategy name {name!r} is already registered by {owner.__module__}.{owner.__qualname__}; "
                f"{_PACKAGE} leaves it alone. Pass `strategy={strategy.__name__}(...)` to {where} instead."
            )
            return
    registry.register(name, strategy, description=description, override=True, **init_params)


def register_with_launchers(
    registry: _StrategyRegistry, name: str, strategy: type, description: str, where: str = "the Trainer"
) -> None:
    """Register ``name`` and its ``_spawn`` / ``_notebook`` variants (see :data:`LAUNCHERS`) for ``strategy``."""
    for suffix, start_method, how in LAUNCHERS:
        register_name(
            registry, name + suffix, strategy, f"{description}; launcher {how}", where, start_method=start_method
        )


def discover(package: str, base: type) -> list[type]:
    """The strategy classes of ``package``'s modules: every subclass of ``base`` a module defines with a
    ``registered_name``, in module-name order. A strategy is found from its own file; nothing else lists it.

    Modules whose names start with ``_`` are helpers and are not searched.
    """
    found: list[type] = []
    for info in sorted(pkgutil.iter_modules(importlib.import_module(package).__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, base)
                and (value.__module__ == module.__name__ or value.__module__.startswith(module.__name__ + "."))
                and getattr(value, "registered_name", None) is not None
            ):
                found.append(value)
    return found
