"""The step driver: runs the pipeline schedule, holds its gradients until backward, overlaps their reduction.

A training step goes through the states of :class:`StepState`::

    IDLE ──run (no overlap)──▶ PENDING ──backward: add to .grad, arm + finish the buckets──▶ IDLE
    IDLE ──run (overlap)─────▶ REDUCING ──backward: wait for the buckets──────────────────▶ IDLE

A run that fails keeps the state it found; a run without overlap after a step whose backward never came (its
``training_step`` returned ``None``) leaves ``REDUCING`` in place, so that the next backward still waits for it.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_dp_strategies.bucketing.sync import GradientSync
from lightning_dp_strategies.comm.failures import PEER_FAILURE_HINT, announce_failure
from lightning_dp_strategies.pipeline import PipelineRunner, keep_owned_parameters
from lightning_dp_strategies.pipeline.activations import Activation
from lightning_dp_strategies.pipeline.runner import PipelineStats, StepResult

__all__ = ["StepDriver", "StepState"]


class StepState(enum.Enum):
    """Where this step's gradients are between the schedule (in ``training_step``) and Lightning's ``backward``."""

    IDLE = "idle"
    """No step's gradients are held: before the first step, and after each backward."""
    PENDING = "pending"
    """The schedule's gradients are held aside; backward adds them to ``.grad`` and averages them."""
    REDUCING = "reducing"
    """The buckets took the gradients during the schedule and their reduction runs; backward waits for it."""


class StepDriver:
    """One rank's side of each training step around the pipeline schedule.

    Attributes:
        state: where this step's gradients are (:class:`StepState`).
        pending: the gradients held aside in :attr:`StepState.PENDING`, by parameter.
        batch_checked: the batch size was checked against the micro-batches in this run.
        targets_compared: the last epoch whose first batch's targets were compared across the stages, in this run.
        eval_targets_pending: the first batch of the running validation or test has its targets still to compare.
        rank: this rank's global rank, named in errors.
        zero_grad_follows: Lightning zeroes gradients between this step's ``training_step`` and backward.
        pipeline_stats: bubble and timing of this rank's pipeline steps.

    Examples:
        >>> driver = StepDriver()
        >>> driver.state, driver.take_p2p()
        (<StepState.IDLE: 'idle'>, (0, 0))
    """

    def __init__(self) -> None:
        self.state = StepState.IDLE
        self.pending: dict[nn.Parameter, Tensor | None] = {}
        self.zero_grad_follows = True
        self.pipeline_stats = PipelineStats()
        self._p2p = [0, 0]  # bytes sent to and received from neighbouring stages since the last optimizer step
        self._trainable: tuple[bool, ...] | None = None  # requires_grad of the body's parameters, as last seen
        self._owned_ids: set[int] = set()
        self._warned_loss = False
        self.batch_checked = False
        self.targets_compared: int | None = None
        self.eval_targets_pending = False
        self.rank = 0

    def start_run(self, rank: int) -> None:
        """At setup: the checks made once per run are made again.

        Args:
            rank: this rank's global rank, named in errors.
        """
        self.batch_checked = False
        self.targets_compared = None
        self._trainable = None
        self.rank = rank

    # ------------------------------------------------------------------ user changes between steps
    def follow_user_changes(
        self, body: nn.Module, runner: PipelineRunner, optimizers: Sequence[Optimizer], owned: set[int] | None = None
    ) -> None:
        """Pick up what user code changed since the last step: parameters frozen or unfrozen, parameter groups added.

        Every rank sees the same change (the whole module is on every rank), so every stage rebuilds alike.

        Args:
            body: the real body of the module.
            runner: the pipeline runner, reset when the trainable parameters changed.
            optimizers: this stage's optimizers; a group added during training keeps only this stage's parameters.
            owned: the ids of this stage's parameters, when they change (at setup).
        """
        if owned is not None:
            self._owned_ids = owned
        trainable = tuple(p.requires_grad for p in body.parameters())
        if self._trainable is not None and trainable != self._trainable:
            runner.reset()
        self._trainable = trainable
        for optimizer in optimizers:  # a group added during training holds the whole model's parameters
            keep_owned_parameters(optimizer, self._owned_ids)

    # ------------------------------------------------------------------ the schedule
    @staticmethod
    def overlaps(sync: GradientSync, module: Any) -> bool:
        """Whether this step's data-parallel reduction starts inside the schedule, as each chunk's gradients become
        final: on the step that synchronises, under Lightning's own ``optimizer_zero_grad`` and backward.

        Args:
            sync: the strategy's gradient sync.
            module: the LightningModule.
        """
        if sync.buckets is None or sync.blocked or module is None:
            return False
        trainer = module.trainer
        return not trainer.fit_loop._skip_backward and not is_overridden("optimizer_zero_grad", module)

    def run(
        self,
        runner: PipelineRunner,
        params: list[nn.Parameter],
        sync: GradientSync,
        step: tuple[Activation, Tensor, float, Callable[[Any, Tensor], Tensor]],
        overlap: bool,
        optimized: Callable[[], set[int]],
    ) -> StepResult:
        """Run the schedule; ``.grad`` is left as it was, and this step's gradients are pending (or, with
        ``overlap``, already in the buckets, their reduction started as each chunk finished its backward).

        Args:
            runner: the pipeline runner.
            params: this stage's trainable parameters.
            sync: the strategy's gradient sync.
            step: the inputs, the target, the loss scale, and the loss of one micro-batch.
            overlap: start the reduction inside the schedule (see :meth:`overlaps`).
            optimized: the ids of the parameters the optimizers hold (what ``zero_grad`` clears).

        Returns:
            The runner's result of the step.
        """
        inputs, target, scale, loss_fn = step
        before = {p: p.grad for p in params}
        for p in params:
            p.grad = None
        buckets = sync.buckets
        if buckets is not None:
            if overlap:
                # what zero_grad is about to clear is not part of this step's gradient; the rest accumulates
                zeroed = optimized() if self.zero_grad_follows else set()
                base = {p: grad for p, grad in before.items() if id(p) not in zeroed}
                # the buckets are about to be refilled, and .grad may be views of them: release what zero_grad clears
                before = {p: grad if id(p) not in zeroed else None for p, grad in before.items()}
                buckets.arm(deferred=True, base=base)
                runner.before_last_backward, runner.after_last_backward = buckets.accept, buckets.take
            else:
                buckets.sync_blocked = True  # per-micro-batch hooks stay silent: averaging happens in backward
        try:
            result = runner.train_step(inputs, target, loss_fn, scale)
            if overlap:
                assert buckets is not None
                buckets.flush()  # gradients no last backward completed (parameters outside the body)
                self.state = StepState.REDUCING
            elif self.state is not StepState.REDUCING:
                self.state = StepState.PENDING
        except (RuntimeError, dist.DistBackendError) as error:
            failure = peer_failure(error, self.rank)
            if failure is None:
                raise
            raise failure from error
        finally:
            runner.before_last_backward = runner.after_last_backward = None
            self.pending = {} if overlap else {p: p.grad for p in params}
            for p, grad in before.items():
                p.grad = grad
            if buckets is not None:
                buckets.sync_blocked = sync.blocked
        return result

    def record(self, result: StepResult) -> None:
        """Count a step's statistics: its bubble and timing, and the bytes it exchanged with neighbouring stages."""
        self.pipeline_stats.record(result.stats)
        self._p2p[0] += result.stats.p2p_bytes_sent
        self._p2p[1] += result.stats.p2p_bytes_received

    def take_p2p(self) -> tuple[int, int]:
        """The bytes sent and received point to point since the last call (each optimizer step)."""
        sent, received = self._p2p
        self._p2p = [0, 0]
        return sent, received

    # ------------------------------------------------------------------ backward
    def apply_gradients(self, sync: GradientSync) -> None:
        """What backward does instead of autograd: the held gradients end up in ``.grad``, averaged over the replicas.

        Args:
            sync: the strategy's gradient sync (inside ``no_sync`` the buckets count a skipped pass).
        """
        buckets = sync.buckets
        if self.state is StepState.REDUCING:  # the buckets hold this step's gradients, added to what came before
            assert buckets is not None
            self.state = StepState.IDLE
            buckets.finish()
            return
        for p, grad in self.pending.items():
            if grad is None:
                continue
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.add_(grad)
        self.pending = {}
        self.state = StepState.IDLE
        if buckets is not None:
            if sync.blocked:
                buckets.skip()
            else:
                buckets.arm()
                buckets.finish()

    def abort(self) -> None:
        """On an exception: no reduction is waited for any more."""
        if self.state is StepState.REDUCING:
            self.state = StepState.IDLE

    def reset(self) -> None:
        """At teardown: nothing is held."""
        self.pending, self.state = {}, StepState.IDLE

    # ------------------------------------------------------------------ checks
    def check_loss(self, step_output: Any, pipeline_loss: Tensor) -> None:
        """Warn once when ``training_step`` returned a loss other than the one the pipeline trained on.

        Args:
            step_output: what the LightningModule's ``training_step`` returned.
            pipeline_loss: the mean of ``pipeline_loss`` over the batch.
        """
        loss = step_output.get("loss") if isinstance(step_output, Mapping) else step_output
        if self._warned_loss or not isinstance(loss, Tensor) or loss.numel() != 1:
            return
        a, b = float(loss.detach()), float(pipeline_loss)
        if abs(a - b) > 1e-3 * max(1.0, abs(b)):
            self._warned_loss = True
            warnings.warn(
                f"training_step returned the loss {a:.6g}, but the pipeline trained on pipeline_loss = {b:.6g} "
                "(mean over the batch). Under HybridPipelineStrategy gradients come from `pipeline_loss` only: make "
                "training_step return `self.pipeline_loss(self.body(x), y)`, or move extra terms into pipeline_loss.",
                stacklevel=2,
            )


def peer_failure(error: BaseException, rank: int) -> RuntimeError | None:
    """The error to raise instead of a failed point-to-point exchange with a neighbouring stage, or ``None``.

    Args:
        error: what the schedule raised.
        rank: this rank's global rank.

    Returns:
        A ``RuntimeError`` naming the likely cause when ``error`` is a lost connection or a timeout, else ``None``.

    Examples:
        >>> peer_failure(RuntimeError("shape mismatch"), 0) is None
        True
    """
    if not isinstance(error, (RuntimeError, dist.DistBackendError)):
        return None
    if "Connection" not in str(error) and "Timed out" not in str(error) and "timeout" not in str(error):
        return None
    return RuntimeError(
        announce_failure(
            f"The pipeline schedule failed on rank {rank} while exchanging activations or "
            f"gradients with a neighbouring stage: {error}\n{PEER_FAILURE_HINT}"
        )
    )
