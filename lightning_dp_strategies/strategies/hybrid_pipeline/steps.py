"""Lightning's step hooks under the pipeline: ``training_step`` and ``backward`` over the driver, and evaluation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dp_strategies.pipeline import PipelineRunner, check_micro_batches
from lightning_dp_strategies.pipeline.activations import Activation, batch_size
from lightning_dp_strategies.pipeline.layout import Layout
from lightning_dp_strategies.pipeline.runner import PipelineStats, StepResult
from lightning_dp_strategies.sharding import clip_grad_norm_across
from lightning_dp_strategies.strategies._trainer import should_log
from lightning_dp_strategies.strategies.bucketed import BucketedDataParallel
from lightning_dp_strategies.strategies.hybrid_pipeline.collectives import check_same_targets, data_group_or, vote
from lightning_dp_strategies.strategies.hybrid_pipeline.config import HybridPipelineConfig
from lightning_dp_strategies.strategies.hybrid_pipeline.driver import StepDriver
from lightning_dp_strategies.strategies.hybrid_pipeline.opt_in import (
    PipelinedBody,
    ReplayBody,
    body_replaced,
    split_batch,
)
from lightning_dp_strategies.strategies.hybrid_pipeline.placement import StagePlacement

__all__ = ["PipelineSteps"]


class PipelineSteps(BucketedDataParallel):
    """The step hooks of :class:`HybridPipelineStrategy` (its base; see its module docstring), Lightning's
    collectives (values over this stage's data-parallel group, decisions over every rank) and clipping by the norm
    over every stage.

    ``training_step`` runs the schedule (:meth:`StepDriver.run`) and then the module's own ``training_step`` with the
    body replaying the pipeline's output; ``backward`` applies the gradients the schedule computed
    (:meth:`StepDriver.apply_gradients`); the evaluation steps run the forward-only pipeline.
    """

    config: HybridPipelineConfig
    layout: Layout | None
    runner: PipelineRunner | None
    driver: StepDriver
    placement: StagePlacement

    # ------------------------------------------------------------------ Lightning's collectives and clipping
    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """Reduce over the data-parallel group (``self.log(..., sync_dist=True)``): each replica's value counts once."""
        return super().reduce(tensor, group=data_group_or(group, self.layout), reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Gather over the data-parallel group: a leading dimension of ``data_parallel`` replicas, each once."""
        return super().all_gather(tensor, group=data_group_or(group, self.layout), sync_grads=sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Vote over every rank: ``all=True`` holds when every rank decides ``True``, ``all=False`` when any does."""
        return vote(decision, all, self.world_size, self.root_device)

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """Lightning's clip-by-norm (``gradient_clip_val``) with the norm over every stage of the pipeline."""
        assert self.layout is not None
        params = list(self.precision_plugin.main_params(optimizer))
        clip_grad_norm_across(params, clip_val, group=self.layout.pipeline_group, device=self.root_device)

    @property
    def pipeline_stats(self) -> PipelineStats:
        """Bubble and timing of this rank's pipeline steps."""
        return self.driver.pipeline_stats

    def _check_blocks(self, inputs: Activation, source: str = "the first batch's inputs") -> None:
        """Once per run, check on fake tensors what each block of the body returns for ``inputs`` (every rank alike)."""
        self.placement.check_blocks(self.lightning_module, self.layout, inputs, source)

    def _owned_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The ``(name, parameter)`` pairs of this rank's stage."""
        module, layout = self.lightning_module, self.layout
        assert module is not None and layout is not None
        return [(n, p) for n, p in module.named_parameters() if layout.owns(n)]

    # ------------------------------------------------------------------ training
    @override
    def on_train_start(self) -> None:
        loader = self.lightning_module.trainer.train_dataloader if self.lightning_module is not None else None
        size = getattr(loader, "batch_size", None)
        if size is None:
            size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
        if isinstance(size, int):
            check_micro_batches(size, self.config.micro_batches, "the training DataLoader (per replica)")
            self.driver.batch_checked = True

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None:  # Lightning's rule in _AutomaticOptimization._make_zero_grad_fn
            self.driver.zero_grad_follows = batch_idx % trainer.accumulate_grad_batches == 0

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the schedule on the batch, then the module's ``training_step`` with its body replaying the output."""
        module, runner, layout = self.lightning_module, self.runner, self.layout
        assert module is not None and runner is not None and layout is not None
        batch = args[0] if args else kwargs["batch"]
        inputs, target = split_batch(module, batch)
        epoch = module.trainer.current_epoch
        if self.driver.targets_compared != epoch:  # a sampler that splits the data wrongly shows on any batch
            check_same_targets(target, layout, self.root_device, f"the first training batch of epoch {epoch}")
            self.driver.targets_compared = epoch
        self._follow_user_changes()
        self._check_blocks(inputs)
        if not self.driver.batch_checked:
            check_micro_batches(batch_size(inputs), self.config.micro_batches, "the first training batch")
            self.driver.batch_checked = True
        scale = 1.0 / max(1, module.trainer.accumulate_grad_batches)
        with self.precision_plugin.train_step_context():
            result = self._run_pipeline(inputs, target, scale)
            output = runner.share_output(result.output)
            with body_replaced(module, layout.body_name, ReplayBody(output, inputs, layout.body_name)):
                step_output = module.training_step(*args, **kwargs)
        self.driver.record(result)
        if result.loss is not None:
            self.driver.check_loss(step_output, result.loss)
        return step_output

    def _follow_user_changes(self, owned: set[int] | None = None) -> None:
        """Pick up parameters frozen or unfrozen and parameter groups added since the last step (see the driver)."""
        module, layout, runner = self.lightning_module, self.layout, self.runner
        assert module is not None and layout is not None and runner is not None
        body = module._modules[layout.body_name]
        assert body is not None
        self.driver.follow_user_changes(body, runner, self.optimizers, owned)

    def _run_pipeline(self, inputs: Activation, target: Tensor, scale: float) -> StepResult:
        """Run the schedule with this stage's trainable parameters (see :meth:`StepDriver.run`)."""
        module, runner = self.lightning_module, self.runner
        assert module is not None and runner is not None
        params = [p for _, p in self._owned_parameters() if p.requires_grad]
        overlap = self.driver.overlaps(self.grad_sync, module)
        loss_fn: Callable[[Any, Tensor], Tensor] = getattr(module, "pipeline_loss")  # noqa: B009
        step = (inputs, target, scale, loss_fn)
        return self.driver.run(runner, params, self.grad_sync, step, overlap, self._optimized_ids)

    def _optimized_ids(self) -> set[int]:
        """The ids of the parameters the optimizers hold."""
        return {id(p) for optimizer in self.optimizers for group in optimizer.param_groups for p in group["params"]}

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Apply the gradients the schedule computed (no second autograd pass) and average them over the replicas."""
        module = self.lightning_module
        assert module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)  # on_before_backward
        self.driver.apply_gradients(self.grad_sync)
        return self.precision_plugin.post_backward(closure_loss, module)  # on_after_backward

    @override
    def _log_step(self) -> None:
        # the step's pipeline ran in Lightning's closure: every training step since the last optimizer step counts
        stats = self.step_stats.copy()
        stats.pipeline_bytes_sent, stats.pipeline_bytes_received = self.driver.take_p2p()
        self.grad_sync.step_stats = stats
        module = self.lightning_module
        if should_log(self, self.config.log_pipeline_stats) and module is not None and module.logger is not None:
            last = self.pipeline_stats.last
            metrics = {
                "pipeline/bubble": last.bubble,
                "pipeline/step_seconds": last.step_seconds,
                "pipeline/micro_batches": float(last.micro_batches),
                **self.step_stats.as_dict("comm/"),
            }
            module.logger.log_metrics(metrics, step=module.trainer.global_step)

    # ------------------------------------------------------------------ evaluation
    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self.driver.eval_targets_pending = True

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self.driver.eval_targets_pending = True

    def _compare_eval_targets(self, hook: str, batch: Any) -> None:
        """At the first batch of a validation or test, whether the stages of each replica read the same batch: every
        rank's metrics and the checkpoint and early-stopping votes taken over them depend on it."""
        module, layout = self.lightning_module, self.layout
        assert module is not None and layout is not None
        self.driver.eval_targets_pending = False
        try:
            target: Tensor | None = split_batch(module, batch)[1]
        except (TypeError, KeyError, IndexError):  # a batch without a target the pipeline can find: compared as none
            target = None
        stage = hook.removesuffix("_step")
        check_same_targets(target, layout, self.root_device, f"the first {stage} batch")

    def _evaluate(self, hook: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        """Run the module's ``hook`` with its body answering through the forward-only pipeline."""
        module, runner, layout = self.lightning_module, self.runner, self.layout
        assert module is not None and runner is not None and layout is not None
        if self.driver.eval_targets_pending and hook != "predict_step":
            self._compare_eval_targets(hook, args[0] if args else kwargs["batch"])
        with context, body_replaced(module, layout.body_name, PipelinedBody(runner, self._check_blocks)):
            return getattr(module, hook)(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("validation_step", self.precision_plugin.val_step_context(), *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("test_step", self.precision_plugin.test_step_context(), *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("predict_step", self.precision_plugin.predict_step_context(), *args, **kwargs)
