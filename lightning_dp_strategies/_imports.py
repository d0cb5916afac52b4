"""What importing the package does: public names resolved on first use, strategy names registered with Lightning
as soon as Lightning is imported (before or after this package), and the deprecated module paths, all listed here.

``import lightning_dp_strategies`` imports neither torch nor Lightning, so the command's ``--help`` answers at once.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["MOVED", "PUBLIC", "install", "public_name", "register_all"]

_PACKAGE = "lightning_dp_strategies"

PUBLIC: dict[str, str] = {
    name: f"{_PACKAGE}.{module}"
    for module, names in {
        "bucketing": ("CommStats", "GradientBuckets", "assign_buckets"),
        "comm": ("CommCounter", "reference_all_reduce", "ring_all_reduce"),
        "core.checkpoint_io": ("AtomicCheckpointIO",),
        "core.options": ("BucketedConfig",),
        "data_parallel": ("gather", "parallel_apply", "replicate", "scatter"),
        "plan": ("Link", "Prediction", "Workload", "predict"),
        "reducers": (
            "REDUCERS",
            "CastCompression",
            "GradBucket",
            "NativeReducer",
            "PerTensorReducer",
            "PowerSGD",
            "Reducer",
            "RingReducer",
            "bf16_compress",
            "fp16_compress",
            "resolve_reducer",
        ),
        "strategies": ("BucketedDataParallel",),
    }.items()
    for name in names
}
"""The package's public names besides its strategies, and the module each comes from. The strategy classes
(Trainer and Fabric) are found by :func:`public_name` in the modules that define them."""

MOVED: dict[str, str] = {
    f"{_PACKAGE}.sizing": f"{_PACKAGE}.plan.sizing",
    f"{_PACKAGE}.plan_compression": f"{_PACKAGE}.plan.compression",
    f"{_PACKAGE}.compression": f"{_PACKAGE}.reducers",
    f"{_PACKAGE}.comm_hooks": f"{_PACKAGE}.reducers.comm_hooks",
    f"{_PACKAGE}.fingerprint": f"{_PACKAGE}.core.agreement",
    f"{_PACKAGE}.checkpoint_io": f"{_PACKAGE}.core.checkpoint_io",
    f"{_PACKAGE}.strategies.checkpoint_io": f"{_PACKAGE}.core.checkpoint_io",
}
"""Module paths of earlier releases and where their contents live now; importing one warns (removed in 0.3)."""


def _strategy_classes() -> list[type]:
    from lightning_dp_strategies.fabric import fabric_strategies
    from lightning_dp_strategies.strategies import trainer_strategies

    return [*trainer_strategies(), *fabric_strategies()]


def public_name(name: str) -> Any:
    """The public object ``name`` of the package root: from :data:`PUBLIC`, or a strategy class of that name."""
    if name in PUBLIC:
        return getattr(importlib.import_module(PUBLIC[name]), name)
    if name.startswith("__"):  # probes such as __wrapped__ or __path__ of a submodule: never import Lightning for them
        raise AttributeError(f"module {_PACKAGE!r} has no attribute {name!r}")
    for cls in _strategy_classes():
        if cls.__name__ == name:
            return cls
    raise AttributeError(f"module {_PACKAGE!r} has no attribute {name!r}")


class _Alias(importlib.abc.Loader):
    """Loads a moved module path as a module that forwards every attribute to the module's new home."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        warnings.warn(
            f"`{module.__name__}` moved to `{self.target}`; the old path will be removed in 0.3.",
            DeprecationWarning,
            stacklevel=2,
        )
        target = importlib.import_module(self.target)
        module.__dict__.update({k: v for k, v in vars(target).items() if not k.startswith("__")})
        module.__dict__["__all__"] = list(getattr(target, "__all__", ()))
        module.__dict__["__getattr__"] = lambda name: getattr(target, name)


class _Tracked(importlib.abc.Loader):
    """Runs a module's own loader between the finder's ``entered`` and ``left`` (its loader is put back after)."""

    def __init__(self, loader: importlib.abc.Loader, finder: _Finder) -> None:
        self.loader, self.finder = loader, finder

    def __getattr__(self, name: str) -> Any:  # get_code, get_source, get_resource_reader, ... (runpy, importlib)
        return getattr(self.loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.finder.entered()
        try:
            self.loader.exec_module(module)
        finally:
            module.__loader__ = self.loader
            if module.__spec__ is not None:
                module.__spec__.loader = self.loader
            self.finder.left()


class _Finder(importlib.abc.MetaPathFinder):
    """Resolves the :data:`MOVED` paths, and registers the strategy names once Lightning is imported.

    Registering imports the strategy modules, which import Lightning: it must not run while one of this package's
    modules is half executed (it may be the very module that imported Lightning). So until the names are registered,
    the imports of ``lightning`` and of this package's modules are tracked, and the names are registered when the
    outermost of them has finished and Lightning is loaded.
    """

    def __init__(self) -> None:
        self.pending = True
        self._depth = threading.local()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in MOVED:
            return importlib.util.spec_from_loader(fullname, _Alias(MOVED[fullname]))
        if not self.pending or not (fullname == "lightning" or fullname.startswith(f"{_PACKAGE}.")):
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if finder is not self and find is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Tracked(spec.loader, self)
                return spec
        return None

    def entered(self) -> None:
        self._depth.value = getattr(self._depth, "value", 0) + 1

    def left(self) -> None:
        self._depth.value -= 1
        self.register_when_ready()

    def register_when_ready(self) -> None:
        if self.pending and getattr(self._depth, "value", 0) == 0 and "lightning" in sys.modules:
            self.pending = False
            register_all()


def register_all() -> None:
    """Register every strategy name of this package with Lightning's registries, the Trainer's ``StrategyRegistry``
    and Fabric's ``STRATEGY_REGISTRY`` (safe to call twice; importing Lightning already did).

    Examples:
        >>> register_all()
        >>> from lightning.pytorch.strategies import StrategyRegistry
        >>> "ring_allreduce" in StrategyRegistry and "dp" in StrategyRegistry
        True
        >>> from lightning.fabric.strategies import STRATEGY_REGISTRY
        >>> "ring_allreduce" in STRATEGY_REGISTRY and "scatter_gather" in STRATEGY_REGISTRY
        True
    """
    from lightning_dp_strategies.fabric import register_fabric_strategies
    from lightning_dp_strategies.strategies import register_trainer_strategies

    register_trainer_strategies()
    register_fabric_strategies()


def install() -> None:
    """Install the finder for the moved paths; register the strategy names now if Lightning is imported already,
    else as soon as it is."""
    finder = _Finder()
    sys.meta_path.insert(0, finder)
    finder.register_when_ready()
