"""Local SGD's options and its outer optimizer: the factory, DiLoCo's, and the check of what a factory built."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = [
    "OUTER_PRECISIONS",
    "LocalSGDConfig",
    "OuterOptimizerFactory",
    "diloco_outer_optimizer",
    "make_outer_optimizer",
]

OUTER_PRECISIONS = ("fp32", "bf16", "int8", "int4")
"""How the outer gradient (the parameter change) travels: as it is, as bf16, or as 8 or 4 bits with a scale a block."""

OuterOptimizerFactory = Callable[[list[Tensor]], Optimizer]
"""``factory(anchor_parameters) -> torch.optim.Optimizer``: makes the outer optimizer once, at setup."""


def diloco_outer_optimizer(lr: float = 0.7, momentum: float = 0.9) -> OuterOptimizerFactory:
    """DiLoCo's outer optimizer (Douillard et al., 2023): SGD with Nesterov momentum, ``lr=0.7``, ``momentum=0.9``.

    Examples:
        >>> make = diloco_outer_optimizer()
        >>> opt = make([torch.zeros(2, requires_grad=True)])
        >>> type(opt).__name__, opt.defaults["lr"], opt.defaults["nesterov"]
        ('SGD', 0.7, True)
    """

    def make(params: list[Tensor]) -> Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=True)

    make.__qualname__ = f"diloco_outer_optimizer(lr={lr}, momentum={momentum})"
    return make


def _check_count(name: str, value: object, minimum: int, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum} ({meaning}), got {value!r}.")
    return value


@dataclass(frozen=True)
class LocalSGDConfig:
    """The options of local SGD (validated on creation; see :class:`LocalSGD`).

    Examples:
        >>> LocalSGDConfig(sync_every=4).warmup_steps
        0
        >>> LocalSGDConfig(sync_every=0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `sync_every` must be an int >= 1 (optimizer steps between synchronisations; ...), got 0.
    """

    sync_every: int | str = 8
    """Optimizer steps between synchronisations (H), or ``"auto"``: chosen from the first steps' timings."""
    outer_optimizer: OuterOptimizerFactory | None = None
    """Makes the outer optimizer over the anchor parameters; ``None``: plain averaging."""
    warmup_steps: int = 0
    """Optimizer steps at the start whose gradients are averaged every step (post-local SGD)."""
    average_buffers: bool = True
    """Average floating-point buffers (BatchNorm statistics) at each synchronisation."""
    fragments: int = 1
    """Streaming: runs of consecutive parameters synchronised in staggered turns, each every ``sync_every`` steps."""
    delay: int = 0
    """Streaming: local steps between a fragment's outer gradient leaving and its average being applied."""
    mixing: float = 0.0
    """Streaming: the weight of the rank's own parameters when a fragment's new global value is merged into them
    (``0``: replaced by the global value)."""
    outer_precision: str = "fp32"
    """How the outer gradient travels (:data:`OUTER_PRECISIONS`)."""

    def __post_init__(self) -> None:
        meaning = "optimizer steps between synchronisations; 1 averages every step; or 'auto'"
        if self.sync_every != "auto":
            _check_count("sync_every", self.sync_every, 1, meaning)
        _check_count("fragments", self.fragments, 1, "runs of parameters synchronised in turns; 1: the whole model")
        _check_count("delay", self.delay, 0, "local steps a fragment's outer gradient travels during; 0: none")
        if isinstance(self.sync_every, int) and self.delay >= self.sync_every:
            raise ValueError(
                f"`delay={self.delay}` must be less than `sync_every={self.sync_every}`: a fragment's average must "
                "be applied before its next turn. Lower `delay` or raise `sync_every`."
            )
        if isinstance(self.sync_every, int) and self.fragments > self.sync_every:
            raise ValueError(
                f"`fragments={self.fragments}` turns cannot fit in a period of `sync_every={self.sync_every}` steps "
                "(at most one fragment leaves a step). Pass `fragments` at most `sync_every`."
            )
        if isinstance(self.mixing, bool) or not isinstance(self.mixing, (int, float)) or not 0 <= self.mixing < 1:
            raise ValueError(
                f"`mixing` must be a number in [0, 1) (the weight of the rank's own parameters when a fragment's "
                f"global value is merged in; 0: replaced, 0.5: the streaming DiLoCo paper's), got {self.mixing!r}."
            )
        if self.outer_precision not in OUTER_PRECISIONS:
            raise ValueError(
                f"`outer_precision` must be one of {', '.join(map(repr, OUTER_PRECISIONS))}, got "
                f"{self.outer_precision!r}."
            )
        _check_count("warmup_steps", self.warmup_steps, 0, "optimizer steps that average gradients first; 0: none")
        if self.outer_optimizer is not None and not callable(self.outer_optimizer):
            raise TypeError(
                "`outer_optimizer` must be a callable `factory(params) -> torch.optim.Optimizer`, e.g. "
                "`lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)` (DiLoCo), or None "
                f"for plain averaging; got {self.outer_optimizer!r}."
            )
        if not isinstance(self.average_buffers, bool):
            raise TypeError(f"`average_buffers` must be True or False, got {self.average_buffers!r}.")

    @property
    def turns_equalize(self) -> bool:
        """Whether a turn leaves every rank with the same parameters: one fragment (the whole model) and no mixing
        with the rank's own values."""
        return self.fragments == 1 and self.mixing == 0


def make_outer_optimizer(factory: OuterOptimizerFactory | None, anchor: list[Tensor]) -> Optimizer | None:
    """``factory(anchor)``, checked to be an optimizer over exactly the anchor tensors; ``None`` without a factory."""
    if factory is None:
        return None
    optimizer = factory(anchor)
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"`outer_optimizer` returned {type(optimizer).__name__}, not a torch.optim.Optimizer. Pass a factory that "
            "builds one over the parameters it is given, e.g. "
            "`lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)`."
        )
    given = {id(t) for group in optimizer.param_groups for t in group["params"]}
    if given != {id(t) for t in anchor}:
        raise ValueError(
            "`outer_optimizer` must build its optimizer over the parameters it is given (the anchor copies the "
            "strategy keeps), not over the model's: `lambda params: torch.optim.SGD(params, ...)`."
        )
    return optimizer
