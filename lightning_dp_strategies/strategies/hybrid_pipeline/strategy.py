"""Pipeline x data parallelism: the body split into stages across ranks, micro-batched, the pipeline replicated.

The world is a ``pipeline_stages x data_parallel`` mesh; rank ``r`` runs stage ``r // D`` of replica ``r % D``::

                 replica 0   replica 1          (D = data_parallel = world // pipeline_stages)
    stage 0      rank 0      rank 1       <- data-parallel group of stage 0: gradients averaged (ring all-reduce)
    stage 1      rank 2      rank 3
                   ^
                   pipeline group of replica 0: activations forward, gradients backward (point-to-point)

How a training step goes, and why backward does not run twice. ``torch.distributed.pipelining``'s schedule runs
forward *and* backward of every micro-batch itself (1F1B interleaves them), but Lightning's automatic optimization
wants ``training_step`` to return a loss that it then backpropagates, after zeroing gradients in between. So:

1. :meth:`HybridPipelineStrategy.training_step` runs the schedule on the batch (the first stage feeds the inputs,
   the last computes ``pipeline_loss`` per micro-batch). The gradients it produces are held aside as *pending*
   (``.grad`` is put back as it was, so Lightning's ``zero_grad`` that follows cannot erase them). On a step that
   averages over replicas, each chunk's gradients go into the buckets instead, during its last backward pass, and
   the buckets are launched while the remaining backwards run.
2. The last stage's output is broadcast to every stage of the replica, and the LightningModule's own
   ``training_step`` runs with its body answering with that output: whatever it logs (the loss, metrics) is
   computed as on one device, on every rank, and reaches the logger and progress bar on rank 0. The loss it returns
   has no graph.
3. Lightning calls :meth:`~HybridPipelineStrategy.backward` with that loss. Instead of autograd, the pending
   gradients are added to ``.grad`` (what ``loss.backward()`` would have done) and averaged over the stage's
   data-parallel group with the gradient buckets of ``"ring_allreduce"``. ``on_before_backward`` and
   ``on_after_backward`` still run.
4. Clipping and the optimizer step go through Lightning unchanged; clipping by norm uses the global norm over all
   stages; each stage's optimizer holds only its own parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.callbacks import BaseFinetuning, ModelSummary as ModelSummaryCallback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_summary import ModelSummary
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from typing_extensions import Unpack, override

from lightning_dp_strategies.bucketing.sync import destroy_groups
from lightning_dp_strategies.comm.groups import time_out_as_world
from lightning_dp_strategies.core.checkpoint_io import atomic_write
from lightning_dp_strategies.pipeline import PipelineRunner
from lightning_dp_strategies.pipeline.activations import is_activation
from lightning_dp_strategies.pipeline.layout import Layout, StageBody, check_mesh
from lightning_dp_strategies.pipeline.materialize import cpu_keeps_meta
from lightning_dp_strategies.pipeline.runner import PipelineStats
from lightning_dp_strategies.plan import HYBRID_PIPELINE, CostModel
from lightning_dp_strategies.reducers import Reducer
from lightning_dp_strategies.reducers.comm_hooks import CommHook
from lightning_dp_strategies.strategies._trainer import warn_gradient_hooks
from lightning_dp_strategies.strategies.hybrid_pipeline.checkpointer import StreamedCheckpointer, StreamedCheckpoints
from lightning_dp_strategies.strategies.hybrid_pipeline.collectives import MetricGroups, point_to_point_device
from lightning_dp_strategies.strategies.hybrid_pipeline.config import HybridPipelineConfig
from lightning_dp_strategies.strategies.hybrid_pipeline.driver import StepDriver
from lightning_dp_strategies.strategies.hybrid_pipeline.opt_in import check_opt_in
from lightning_dp_strategies.strategies.hybrid_pipeline.placement import StagePlacement
from lightning_dp_strategies.strategies.hybrid_pipeline.refusals import (
    check_automatic_optimization,
    check_no_sync_batchnorm,
    check_precision,
    check_reducer_not_auto,
    check_whole_model_callbacks,
)
from lightning_dp_strategies.strategies.hybrid_pipeline.steps import PipelineSteps
from lightning_dp_strategies.strategies.hybrid_pipeline.summary import restore_summaries, stage_summary, summarize_with
from lightning_dp_strategies.strategies.options import StrategyOptions
from lightning_dp_strategies.strategies.precision import stored_under_plugin_name

__all__ = ["HybridPipelineConfig", "HybridPipelineStrategy", "PipelineStats"]


STAGE_GRADIENTS = (
    "will find only this rank's pipeline stage's gradients with pipeline_stages > 1: the other stages' parameters "
    "have none on this rank, so a norm computed there is this stage's alone, and clipping there clips each stage by "
    "its own norm. Clip with the Trainer's `gradient_clip_val` (by the norm over every stage)."
)


class HybridPipelineStrategy(PipelineSteps, StreamedCheckpoints):
    """The body of the model split into pipeline stages across ranks, micro-batched, and replicated.

    ``world = pipeline_stages x data_parallel`` processes, one device each. Stage ``s`` runs and trains only its
    own blocks (its optimizer keeps only their parameters); activations and their gradients travel between stages
    point to point (``torch.distributed.pipelining``); the replicas of a stage average gradients with the bucketed
    ring all-reduce. The distributed sampler splits the data over the ``data_parallel`` replicas only.

    The LightningModule opts in with two members (a module without them gets an error naming them)::

        class MyModel(L.LightningModule):
            pipeline_body = "body"                      # 1. the nn.Sequential attribute holding the blocks

            def pipeline_loss(self, output, target):    # 2. the loss of one micro-batch, on the last block's output
                return F.cross_entropy(output, target)

    Optionally ``pipeline_split_batch(self, batch) -> (inputs, target)`` when the batch is not ``(inputs, target)``.
    Under this strategy ``training_step`` runs *after* the pipeline (see the module docstring): ``self.body(x)``
    returns the pipeline's output and the gradient comes from ``pipeline_loss``.

    Args:
        pipeline_stages: number of stages ``S``; the world size must be a multiple of it.
        micro_batches: micro-batches per step ``M``; the per-replica batch size must be a multiple of it.
        schedule: ``"1f1b"`` (default; holds at most ``S - s`` micro-batches of activations on stage ``s``),
            ``"gpipe"`` (all forwards, then all backwards; holds ``M``), or a schedule with ``virtual_stages``
            chunks per rank and a smaller bubble: ``"interleaved_1f1b"``, ``"looped_bfs"``, and the zero-bubble
            ``"interleaved_zb"`` and ``"zbv"`` (exactly two chunks per rank, in a V), which split each backward into
            input- and weight-gradient passes.
        virtual_stages: chunks of the body per rank (``None``: 1 for GPipe and 1F1B, 2 for the others); the body is
            cut into ``pipeline_stages x virtual_stages`` chunks, balanced as ``balance`` says.
        balance: blocks per chunk (e.g. ``[3, 2]``; one chunk per stage unless ``virtual_stages > 1``),
            ``"parameters"`` (default: even parameter counts) or
            ``"time"`` (even measured forward+backward time on ``module.example_input_array``, measured on rank 0).
        bucket_cap_mb: gradient bucket cap in MiB, as ``"ring_allreduce"``.
        first_bucket_cap_mb: cap of the first bucket in MiB.
        reducer: how a bucket is averaged over the data-parallel group, as in ``"ring_allreduce"`` (default
            ``"ring"``; ``"native"``, ``"per_tensor"`` or a callable ``reducer(bucket) -> Future``).
        log_pipeline_stats: log ``pipeline/bubble`` (rank 0's) and the communication counters every
            ``log_every_n_steps``.
        measure_activations: record the peak bytes saved for backward in every step (``pipeline_stats``); costs a
            hook per saved tensor.
        ddp_comm_hook: a torch DDP communication hook ``hook(state, bucket) -> Future`` (``allreduce_hook``,
            ``fp16_compress_hook``, ``powerSGD_hook``, ...) that averages the replicas' buckets instead of
            ``reducer``, on any device and backend, CPU/gloo included (see :mod:`lightning_dp_strategies.comm_hooks`).
        ddp_comm_state: the hook's ``state`` (e.g. ``PowerSGDState``); ``None`` gives it the gradient group.
        ddp_comm_wrapper: applied once as ``ddp_comm_wrapper(ddp_comm_hook)`` (e.g. ``fp16_compress_wrapper``).
        **options: the shared keyword options (``nonfinite_grads``, ``timeout``, ...): see
            :class:`~lightning_dp_strategies.strategies.options.StrategyOptions`.

    Examples:
        >>> import lightning as L
        >>> import lightning_dp_strategies  # registers "hybrid_pipeline"
        >>> trainer = L.Trainer(strategy="hybrid_pipeline", accelerator="cpu", devices=4)  # doctest: +SKIP
        >>> strategy = HybridPipelineStrategy(pipeline_stages=2, micro_batches=8, schedule="gpipe")
    """

    config: HybridPipelineConfig
    cost_model: ClassVar[CostModel] = HYBRID_PIPELINE
    registered_name: ClassVar[str | None] = "hybrid_pipeline"
    compared_as: ClassVar[str | None] = "hybrid_pipeline"
    registered_description: ClassVar[str] = (
        "Pipeline stages across ranks (GPipe, 1F1B, interleaved and zero-bubble schedules) x data parallelism"
    )

    def __init__(
        self,
        pipeline_stages: int = 2,
        micro_batches: int = 4,
        schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv"] = "1f1b",
        virtual_stages: int | None = None,
        balance: Sequence[int] | Literal["parameters", "time"] = "parameters",
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        reducer: str | Reducer | None = None,
        log_pipeline_stats: bool = False,
        measure_activations: bool = False,
        ddp_comm_state: object = None,
        ddp_comm_hook: CommHook | None = None,
        ddp_comm_wrapper: Callable[[CommHook], CommHook] | None = None,
        **options: Unpack[StrategyOptions],
    ) -> None:
        super().__init__(
            config=HybridPipelineConfig(
                bucket_cap_mb=bucket_cap_mb,
                first_bucket_cap_mb=first_bucket_cap_mb,
                pipeline_stages=pipeline_stages,
                micro_batches=micro_batches,
                schedule=schedule,
                balance=balance,  # type: ignore[arg-type]  # a sequence, made a tuple by validation
                log_pipeline_stats=log_pipeline_stats,
                virtual_stages=virtual_stages,
                measure_activations=measure_activations,
            ),
            reducer=reducer,
            ddp_comm_state=ddp_comm_state,
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_wrapper=ddp_comm_wrapper,
            **options,
        )
        check_reducer_not_auto(reducer, type(self).__name__)
        self._init_runtime()

    def _init_runtime(self) -> None:
        """The collaborators and the runtime state (``layout`` and ``runner`` from setup to teardown)."""
        self.layout: Layout | None = None
        self.runner: PipelineRunner | None = None
        self.placement = StagePlacement(self.config)
        self.driver = StepDriver()
        self.checkpointer = StreamedCheckpointer()
        self.metric_groups = MetricGroups()
        self._mesh: Any = None
        self._optimizers_layout: Layout | None = None  # what the optimizers hold; kept after teardown, for checkpoints
        self._failed = False
        self._summary_callbacks: list[ModelSummaryCallback] = []  # build a PipelineSummary from setup to teardown

    # ------------------------------------------------------------------ mesh
    @property
    def data_parallel_size(self) -> int:
        """Replicas of the pipeline: ``world_size // pipeline_stages``."""
        return max(1, self.world_size // self.config.pipeline_stages)

    def _check_world(self) -> None:
        check_mesh(self.num_nodes, self.num_processes, self.config.pipeline_stages)

    @override
    def _configure_launcher(self) -> None:
        self._check_world()
        check_no_sync_batchnorm(self._layer_sync, type(self).__name__)
        super()._configure_launcher()

    @override
    def setup_distributed(self) -> None:
        self._check_world()
        super().setup_distributed()  # the gradient groups: one per stage (grad_group_ranks)
        stages, replicas = self.config.pipeline_stages, self.data_parallel_size
        self._mesh = init_device_mesh(
            self.root_device.type, (stages, replicas), mesh_dim_names=("pipeline", "data_parallel")
        )
        for name in ("pipeline", "data_parallel"):  # torch's 30 minutes otherwise, whatever `timeout` says
            time_out_as_world(self._mesh.get_group(name))

    @override
    def grad_group_ranks(self) -> list[list[int]]:
        """The replicas of each stage average together: stage ``s`` is ranks ``s * D`` to ``s * D + D - 1``."""
        replicas = self.data_parallel_size
        return [[s * replicas + d for d in range(replicas)] for s in range(self.config.pipeline_stages)]

    @override
    def bucketed_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters of this rank's stage."""
        return self._owned_parameters()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Split the data over the data-parallel replicas only: the stages of one replica see the same batches."""
        return {"num_replicas": self.data_parallel_size, "rank": self.global_rank % self.data_parallel_size}

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Check, partition and place the stage, build its runner, then (fitting) buckets and optimizers."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None and self.model is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        body_name = self._check_setup(module, fitting)
        stages = self.config.pipeline_stages
        check_whole_model_callbacks(trainer.callbacks, fitting, stages, type(self).__name__)  # type: ignore[attr-defined]
        if fitting and stages > 1:
            warn_gradient_hooks(trainer, STAGE_GRADIENTS)
        self._check_ranks_agree()  # the whole model, before it is partitioned and rank 0's weights broadcast
        finetuning = fitting and any(isinstance(c, BaseFinetuning) for c in trainer.callbacks)  # type: ignore[attr-defined]
        layout, bodies = self._place_stage(module, body_name, keep_others=finetuning)
        self.checkpointer.load_pending(module)  # a checkpoint restored before setup, into the blocks placed here
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.placement.sync_replicas(module, layout)
        self.runner = self._make_runner(layout, bodies)
        self.metric_groups.bind(module, layout.data_group)
        if fitting:  # validate/test/predict keep the optimizers of the last fit, and the layout they follow
            self._setup_training(trainer, layout)
            self._optimizers_layout = layout
        self.clip_by_norm_across(self._clip_grad_by_norm)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _check_setup(self, module: pl.LightningModule, fitting: bool) -> str:
        """Refuse what the strategy cannot run, on every rank, and start the run's checks; the body's name."""
        body_name = check_opt_in(module)
        check_automatic_optimization(module, fitting, type(self).__name__)
        body_blocks = len(getattr(module, body_name))  # an empty body gets its own error from the partition
        if fitting and body_blocks:
            self._require_trainable("use `trainer.validate` / `trainer.predict` to run the frozen model")
        check_precision(self.precision_plugin, type(self).__name__)
        self.driver.start_run(self.global_rank)
        self.placement.blocks_checked = self._failed = False
        return body_name

    def _place_stage(
        self, module: pl.LightningModule, body_name: str, keep_others: bool
    ) -> tuple[Layout, list[StageBody]]:
        """Partition the body, check its blocks on ``example_input_array`` if set, and place this rank's blocks."""
        seat = (self.global_rank, self.world_size)
        self.layout, bodies = self.placement.partition(module, body_name, self._mesh, *seat)
        example = getattr(module, "example_input_array", None)
        if is_activation(example):
            self._check_blocks(example, "`example_input_array` (the body's input)")  # else on the first batch
        devices = (self.root_device, point_to_point_device(self.root_device))
        self.placement.place(module, self.layout, seat, devices, keep_others=keep_others)
        return self.layout, bodies

    def _make_runner(self, layout: Layout, bodies: list[StageBody]) -> PipelineRunner:
        """The runner of this rank's chunks under the configured schedule."""
        config = self.config
        return PipelineRunner(
            bodies,
            layout.stage,
            config.pipeline_stages,
            layout.pipeline_group,
            self.root_device,
            config.schedule,
            config.micro_batches,
            measure_activations=config.measure_activations,
            virtual_stages=config.chunks_per_rank,
        )

    def _setup_training(self, trainer: pl.Trainer, layout: Layout) -> None:
        """The summary callbacks, the gradient buckets and this stage's share of the user's optimizers; the replicas'
        first batches to be compared (:class:`~lightning_dp_strategies.core.distinct_batches.DistinctBatches`)."""
        self._summary_callbacks = summarize_with(trainer.callbacks, self._summarize)  # type: ignore[attr-defined]
        self.distinct_batches.pending = True
        if layout.replicas > 1:
            self._build_buckets(allow_no_trainable=True)  # a stage of frozen blocks averages nothing
        self.setup_optimizers(trainer)  # the user's configure_optimizers sees the whole module, as on one device
        self._follow_user_changes(owned={id(p) for _, p in self._owned_parameters()})

    @override
    def model_to_device(self) -> None:
        """Move the module to this rank's device; other stages' blocks, never built here, stay on the meta device."""
        assert self.model is not None
        device = self.root_device
        self.model._apply(lambda t: t if t.is_meta else t.to(device))

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """``trainer.init_module(empty_init=True)`` builds the module on the meta device: each stage then allocates
        and initializes only its own blocks at setup."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    def _summarize(
        self, callback: ModelSummaryCallback, trainer: pl.Trainer, module: pl.LightningModule
    ) -> ModelSummary:
        """What each Lightning ``ModelSummary`` callback builds from setup to teardown (see :func:`stage_summary`)."""
        return stage_summary(callback, trainer, module, self.layout, self.root_device)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Finish the save the model's ``state_dict`` began: rank 0 streams the file as the other stages send."""
        # `atomic_write` is looked up in this module on every save: tests wrap it to see the files each rank writes
        checkpoint = stored_under_plugin_name(checkpoint, self.precision_plugin)
        self._finish_save(checkpoint, filepath, storage_options, atomic_write)

    # ------------------------------------------------------------------ teardown: the whole module again
    def _return_to_rank_zero(self) -> None:
        """After a run, rank 0 gets the whole model back if it held it at setup; the other ranks keep their stage."""
        module, layout = self.lightning_module, self.layout
        if module is None or layout is None:
            return
        devices = (self.root_device, point_to_point_device(self.root_device))
        self.placement.return_to_rank_zero(module, layout, self.global_rank, devices, self._failed)
        self.layout = None

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        self.driver.abort()
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        restore_summaries(self._summary_callbacks)
        self._summary_callbacks = []
        self.metric_groups.restore()
        self._return_to_rank_zero()
        self.runner = None
        self.driver.reset()
        self.checkpointer.pending = {}
        with cpu_keeps_meta(self.lightning_module):
            super().teardown()  # closes the buckets and reducer, destroys the gradient groups
        # every fit/validate/predict makes a fresh mesh: repeated calls in one process must not pile groups up
        if self._mesh is not None:
            destroy_groups([self._mesh.get_group(name) for name in ("pipeline", "data_parallel")])
        self._mesh = None
