"""Which strategies the comparison knows, which run by default, and which can run on this machine."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

from lightning.pytorch.strategies import StrategyRegistry

__all__ = [
    "BASELINE",
    "REFERENCE",
    "available_strategies",
    "cannot_run_here",
    "check_strategies",
    "default_strategies",
    "processes_for",
    "runnable_strategies",
]

BASELINE = "single"
"""The single-device baseline every other row is compared with."""
REFERENCE = "ddp"
"""Lightning's own DDP, the anchor the package's strategies are compared with."""


def available_strategies() -> list[str]:
    """The names ``compare`` accepts: the baseline, then every registered strategy (ours and Lightning's).

    Examples:
        >>> names = available_strategies()
        >>> names[0], "ring_allreduce" in names, "ddp" in names
        ('single', True, True)
    """
    return [BASELINE, *sorted(StrategyRegistry)]


def default_strategies() -> list[str]:
    """The baseline, the package's strategies that say ``compared_as`` (by that name), then Lightning's ``ddp``.

    Examples:
        >>> default_strategies()
        ['single', 'dp', 'hybrid_pipeline', 'ring_allreduce', 'ddp']
    """
    from lightning_dp_strategies.strategies import trainer_strategies

    ours = sorted(n for cls in trainer_strategies() if (n := getattr(cls, "compared_as", None)) is not None)
    names = set(available_strategies())
    return [n for n in (BASELINE, *ours, REFERENCE) if n in names]


_NEEDS = {
    "DeepSpeedStrategy": ("cuda", "deepspeed", "a GPU and the deepspeed package"),
    "FSDPStrategy": ("cuda", None, "a GPU"),
    "XLAStrategy": ("xla", "torch_xla", "a TPU and torch_xla"),
    "SingleDeviceXLAStrategy": ("xla", "torch_xla", "a TPU and torch_xla"),
    "SingleTPUStrategy": ("xla", "torch_xla", "a TPU and torch_xla"),
}
"""Registered Lightning strategies that need hardware or packages beyond a CPU: (device kind, package, in words)."""


def cannot_run_here(name: str, accelerator: str) -> str | None:
    """Why a registered strategy cannot run on ``accelerator`` (``"cpu"`` or ``"cuda"``) here, or ``None``.

    Examples:
        >>> cannot_run_here("fsdp", "cpu"), cannot_run_here("ring_allreduce", "cpu")
        ('fsdp needs a GPU', None)
    """
    if name == BASELINE or name not in StrategyRegistry:
        return None
    needs = _NEEDS.get(StrategyRegistry[name]["strategy"].__name__)
    if needs is None:
        return None
    kind, package, words = needs
    if kind != accelerator or (package is not None and importlib.util.find_spec(package) is None):
        return f"{name} needs {words}"
    return None


def runnable_strategies(accelerator: str = "cpu") -> list[str]:
    """The names that can run on ``accelerator`` here: the defaults first, then the other registered ones.

    Examples:
        >>> names = runnable_strategies("cpu")
        >>> names[:5], "fsdp" in names, "deepspeed" in names
        (['single', 'dp', 'hybrid_pipeline', 'ring_allreduce', 'ddp'], False, False)
    """
    defaults = default_strategies()
    others = [n for n in available_strategies() if n not in defaults and cannot_run_here(n, accelerator) is None]
    return defaults + others


def check_strategies(names: Sequence[str], accelerator: str = "cpu") -> list[str]:
    """The names to compare, stripped; ``ValueError`` (naming what can run) if one is empty, unknown, repeated or needs
    hardware this machine lacks.

    Examples:
        >>> check_strategies([" single", "ring_allreduce "])
        ['single', 'ring_allreduce']
        >>> check_strategies(["", " "])
        Traceback (most recent call last):
        ...
        ValueError: no strategy named: pass names separated by commas, for example single,ring_allreduce
    """
    cleaned = [n.strip() for n in names if n.strip()]
    if not cleaned:
        raise ValueError("no strategy named: pass names separated by commas, for example single,ring_allreduce")
    kind = "cpu" if accelerator == "auto" else accelerator
    runnable = runnable_strategies(kind)
    unknown = [n for n in cleaned if n not in available_strategies()]
    if unknown:
        raise ValueError(
            f"unknown strategy {', '.join(map(repr, unknown))}; these run here: {', '.join(runnable)}"
            " (register your own and pass --import MODULE)"
        )
    for name in cleaned:
        reason = cannot_run_here(name, kind)
        if reason:
            raise ValueError(f"{reason}; these run here: {', '.join(runnable)}")
    repeated = sorted({n for n in cleaned if cleaned.count(n) > 1})
    if repeated:
        raise ValueError(f"strategy {', '.join(map(repr, repeated))} named twice: name each strategy once")
    return cleaned


def processes_for(name: str, devices: int) -> int:
    """Processes a strategy starts: one for the baseline; what the registered class says (``launched_processes``,
    which this package's strategies and their subclasses have); else one per device, as Lightning's own launch.

    Examples:
        >>> [processes_for(name, 2) for name in ("single", "dp", "ring_allreduce", "ddp")]
        [1, 1, 2, 2]
    """
    if name == BASELINE:
        return 1
    strategy = StrategyRegistry[name]["strategy"] if name in StrategyRegistry else None
    count = getattr(strategy, "launched_processes", None)
    return int(count(devices)) if callable(count) else devices
