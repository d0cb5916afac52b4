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

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, ClassVar, Literal

import fsspec
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.optimizer import _optimizer_to_device, _optimizers_to_device
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.model_summary import ModelSummary, summarize
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dp_strategies.bucketing.sync import destroy_groups
from lightning_dp_strategies.comm.failures import PEER_FAILURE_HINT, announce_failure
from lightning_dp_strategies.core.checkpoint_io import AtomicCheckpointIO, atomic_write
from lightning_dp_strategies.pipeline import (
    PipelineRunner,
    balance_by_parameters,
    balance_by_time,
    check_balance,
    check_micro_batches,
    clip_grad_norm_across,
    keep_owned_parameters,
)
from lightning_dp_strategies.pipeline.activations import Activation, batch_size, check_blocks, is_activation
from lightning_dp_strategies.pipeline.checkpoint import (
    load_stage_optimizer_state,
    load_stage_state,
    whole_model_state,
    whole_optimizer_state,
)
from lightning_dp_strategies.pipeline.layout import Layout, StageBody, check_mesh, prefix_of
from lightning_dp_strategies.pipeline.materialize import check_initializable, has_meta, materialize
from lightning_dp_strategies.pipeline.placement import release, return_to_rank_zero, share_units
from lightning_dp_strategies.pipeline.runner import PipelineStats
from lightning_dp_strategies.pipeline.schedule import chunk_ranks
from lightning_dp_strategies.pipeline.streamed import Inbox, Outbox, write_streamed
from lightning_dp_strategies.plan import HYBRID_PIPELINE, CostModel
from lightning_dp_strategies.reducers import Reducer
from lightning_dp_strategies.reducers.comm_hooks import CommHook
from lightning_dp_strategies.strategies.bucketed import BucketedDataParallel
from lightning_dp_strategies.strategies.hybrid_pipeline.config import HybridPipelineConfig
from lightning_dp_strategies.strategies.hybrid_pipeline.opt_in import (
    PipelinedBody,
    ReplayBody,
    check_opt_in,
    split_batch,
)
from lightning_dp_strategies.strategies.hybrid_pipeline.precision import global_norm_view
from lightning_dp_strategies.strategies.hybrid_pipeline.summary import (
    PipelineSummary,
    restore_summaries,
    summarize_with,
)

__all__ = ["HybridPipelineConfig", "HybridPipelineStrategy", "PipelineStats"]


class HybridPipelineStrategy(BucketedDataParallel):
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
        nonfinite_grads: check the reduced gradients for NaN/Inf before each optimizer step: ``None`` (no check,
            the default), ``"skip"`` (skip the step on every rank alike, counted in ``nonfinite.skipped_steps``) or
            ``"raise"`` (``FloatingPointError`` on every rank).
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; ``None`` picks by device.
        timeout: collective timeout (``timedelta`` or seconds); ``None`` is 5 minutes on gloo, 30 on NCCL.
        start_method: ``"popen"`` (default), ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        ddp_comm_hook: a torch DDP communication hook ``hook(state, bucket) -> Future`` (``allreduce_hook``,
            ``fp16_compress_hook``, ``powerSGD_hook``, ...) that averages the replicas' buckets instead of
            ``reducer``, on any device and backend, CPU/gloo included (see :mod:`lightning_dp_strategies.comm_hooks`).
        ddp_comm_state: the hook's ``state`` (e.g. ``PowerSGDState``); ``None`` gives it the gradient group.
        ddp_comm_wrapper: applied once as ``ddp_comm_wrapper(ddp_comm_hook)`` (e.g. ``fp16_compress_wrapper``).

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
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[Any] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        reducer: str | Reducer | None = None,
        log_pipeline_stats: bool = False,
        measure_activations: bool = False,
        nonfinite_grads: Literal["skip", "raise"] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        ddp_comm_state: object = None,
        ddp_comm_hook: CommHook | None = None,
        ddp_comm_wrapper: Callable[[CommHook], CommHook] | None = None,
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
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            reducer=reducer,
            nonfinite_grads=nonfinite_grads,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            ddp_comm_state=ddp_comm_state,
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_wrapper=ddp_comm_wrapper,
        )
        # runtime state (step_stats: gradient communication over this stage's data-parallel group)
        self.layout: Layout | None = None
        self._optimizers_layout: Layout | None = None  # what the optimizers hold; kept after teardown, for checkpoints
        self.runner: PipelineRunner | None = None
        self._mesh: Any = None
        self._pending: dict[nn.Parameter, Tensor | None] = {}
        self._reducing = False  # the buckets took this step's gradients during the schedule; backward waits for them
        self._zero_grad_follows = True  # Lightning zeroes gradients between this step's training_step and backward
        self._batch_checked = False
        self._blocks_checked = False
        self._owned_ids: set[int] = set()
        self._trainable: tuple[bool, ...] | None = None  # requires_grad of the body's parameters, as the stages know it
        self._warned_loss = False
        self._failed = False
        self._trained = False
        self._metric_groups: list[tuple[Any, Any]] = []
        self._stage_bodies: list[StageBody] = []  # this stage's chunks of blocks, what the runner runs
        self._whole_on_rank_zero = False  # rank 0 held the whole model at setup: it gets it back at teardown
        self._outbox = Outbox()  # this stage's tensors for the checkpoint being saved (replica 0, stages > 0)
        self._inbox = Inbox()  # on rank 0: the stand-ins of the other stages' tensors in that checkpoint
        self._precision_view: Precision | None = None
        self._summary_callbacks: list[ModelSummaryCallback] = []  # build a PipelineSummary from setup to teardown
        # statistics
        self._p2p_since_step = [0, 0]  # bytes sent to and received from neighbouring stages since the last step
        self.pipeline_stats = PipelineStats()
        """Bubble and timing of this rank's pipeline steps."""

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
        if self._layer_sync is not None:
            raise ValueError(
                f"`sync_batchnorm=True` is not supported by {type(self).__name__}: a stage's BatchNorm layers run "
                "micro-batch by micro-batch inside the pipeline schedule, with no synchronisation across replicas. "
                "Drop `sync_batchnorm=True` (each micro-batch then uses its own statistics), or use "
                "strategy='ring_allreduce'."
            )
        super()._configure_launcher()

    @override
    def setup_distributed(self) -> None:
        self._check_world()
        super().setup_distributed()  # the gradient groups: one per stage (grad_group_ranks)
        stages, replicas = self.config.pipeline_stages, self.data_parallel_size
        self._mesh = init_device_mesh(
            self.root_device.type, (stages, replicas), mesh_dim_names=("pipeline", "data_parallel")
        )

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
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None and self.model is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        body_name = check_opt_in(module)
        if fitting and not module.automatic_optimization:
            raise ValueError(
                f"{type(self).__name__} supports automatic optimization only: the pipeline schedule runs backward "
                "itself, micro-batch by micro-batch, so `manual_backward` has nothing to do. Remove "
                "`self.automatic_optimization = False` (Lightning then clips and steps), or use "
                "strategy='ring_allreduce'."
            )
        body_blocks = len(getattr(module, body_name))  # an empty body gets its own error from the partition
        if fitting and body_blocks:
            self._require_trainable("use `trainer.validate` / `trainer.predict` to run the frozen model")
        if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None:
            raise ValueError(
                f"{type(self).__name__} does not support precision='16-mixed': its loss scaling would have to run "
                "inside the pipeline schedule. Use precision='bf16-mixed' or '32-true'."
            )
        self._batch_checked = self._blocks_checked = self._trained = self._failed = False
        self._trainable = None
        self._check_ranks_agree()  # the whole model, before it is partitioned and rank 0's weights broadcast
        self._partition(module, body_name)
        example = getattr(module, "example_input_array", None)
        if is_activation(example):
            self._check_blocks(example, "`example_input_array` (the body's input)")  # else on the first batch
        self._place_blocks(module, body_name, keep_others=fitting and self._finetuning(trainer))
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._sync_replicas()
        layout = self.layout
        assert layout is not None and self._stage_bodies
        self.runner = PipelineRunner(
            self._stage_bodies,
            layout.stage,
            self.config.pipeline_stages,
            layout.pipeline_group,
            self.root_device,
            self.config.schedule,
            self.config.micro_batches,
            measure_activations=self.config.measure_activations,
            virtual_stages=self.config.chunks_per_rank,
        )
        self._set_metric_groups(module)
        if fitting:
            self._summary_callbacks = summarize_with(trainer.callbacks, self._summarize)  # type: ignore[attr-defined]
            if layout.replicas > 1:
                self._build_buckets(allow_no_trainable=True)  # a stage of frozen blocks averages nothing
            self.setup_optimizers(trainer)  # the user's configure_optimizers sees the whole module, as on one device
            self._owned_ids = {id(p) for _, p in self._owned_parameters()}
            self._follow_user_changes()
        self._optimizers_layout = self.layout if fitting else None
        self._precision_view = global_norm_view(self.precision_plugin, self._clip_grad_by_norm)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _partition(self, module: pl.LightningModule, body_name: str) -> None:
        """Work out the balance and gather this stage's blocks into a :class:`StageBody` of the strategy's own.

        The module, and its ``nn.Sequential`` body, stay as they are: the blocks are shared, not moved."""
        body = getattr(module, body_name)
        blocks = list(body)
        config = self.config
        chunks = config.chunks
        if config.chunks_per_rank > 1 and 0 < len(blocks) < chunks:
            raise ValueError(
                f"schedule={config.schedule!r} cuts the body into pipeline_stages x virtual_stages = "
                f"{config.pipeline_stages} x {config.chunks_per_rank} = {chunks} chunks, but it has {len(blocks)} "
                f"blocks. Split the body into at least {chunks} blocks, lower virtual_stages (or pipeline_stages), or "
                "use schedule='1f1b'."
            )
        if isinstance(config.balance, tuple):
            balance = check_balance(config.balance, len(blocks), chunks)
        elif config.balance == "time":
            balance = self._balance_by_time(module, blocks)
        else:
            balance = balance_by_parameters(blocks, chunks)
        mesh = self._mesh
        layout = Layout(
            stage=self.global_rank // self.data_parallel_size,
            replica=self.global_rank % self.data_parallel_size,
            replicas=self.data_parallel_size,
            pipeline_group=mesh.get_group("pipeline"),
            data_group=mesh.get_group("data_parallel"),
            body_name=body_name,
            balance=balance,
            full_keys=list(module.state_dict().keys()),
            param_order=[n for n, _ in module.named_parameters()],
            body_prefix=prefix_of(module, body),
            chunk_ranks=chunk_ranks(config.schedule, config.pipeline_stages, config.chunks_per_rank),
        )
        self._stage_bodies = [StageBody({i: blocks[i] for i in layout.chunk_blocks(c)}) for c in layout.chunks]
        self.layout = layout

    @staticmethod
    def _finetuning(trainer: pl.Trainer) -> bool:
        return any(isinstance(callback, BaseFinetuning) for callback in trainer.callbacks)  # type: ignore[attr-defined]

    def _place_blocks(self, module: pl.LightningModule, body_name: str, keep_others: bool = False) -> None:
        """Give this rank the blocks of its stage and every submodule outside the body, and release the other blocks.

        A block no rank holds (built on the meta device: deferred init) is allocated and initialized by the ranks
        that need it, block ``i`` under the seed ``rank 0's torch.initial_seed() + i`` (submodules outside the body
        under ``+ len(body) + k``), so the values do not depend on the number of stages. A block another rank holds
        (after an earlier run each rank holds only its stage) is received from rank 0, or else from the rank that
        holds it. The other stages' blocks are moved to the meta device (with ``keep_others`` at teardown), and rank 0
        gets them back at teardown if it held them at setup.

        ``keep_others`` is for ``BaseFinetuning``, which compares parameters by value (``torch.equal``), something a
        meta tensor cannot do; a body built on the meta device is refused then."""
        layout = self.layout
        assert layout is not None
        body = module._modules[body_name]
        assert isinstance(body, nn.Sequential)
        outside = [child for name, child in module.named_children() if name != body_name]
        units: list[nn.Module] = [*body, *outside]
        world, replicas = self.world_size, layout.replicas
        ranges = [range(s * replicas, (s + 1) * replicas) for s in range(layout.stages)]
        owners = [set(ranges[layout.block_stage(i)]) for i in range(len(body))]
        needed_by = [*owners, *[set(range(world)) for _ in outside]]  # every stage runs training_step's replay
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        stray = [n for n, t in own if t.is_meta]
        if stray:
            raise TypeError(
                f"{type(module).__name__} holds tensors of its own ({', '.join(stray)}) on the meta device, outside "
                "any submodule, where no `reset_parameters()` can initialize them. Build them on a real device, or "
                "move them into a submodule."
            )
        if world == 1:
            nowhere = [i for i, unit in enumerate(units) if has_meta(unit)]
            self._whole_on_rank_zero = not nowhere
        else:
            shared = share_units(units, needed_by, self.root_device, self._comm_device())
            self._whole_on_rank_zero, nowhere = shared.whole_on_rank_zero, shared.nowhere
        if keep_others and nowhere:
            raise ValueError(
                "A BaseFinetuning callback compares parameters by value (`torch.equal`), which the blocks of other "
                f"stages, on the meta device, cannot do; {type(module).__name__} builds its body on the meta device. "
                "Build the body eagerly in __init__ (each rank then keeps every block while fitting), or unfreeze in "
                "the LightningModule's own hooks (`requires_grad_` on the blocks, a new group with `add_param_group`)."
            )
        # checked on every rank over every block, so that a block no stage can initialize fails on all of them
        check_initializable([(i, units[i]) for i in nowhere])
        if nowhere:
            box = [torch.initial_seed() % 2**31]
            if world > 1:
                dist.broadcast_object_list(box, src=0)
            mine = [(i, units[i]) for i in nowhere if self.global_rank in needed_by[i]]
            materialize(mine, self.root_device, seed=int(box[0]))
        if not keep_others:
            release([block for i, block in enumerate(body) if i not in layout.local_blocks])

    def _comm_device(self) -> torch.device:
        """Where point-to-point tensors travel: the CPU on gloo, this rank's device otherwise."""
        if dist.is_initialized() and dist.get_backend() == "gloo":
            return torch.device("cpu")
        return self.root_device

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

    def _balance_by_time(self, module: pl.LightningModule, blocks: list[nn.Module]) -> list[int]:
        """Rank 0 measures the blocks and every rank uses its balance (timings differ per process); rank 0's
        refusal is raised on every rank."""
        box: list[Any] = [None]
        if self.global_rank == 0:
            sample = getattr(module, "example_input_array", None)
            if any(has_meta(block) for block in blocks):
                box[0] = (
                    "balance='time' measures each block, but rank 0 holds the body on the meta device (deferred "
                    "initialization, or it was built eagerly on another rank only). Use balance='parameters' "
                    "(computed from the shapes) or an explicit list."
                )
            elif not is_activation(sample):
                box[0] = (
                    "balance='time' measures each block on `example_input_array`, which "
                    f"{type(module).__name__} does not set to a tensor or a tuple of tensors. Set "
                    "`self.example_input_array = torch.randn(batch, ...)` in __init__, or use balance='parameters' or "
                    "an explicit list."
                )
            else:
                box[0] = balance_by_time(blocks, sample, self.config.chunks)
        if self.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], str):
            raise ValueError(box[0])
        return list(box[0])

    def _check_blocks(self, inputs: Activation, source: str = "the first batch's inputs") -> None:
        """Once per run, check on fake tensors what each block of the body returns for ``inputs`` (every rank alike)."""
        module, layout = self.lightning_module, self.layout
        if self._blocks_checked or module is None or layout is None:
            return
        body = module._modules[layout.body_name]  # the real body, also while a stand-in shadows it
        assert isinstance(body, nn.Sequential)
        check_blocks(list(body), inputs, source)
        self._blocks_checked = True

    def _sync_replicas(self) -> None:
        """Every replica of a stage starts from replica 0's parameters and buffers (as DDP does from rank 0)."""
        module = self.lightning_module
        layout = self.layout
        assert module is not None and layout is not None
        if layout.replicas == 1:
            return
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if layout.owns(name):
                dist.broadcast(tensor.data, group=layout.data_group, group_src=0)

    def _owned_parameters(self) -> list[tuple[str, nn.Parameter]]:
        module, layout = self.lightning_module, self.layout
        assert module is not None and layout is not None
        return [(n, p) for n, p in module.named_parameters() if layout.owns(n)]

    def _set_metric_groups(self, module: pl.LightningModule) -> None:
        """torchmetrics on every stage sync over the data-parallel group: the stages of a replica hold equal states."""
        try:
            from torchmetrics import Metric
        except ImportError:  # pragma: no cover - torchmetrics comes with Lightning
            return
        assert self.layout is not None
        for sub in module.modules():
            if isinstance(sub, Metric):
                self._metric_groups.append((sub, sub.process_group))
                sub.process_group = self.layout.data_group

    def _summarize(
        self, callback: ModelSummaryCallback, trainer: pl.Trainer, module: pl.LightningModule
    ) -> ModelSummary:
        """The summary Lightning's ``ModelSummary`` / ``RichModelSummary`` callback prints at the start of ``fit``: a
        :class:`PipelineSummary` (the whole model's counts, this stage's share), headed by a line on this rank's stage.

        From setup to teardown, each such callback in the Trainer calls this instead of its ``_summary`` method (an
        instance attribute shadows the method, as Lightning's callback picks ``DeepSpeedSummary`` for ZeRO-3 there);
        teardown removes the attribute and the callback is as it was."""
        depth = getattr(callback, "_max_depth", 1)
        if self.layout is None:  # pragma: no cover - the callback runs between setup and teardown
            return summarize(module, max_depth=depth)
        summary = PipelineSummary(module, self.layout, self.root_device, max_depth=depth)
        if trainer.is_global_zero and depth:
            rank_zero_info(summary.stage_line)
        return summary

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """Lightning's clip-by-norm (``gradient_clip_val``) with the norm over every stage of the pipeline."""
        assert self.layout is not None
        params = list(super().precision_plugin.main_params(optimizer))
        clip_grad_norm_across(params, clip_val, group=self.layout.pipeline_group, device=self.root_device)

    @property
    @override
    def precision_plugin(self) -> Precision:
        """Lightning's precision plugin; from setup to teardown a view of it that clips by the norm over every stage.

        The view (:func:`global_norm_view`) shares the plugin's state and class; the plugin itself is not changed.
        """
        view = self.__dict__.get("_precision_view")
        return view if view is not None else super().precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        self._precision_view = None
        BucketedDataParallel.precision_plugin.fset(self, precision_plugin)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ training
    @override
    def on_train_start(self) -> None:
        loader = self.lightning_module.trainer.train_dataloader if self.lightning_module is not None else None
        batch_size = getattr(loader, "batch_size", None)
        if batch_size is None:
            batch_size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
        if isinstance(batch_size, int):
            check_micro_batches(batch_size, self.config.micro_batches, "the training DataLoader (per replica)")
            self._batch_checked = True

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None:  # Lightning's rule in _AutomaticOptimization._make_zero_grad_fn
            self._zero_grad_follows = batch_idx % trainer.accumulate_grad_batches == 0

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module, runner, layout = self.lightning_module, self.runner, self.layout
        assert module is not None and runner is not None and layout is not None
        batch = args[0] if args else kwargs["batch"]
        inputs, target = split_batch(module, batch)
        self._follow_user_changes()
        self._check_blocks(inputs)
        if not self._batch_checked:
            check_micro_batches(batch_size(inputs), self.config.micro_batches, "the first training batch")
            self._batch_checked = True
        scale = 1.0 / max(1, module.trainer.accumulate_grad_batches)
        with self.precision_plugin.train_step_context():
            result = self._run_pipeline(inputs, target, scale)
            output = runner.share_output(result.output)
            with self._body_replaced(ReplayBody(output, inputs, layout.body_name)):
                step_output = module.training_step(*args, **kwargs)
        self.pipeline_stats.record(result.stats)
        self._p2p_since_step[0] += result.stats.p2p_bytes_sent
        self._p2p_since_step[1] += result.stats.p2p_bytes_received
        if result.loss is not None:
            self._check_loss(step_output, result.loss)
        return step_output

    def _follow_user_changes(self) -> None:
        """Pick up what user code changed since the last step: parameters frozen or unfrozen, parameter groups added.

        Every rank sees the same change (the whole module is on every rank), so every stage rebuilds alike."""
        module, layout, runner = self.lightning_module, self.layout, self.runner
        assert module is not None and layout is not None and runner is not None
        body = module._modules[layout.body_name]
        assert body is not None
        trainable = tuple(p.requires_grad for p in body.parameters())
        if self._trainable is not None and trainable != self._trainable:
            runner.reset()
        self._trainable = trainable
        for optimizer in self.optimizers:  # a group added during training holds the whole model's parameters
            keep_owned_parameters(optimizer, self._owned_ids)

    def _overlap_reduction(self) -> bool:
        """Whether this step's data-parallel reduction starts inside the schedule, as each chunk's gradients become
        final: on the step that synchronises, under Lightning's own ``optimizer_zero_grad`` and backward."""
        module = self.lightning_module
        if self.buckets is None or self.grad_sync.blocked or module is None:
            return False
        trainer = module.trainer
        return not trainer.fit_loop._skip_backward and not is_overridden("optimizer_zero_grad", module)

    def _run_pipeline(self, inputs: Activation, target: Tensor, scale: float) -> Any:
        """Run the schedule; ``.grad`` is left as it was, and this step's gradients are pending (or, on a step that
        synchronises, already in the buckets, their reduction started as each chunk finished its backward)."""
        module, runner = self.lightning_module, self.runner
        assert module is not None and runner is not None
        params = [p for _, p in self._owned_parameters() if p.requires_grad]
        before = {p: p.grad for p in params}
        for p in params:
            p.grad = None
        reducing = self._overlap_reduction()
        if self.buckets is not None:
            if reducing:
                # what zero_grad is about to clear is not part of this step's gradient; the rest accumulates
                zeroed = self._optimized_ids() if self._zero_grad_follows else set()
                base = {p: grad for p, grad in before.items() if id(p) not in zeroed}
                # the buckets are about to be refilled, and .grad may be views of them: release what zero_grad clears
                before = {p: grad if id(p) not in zeroed else None for p, grad in before.items()}
                self.buckets.arm(deferred=True, base=base)
                runner.before_last_backward, runner.after_last_backward = self.buckets.accept, self.buckets.take
            else:
                self.buckets.sync_blocked = True  # per-micro-batch hooks stay silent: averaging happens in backward
        try:
            loss_fn: Callable[[Any, Tensor], Tensor] = getattr(module, "pipeline_loss")  # noqa: B009
            result = runner.train_step(inputs, target, loss_fn, scale)
            if reducing:
                assert self.buckets is not None
                self.buckets.flush()  # gradients no last backward completed (parameters outside the body)
                self._reducing = True
        except (RuntimeError, dist.DistBackendError) as error:
            if "Connection" not in str(error) and "Timed out" not in str(error) and "timeout" not in str(error):
                raise
            raise RuntimeError(
                announce_failure(
                    f"The pipeline schedule failed on rank {self.global_rank} while exchanging activations or "
                    f"gradients with a neighbouring stage: {error}\n{PEER_FAILURE_HINT}"
                )
            ) from error
        finally:
            runner.before_last_backward = runner.after_last_backward = None
            self._pending = {} if reducing else {p: p.grad for p in params}
            for p, grad in before.items():
                p.grad = grad
            if self.buckets is not None:
                self.buckets.sync_blocked = self.grad_sync.blocked
        return result

    def _optimized_ids(self) -> set[int]:
        return {id(p) for optimizer in self.optimizers for group in optimizer.param_groups for p in group["params"]}

    def _check_loss(self, step_output: Any, pipeline_loss: Tensor) -> None:
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

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Apply the gradients the schedule computed (no second autograd pass) and average them over the replicas."""
        module = self.lightning_module
        assert module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)  # on_before_backward
        self._trained = True
        if self._reducing:  # the buckets hold this step's gradients, added to what accumulated before
            assert self.buckets is not None
            self._reducing = False
            self.buckets.finish()
            return self.precision_plugin.post_backward(closure_loss, module)  # on_after_backward
        for p, grad in self._pending.items():
            if grad is None:
                continue
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.add_(grad)
        self._pending = {}
        if self.buckets is not None:
            if self.grad_sync.blocked:
                self.buckets.skip()
            else:
                self.buckets.arm()
                self.buckets.finish()
        return self.precision_plugin.post_backward(closure_loss, module)  # on_after_backward

    @override
    def _log_step(self) -> None:
        # the step's pipeline ran in Lightning's closure: every training step since the last optimizer step counts
        stats = self.step_stats.copy()
        stats.pipeline_bytes_sent, stats.pipeline_bytes_received = self._p2p_since_step
        self._p2p_since_step = [0, 0]
        self.grad_sync.step_stats = stats
        module = self.lightning_module
        if self._should_log(self.config.log_pipeline_stats) and module is not None and module.logger is not None:
            last = self.pipeline_stats.last
            metrics = {
                "pipeline/bubble": last.bubble,
                "pipeline/step_seconds": last.step_seconds,
                "pipeline/micro_batches": float(last.micro_batches),
                **self.step_stats.as_dict("comm/"),
            }
            module.logger.log_metrics(metrics, step=module.trainer.global_step)

    # ------------------------------------------------------------------ evaluation
    @contextmanager
    def _body_replaced(self, stand_in: object) -> Iterator[None]:
        module, layout = self.lightning_module, self.layout
        assert module is not None and layout is not None
        # an instance attribute shadows the registered submodule for attribute access only: parameters(),
        # state_dict() and the hooks still see the real (partial) body
        module.__dict__[layout.body_name] = stand_in
        try:
            yield
        finally:
            module.__dict__.pop(layout.body_name, None)

    def _evaluate(self, hook: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        module, runner = self.lightning_module, self.runner
        assert module is not None and runner is not None
        with context, self._body_replaced(PipelinedBody(runner, self._check_blocks)):
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

    # ------------------------------------------------------------------ decisions across ranks
    # The stages of one replica hold the same logged values and metrics (every stage receives the last stage's output),
    # so the D replicas are the data-parallel ranks of a one-process-per-replica run: values reduce and gather over
    # them, decisions and objects go over every rank. See docs/strategies/hybrid_pipeline.md.

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """Reduce over the data-parallel group (``self.log(..., sync_dist=True)``): each replica's value counts once."""
        if group is None and self.layout is not None:
            group = self.layout.data_group
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Gather over the data-parallel group: a leading dimension of ``data_parallel`` replicas, each once."""
        if group is None and self.layout is not None:
            group = self.layout.data_group
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Vote over every rank: ``all=True`` holds when every rank decides ``True``, ``all=False`` when any does."""
        if not dist.is_initialized() or self.world_size == 1:
            return decision
        votes = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(votes, op=dist.ReduceOp.SUM)
        return bool(votes == self.world_size) if all else bool(votes)

    # ------------------------------------------------------------------ checkpoints: the whole model
    def _saving_layout(self) -> Layout | None:
        """The layout the stages' tensors follow: this run's, or after ``fit`` the last fit's (each rank still holds
        its stage's blocks and optimizer state); ``None`` when one rank holds everything."""
        layout = self.layout or (self._optimizers_layout if dist.is_initialized() else None)
        return None if layout is None or self.config.pipeline_stages == 1 else layout

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model's ``state_dict`` on rank 0, this stage's part elsewhere.

        During a run (and after ``fit`` for a module built on the meta device) the other stages' tensors are meta
        stand-ins on rank 0, filled in by :meth:`save_checkpoint` as the file is written; after ``fit`` rank 0 holds
        an eagerly built module whole and returns its own ``state_dict``. A collective: every rank calls it, as
        Lightning's ``trainer.save_checkpoint`` does."""
        module = self.lightning_module
        assert module is not None
        self._outbox, self._inbox = Outbox(), Inbox()
        layout = self._saving_layout()
        if layout is None or (self.layout is None and self._whole_on_rank_zero):
            # every rank raises alike: after an eager fit only ranks other than 0 hold meta blocks, and that is fine
            if has_meta(module) and (self.is_global_zero or not self._whole_on_rank_zero):
                raise RuntimeError(
                    f"{type(module).__name__} has blocks on the meta device on rank 0 and no run of this strategy "
                    "holds the others, so there is no whole model to save. Save during or after `fit` with this "
                    "strategy, or load the trained state first."
                )
            return module.state_dict()
        return whole_model_state(module, layout, self._outbox, self._inbox)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The whole model's optimizer state on rank 0, numbered as a single-device optimizer over the module (the
        other stages' tensors as stand-ins, as in :meth:`lightning_module_state_dict`). Also after ``fit``, when
        each stage's optimizer still holds only its own parameters; a collective, like it."""
        layout = self._saving_layout()
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        module = self.lightning_module
        if layout is None or module is None:
            return optimizer.state_dict()
        whole = whole_optimizer_state(optimizer, module, layout, self._outbox, self._inbox)
        return optimizer.state_dict() if whole is None else whole

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Rank 0 writes the checkpoint while the other stages of replica 0 send their tensors one at a time.

        With the default ``AtomicCheckpointIO`` and a local path the file is streamed (no rank holds more than its
        own stage and one tensor in flight); any other ``checkpoint_io`` receives the whole checkpoint on rank 0 first.
        """
        outbox, inbox = self._outbox, self._inbox
        self._outbox, self._inbox = Outbox(), Inbox()
        device = self._comm_device()
        if not self.is_global_zero:
            outbox.send(lambda tensor: dist.send(tensor.to(device), dst=0))
            return
        if not len(inbox):
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return

        def receive(src: int, buffer: Tensor) -> None:
            dist.recv(buffer, src=src)

        try:
            streams = type(self.checkpoint_io) is AtomicCheckpointIO and storage_options is None
            if streams and fsspec.utils.get_protocol(str(filepath)) == "file":
                atomic_write(filepath, lambda file: write_streamed(checkpoint, file, inbox, receive, device))
            else:
                self.checkpoint_io.save_checkpoint(inbox.fill(checkpoint, receive, device), filepath, storage_options)
        finally:
            inbox.drain(receive, device)  # after a failure: no sender is left waiting

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load a whole-model ``state_dict`` (from any strategy or a single device); each stage takes its part."""
        module, layout = self.lightning_module, self.layout
        assert module is not None
        if layout is None:
            module.load_state_dict(checkpoint["state_dict"], strict=strict)
            return
        load_stage_state(module, layout, checkpoint["state_dict"], strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        module, layout = self.lightning_module, self.layout
        if layout is None or module is None or self.config.pipeline_stages == 1:
            super().load_optimizer_state_dict(checkpoint)
            return
        for optimizer, full in zip(self.optimizers, checkpoint["optimizer_states"], strict=False):
            load_stage_optimizer_state(optimizer, module, layout, full)
            _optimizer_to_device(optimizer, self.root_device)

    # ------------------------------------------------------------------ teardown: the whole module again
    def _return_to_rank_zero(self) -> None:
        """After a run, rank 0 receives what the other stages hold (their blocks, and the state outside the body that
        the last stage owns) if it held the whole model at setup; the other ranks keep their own stage."""
        module, layout = self.lightning_module, self.layout
        if module is None or layout is None:
            return
        whole = self._whole_on_rank_zero and not self._failed and dist.is_initialized()
        if whole and self.config.pipeline_stages > 1:
            body = module._modules[layout.body_name]
            assert isinstance(body, nn.Sequential)
            last = layout.last_stage * layout.replicas
            outside = [child for name, child in module.named_children() if name != layout.body_name]
            direct = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            units: list[Any] = [*body, *outside, direct]
            owners = [layout.block_stage(i) * layout.replicas for i in range(len(body))]
            owners += [last] * (len(outside) + 1)
            return_to_rank_zero(units, owners, self.root_device, self._comm_device())
        if self.global_rank != 0:  # blocks kept for BaseFinetuning: the other stages trained them, these are stale
            body = module._modules[layout.body_name]
            assert isinstance(body, nn.Sequential)
            release([block for i, block in enumerate(body) if i not in layout.local_blocks])
        self._stage_bodies = []
        self.layout = None

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed, self._reducing = True, False
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self._precision_view = None
        restore_summaries(self._summary_callbacks)
        self._summary_callbacks = []
        for metric, group in self._metric_groups:
            metric.process_group = group
        self._metric_groups = []
        self._return_to_rank_zero()
        self.runner = None
        self._pending, self._reducing = {}, False
        module = self.lightning_module
        shadowed = module if module is not None and has_meta(module) and "cpu" not in module.__dict__ else None
        if shadowed is not None:
            # Lightning's teardown calls module.cpu(), which cannot copy a meta tensor: for that call only, an instance
            # attribute (removed right after) moves what has storage and leaves the other stages' blocks on meta
            shadowed.__dict__["cpu"] = lambda: shadowed._apply(lambda t: t if t.is_meta else t.cpu())
        try:
            super().teardown()  # closes the buckets and reducer, destroys the gradient groups
        finally:
            if shadowed is not None:
                shadowed.__dict__.pop("cpu")
        # every fit/validate/predict makes a fresh mesh: repeated calls in one process must not pile groups up
        if self._mesh is not None:
            destroy_groups([self._mesh.get_group(name) for name in ("pipeline", "data_parallel")])
        self._mesh = None
