"""The LightningModule's opt-in to the pipeline (a body of blocks, a per-micro-batch loss) and the batch split."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from torch import Tensor, nn
from torch._dynamo import OptimizedModule  # as Lightning's Fabric imports it

from lightning_dp_strategies.pipeline import PipelineRunner
from lightning_dp_strategies.pipeline.activations import Activation, describe, is_activation, signature

__all__ = ["OPT_IN_EXAMPLE", "PipelinedBody", "ReplayBody", "body_replaced", "check_opt_in", "split_batch"]

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

    def __init__(self, output: Activation, inputs: Activation, name: str) -> None:
        self.output = output
        self.inputs = inputs
        self.name = name

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Activation:
        if not is_activation(x) or signature(x) != signature(self.inputs):
            raise RuntimeError(
                f"training_step called self.{self.name} on {describe(x)}, but the pipeline ran this step on the "
                f"batch's inputs, {describe(self.inputs)}. Under HybridPipelineStrategy the body runs once per step, "
                "on the inputs `pipeline_split_batch` returns (by default batch[0]); call it on those."
            )
        return self.output


class PipelinedBody:
    """Stands in for the body during evaluation: runs the forward-only pipeline and returns the last output.

    ``check`` sees every input first (the strategy checks the blocks' outputs on the first one)."""

    def __init__(self, runner: PipelineRunner, check: Callable[[Activation], None]) -> None:
        self.runner = runner
        self.check = check

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Activation:
        if not is_activation(x):
            raise TypeError(
                f"The pipelined body takes one tensor or a tuple of tensors, got {describe(x)}; call it on what "
                "`pipeline_split_batch` returns as inputs."
            )
        self.check(x)
        return self.runner.share_output(self.runner.forward(x))


@contextmanager
def body_replaced(module: nn.Module, body_name: str, stand_in: object) -> Iterator[None]:
    """Inside, ``module.<body_name>`` is ``stand_in`` (a :class:`ReplayBody` or :class:`PipelinedBody`).

    An instance attribute shadows the registered submodule for attribute access only: ``parameters()``,
    ``state_dict()`` and the hooks still see the real (partial) body.

    Examples:
        >>> module = nn.Module(); module.body = nn.Sequential()
        >>> with body_replaced(module, "body", "stand-in"):
        ...     module.body
        'stand-in'
        >>> type(module.body).__name__
        'Sequential'
    """
    module.__dict__[body_name] = stand_in
    try:
        yield
    finally:
        module.__dict__.pop(body_name, None)


def check_opt_in(module: pl.LightningModule) -> str:
    """Return the name of the body, or raise naming exactly what the module lacks."""
    name = getattr(module, "pipeline_body", None)
    problems = []
    if not isinstance(name, str):
        problems.append('a class attribute `pipeline_body = "<attribute>"` naming its nn.Sequential of blocks')
    elif isinstance(getattr(module, name, None), OptimizedModule):  # the stages are cut from the Sequential itself
        problems.append(
            f"`pipeline_body = {name!r}` to name an nn.Sequential attribute (self.{name} is a torch.compile'd "
            f"module); compile each block instead: `self.{name} = nn.Sequential(*(torch.compile(b) for b in blocks))`"
        )
    elif not isinstance(getattr(module, name, None), nn.Sequential):
        found = type(getattr(module, name, None)).__name__
        problems.append(
            f"`pipeline_body = {name!r}` to name an nn.Sequential attribute (self.{name} is a {found}); "
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


def split_batch(module: pl.LightningModule, batch: Any) -> tuple[Activation, Tensor]:
    """The batch's inputs (a tensor, or a tuple of tensors for a first block that takes a tuple) and target."""
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
    if isinstance(inputs, list):
        inputs = tuple(inputs)
    if not is_activation(inputs) or not isinstance(target, Tensor):
        raise TypeError(
            f"The pipeline takes inputs (one tensor or a tuple of tensors) and one target tensor, got "
            f"{describe(inputs)} and {describe(target)}; return those from `pipeline_split_batch`."
        )
    return inputs, target
