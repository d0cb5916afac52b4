"""Sharded optimizer state (ZeRO stage 1) as an object a strategy holds, Trainer and Fabric alike.

The strategy calls it at fixed points, around the gradient buckets it already drives::

    setup         attach(buckets, group)  ──▶  bind(optimizer) for each optimizer
    each backward before_backward()  ─ backward (buckets reduce-scatter) ─  after_backward()
    each step     optimizer.step() on this rank's pieces  ──▶  after_step(optimizer): all-gather the parameters
    checkpoints   begin_save() ─ optimizer_state(optimizer) each ─ write/send (whole state, streamed to rank 0)
                  load(optimizer, whole_state): this rank's pieces of it
    teardown      close()

Each rank keeps the optimizer state of about 1/N of the parameters; the gradients go over the wire as a
reduce-scatter and the parameters come back as an all-gather: the bytes of one all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_dp_strategies.bucketing import GradientBuckets
from lightning_dp_strategies.comm import CommCounter
from lightning_dp_strategies.reducers.scatter import ScatterReducer
from lightning_dp_strategies.sharding.checkpoint import ShardedSave, local_state
from lightning_dp_strategies.sharding.gather import ParameterGather
from lightning_dp_strategies.sharding.layout import ShardLayout
from lightning_dp_strategies.sharding.optimizer import ShardedParameters

__all__ = ["OptimizerSharding"]


class OptimizerSharding:
    """This rank's share of the optimizer state, the parameter all-gather and the whole-state checkpoints.

    Examples:
        >>> sharding = OptimizerSharding()
        >>> sharding.attached, sharding.state_numel()
        (False, 0)
    """

    def __init__(self) -> None:
        # runtime state
        self.buckets: GradientBuckets | None = None
        self.shards: ShardedParameters | None = None
        self.gather: ParameterGather | None = None
        self.save = ShardedSave()
        """The checkpoint being saved (a fresh one between saves)."""
        self._builds = 0
        self._synced = 0

    @property
    def attached(self) -> bool:
        return self.shards is not None

    # ------------------------------------------------------------------ setup
    def attach(self, buckets: GradientBuckets, group: dist.ProcessGroup | None) -> None:
        """Cut ``buckets`` (reduce-scattered by a :class:`ScatterReducer` over ``group``) into every rank's pieces."""
        if not isinstance(buckets.reducer, ScatterReducer):
            raise TypeError(f"Sharded optimizer state needs the ScatterReducer, not {type(buckets.reducer).__name__}.")
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        layout = ShardLayout([b.params for b in buckets.buckets], world)
        self.buckets, self._builds = buckets, buckets.builds
        self._synced = buckets.totals.synced_backwards
        self.shards = ShardedParameters(layout, rank)
        self.gather = ParameterGather(layout, rank, buckets.reducer, group)

    def bind(self, optimizer: Optimizer) -> None:
        """Make ``optimizer`` step this rank's pieces of its parameters (see :meth:`ShardedParameters.bind`)."""
        assert self.shards is not None
        self.shards.bind(optimizer)

    # ------------------------------------------------------------------ each backward and step
    def before_backward(self) -> None:
        """Before a synchronised backward: check the layout still holds, keep gradients not stepped yet."""
        if self.buckets is None or self.shards is None:
            return
        if self.buckets.builds != self._builds:
            raise RuntimeError(
                "The set of trainable parameters changed during training (a parameter was frozen or unfrozen), "
                "which re-cuts the gradient buckets; the optimizer's shards no longer match. With "
                "shard_optimizer_state=True, set `requires_grad` before `fit` and keep it, or train unsharded."
            )
        self.shards.keep_gradients()

    def after_backward(self) -> None:
        """After a backward: when it was synchronised, hand each piece its reduced gradient."""
        buckets, shards = self.buckets, self.shards
        if buckets is None or shards is None or buckets.totals.synced_backwards == self._synced:
            return
        self._synced = buckets.totals.synced_backwards
        shards.take_gradients([b.buffer for b in buckets.buckets], buckets.reduced_flags())

    def after_step(self, optimizer: Optimizer) -> None:
        """After ``optimizer`` stepped this rank's pieces: all-gather its buckets' parameters (counted in the
        buckets' statistics)."""
        if self.shards is None or self.gather is None or self.buckets is None:
            return
        self.shards.check_bound()
        counter = CommCounter()
        self.gather.gather(self.shards.bound(optimizer).buckets, counter)
        self.buckets.totals.add_counter(counter)

    def piece_gradients(self) -> list[list[Tensor | None]]:
        """Each bound optimizer's pieces' ``.grad`` (what its gradient scaler will unscale), in binding order."""
        if self.shards is None:
            return []
        views = self.shards.views
        return [[views[p].grad for group in bound.pieces for p in group] for bound in self.shards.optimizers]

    def named_pieces(self, named_params: Iterable[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
        """This rank's pieces named after their parameters (``"fc.weight[0:96]"``, flattened elements)."""
        assert self.shards is not None
        names = {id(p): n for n, p in named_params}
        layout = self.shards.layout
        return [
            (f"{names.get(id(layout.params[piece.param]), '?')}[{piece.start}:{piece.stop}]", view)
            for piece, view in self.shards.views.items()
        ]

    # ------------------------------------------------------------------ checkpoints
    def begin_save(self) -> None:
        """Start a checkpoint: what an unfinished save described is dropped."""
        self.save = ShardedSave()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The whole optimizer's ``state_dict`` on global rank 0 (stand-ins filled when the file is written), this
        rank's own elsewhere; a collective over the default group."""
        assert self.shards is not None
        return self.save.describe(self.shards, self.shards.bound(optimizer), dist.get_rank(), dist.get_world_size())

    def load(self, optimizer: Optimizer, whole: Mapping[str, Any]) -> None:
        """Load this rank's pieces of a whole optimizer ``state_dict`` (saved sharded or not, at any world size)."""
        assert self.shards is not None
        bound = self.shards.bound(optimizer)
        bound.optimizer.load_state_dict(local_state(whole, self.shards, bound))

    # ------------------------------------------------------------------ statistics and teardown
    def state_numel(self) -> int:
        """Elements of per-element optimizer state this rank holds (Adam: two per element of its pieces); summed
        over the ranks, it is what each rank of an unsharded run holds."""
        return self.shards.state_numel() if self.shards is not None else 0

    def close(self) -> None:
        """Release the all-gather's workspaces; the optimizers keep stepping their pieces (see the strategy)."""
        if self.gather is not None:
            self.gather.release()
        self.buckets = None
