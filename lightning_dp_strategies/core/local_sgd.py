"""The parts of local SGD a strategy holds beside :class:`~lightning_dp_strategies.local_sgd.LocalSGD`: the option
checks and the options the ranks agree on; the algorithm's names, from :mod:`lightning_dp_strategies.local_sgd`, are
exported here too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from torch import Tensor, nn

from lightning_dp_strategies.core.engine import BucketedEngine, EngineView
from lightning_dp_strategies.core.module_state import quoted_names
from lightning_dp_strategies.core.options import ConfigOption
from lightning_dp_strategies.core.registry import register_with_launchers
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
from lightning_dp_strategies.local_sgd.streaming import STREAMING_FRAGMENTS
from lightning_dp_strategies.plan import CostModel
from lightning_dp_strategies.plan.formulas import LOCAL_SGD, local_sgd_cost_model

__all__ = [
    "STREAMING_DEFAULTS",
    "LocalSGD",
    "LocalSGDConfig",
    "LocalSGDInterface",
    "OuterOptimizerFactory",
    "check_local_options",
    "check_not_sharded",
    "check_single_optimizer",
    "diloco_outer_optimizer",
    "gather_to_zero",
    "local_checkpoint_record",
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
    "fragments": STREAMING_FRAGMENTS,
    "delay": 1,
    "mixing": 0.0,
    "outer_precision": "int4",
    "outer_optimizer": None,
}
"""The options the registered name ``"streaming_diloco"`` stands for: four fragments in turns, each change sent as 4
bits during at least one inner step, the period chosen from the first steps' timings (``sync_every="auto"``), and
plain averaging as the outer step. ``"auto"`` picks short periods (a few steps) wherever the link hides a fragment
behind a step; DiLoCo's outer Nesterov step (``diloco_outer_optimizer()``, lr 0.7, momentum 0.9) is made for long
ones: pass it with a fixed ``sync_every`` of 16 or more (docs: "Training over slow links")."""


def check_local_options(shard_optimizer_state: object, reducer: object, outer_precision: str) -> None:
    """The checks that span options: sharding is refused, and so is a ``reducer`` beside an 8- or 4-bit
    ``outer_precision`` (which sends through its own quantized reduction).

    Examples:
        >>> check_local_options(False, None, "int4")
        >>> check_local_options(False, "native", "int8")  # doctest: +ELLIPSIS
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


class LocalSGDInterface:
    """What the Trainer's and Fabric's local SGD strategies share: one constructor (its options checked once into a
    :class:`LocalSGDConfig`), the options' read-only views, the algorithm's view, :meth:`synchronize` and the
    registered name ``"streaming_diloco"``. A strategy puts it ahead of its Lightning-facing base and makes that base
    in :meth:`_init_data_parallel`.

    Args:
        sync_every: optimizer steps between synchronisations (H, >= 1). With 1, plain averaging and SGD it trains as
            ``ring_allreduce`` does. ``"auto"``: a trial period sends every fragment once, one a step, and times
            the inner steps and the fragments' reductions; then the ranks take the smallest period (a multiple of
            ``fragments``) in which a fragment's reduction ends before the next one leaves, raise ``delay`` to
            cover it, and log the choice once.
        outer_optimizer: ``factory(params) -> Optimizer`` over the anchor parameters it is given, called once at
            setup (``None``: plain averaging; :func:`diloco_outer_optimizer`: DiLoCo).
        warmup_steps: optimizer steps at the start whose gradients are averaged every step, as ``ring_allreduce``
            does (post-local SGD); local steps begin after them.
        reducer: how the change is averaged (and the warm-up's gradients): ``"ring"`` (default), ``"native"``, or
            a reducer such as ``bf16_compress("ring")``, which halves the bytes sent.
        average_buffers: average floating-point buffers (BatchNorm statistics) at each synchronisation.
        bucket_cap_mb: cap of the warm-up's gradient buckets in MiB.
        first_bucket_cap_mb: cap of the warm-up's first gradient bucket in MiB.
        shard_optimizer_state: refused (``True`` raises): between averages every rank steps its whole model, so
            it needs the whole optimizer state; see ``RingAllReduceStrategy(shard_optimizer_state=True)``.
        fragments: streaming DiLoCo: runs of consecutive parameters (about equal in size) synchronised in staggered
            turns, each every ``sync_every`` steps, so a turn sends ``1/fragments`` of the model (1: all at once).
        delay: streaming DiLoCo: inner steps that run while a fragment's change is averaged on a background thread;
            the average is applied after them (``0``: at once, the loop waits). Less than ``sync_every``.
        mixing: streaming DiLoCo: the weight of the rank's own values when a fragment's new global values are merged
            in (``0``: replaced; ``0.5`` suits a delay).
        outer_precision: how the change travels: ``"fp32"`` (through ``reducer``), ``"bf16"`` (``reducer`` on a
            bf16 copy), ``"int8"`` or ``"int4"`` (8 or 4 bits with a scale a block of 128 values, summed in fp32, on
            any backend, gloo included).
        **options: the shared keyword options (``nonfinite_grads``, ``timeout``, ...): see
            :class:`~lightning_dp_strategies.strategies.options.StrategyOptions` (Trainer) and
            :class:`~lightning_dp_strategies.fabric.options.FabricOptions` (Fabric).

    ``fragments=1, delay=0, mixing=0, outer_precision="fp32"`` (the defaults) is local SGD, or DiLoCo with its outer
    optimizer. The name ``"streaming_diloco"`` stands for :data:`STREAMING_DEFAULTS`.
    """

    engine: BucketedEngine
    cost_model: ClassVar[CostModel] = LOCAL_SGD
    """At the default period; an instance carries the model of its own period, fragments, delay and outer
    precision (:func:`~lightning_dp_strategies.plan.formulas.local_sgd_cost_model`)."""
    registered_where: ClassVar[str] = "the Trainer"
    """What takes the strategy, in the registry's warnings (``"the Trainer"``, ``"Fabric"``)."""

    def __init__(
        self,
        sync_every: int | str = 8,
        outer_optimizer: OuterOptimizerFactory | None = None,
        warmup_steps: int = 0,
        reducer: Any = None,
        average_buffers: bool = True,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        shard_optimizer_state: bool = False,
        fragments: int = 1,
        delay: int = 0,
        mixing: float = 0.0,
        outer_precision: str = "fp32",
        **options: Any,
    ) -> None:
        check_local_options(shard_optimizer_state, reducer, outer_precision)
        options_in_order = (sync_every, outer_optimizer, warmup_steps, average_buffers, fragments, delay, mixing)
        self.local_config = config = LocalSGDConfig(*options_in_order, outer_precision)
        self._init_data_parallel((bucket_cap_mb, first_bucket_cap_mb), reducer, options)
        priced = (config.sync_every, config.fragments, config.delay, config.outer_precision)
        self.cost_model = local_sgd_cost_model(*priced)  # type: ignore[misc]  # this instance's

    def _init_data_parallel(self, caps: tuple[float, float], reducer: Any, options: Mapping[str, Any]) -> None:
        """Make the Lightning-facing base with the bucket caps, the reducer and the shared keyword options."""
        raise NotImplementedError

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """The base's names, then ``"streaming_diloco"`` (and its launcher variants) for this class, made with
        :data:`STREAMING_DEFAULTS`."""
        super().register_strategies(strategy_registry)  # type: ignore[misc]  # the Lightning-facing base's
        description = "Streaming DiLoCo: fragments synchronised in turns, 4-bit changes sent during the inner steps"
        register_with_launchers(
            strategy_registry, "streaming_diloco", cls, description, cls.registered_where, STREAMING_DEFAULTS
        )

    local_sgd = EngineView[LocalSGD | None]()  # the algorithm (``None`` before setup)

    def _start_local_sgd(self) -> None:
        """Make the algorithm over the gradient group, averaging with ``configure_reducer()``'s reducer (collective;
        once the process group is up)."""
        strategy: Any = self  # the Lightning-facing base's members
        reducer = strategy.configure_reducer()
        self.engine.start_local_sgd(self.local_config, reducer, strategy.world_size, strategy._process_group_backend)

    def _check_averaged(self, optimizer: Any, module: nn.Module | None) -> None:
        """Before an optimizer step: raise on this rank where ``optimizer`` would step a parameter that local SGD does
        not average (:func:`check_averaged`)."""
        local = self.local_sgd
        if local is not None and module is not None:
            check_averaged(optimizer, local.params, module)

    def synchronize(self) -> None:
        """Apply the averages in flight, average the ranks' parameter changes and apply the outer step, on every
        rank (nothing when the ranks are in sync already). The Trainer strategy calls it before validation and at
        the end of ``fit``; under Fabric, call it before evaluating."""
        self.engine.synchronize()

    sync_every = ConfigOption[int | str]("local_config")
    outer_optimizer = ConfigOption[OuterOptimizerFactory | None]("local_config")
    warmup_steps = ConfigOption[int]("local_config")
    average_buffers = ConfigOption[bool]("local_config")
    fragments = ConfigOption[int]("local_config")
    delay = ConfigOption[int]("local_config")
    mixing = ConfigOption[float]("local_config")
    outer_precision = ConfigOption[str]("local_config")


def check_averaged(optimizer: Any, averaged: Sequence[Tensor], module: nn.Module) -> None:
    """Raise where ``optimizer`` holds a parameter that requires grad but is not among ``averaged`` (the parameters
    that required grad when training began): unfrozen since, it would train apart on each rank, never averaged.

    Examples:
        >>> import torch
        >>> layer = nn.Linear(2, 1)
        >>> check_averaged(torch.optim.SGD(layer.parameters(), lr=0.1), list(layer.parameters()), layer)
        >>> check_averaged(torch.optim.SGD(layer.parameters(), lr=0.1), [layer.weight], layer)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: Local SGD averages the parameters that required grad when training began; `bias` became ...
    """
    tracked = {id(p) for p in averaged}
    stray = {id(p) for g in getattr(optimizer, "param_groups", []) for p in g["params"] if p.requires_grad} - tracked
    if stray:
        names = [name for name, p in module.named_parameters() if id(p) in stray]
        raise RuntimeError(
            f"Local SGD averages the parameters that required grad when training began; {quoted_names(names)} "
            "became trainable since (a fine-tuning schedule, or "
            "`requires_grad_(True)` in a hook) and would train apart on each rank, never averaged. Make every "
            "parameter the run will train trainable before `fit` (a parameter group with lr=0 holds it still until "
            "then; it is averaged from the start, at the cost of its bytes), or train with "
            "strategy='ring_allreduce', which picks up a parameter unfrozen later at the next step."
        )
