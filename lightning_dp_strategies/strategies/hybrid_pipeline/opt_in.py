"""The LightningModule's opt-in to the pipeline (a body of blocks, a per-micro-batch loss) and the batch split."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import Tensor, nn

from lightning_dp_strategies.pipeline import PipelineRunner

__all__ = ["OPT_IN_EXAMPLE", "PipelinedBody", "ReplayBody", "check_opt_in", "split_batch"]

OPT_IN_EXAMPLE = """
    class MyModel(L.LightningModule):
        pipeline_body = "body"                      # 1. the nn.Sequential attribute holding the blocks

        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))

        def pipeline_loss(self, output, target):    # 2. the loss of one micro-batch, on the last block's output
            return F.cross_entropy(output, target)

        def training_step(self, batch, batch_idx):  # unchanged: batch = (inputs, target)
            x, y = batch
            loss = self.pipeline_loss(self.body(x), y)
            self.log("train_loss", loss, prog_bar=True)
            return loss
"""


class ReplayBody:
    """Stands in for the body during ``training_step``: returns the output the pipeline computed for this batch."""

    def __init__(self, output: Tensor, inputs: Tensor, name: str) -> None:
        self.output = output
        self.inputs = inputs
        self.name = name

    def __call__(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if not isinstance(x, Tensor) or x.shape != self.inputs.shape:
            raise RuntimeError(
                f"training_step called self.{self.name} on {_describe(x)}, but the pipeline ran this step on the "
                f"batch's inputs of shape {tuple(self.inputs.shape)}. Under HybridPipelineStrategy the body runs "
                "once per step, on the inputs `pipeline_split_batch` returns (by default batch[0]); call it on those."
            )
        return self.output


class PipelinedBody:
    """Stands in for the body during evaluation: runs the forward-only pipeline and returns the last output."""

    def __init__(self, runner: PipelineRunner) -> None:
        self.runner = runner

    def __call__(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return self.runner.share_output(self.runner.forward(x))


def _describe(x: object) -> str:
    return f"a tensor of shape {tuple(x.shape)}" if isinstance(x, Tensor) else f"a {type(x).__name__}"


def check_opt_in(module: pl.LightningModule) -> str:
    """Return the name of the body, or raise naming exactly what the module lacks."""
    name = getattr(module, "pipeline_body", None)
    problems = []
    if not isinstance(name, str):
        problems.append('a class attribute `pipeline_body = "<attribute>"` naming its nn.Sequential of blocks')
    elif not isinstance(getattr(module, name, None), nn.Sequential):
        found = type(getattr(module, name, None)).__name__
        problems.append(
            f"`pipeline_body = {name!r}` must name an nn.Sequential attribute (self.{name} is a {found}); "
            "wrap the blocks in nn.Sequential"
        )
    if not callable(getattr(module, "pipeline_loss", None)):
        problems.append(
            "a method `pipeline_loss(self, output, target) -> Tensor`: the mean loss of one micro-batch, computed "
            "on the last block's output"
        )
    if problems:
        raise TypeError(
            f"{type(module).__name__} cannot run under HybridPipelineStrategy: it needs "
            + "; and ".join(problems)
            + ". For example:\n"
            + OPT_IN_EXAMPLE
        )
    assert isinstance(name, str)
    return name


def split_batch(module: pl.LightningModule, batch: Any) -> tuple[Tensor, Tensor]:
    split = getattr(module, "pipeline_split_batch", None)
    if callable(split):
        inputs, target = split(batch)
    elif isinstance(batch, (tuple, list)) and len(batch) >= 2:
        inputs, target = batch[0], batch[1]
    else:
        raise TypeError(
            f"HybridPipelineStrategy cannot tell the inputs from the target in a batch of type "
            f"{type(batch).__name__}: by default the batch is `(inputs, target, ...)`. Define "
            "`pipeline_split_batch(self, batch) -> (inputs, target)` on the LightningModule."
        )
    if not isinstance(inputs, Tensor) or not isinstance(target, Tensor):
        raise TypeError(
            f"The pipeline takes one input tensor and one target tensor, got {_describe(inputs)} and "
            f"{_describe(target)}; return tensors from `pipeline_split_batch`."
        )
    return inputs, target
