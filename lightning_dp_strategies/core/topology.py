"""Where the ranks are: how many nodes and processes a node, and the reducer that layout calls for."""

from __future__ import annotations

from dataclasses import replace

import torch

from lightning_dp_strategies.core.options import ReductionOptions
from lightning_dp_strategies.plan import CostModel, Reduction
from lightning_dp_strategies.reducers import AutoReducer, NativeReducer, PowerSGD, Reducer, RingReducer
from lightning_dp_strategies.reducers.casts import CastCompression
from lightning_dp_strategies.reducers.comm_hooks import CommHookReducer
from lightning_dp_strategies.reducers.two_level import TwoLevelReducer

__all__ = ["check_own_reducer", "check_two_level", "layout_reducer", "priced", "priced_reduction"]


def check_two_level(two_level: bool | None, reduction: ReductionOptions) -> None:
    """A clear error when ``two_level=True`` meets a reducer that needs whole buckets: a torch DDP communication hook
    or PowerSGD. (The option's type is checked by :class:`~lightning_dp_strategies.core.options.RingAllReduceConfig`.)

    Examples:
        >>> check_two_level(None, ReductionOptions())
        >>> from lightning_dp_strategies.reducers import PowerSGD
        >>> check_two_level(True, ReductionOptions(PowerSGD("ring", rank=2)))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `two_level=True` cannot be combined with `reducer=PowerSGD(...)`: ...
    """
    if two_level and reduction.ddp_comm_hook is not None:
        raise ValueError(
            "`two_level=True` cannot be combined with `ddp_comm_hook`: a torch communication hook reduces whole "
            "buckets. Pass `two_level=False`, or a reducer instead of the hook (e.g. `reducer=bf16_compress('ring')`)."
        )
    if two_level and isinstance(reduction.reducer, PowerSGD):
        raise ValueError(
            "`two_level=True` cannot be combined with `reducer=PowerSGD(...)`: PowerSGD compresses the bucket's "
            "matrices, and the hop across nodes carries a flat shard of it. Pass `two_level=False` for PowerSGD, or "
            "`reducer=bf16_compress('ring')` to compress the hop across nodes."
        )


def _needs_whole_buckets(reduction: ReductionOptions, reducer: Reducer | None) -> bool:
    """A torch communication hook and PowerSGD reduce whole buckets (PowerSGD compresses the bucket's matrices)."""
    return (
        reduction.ddp_comm_hook is not None
        or isinstance(reduction.reducer, PowerSGD)
        or isinstance(reducer, (PowerSGD, CommHookReducer))
    )


def layout_reducer(
    two_level: bool | None, per_node: int, reduction: ReductionOptions, reducer: Reducer | None = None
) -> Reducer:
    """The reducer of the buckets for this layout: ``reducer`` (default: the ``reducer=`` option's or the hook's) as
    it is, or, with ``two_level=True``, as the hop across nodes (``per_node`` processes a node) of a
    :class:`~lightning_dp_strategies.reducers.two_level.TwoLevelReducer`. ``None`` (the default) is one flat ring;
    ``reducer="auto"`` decides between one and two levels itself (``docs/network.md`` shows both measured).

    Examples:
        >>> type(layout_reducer(True, 2, ReductionOptions("native"))).__name__
        'TwoLevelReducer'
        >>> type(layout_reducer(None, 2, ReductionOptions("native"))).__name__
        'NativeReducer'
    """
    reducer = reduction.make_reducer() if reducer is None else reducer
    if isinstance(reducer, AutoReducer):  # it tries one and two levels itself
        return reducer.with_layout(per_node, two_level)
    if two_level and _needs_whole_buckets(reduction, reducer):
        raise ValueError(
            f"`two_level=True` cannot be combined with the reducer {type(reducer).__name__} that `configure_reducer` "
            "returned: it reduces whole buckets, and the hop across nodes carries a flat shard of one. Pass "
            "`two_level=None` (the default: one flat ring)."
        )
    if two_level:
        return TwoLevelReducer(per_node, inter_node=reducer)
    return reducer


def check_own_reducer(strategy: type, base: type, shard_optimizer_state: bool) -> None:
    """Refuse sharded optimizer state when ``strategy`` picks its own reducer (overrides ``configure_reducer`` of
    ``base``): the shards are the chunks the flat ring's reduce-scatter leaves on each rank, so the strategy reduces
    the buckets itself.

    Examples:
        >>> class Base:
        ...     def configure_reducer(self): ...
        >>> class Own(Base):
        ...     def configure_reducer(self): ...
        >>> check_own_reducer(Base, Base, True); check_own_reducer(Own, Base, False)
        >>> check_own_reducer(Own, Base, True)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `shard_optimizer_state=True` cannot be combined with `Own.configure_reducer`: ...
    """
    if shard_optimizer_state and strategy.configure_reducer is not base.configure_reducer:  # type: ignore[attr-defined]
        raise ValueError(
            f"`shard_optimizer_state=True` cannot be combined with `{strategy.__name__}.configure_reducer`: the "
            "optimizer's shards are the chunks the flat ring's reduce-scatter leaves on each rank, so with sharded "
            "state the strategy reduces the buckets itself and a reducer of your own would never run. Pass "
            "`shard_optimizer_state=False` to keep your reducer, or drop the `configure_reducer` override."
        )


_CASTS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def priced_reduction(reducer: object, two_level: bool | None) -> Reduction | None:
    """The planner's :class:`~lightning_dp_strategies.plan.Reduction` for buckets reduced by ``reducer`` (the
    ``reducer=`` option as written, or a reducer) with ``two_level``, or ``None`` where it has none: the plain ring
    or the backend's all-reduce, a 16-bit cast over either, and PowerSGD over either (one level, its default
    ``min_compression``) are priced; any other reducer is not.

    Examples:
        >>> from lightning_dp_strategies.reducers import bf16_compress
        >>> priced_reduction("ring", True).label, priced_reduction(bf16_compress("ring"), None).label
        ('two-level plain', 'flat bf16')
        >>> priced_reduction(PowerSGD("ring", rank=2), None).label, priced_reduction("int8", None)
        ('flat powersgd r2', None)
    """
    plain = (RingReducer, NativeReducer)
    levels = bool(two_level)
    if reducer is None or reducer in ("ring", "native") or type(reducer) in plain:
        return Reduction(two_level=levels)
    inner = getattr(reducer, "inner", None)
    if type(inner) not in plain:
        return None
    if type(reducer) is CastCompression and reducer.dtype in _CASTS:
        return Reduction(_CASTS[reducer.dtype], two_level=levels)
    if type(reducer) is PowerSGD and reducer.min_compression == 2.0 and not levels:
        return Reduction("powersgd", rank=reducer.rank)
    return None


def priced(model: CostModel, reduction: ReductionOptions, two_level: bool | None) -> CostModel:
    """``model`` as a strategy reducing its buckets this way carries it: a bucketed model holds ``reducer="auto"``'s
    options (with the strategy's ``two_level``), whose choice the planner prices (:attr:`CostModel.auto`), the
    reduction it prices (:attr:`CostModel.reduction`, :func:`priced_reduction`), or the name of one it cannot price
    (:attr:`CostModel.reducer`).

    Examples:
        >>> from lightning_dp_strategies.plan import RING_ALLREDUCE
        >>> priced(RING_ALLREDUCE, ReductionOptions(reducer="per_tensor"), None).reducer
        "reducer='per_tensor'"
        >>> priced(RING_ALLREDUCE, ReductionOptions(reducer="auto"), True).auto
        AutoChoice(allow=('none', 'bf16', 'powersgd'), rank=4, two_level=True)
        >>> priced(RING_ALLREDUCE, ReductionOptions(), True).reduction.label
        'two-level plain'
    """
    if not model.bucketed:
        return model
    auto = AutoReducer() if reduction.reducer == "auto" else reduction.reducer
    if reduction.ddp_comm_hook is None and isinstance(auto, AutoReducer):
        return replace(model, auto=auto.with_layout(auto.per_node, two_level).choice)
    how = None if reduction.ddp_comm_hook is not None else priced_reduction(reduction.reducer, two_level)
    if how == Reduction():  # the plain flat ring: the formula's own
        return model
    return replace(model, reducer=reduction.custom) if how is None else replace(model, reduction=how)
