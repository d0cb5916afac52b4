"""Deferred initialization: blocks built on the meta device, allocated and initialized only where they run.

A module built under ``torch.device("meta")`` (in ``configure_model``, or under
``trainer.init_module(empty_init=True)``) has shapes and no storage, so the partition can be decided from parameter
counts before anything is allocated. Each stage then allocates and initializes only its own blocks
(:func:`materialize`): ``to_empty`` on the device, then every submodule's ``reset_parameters()``, block ``i`` under
the random seed ``seed + i``. The values therefore do not depend on how the body is cut into stages, and one device
reaches the same values with the same call over all blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["check_initializable", "cpu_keeps_meta", "has_meta", "materialize"]


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (has no storage yet).

    Examples:
        >>> with torch.device("meta"):
        ...     lazy = nn.Linear(2, 2)
        >>> has_meta(lazy), has_meta(nn.Linear(2, 2))
        (True, False)
    """
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _uninitializable(block: nn.Module) -> list[str]:
    """Submodules with meta tensors of their own but no ``reset_parameters`` to initialize them."""
    names = []
    for name, sub in block.named_modules():
        own = [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]
        if own and any(t.is_meta for t in own) and not callable(getattr(sub, "reset_parameters", None)):
            names.append(name or type(block).__name__)
    return names


def check_initializable(blocks: Iterable[tuple[int, nn.Module]], what: str = "block") -> None:
    """Raise, naming the first one, if a meta-device block has a submodule that :func:`materialize` cannot initialize.

    Examples:
        >>> with torch.device("meta"):
        ...     check_initializable([(0, nn.Linear(2, 2))])  # Linear has reset_parameters()
    """
    for index, block in blocks:
        missing = _uninitializable(block)
        if missing:
            raise TypeError(
                f"{what.capitalize()} {index} ({type(block).__name__}) was built on the meta device, but "
                f"{', '.join(missing)} cannot be initialized: it has parameters or buffers of its own and no "
                "`reset_parameters()` method. Define `reset_parameters()` on it (initialize its tensors in place), or "
                "build this block on a real device."
            )


def materialize(blocks: Iterable[tuple[int, nn.Module]], device: torch.device, seed: int, what: str = "block") -> None:
    """Allocate on ``device`` and initialize every ``(index, block)`` that is on the meta device, in place.

    Raises before allocating anything if a submodule with meta tensors has no ``reset_parameters``: its memory would
    be left uninitialized.

    Examples:
        >>> with torch.device("meta"):
        ...     body = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> materialize([(2, body[2])], torch.device("cpu"), seed=0)  # only block 2: blocks 0 and 1 stay on meta
        >>> body[0].weight.is_meta, body[2].weight.is_meta
        (True, False)
    """
    pending = [(index, block) for index, block in blocks if has_meta(block)]
    check_initializable(pending, what)
    cuda: list[Any] = [device] if device.type == "cuda" else []
    for index, block in pending:
        block.to_empty(device=device)
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(seed + index)
            if device.type == "cuda":
                torch.cuda.manual_seed(seed + index)
            with torch.no_grad():
                for sub in block.modules():
                    reset = getattr(sub, "reset_parameters", None)
                    if callable(reset):
                        reset()


@contextmanager
def cpu_keeps_meta(module: nn.Module | None) -> Iterator[None]:
    """Inside, ``module.cpu()`` moves what has storage and leaves what is on the meta device there (a pipeline
    stage's blocks held by other ranks, a module built on the meta device that a strategy refused).

    Lightning's teardown calls ``module.cpu()``, which cannot copy a meta tensor: for that call only, an instance
    attribute (removed on exit) shadows the method. A module without meta tensors is left alone.

    Args:
        module: the LightningModule, or ``None``.

    Examples:
        >>> module = nn.Linear(1, 1, device="meta")
        >>> with cpu_keeps_meta(module):
        ...     module.cpu().weight.is_meta
        True
        >>> "cpu" in vars(module)
        False
    """
    shadowed = module if module is not None and has_meta(module) and "cpu" not in module.__dict__ else None
    if shadowed is not None:
        shadowed.__dict__["cpu"] = lambda: shadowed._apply(lambda t: t if t.is_meta else t.cpu())
    try:
        yield
    finally:
        if shadowed is not None:
            shadowed.__dict__.pop("cpu")
