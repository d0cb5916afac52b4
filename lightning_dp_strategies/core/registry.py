"""The names the package answers to: its strategy names in Lightning's strategy registries (Trainer, Fabric),
registered idempotently, and the module paths of earlier releases (:data:`MOVED`), each a shim that forwards."""

from __future__ import annotations

import functools
import importlib
import pkgutil
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_dp_strategies.plan import CostModel
from lightning_dp_strategies.plan.predict import name_strategy

_PACKAGE = "lightning_dp_strategies"

LAUNCHERS = (
    ("", "popen", "re-runs the script for each rank (scripts, torchrun, SLURM)"),
    ("_spawn", "spawn", "spawns fresh processes"),
    ("_notebook", "fork", "forks the current process (works inside Jupyter)"),
)
"""The launcher variants of a multi-process strategy's name: ``(suffix, start_method, what it does)``."""

MOVED: dict[str, str] = {
    f"{_PACKAGE}.sizing": f"{_PACKAGE}.plan.sizing",
    f"{_PACKAGE}.plan_compression": f"{_PACKAGE}.plan.compression",
    f"{_PACKAGE}.compression": f"{_PACKAGE}.reducers",
    f"{_PACKAGE}.comm_hooks": f"{_PACKAGE}.reducers.comm_hooks",
    f"{_PACKAGE}.fingerprint": f"{_PACKAGE}.core.agreement",
    f"{_PACKAGE}.checkpoint_io": f"{_PACKAGE}.core.checkpoint_io",
    f"{_PACKAGE}.strategies.checkpoint_io": f"{_PACKAGE}.core.checkpoint_io",
}
"""Module paths of earlier releases and where their contents live now (the paths will be removed in 0.3). Each path
is a shim module whose only statement is ``forward_moved(__name__)``; :func:`discover` does not import them."""


def forward_moved(name: str) -> None:
    """Make the module ``name``, a path of :data:`MOVED` being imported, forward to its new home, with a warning.

    The module gets the new home's names and its ``__all__``, and looks up any other name there.

    Examples:
        A shim module's whole code (``lightning_dp_strategies/sizing.py``; importing it warns that the path moved to
        ``lightning_dp_strategies.plan.sizing``)::

            from lightning_dp_strategies.core.registry import forward_moved

            forward_moved(__name__)
    """
    target = MOVED[name]
    # stacklevel 3: the frame that imports the shim (the import machinery's own frames are skipped)
    warnings.warn(
        f"`{name}` moved to `{target}`; the old path will be removed in 0.3.", DeprecationWarning, stacklevel=3
    )
    new = importlib.import_module(target)
    namespace = vars(sys.modules[name])
    namespace.update({key: value for key, value in vars(new).items() if not key.startswith("__")})
    namespace["__all__"] = list(getattr(new, "__all__", ()))
    namespace["__getattr__"] = lambda attribute: getattr(new, attribute)


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
    A strategy with a ``cost_model`` is priced under ``name`` too (:func:`~lightning_dp_strategies.plan.cost_model_of`).
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
    if isinstance(getattr(strategy, "cost_model", None), CostModel):  # the planner prices the name as it trains
        name_strategy(name, functools.partial(strategy, **init_params))


def register_with_launchers(
    registry: _StrategyRegistry,
    name: str,
    strategy: type,
    description: str,
    where: str = "the Trainer",
    init_params: Mapping[str, Any] | None = None,
) -> None:
    """Register ``name`` and its ``_spawn`` / ``_notebook`` variants (see :data:`LAUNCHERS`) for ``strategy``, each
    made with ``init_params`` besides its start method."""
    for suffix, start_method, how in LAUNCHERS:
        params = {"start_method": start_method, **(init_params or {})}
        register_name(registry, name + suffix, strategy, f"{description}; launcher {how}", where, **params)


def discover(package: str, base: type) -> list[type]:
    """The strategy classes of ``package``'s modules: every subclass of ``base`` a module defines with a
    ``registered_name``, in module-name order. A strategy is found from its own file; nothing else lists it.

    Modules whose names start with ``_`` are helpers, and the shims of :data:`MOVED` only forward: neither is
    searched. A module's value counts as a class by its real type, not ``isinstance(value, type)``: on Python 3.10
    a generic alias such as ``Callable[[Any], Any]`` passes that check and ``issubclass`` then raises.
    """
    found: list[type] = []
    for info in sorted(pkgutil.iter_modules(importlib.import_module(package).__path__), key=lambda m: m.name):
        if info.name.startswith("_") or f"{package}.{info.name}" in MOVED:
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        for value in vars(module).values():
            if (
                issubclass(type(value), type)
                and issubclass(value, base)
                and (value.__module__ == module.__name__ or value.__module__.startswith(module.__name__ + "."))
                and getattr(value, "registered_name", None) is not None
            ):
                found.append(value)
    return found


def register_discovered(package: str, base: type, registry: _StrategyRegistry) -> None:
    """Register every strategy :func:`discover` finds in ``package`` with ``registry`` (safe to call twice)."""
    for strategy in discover(package, base):
        strategy.register_strategies(registry)  # type: ignore[attr-defined]  # Lightning's classmethod


def discovery(
    package: str, base: type, registry: _StrategyRegistry
) -> tuple[Callable[[], list[type]], Callable[[], None]]:
    """``package``'s two functions: the one that finds its strategies (:func:`discover`) and the one that registers
    them with ``registry`` (:func:`register_discovered`, safe to call twice), both bound to ``package`` and ``base``.

    Examples:
        >>> from lightning.pytorch.strategies import Strategy, StrategyRegistry
        >>> strategies, register = discovery("lightning_dp_strategies.strategies", Strategy, StrategyRegistry)
        >>> register()
        >>> [cls.registered_name for cls in strategies()][:2]
        ['hybrid_pipeline', 'local_sgd']
    """
    return functools.partial(discover, package, base), functools.partial(register_discovered, package, base, registry)
