"""What the strategies that average gradients with ``GradientBuckets`` share: no-sync blocks and per-step stats."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ParallelStrategy
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dp_strategies.bucketing import CommStats, GradientBuckets
from lightning_dp_strategies.fingerprint import check_ranks_agree, model_fingerprint
from lightning_dp_strategies.reducers import Reducer, resolve_reducer
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


class BucketedGradSync(NonfiniteCheck, ParallelStrategy):
    """The bookkeeping half of :class:`~.bucketed.BucketedDataParallel` (which wires it up): no-sync blocks,
    per-step statistics, the reducer hook and the rank-agreement check. Subclasses may override :meth:`_log_step`
    to log after each optimizer step.
    """

    buckets: GradientBuckets | None
    reducer: str | Reducer | None
    """The ``reducer=`` option: a name in ``REDUCERS``, a reducer, or ``None`` (the ring)."""
    step_stats: CommStats
    """Communication of the last optimizer step (all backward passes since the previous step)."""

    def configure_reducer(self) -> Reducer:
        """The reducer of the gradient buckets, called once at setup: override it to reduce another way.

        The default resolves the ``reducer=`` option (see :mod:`lightning_dp_strategies.reducers`).

        Examples:
            >>> from lightning_dp_strategies import NativeReducer, RingAllReduceStrategy
            >>> class NativeStrategy(RingAllReduceStrategy):
            ...     def configure_reducer(self) -> Reducer:
            ...         return NativeReducer()
            >>> type(NativeStrategy().configure_reducer()).__name__
            'NativeReducer'
        """
        return resolve_reducer(self.reducer)

    def _fingerprint_options(self) -> dict[str, Any]:
        """What every rank must agree on besides the model; subclasses add their own options."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        reducer = self.reducer if isinstance(self.reducer, str) or self.reducer is None else type(self.reducer)
        return {
            "strategy": type(self).__qualname__,
            "reducer": getattr(reducer, "__qualname__", reducer),
            "precision": getattr(self.precision_plugin, "precision", type(self.precision_plugin).__name__),
            "accumulate_grad_batches": getattr(trainer, "accumulate_grad_batches", None),
            "gradient_clip_val": getattr(trainer, "gradient_clip_val", None),
            "world_size": self.world_size,
            "torch": torch.__version__,
            "lightning": pl.__version__,
        }

    def _check_ranks_agree(self) -> None:
        """Fail on every rank, before anything else is communicated, if the ranks' models or options differ."""
        module = self.lightning_module
        assert module is not None
        check_ranks_agree(model_fingerprint(module, self._fingerprint_options()))

    def _init_grad_sync(self, nonfinite_grads: object = None) -> None:
        self._init_nonfinite(nonfinite_grads)
        self.buckets = None
        self.step_stats = CommStats()
        self._sync_blocked = False
        self._step_start = CommStats()
        self._closed_totals = CommStats()

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Backward passes inside this context accumulate gradients locally and do not communicate.

        Lightning enters it on gradient-accumulation steps; in manual optimization use it as ``no_sync``::

            with self.trainer.strategy.no_backward_sync():
                self.manual_backward(loss)   # local only
            self.manual_backward(loss2)      # averages the accumulated gradients
        """
        previous = self._sync_blocked
        self._set_sync_blocked(True)
        try:
            yield None
        finally:
            self._set_sync_blocked(previous)

    no_backward_sync = block_backward_sync

    def _set_sync_blocked(self, blocked: bool) -> None:
        self._sync_blocked = blocked
        if self.buckets is not None:
            self.buckets.sync_blocked = blocked

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Any | None = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.buckets is not None:
            self.step_stats = self.buckets.totals - self._step_start
            self._step_start = self.buckets.totals.copy()
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

    @property
    def comm_stats(self) -> CommStats:
        """Running totals of gradient communication on this rank since setup (kept after teardown)."""
        return self.buckets.totals if self.buckets is not None else self._closed_totals

    def _close_buckets(self) -> None:
        if self.buckets is not None:
            self.buckets.close()
            self._closed_totals = self.buckets.totals
            self.buckets = None
