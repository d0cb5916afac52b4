"""The parts of local SGD a strategy holds beside :class:`~lightning_dp_strategies.local_sgd.LocalSGD`: the option
checks and the options the ranks agree on; the algorithm's names, from :mod:`lightning_dp_strategies.local_sgd`, are
exported here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_dp_strategies.local_sgd import (
    OUTER_PRECISIONS,
    LocalSGD,
    LocalSGDConfig,
    OuterOptimizerFactory,
    diloco_outer_optimizer,
    gather_to_zero,
    local_checkpoint_record,
    make_outer_optimizer,
    restore_local_record,
)

__all__ = [
    "STREAMING_DEFAULTS",
    "LocalSGD",
    "LocalSGDConfig",
    "OuterOptimizerFactory",
    "check_not_sharded",
    "check_single_optimizer",
    "diloco_outer_optimizer",
    "gather_to_zero",
    "local_checkpoint_record",
    "local_config",
    "local_options",
    "make_outer_optimizer",
    "restore_local_record",
]


def check_not_sharded(shard_optimizer_state: object) -> None:
    """A clear error for ``shard_optimizer_state=True``: between averages every rank steps its whole model, so every
    rank needs the whole optimizer state.

    Examples:
        >>> check_not_sharded(False)
        >>> check_not_sharded(True)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Local SGD cannot shard the optimizer state: ...
    """
    if shard_optimizer_state:
        raise ValueError(
            "Local SGD cannot shard the optimizer state: between averages every rank steps its whole model on its "
            "own, so every rank needs the whole optimizer state. To save optimizer memory, train with "
            "`RingAllReduceStrategy(shard_optimizer_state=True)`; to save traffic, keep local SGD unsharded."
        )


STREAMING_DEFAULTS: dict[str, Any] = {
    "sync_every": "auto",
    "fragments": 4,
    "delay": 1,
    "mixing": 0.5,
    "outer_precision": "int4",
    "outer_optimizer": diloco_outer_optimizer(),
}
"""The options the registered name ``"streaming_diloco"`` stands for: DiLoCo's outer optimizer, four fragments in
turns, the change sent as 4 bits during at least one inner step and mixed half-and-half, the period chosen from the
first steps' timings (``sync_every="auto"``)."""


def local_config(
    shard_optimizer_state: object, reducer: object, outer_precision: str, **options: Any
) -> LocalSGDConfig:
    """The strategy's :class:`LocalSGDConfig`, after the checks that span options: sharding is refused, and so is a
    ``reducer`` beside an 8- or 4-bit ``outer_precision`` (which sends through its own quantized reduction).

    Examples:
        >>> local_config(False, None, "int4", sync_every=8, fragments=2).fragments
        2
        >>> local_config(False, "native", "int8")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `outer_precision='int8'` sends the change through its own 8-bit reduction, ...
    """
    check_not_sharded(shard_optimizer_state)
    if outer_precision in OUTER_PRECISIONS[2:] and reducer is not None:
        raise ValueError(
            f"`outer_precision={outer_precision!r}` sends the change through its own {outer_precision[3:]}-bit "
            f"reduction, so `reducer={reducer!r}` would go unused. Drop `reducer=`, or pass "
            "`outer_precision='fp32'` (or 'bf16') to average through that reducer."
        )
    return LocalSGDConfig(outer_precision=outer_precision, **options)


def check_single_optimizer(optimizers: Sequence[object], strategy: str) -> None:
    """Local SGD counts the steps of one optimizer: a clear error for several."""
    if len(optimizers) > 1:
        raise ValueError(
            f"{strategy} counts `sync_every` in steps of one optimizer, but `configure_optimizers` returned "
            f"{len(optimizers)}. Return one optimizer with a parameter group per part of the model "
            "(`torch.optim.AdamW([{'params': a.parameters()}, {'params': b.parameters(), 'lr': 1e-4}])`), or use "
            "RingAllReduceStrategy."
        )


def local_options(config: LocalSGDConfig) -> dict[str, Any]:
    """The local SGD options every rank must agree on (for the ranks' fingerprint).

    Examples:
        >>> local_options(LocalSGDConfig(sync_every=4))["sync_every"]
        4
    """
    outer = config.outer_optimizer
    return {
        "sync_every": config.sync_every,
        "warmup_steps": config.warmup_steps,
        "outer_optimizer": None if outer is None else getattr(outer, "__qualname__", "callable"),
        "average_buffers": config.average_buffers,
        "fragments": config.fragments,
        "delay": config.delay,
        "mixing": config.mixing,
        "outer_precision": config.outer_precision,
    }
