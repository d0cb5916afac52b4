"""The collaborators every bucketed strategy holds, Trainer and Fabric alike, driven at fixed points of a step.

A Trainer strategy and its Fabric twin hold one :class:`BucketedEngine` and call it from their hooks; neither
knows what the other does, and the engine knows nothing of either::

    setup        make_groups(partition, rank, backend, reducer) ─ start_model_averaging(...) ─ attach(named, ...)
                 bind(optimizer) for each optimizer (sharded state)
    each step    before_backward() ─ backward ─ after_backward(scaler) ─ optimizer step ─ after_step(optimizer)
    checkpoints  optimizer_state / save_sharded / load_optimizer (sharded state)
    teardown     close() ─ (the strategy's own teardown) ─ destroy_groups()

What it holds, each one object with one job: :attr:`grad_sync` (the buckets and their reducer), :attr:`sharding`
(this rank's share of the optimizer state, when ``shard_optimizer_state=True``), :attr:`nonfinite` (the check of the
reduced gradients) and the parameter averaging of post-local SGD (``model_averaging_period``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Generic, TypeVar, overload

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_dp_strategies.bucketing import CommStats, GradientBuckets
from lightning_dp_strategies.bucketing.sync import GradientSync, destroy_groups
from lightning_dp_strategies.comm.groups import new_group
from lightning_dp_strategies.core.agreement import require_dense_gradients
from lightning_dp_strategies.core.checkpoint_io import atomic_write, can_stream
from lightning_dp_strategies.core.nonfinite import NonfiniteGuard, check_nonfinite_mode
from lightning_dp_strategies.core.options import BucketedConfig, ReductionOptions
from lightning_dp_strategies.local_sgd import FlatAverager, LocalSGD, LocalSGDConfig, PeriodicAverager, outer_averager
from lightning_dp_strategies.reducers import Reducer, resolve_reducer
from lightning_dp_strategies.sharding import OptimizerSharding, clip_grad_norm_across
from lightning_dp_strategies.sharding.checkpoint import finish_save
from lightning_dp_strategies.sharding.scaler import agree_on_nonfinite

__all__ = ["BucketedEngine", "EngineView", "node_ranks"]

T = TypeVar("T")


def node_ranks(nodes: int, per_node: int) -> list[list[int]]:
    """The global ranks of each node, as Lightning numbers them (``node_rank * per_node + local_rank``).

    Examples:
        >>> node_ranks(2, 2)
        [[0, 1], [2, 3]]
    """
    return [list(range(node * per_node, (node + 1) * per_node)) for node in range(nodes)]


class BucketedEngine:
    """Gradient buckets, sharded optimizer state, the non-finite check and post-local SGD's averaging.

    Args:
        config: the strategy's bucket options (``shard_optimizer_state`` read where the config has it).
        reduction: the ``reducer=`` / communication-hook options (post-local SGD reads its state and period).
        nonfinite_grads: ``None``, ``"skip"`` or ``"raise"``.

    Examples:
        >>> engine = BucketedEngine(BucketedConfig(), ReductionOptions(), None)
        >>> engine.before_backward(); engine.after_backward(None)  # before setup: nothing to do
        >>> engine.sharded, engine.step_stats.bytes_sent
        (False, 0)
    """

    def __init__(self, config: BucketedConfig, reduction: ReductionOptions, nonfinite_grads: object) -> None:
        # configuration
        self.config = config
        self.reduction = reduction
        # collaborators (runtime state and statistics)
        self.grad_sync = GradientSync()
        self.sharding = OptimizerSharding()
        self.nonfinite = NonfiniteGuard(check_nonfinite_mode(nonfinite_grads))
        self.model_averager: PeriodicAverager | None = None
        self.local_sgd: LocalSGD | None = None
        """Local SGD / DiLoCo, for the strategies that step locally (made by :meth:`start_local_sgd`)."""
        self._node_groups: list[dist.ProcessGroup] = []
        self._averaged_step = CommStats()

    @property
    def shards_optimizer_state(self) -> bool:
        """Whether the options ask for sharded optimizer state."""
        return bool(getattr(self.config, "shard_optimizer_state", False))

    @property
    def sharded(self) -> bool:
        """Whether this rank's optimizers step its shard now (asked for, and attached at setup)."""
        return self.shards_optimizer_state and self.sharding.attached

    @property
    def buckets(self) -> GradientBuckets | None:
        return self.grad_sync.buckets

    @property
    def step_stats(self) -> CommStats:
        """Communication of the last optimizer step: its gradients, or the local SGD synchronisation it ended with,
        and one run since (before validation, at the end of ``fit``)."""
        stats: CommStats = self.grad_sync.step_stats + self._averaged_step
        return stats

    @property
    def comm_stats(self) -> CommStats:
        """Running totals on this rank since setup (kept after teardown): gradients and local SGD synchronisations."""
        totals: CommStats = self.grad_sync.totals
        return totals + self.local_sgd.stats if self.local_sgd is not None else totals

    # ------------------------------------------------------------------ setup
    def make_groups(self, partition: list[list[int]], rank: int, backend: str | None, reducer: Reducer) -> None:
        """One process group per list of ``partition`` and the reducer's own groups (see :class:`GradientSync`)."""
        self.grad_sync.make_groups(partition, rank, backend, reducer)

    def start_model_averaging(self, world_size: int, rank: int, per_node: int, backend: str | None) -> None:
        """Post-local SGD (``ddp_comm_state=PostLocalSGDState(...)`` with ``model_averaging_period``): the
        parameters are averaged with the ring every period after the state's warm-up. Where the state has no
        ``subgroup``, one group per node is made and given to it (taken back in :meth:`destroy_groups`)."""
        period, state = self.reduction.model_averaging_period, self.reduction.ddp_comm_state
        if period is None or state is None:
            return
        if getattr(state, "subgroup", None) is None:
            nodes = max(1, world_size // per_node)
            self._node_groups = [new_group(ranks) for ranks in node_ranks(nodes, per_node)]
            state.subgroup = self._node_groups[rank // per_node]  # type: ignore[attr-defined]
        averager = FlatAverager(resolve_reducer("ring"))
        averager.setup(None, list(range(world_size)), backend)
        warmup = int(getattr(state, "start_localSGD_iter", 0))
        self.model_averager = PeriodicAverager(averager, period=period, warmup_steps=warmup)

    def start_local_sgd(self, config: LocalSGDConfig, reducer: Reducer, world_size: int, backend: str | None) -> None:
        """Local SGD over the gradient group: the parameter change averaged with ``reducer`` every period (in the
        config's outer precision), buffers and whole-model states exactly."""
        averager = outer_averager(config.outer_precision, reducer)
        averager.setup(self.grad_sync.group, list(range(world_size)), backend)
        self.local_sgd = LocalSGD(config, averager)

    def attach(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        timeout: timedelta | None,
        allow_no_trainable: bool = False,
        module: nn.Module | None = None,
    ) -> None:
        """Attach the gradient buckets to ``named_params``; with sharded state, cut them into every rank's pieces.
        Where the buckets ever average gradients (always, but local SGD's only in its warm-up steps), ``module``'s
        sparse embeddings among ``named_params`` are refused."""
        if module is not None and (self.local_sgd is None or self.local_sgd.config.warmup_steps > 0):
            require_dense_gradients(module, named_params)
        cfg = self.config
        self.grad_sync.attach(
            named_params,
            cfg.bucket_cap_mb,
            cfg.first_bucket_cap_mb,
            allow_no_trainable=allow_no_trainable,
            timeout=timeout,
        )
        if self.shards_optimizer_state and self.grad_sync.buckets is not None:
            self.sharding = OptimizerSharding()
            self.sharding.attach(self.grad_sync.buckets, self.grad_sync.group)

    def bind(self, optimizer: Optimizer) -> None:
        """With sharded state: ``optimizer`` steps this rank's pieces of its parameters from now on."""
        if self.sharded:
            self.sharding.bind(optimizer)

    # ------------------------------------------------------------------ each step
    def before_backward(self) -> None:
        """Arm the buckets (or count a pass skipped inside ``no_sync``, or a local SGD step's, kept on the rank)."""
        if self.local_sgd is not None and not self.local_sgd.averages_gradients:
            self.grad_sync.set_blocked(True)
        if self.sharded and not self.grad_sync.blocked:
            self.sharding.before_backward()
        self.grad_sync.arm_or_skip()

    def after_backward(self, scaler: torch.amp.GradScaler | None) -> None:
        """Wait until the gradients are reduced; with sharded state hand the pieces theirs, and make a gradient
        scaler (16-mixed) find Inf/NaN on every rank when any rank's pieces hold one."""
        synced = not self.grad_sync.blocked
        self.grad_sync.finish()
        if self.sharded:
            self.sharding.after_backward()
            if scaler is not None and synced:
                for gradients in self.sharding.piece_gradients():
                    agree_on_nonfinite(gradients, self.grad_sync.group)

    def guard(
        self, closure: Callable[[], Any], optimizer: Optimizer, named: Iterable[tuple[str, nn.Parameter]], device: Any
    ) -> Callable[[], Any]:
        """``closure`` checked by the non-finite guard (itself when the check is off); names are the pieces'."""
        if self.nonfinite.mode is None:
            return closure
        return self.nonfinite.wrap(closure, optimizer, self.guarded_parameters(named), device)

    def guarded_parameters(self, named: Iterable[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
        """What a non-finite gradient is reported under: the parameters, or this rank's pieces named after them."""
        return self.sharding.named_pieces(named) if self.sharded else list(named)

    def after_step(self, optimizer: Optimizer | Any) -> None:
        """After an optimizer step: post-local SGD's averaging, the sharded parameters all-gathered, the step's
        communication recorded, then local SGD's count (synchronising at the end of a period). ``optimizer`` may be
        any steppable (Fabric's ``Optimizable``): only a torch optimizer's parameters are averaged or gathered."""
        if self.model_averager is not None and hasattr(optimizer, "param_groups"):
            params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            self.model_averager.after_step(params)
        if self.sharded and hasattr(optimizer, "param_groups"):
            self.sharding.after_step(getattr(optimizer, "optimizer", optimizer))
        self.grad_sync.record_step()
        if self.local_sgd is not None:
            before = self.local_sgd.stats
            self.local_sgd.after_step()
            self._averaged_step = self.local_sgd.stats - before

    def synchronize(self) -> None:
        """Average the ranks' parameter changes now and apply the outer step (local SGD; nothing when in sync); what
        it sends joins :attr:`step_stats` (the synchronisation before validation or at the end of ``fit``)."""
        if self.local_sgd is not None:
            before = self.local_sgd.stats
            self.local_sgd.synchronize()
            self._averaged_step = self._averaged_step + (self.local_sgd.stats - before)

    def clip_grad_norm(self, pieces: Sequence[Tensor], max_norm: float, device: torch.device) -> Tensor:
        """Clip this rank's pieces by the 2-norm over every rank's (each element lives on one rank)."""
        return clip_grad_norm_across(pieces, max_norm, group=None, device=device)

    # ------------------------------------------------------------------ checkpoints (sharded state)
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The whole optimizer's ``state_dict`` on rank 0 (stand-ins streamed in by :meth:`save_sharded`)."""
        return self.sharding.optimizer_state(optimizer)

    def save_sharded(
        self,
        checkpoint: dict[str, Any],
        path: Any,
        checkpoint_io: Any,
        writer: bool,
        device: torch.device,
        save_whole: Callable[[dict[str, Any]], None],
        storage_options: Any | None = None,
    ) -> None:
        """Rank 0 writes ``checkpoint`` while every rank sends its pieces of the optimizer state, one tensor at a
        time (over ``device``: the process group's); streamed into the file with an atomic checkpoint IO and a
        local path, else received whole first."""
        stream = functools.partial(atomic_write, path) if can_stream(checkpoint_io, path, storage_options) else None
        save, self.sharding.save = self.sharding.save, type(self.sharding.save)()
        finish_save(save, checkpoint, writer, device, stream, save_whole)

    def load_optimizer(self, optimizer: Optimizer, whole: Mapping[str, Any]) -> None:
        """This rank's pieces of a whole optimizer ``state_dict`` (saved by any strategy, at any world size)."""
        self.sharding.load(optimizer, whole)

    # ------------------------------------------------------------------ teardown
    def abort(self) -> None:
        self.grad_sync.abort()

    def close(self) -> None:
        """Close the buckets, the reducer, the sharded gather and post-local SGD's averager."""
        if self.local_sgd is not None:
            self.local_sgd.close()
        for averager in (self.model_averager, self.local_sgd):
            if averager is not None:
                averager.averager.close()
        self.model_averager = None
        self.sharding.close()
        self.grad_sync.close()

    def destroy_groups(self) -> None:
        """Destroy the gradient groups and the node groups made for post-local SGD."""
        self.grad_sync.destroy_groups()
        if self._node_groups:
            self.reduction.ddp_comm_state.subgroup = None  # type: ignore[attr-defined]
            destroy_groups(self._node_groups)
            self._node_groups = []


class EngineView(Generic[T]):
    """A strategy's read-only attribute that is its engine's attribute of the same name (``strategy.buckets`` is
    ``strategy.engine.buckets``), so that Trainer and Fabric strategies show the same collaborators alike."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> EngineView[T]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> T: ...
    def __get__(self, obj: object | None, owner: type) -> EngineView[T] | T:
        if obj is None:
            return self
        value: T = getattr(obj.engine, self.name)  # type: ignore[attr-defined]
        return value
