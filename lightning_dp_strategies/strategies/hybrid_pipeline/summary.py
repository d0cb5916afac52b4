"""Lightning's model summary of a pipelined module: the whole model's counts, and what this rank's stage owns.

Each rank holds the other stages' blocks on the meta device (shapes, no storage), so the module keeps its shape and
Lightning's counts are the whole model's. Two things differ from one device: the summary's forward pass on
``example_input_array`` cannot run blocks that have no storage, so :class:`PipelineSummary` runs it on fake tensors
(shapes and FLOPs, no memory, no compute); and a ``"Params per Device"`` column (the column Lightning's
``RichModelSummary`` also shows for DeepSpeed ZeRO-3) gives each layer's parameters that this rank's stage owns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_summary import ModelSummary, summarize
from lightning.pytorch.utilities.model_summary.model_summary import NOT_APPLICABLE, get_human_readable_count
from torch.func import functional_call
from typing_extensions import override

from lightning_dp_strategies.pipeline.layout import Layout

__all__ = ["PER_DEVICE", "PipelineSummary", "ranges", "restore_summaries", "stage_summary", "summarize_with"]

PER_DEVICE = "Params per Device"
"""The column of the parameters this rank's stage owns; ``RichModelSummary`` shows a column of this name."""

SummaryFn = Callable[[ModelSummaryCallback, "pl.Trainer", "pl.LightningModule"], ModelSummary]


def ranges(indices: Sequence[int]) -> str:
    """Sorted indices written as ranges.

    Examples:
        >>> ranges([0, 1, 2, 5, 7, 8]), ranges([3]), ranges([])
        ('0-2, 5, 7-8', '3', 'none')
    """
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs) or "none"


class PipelineSummary(ModelSummary):
    """Lightning's ``ModelSummary`` of a module whose body is cut into pipeline stages, seen from one rank.

    The totals (trainable, non-trainable, total, size in MB) count the whole model, as on one device: the other
    stages' blocks are on the meta device here, with their shapes. The ``"Params per Device"`` column counts what this
    rank's stage owns (its blocks; the parameters outside the body on the last stage). The forward pass on
    ``example_input_array`` runs on fake tensors placed on ``device``.

    Args:
        model: the LightningModule, partitioned as ``layout`` says.
        layout: where this rank sits and what it owns.
        device: the device the fake forward pass pretends to run on (the strategy's root device).
        max_depth: as Lightning's ``ModelSummary``.
    """

    def __init__(self, model: pl.LightningModule, layout: Layout, device: torch.device, max_depth: int = 1) -> None:
        self._layout = layout
        self._device = device
        super().__init__(model, max_depth)  # runs the forward pass: the layout and device are needed first

    @property
    def stage_parameters(self) -> int:
        """Parameters this rank's stage owns."""
        return sum(p.numel() for name, p in self._model.named_parameters() if self._layout.owns(name))

    @property
    def stage_line(self) -> str:
        """One line on what this rank holds, to print above the table."""
        layout = self._layout
        return (
            f"hybrid_pipeline: pipeline stage {layout.stage} of {layout.stages} on this rank: "
            f"{get_human_readable_count(self.stage_parameters).strip()} of "
            f"{get_human_readable_count(self.total_parameters).strip()} params (body blocks "
            f"{ranges(layout.local_blocks)}; column '{PER_DEVICE}'). The totals are the whole model's."
        )

    def _owned_by_layer(self) -> list[int]:
        counts = []
        for name in self._layer_summary:
            layer = self._model.get_submodule(name)
            owned = [p for n, p in layer.named_parameters(prefix=name) if self._layout.owns(n)]
            counts.append(sum(p.numel() for p in owned))
        return counts

    @override
    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        arrays = super()._get_summary_data()
        per_device = list(map(get_human_readable_count, self._owned_by_layer()))
        rows = len(arrays[0][1])
        per_device += [NOT_APPLICABLE] * (rows - len(per_device))  # the row of parameters outside any layer
        index = [name for name, _ in arrays].index("Params") + 1
        arrays.insert(index, (PER_DEVICE, per_device))
        return arrays

    @override
    def _forward_example_input(self) -> None:
        """Lightning's forward pass on ``example_input_array`` (in/out sizes, FLOPs), with every parameter and buffer
        a fake tensor: the blocks on the meta device take part, and nothing is allocated or computed."""
        from torch._subclasses.fake_tensor import (
            DataDependentOutputException,
            DynamicOutputShapeException,
            FakeTensorMode,
            UnsupportedOperatorException,
        )

        model = self._model
        trainer = model._trainer
        example = model._on_before_batch_transfer(model.example_input_array)
        example = model._apply_batch_transfer_handler(example)
        if isinstance(example, dict):
            args, kwargs = (), example
        else:
            args, kwargs = (tuple(example) if isinstance(example, (list, tuple)) else (example,)), {}
        forward_context = contextlib.nullcontext() if trainer is None else trainer.precision_plugin.forward_context()
        flops: Any = getattr(self, "_flop_counter", None) or contextlib.nullcontext()
        cuda = [self._device] if self._device.type == "cuda" else []
        modes = {sub: sub.training for sub in model.modules()}
        model.eval()
        try:
            # the flop counter is entered last, so that it sees each operation before the fake mode answers it
            with torch.random.fork_rng(devices=cuda), FakeTensorMode(allow_non_fake_inputs=True):
                state = {
                    name: torch.empty_like(t, device=self._device)
                    for name, t in [*model.named_parameters(), *model.named_buffers()]
                }
                with torch.no_grad(), forward_context, flops:
                    functional_call(model, state, args, kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException):
            pass  # an operation that depends on values: the sizes stay unknown ("?")
        finally:
            for sub, training in modes.items():
                sub.training = training


def summarize_with(callbacks: Sequence[Any], make: SummaryFn) -> list[ModelSummaryCallback]:
    """Make each ``ModelSummary`` callback (``RichModelSummary`` included) in ``callbacks`` build its summary with
    ``make(callback, trainer, module)``, and return them for :func:`restore_summaries`.

    This sets an instance attribute ``_summary`` on the callback, shadowing the method Lightning's callback calls to
    build the summary (where it picks ``DeepSpeedSummary`` for ZeRO-3); a callback that already has one is left alone.
    """
    changed = []
    for callback in callbacks:
        if isinstance(callback, ModelSummaryCallback) and "_summary" not in vars(callback):
            if callable(getattr(type(callback), "_summary", None)):
                vars(callback)["_summary"] = lambda trainer, module, callback=callback: make(callback, trainer, module)
                changed.append(callback)
    return changed


def restore_summaries(callbacks: Sequence[ModelSummaryCallback]) -> None:
    """Undo :func:`summarize_with`: the callbacks build Lightning's own summary again."""
    for callback in callbacks:
        vars(callback).pop("_summary", None)


def stage_summary(
    callback: ModelSummaryCallback,
    trainer: pl.Trainer,
    module: pl.LightningModule,
    layout: Layout | None,
    device: torch.device,
) -> ModelSummary:
    """The summary a ``ModelSummary`` callback prints at the start of ``fit`` under the pipeline strategy.

    A :class:`PipelineSummary` (the whole model's counts, this stage's share), headed on rank 0 by a line on its
    stage; Lightning's own summary outside a run.

    Args:
        callback: the ``ModelSummary`` / ``RichModelSummary`` callback (its ``max_depth`` is used).
        trainer: the Trainer.
        module: the LightningModule.
        layout: this rank's layout (``None`` outside a run).
        device: this rank's device.

    Returns:
        The summary the callback prints.
    """
    depth = getattr(callback, "_max_depth", 1)
    if layout is None:  # pragma: no cover - the callback runs between setup and teardown
        return summarize(module, max_depth=depth)
    summary = PipelineSummary(module, layout, device, max_depth=depth)
    if trainer.is_global_zero and depth:
        rank_zero_info(summary.stage_line)
    return summary
