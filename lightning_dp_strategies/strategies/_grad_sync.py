"""What the strategies that average gradients with ``GradientBuckets`` share: groups, buckets, no-sync blocks, stats.

:class:`GradSync` is the half that knows nothing of Lightning's loops (the Trainer's bucketed strategies and the
Fabric strategies both build on it); :class:`BucketedGradSync` adds what the Trainer asks of a strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Sequence
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ParallelStrategy
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dp_strategies.bucketing import CommStats, GradientBuckets
from lightning_dp_strategies.comm_hooks import CommHook, check_comm_hook, hook_name, make_reducer
from lightning_dp_strategies.fingerprint import check_ranks_agree, model_fingerprint
from lightning_dp_strategies.reducers import Reducer, close_reducer, setup_reducer
from lightning_dp_strategies.strategies._nonfinite import NonfiniteCheck


def destroy_groups(groups: Iterable[object]) -> None:
    """Destroy the process groups a strategy made at setup, once each; ``None``, the placeholder a rank outside a
    group holds, and the default group (Lightning's) are skipped."""
    if not dist.is_initialized():
        return
    destroyed: set[int] = set()
    for group in groups:
        if isinstance(group, dist.ProcessGroup) and group is not dist.group.WORLD and id(group) not in destroyed:
            destroyed.add(id(group))
            dist.destroy_process_group(group)


def base_fingerprint_options(strategy: object, reducer: str | Reducer | None, world_size: int) -> dict[str, Any]:
    """The options every rank of a bucketed strategy, Trainer or Fabric, must agree on besides the model."""
    kind = reducer if isinstance(reducer, str) or reducer is None else type(reducer)
    return {
        "strategy": type(strategy).__qualname__,
        "reducer": getattr(kind, "__qualname__", kind),
        "ddp_comm_hook": hook_name(getattr(strategy, "_comm_hook", None)),
        "ddp_comm_state": type(getattr(strategy, "ddp_comm_state", None)).__qualname__,
        "world_size": world_size,
        "torch": torch.__version__,
        "lightning": pl.__version__,
    }


class GradSync:
    """The Lightning-agnostic state of a strategy whose gradients ``GradientBuckets`` average: the reducer (made in
    :meth:`configure_reducer`), one process group per averaging group, the buckets, the no-sync flag, and the
    statistics (running totals and the last optimizer step's). The Trainer's strategies (:class:`BucketedGradSync`)
    and the Fabric strategies (:mod:`lightning_dp_strategies.fabric`) wire it into their own loops.
    """

    buckets: GradientBuckets | None
    reducer: str | Reducer | None
    """The ``reducer=`` option: a name in ``REDUCERS``, a reducer, or ``None`` (the ring)."""
    step_stats: CommStats
    """Communication of the last optimizer step (all backward passes since the previous step)."""
    ddp_comm_state: object = None
    """The ``ddp_comm_state=`` option, as given (set by :meth:`_init_comm_hook`)."""
    _comm_hook: CommHook | None = None
    """The communication hook, wrapped when a wrapper was given; ``None``: the ``reducer=`` option reduces."""

    def _init_grad_sync_state(self) -> None:
        # runtime state
        self.buckets = None
        self._sync_blocked = False
        self._grad_groups: list[dist.ProcessGroup] = []
        self._grad_group: dist.ProcessGroup | None = None
        self._reducer: Reducer | None = None
        # statistics
        self.step_stats = CommStats()
        self._step_start = CommStats()
        self._closed_totals = CommStats()

    def _init_comm_hook(self, reducer: object, hook: object, state: object, wrapper: object) -> None:
        """Check and keep the torch DDP communication-hook options (:func:`~...comm_hooks.check_comm_hook`)."""
        self._comm_hook = check_comm_hook(hook, state, wrapper, reducer)  # wrapped, when a wrapper was given
        self.ddp_comm_hook = hook
        """The ``ddp_comm_hook=`` option, as given."""
        self.ddp_comm_state = state
        self.ddp_comm_wrapper = wrapper
        """The ``ddp_comm_wrapper=`` option, as given."""

    def configure_reducer(self) -> Reducer:
        """The reducer of the gradient buckets, called once at setup: override it to reduce another way.

        The default is the communication hook's (:class:`~lightning_dp_strategies.comm_hooks.CommHookReducer`) when
        ``ddp_comm_hook`` was given, else the ``reducer=`` option's (see :mod:`lightning_dp_strategies.reducers`).

        Examples:
            >>> from lightning_dp_strategies import NativeReducer, RingAllReduceStrategy
            >>> class NativeStrategy(RingAllReduceStrategy):
            ...     def configure_reducer(self) -> Reducer:
            ...         return NativeReducer()
            >>> type(NativeStrategy().configure_reducer()).__name__
            'NativeReducer'
        """
        return make_reducer(self.reducer, self._comm_hook, self.ddp_comm_state)

    def _make_grad_groups(self, partition: Sequence[Sequence[int]], rank: int, backend: str | None) -> None:
        """One dedicated group per list of ``partition`` (the global ranks that average together), then the reducer
        (:meth:`configure_reducer`) and its own groups, on every rank in the same order; this rank's group kept.

        A dedicated group keeps the communication thread from interleaving with collectives the main thread issues
        on the default group (metric syncs, SyncBatchNorm, barriers).
        """
        self._grad_groups = [dist.new_group(list(ranks), backend=backend) for ranks in partition]
        self._reducer = self.configure_reducer()
        for group, ranks in zip(self._grad_groups, partition, strict=True):
            setup_reducer(self._reducer, group, list(ranks), backend)
        mine = [group for group, ranks in zip(self._grad_groups, partition, strict=True) if rank in ranks]
        self._grad_group = mine[0] if mine else None

    def _attach_buckets(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        bucket_cap_mb: float,
        first_bucket_cap_mb: float,
        allow_no_trainable: bool = False,
    ) -> None:
        """Attach the gradient buckets to ``named_params``, averaging over this rank's group with the reducer."""
        self.buckets = GradientBuckets(
            named_params,
            group=self._grad_group,
            reducer=self._reducer,
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_cap_mb=first_bucket_cap_mb,
            allow_no_trainable=allow_no_trainable,
            timeout=timeout.total_seconds() if (timeout := getattr(self, "_timeout", None)) is not None else None,
        )
        self.buckets.sync_blocked = self._sync_blocked

    @contextmanager
    def _sync_blocked_block(self) -> Generator[None, None, None]:
        """Backward passes inside accumulate gradients locally; the previous state comes back on exit (nesting)."""
        previous = self._sync_blocked
        self._set_sync_blocked(True)
        try:
            yield None
        finally:
            self._set_sync_blocked(previous)

    def _set_sync_blocked(self, blocked: bool) -> None:
        self._sync_blocked = blocked
        if self.buckets is not None:
            self.buckets.sync_blocked = blocked

    def _arm_or_skip(self) -> None:
        """Before a backward pass: arm the buckets, or count a skipped one inside a no-sync block."""
        if self.buckets is None:
            return
        if self._sync_blocked:
            self.buckets.skip()
        else:
            self.buckets.arm()

    def _record_step(self) -> None:
        """After an optimizer step: the communication since the previous one becomes :attr:`step_stats`."""
        if self.buckets is not None:
            self.step_stats = self.buckets.totals - self._step_start
            self._step_start = self.buckets.totals.copy()

    @property
    def comm_stats(self) -> CommStats:
        """Running totals of gradient communication on this rank since setup (kept after teardown)."""
        return self.buckets.totals if self.buckets is not None else self._closed_totals

    def _close_buckets(self) -> None:
        if self.buckets is not None:
            self.buckets.close()
            self._closed_totals = self.buckets.totals
            self.buckets = None

    def _close_reducer_and_buckets(self) -> None:
        """Close the buckets (which close their reducer), or the reducer alone when no buckets were built."""
        if self.buckets is None and self._reducer is not None:
            close_reducer(self._reducer)
        self._reducer = None
        self._close_buckets()

    def _destroy_grad_groups(self) -> None:
        destroy_groups(self._grad_groups)
        self._grad_groups, self._grad_group = [], None


class BucketedGradSync(GradSync, NonfiniteCheck, ParallelStrategy):
    """The bookkeeping half of :class:`~.bucketed.BucketedDataParallel` (which wires it up), on top of
    :class:`GradSync`: Lightning's no-sync block, the per-step statistics at the optimizer step, and the
    rank-agreement check. Subclasses may override :meth:`_log_step` to log after each optimizer step.
    """

    def _fingerprint_options(self) -> dict[str, Any]:
        """What every rank must agree on besides the model; subclasses add their own options."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return {
            **base_fingerprint_options(self, self.reducer, self.world_size),
            "precision": getattr(self.precision_plugin, "precision", type(self.precision_plugin).__name__),
            "accumulate_grad_batches": getattr(trainer, "accumulate_grad_batches", None),
            "gradient_clip_val": getattr(trainer, "gradient_clip_val", None),
        }

    def _check_ranks_agree(self) -> None:
        """Fail on every rank, before anything else is communicated, if the ranks' models or options differ."""
        module = self.lightning_module
        assert module is not None
        check_ranks_agree(model_fingerprint(module, self._fingerprint_options()))

    def _init_grad_sync(self, nonfinite_grads: object = None) -> None:
        self._init_nonfinite(nonfinite_grads)
        self._init_grad_sync_state()

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Backward passes inside this context accumulate gradients locally and do not communicate.

        Lightning enters it on gradient-accumulation steps; in manual optimization use it as ``no_sync``::

            with self.trainer.strategy.no_backward_sync():
                self.manual_backward(loss)   # local only
            self.manual_backward(loss2)      # averages the accumulated gradients
        """
        with self._sync_blocked_block():
            yield None

    no_backward_sync = block_backward_sync

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Any | None = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._record_step()
        self._log_step()
        return output

    def _log_step(self) -> None:
        """Called after every optimizer step; the default logs nothing."""

    def _should_log(self, enabled: bool) -> bool:
        """Whether to log now: ``enabled``, a logger exists, and this is a ``log_every_n_steps`` step."""
        module = self.lightning_module
        if not enabled or module is None or module.logger is None:
            return False
        every = int(getattr(module.trainer, "log_every_n_steps", 1))
        return every > 0 and module.trainer.global_step % every == 0
