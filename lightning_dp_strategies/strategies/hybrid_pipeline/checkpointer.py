"""The whole-model checkpoint of a pipelined run: each stage's tensors streamed to rank 0 as it writes the file.

Lightning saves in three calls: the model's ``state_dict``, each optimizer's state, then ``save_checkpoint``. A save
is one :class:`PipelineSave` from :meth:`StreamedCheckpointer.begin` (at the model's ``state_dict``) to
:meth:`StreamedCheckpointer.finish` (at ``save_checkpoint``)::

    begin ──▶ model_state ──▶ optimizer_state (each) ──▶ finish: stages > 0 send, rank 0 writes as tensors arrive
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import fsspec
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dp_strategies.core.checkpoint_io import AtomicCheckpointIO, atomic_write
from lightning_dp_strategies.pipeline.checkpoint import (
    load_stage_optimizer_state,
    load_stage_state,
    whole_model_state,
    whole_optimizer_state,
)
from lightning_dp_strategies.pipeline.layout import Layout
from lightning_dp_strategies.pipeline.materialize import has_meta
from lightning_dp_strategies.pipeline.streamed import Inbox, Outbox, write_streamed
from lightning_dp_strategies.strategies.bucketed import BucketedDataParallel
from lightning_dp_strategies.strategies.hybrid_pipeline.collectives import point_to_point_device
from lightning_dp_strategies.strategies.hybrid_pipeline.config import HybridPipelineConfig
from lightning_dp_strategies.strategies.hybrid_pipeline.placement import StagePlacement

__all__ = ["PipelineSave", "StreamedCheckpointer", "StreamedCheckpoints"]


def _check_optimizer_of(optimizer: Optimizer, module: nn.Module) -> None:
    """Refuse, on every rank alike, to save an optimizer over parameters that are not ``module``'s: after ``fit``, a
    ``validate``, ``test`` or ``predict`` of another module leaves the strategy holding the fit's optimizers."""
    own = {id(p) for p in module.parameters()}
    if any(id(p) not in own for group in optimizer.param_groups for p in group["params"]):
        raise RuntimeError(
            "The optimizers are those of the module the last `fit` trained, and the trainer now runs another "
            f"{type(module).__name__}: a checkpoint of the two could not be resumed. Save the checkpoint before "
            "running another module, or `fit` that module first."
        )


@dataclass
class PipelineSave:
    """One checkpoint being saved: what this stage sends (``outbox``) and, on rank 0, what it waits for (``inbox``)."""

    outbox: Outbox = field(default_factory=Outbox)
    inbox: Inbox = field(default_factory=Inbox)
    group_names: list[list[list[str]]] = field(default_factory=list)
    """On rank 0, per optimizer saved, per parameter group, the whole model's names of its parameters."""


AtomicWrite = Callable[[Any, Callable[[IO[bytes]], None]], None]
"""``write(path, fill)``: ``fill`` writes the file's bytes; the file appears at ``path`` only once complete."""


def _receive(src: int, buffer: Tensor) -> None:
    """Fill ``buffer`` with the next tensor rank ``src`` sends."""
    dist.recv(buffer, src=src)


def _whole_finetuning_groups(checkpoint: dict[str, Any], group_names: list[list[list[str]]]) -> None:
    """Give the parameter groups a ``BaseFinetuning`` callback recorded (by name, to restore them when a fit resumes)
    the whole model's parameters, as the saved optimizer state has them: on rank 0 it recorded its stage's. Each state
    is replaced in ``checkpoint``, not changed (it is the callback's own).

    Examples:
        >>> metadata = {0: [{"lr": 0.1, "params": ["a"]}]}
        >>> checkpoint = {"callbacks": {"Unfreeze": {"internal_optimizer_metadata": metadata}}}
        >>> _whole_finetuning_groups(checkpoint, [[["a", "b"]]])
        >>> checkpoint["callbacks"]["Unfreeze"]["internal_optimizer_metadata"], metadata
        ({0: [{'lr': 0.1, 'params': ['a', 'b']}]}, {0: [{'lr': 0.1, 'params': ['a']}]})
    """
    callbacks = checkpoint.get("callbacks") or {}
    for key, state in list(callbacks.items()):
        recorded = state.get("internal_optimizer_metadata") if isinstance(state, dict) else None
        if isinstance(recorded, dict):
            whole = {index: _whole_groups(groups, group_names, index) for index, groups in recorded.items()}
            callbacks[key] = {**state, "internal_optimizer_metadata": whole}


def _whole_groups(groups: list[dict[str, Any]], group_names: list[list[list[str]]], index: Any) -> list[dict[str, Any]]:
    """``groups`` (optimizer ``index``'s, as recorded) with the whole model's names of each group, where each group's
    recorded names are among them; as they are otherwise."""
    names = group_names[index] if isinstance(index, int) and 0 <= index < len(group_names) else []
    if len(names) != len(groups) or any(not set(g["params"]) <= set(n) for g, n in zip(groups, names, strict=True)):
        return groups
    return [{**group, "params": list(n)} for group, n in zip(groups, names, strict=True)]


class StreamedCheckpointer:
    """Saves and loads the whole model while each rank holds only its stage.

    Examples:
        >>> checkpointer = StreamedCheckpointer()
        >>> save = checkpointer.begin()
        >>> checkpointer.current is save, len(save.inbox)
        (True, 0)
    """

    def __init__(self) -> None:
        self.current = PipelineSave()
        """The save in progress (a fresh one between saves): what ``optimizer_state`` describes into."""
        self.pending: dict[str, Any] = {}
        """Entries of a checkpoint loaded before setup whose tensors were on the meta device then (:meth:`load_pending`
        loads them once the stage has its blocks)."""

    # ------------------------------------------------------------------ save
    def begin(self) -> PipelineSave:
        """Start a checkpoint: whatever an unfinished save described is dropped.

        Returns:
            The new save in progress.
        """
        self.current = PipelineSave()
        return self.current

    def model_state(
        self, module: nn.Module, layout: Layout | None, whole_on_rank_zero: bool, during_run: bool, rank_zero: bool
    ) -> dict[str, Any]:
        """Begin a save and give the whole model's ``state_dict`` on rank 0, this stage's part elsewhere.

        Args:
            module: the LightningModule.
            layout: the layout the stages' tensors follow, ``None`` when one rank holds everything.
            whole_on_rank_zero: rank 0 held the whole model at setup (and got it back after ``fit``).
            during_run: a run of the strategy is under way (between setup and teardown).
            rank_zero: this is global rank 0.

        Returns:
            The ``state_dict``; on rank 0 the other stages' tensors are stand-ins that :meth:`finish` fills in.
        """
        save = self.begin()
        if layout is None or (not during_run and whole_on_rank_zero):
            # every rank raises alike: after an eager fit only ranks other than 0 hold meta blocks, and that is fine
            if has_meta(module) and (rank_zero or not whole_on_rank_zero):
                raise RuntimeError(
                    f"{type(module).__name__} has blocks on the meta device on rank 0 and no run of this strategy "
                    "holds the others, so there is no whole model to save. Save during or after `fit` with this "
                    "strategy, or load the trained state first."
                )
            return module.state_dict()
        return whole_model_state(module, layout, save.outbox, save.inbox)

    def optimizer_state(self, optimizer: Optimizer, module: nn.Module | None, layout: Layout | None) -> dict[str, Any]:
        """The whole model's optimizer state on rank 0 (stand-ins as in :meth:`model_state`), into the current save.

        Args:
            optimizer: a stage's optimizer (Lightning's wrapper or the optimizer itself).
            module: the LightningModule.
            layout: as in :meth:`model_state`.

        Returns:
            The optimizer's ``state_dict``, numbered as a single-device optimizer over the whole module.
        """
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        if layout is None or module is None:
            return optimizer.state_dict()
        _check_optimizer_of(optimizer, module)
        save = self.current
        whole = whole_optimizer_state(optimizer, module, layout, save.outbox, save.inbox)
        if whole is None:
            return optimizer.state_dict()
        save.group_names.append(whole[1])
        return whole[0]

    def finish(
        self,
        checkpoint: dict[str, Any],
        target: tuple[Any, Any | None],
        rank_zero: bool,
        device: torch.device,
        io: tuple[CheckpointIO, Callable[[], None]],
        write: AtomicWrite = atomic_write,
    ) -> None:
        """End the save in progress: the other stages send their tensors while rank 0 writes the file.

        With the default ``AtomicCheckpointIO`` and a local path the file is streamed (no rank holds more than its
        own stage and one tensor in flight); any other ``checkpoint_io`` receives the whole checkpoint first. A
        save with nothing to receive on rank 0 is written as the strategy writes any checkpoint.

        Args:
            checkpoint: the checkpoint Lightning dumped, with stand-ins.
            target: the file path and storage options.
            rank_zero: this is global rank 0, the writer.
            device: where point-to-point tensors travel.
            io: the strategy's ``checkpoint_io``, and how it saves a checkpoint with nothing to receive.
            write: ``write(path, fill)``: opens the file atomically for ``fill`` (the streamed write).
        """
        save, self.current = self.current, PipelineSave()
        if not rank_zero:
            save.outbox.send(lambda tensor: dist.send(tensor.to(device), dst=0))
            return
        _whole_finetuning_groups(checkpoint, save.group_names)
        checkpoint_io, save_plain = io
        if not len(save.inbox):
            save_plain()
            return
        filepath, storage_options = target
        try:
            streams = type(checkpoint_io) is AtomicCheckpointIO and storage_options is None
            if streams and fsspec.utils.get_protocol(str(filepath)) == "file":
                write(filepath, lambda file: write_streamed(checkpoint, file, save.inbox, _receive, device))
            else:
                checkpoint_io.save_checkpoint(save.inbox.fill(checkpoint, _receive, device), filepath, storage_options)
        finally:
            save.inbox.drain(_receive, device)  # after a failure: no sender is left waiting

    # ------------------------------------------------------------------ load
    def load_model_state(
        self, module: nn.Module, layout: Layout | None, state_dict: Mapping[str, Any], strict: bool = True
    ) -> None:
        """Load a whole-model ``state_dict`` (from any strategy or a single device); each rank takes what it holds.
        Before setup (no ``layout``), what lands on the meta device (a body built there, or the other stages' blocks
        after an earlier run) is kept for :meth:`load_pending`; during a run, the other stages' blocks are theirs.

        Args:
            module: the LightningModule.
            layout: this run's layout (``None``: before setup, the module's own keys are the whole model's).
            state_dict: the whole model's state.
            strict: as in ``nn.Module.load_state_dict``.
        """
        left = load_stage_state(module, layout, state_dict, strict)
        self.pending = left if layout is None else {}

    def load_pending(self, module: nn.Module) -> None:
        """Load the entries kept by :meth:`load_model_state` into the tensors this rank now holds (its stage's blocks,
        allocated at setup); the rest belong to other stages."""
        pending, self.pending = self.pending, {}
        if pending:
            load_stage_state(module, None, pending, strict=False)

    @staticmethod
    def load_optimizer_states(
        optimizers: Sequence[Optimizer],
        states: Sequence[Mapping[str, Any]],
        module: nn.Module,
        layout: Layout,
        device: torch.device,
    ) -> None:
        """Each stage's optimizers take their part of whole-model optimizer states, moved to ``device``.

        Args:
            optimizers: this stage's optimizers.
            states: the whole model's optimizer states, in the same order.
            module: the LightningModule.
            layout: this run's layout.
            device: this rank's device.
        """
        for optimizer, full in zip(optimizers, states, strict=False):
            load_stage_optimizer_state(optimizer, module, layout, full)
            _optimizer_to_device(optimizer, device)


class StreamedCheckpoints(BucketedDataParallel):
    """Lightning's checkpoint hooks of :class:`HybridPipelineStrategy` (mixed in ahead of its base), over its
    :class:`StreamedCheckpointer`: the model's ``state_dict`` begins a save, ``save_checkpoint`` finishes it (with
    :meth:`_finish_save`)."""

    config: HybridPipelineConfig
    layout: Layout | None
    placement: StagePlacement
    checkpointer: StreamedCheckpointer
    _optimizers_layout: Layout | None

    def _saving_layout(self) -> Layout | None:
        """The layout the stages' tensors follow: this run's, or after ``fit`` the last fit's (each rank still holds
        its stage's blocks and optimizer state); ``None`` when one rank holds everything."""
        layout = self.layout or (self._optimizers_layout if dist.is_initialized() else None)
        return None if layout is None or self.config.pipeline_stages == 1 else layout

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model's ``state_dict`` on rank 0, this stage's part elsewhere; begins a checkpoint's save.

        During a run (and after ``fit`` for a module built on the meta device) the other stages' tensors are meta
        stand-ins on rank 0, filled in by :meth:`save_checkpoint` as the file is written; after ``fit`` rank 0 holds
        an eagerly built module whole and returns its own ``state_dict``. A collective: every rank calls it, as
        Lightning's ``trainer.save_checkpoint`` does."""
        module = self.lightning_module
        assert module is not None
        whole, during_run = self.placement.whole_on_rank_zero, self.layout is not None
        return self.checkpointer.model_state(module, self._saving_layout(), whole, during_run, self.is_global_zero)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The whole model's optimizer state on rank 0, numbered as a single-device optimizer over the module (the
        other stages' tensors as stand-ins). Also after ``fit``; a collective, like the model's ``state_dict``."""
        return self.checkpointer.optimizer_state(optimizer, self.lightning_module, self._saving_layout())

    def _finish_save(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None, write: AtomicWrite
    ) -> None:
        """Rank 0 writes the checkpoint while the other stages of replica 0 send their tensors one at a time.

        With the default ``AtomicCheckpointIO`` and a local path the file is streamed (no rank holds more than its
        own stage and one tensor in flight, ``write`` opening the file); any other ``checkpoint_io`` receives the
        whole checkpoint on rank 0 first.
        """
        device = point_to_point_device(self.root_device)

        def save_plain() -> None:
            super(StreamedCheckpoints, self).save_checkpoint(checkpoint, filepath, storage_options)

        target, io = (filepath, storage_options), (self.checkpoint_io, save_plain)
        self.checkpointer.finish(checkpoint, target, self.is_global_zero, device, io, write)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load a whole-model ``state_dict`` (from any strategy or a single device): each rank loads what it holds;
        restored before setup, the stage's blocks follow once setup has allocated them
        (:meth:`StreamedCheckpointer.load_pending`)."""
        module = self.lightning_module
        assert module is not None
        self.checkpointer.load_model_state(module, self.layout, checkpoint["state_dict"], strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load whole-model optimizer states; each stage's optimizers take their part."""
        module, layout = self.lightning_module, self.layout
        if layout is None or module is None or self.config.pipeline_stages == 1:
            super().load_optimizer_state_dict(checkpoint)
            return
        states: Sequence[Mapping[str, Any]] = checkpoint["optimizer_states"]
        self.checkpointer.load_optimizer_states(self.optimizers, states, module, layout, self.root_device)
