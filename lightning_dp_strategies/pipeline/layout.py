"""Where a rank sits in the ``pipeline_stages x data_parallel`` mesh, which blocks and state it owns, and its stage."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from lightning_dp_strategies.pipeline.activations import from_args
from lightning_dp_strategies.pipeline.partition import stage_ranges
from lightning_dp_strategies.plan.sizing import divisors

__all__ = ["Layout", "StageBody", "check_mesh", "prefix_of"]


def check_mesh(nodes: int, devices: int, stages: int) -> None:
    """Raise, naming device counts that work, unless ``stages`` divides the world (``nodes x devices``).

    Examples:
        >>> check_mesh(1, 3, 2)
        Traceback (most recent call last):
        ...
        ValueError: The world size 3 (devices x nodes) is not divisible by pipeline_stages=2: the ranks form a \
pipeline_stages x data_parallel grid. Use devices=2 or 4, or pipeline_stages in [1, 3].
    """
    world_size = nodes * devices
    if world_size % stages == 0:
        return
    step = stages // math.gcd(stages, nodes)  # devices per node must be a multiple of it
    options = sorted({step * max(1, devices // step), step * (devices // step + 1)})
    per_node = f" per node ({nodes} nodes)" if nodes > 1 else ""
    raise ValueError(
        f"The world size {world_size} (devices x nodes) is not divisible by pipeline_stages={stages}: the ranks form "
        f"a pipeline_stages x data_parallel grid. Use devices={' or '.join(map(str, options))}{per_node}, or "
        f"pipeline_stages in {divisors(world_size)}."
    )


@dataclass
class Layout:
    """Where this rank sits and what it holds; built at setup.

    The body is cut into ``len(balance)`` contiguous chunks; chunk ``c`` runs on pipeline rank (stage)
    ``chunk_ranks[c]`` (one chunk per stage unless a schedule interleaves several per rank)."""

    stage: int
    replica: int
    replicas: int
    pipeline_group: dist.ProcessGroup
    data_group: dist.ProcessGroup
    body_name: str
    balance: list[int]  # blocks per chunk, in body order
    full_keys: list[str]  # the whole module's state_dict keys, in order
    param_order: list[str]  # the whole module's parameter names, in order
    body_prefix: str = ""
    chunk_ranks: list[int] | None = None  # the stage of each chunk; None: chunk c on stage c

    @property
    def ranks(self) -> list[int]:
        return list(range(len(self.balance))) if self.chunk_ranks is None else self.chunk_ranks

    @property
    def stages(self) -> int:
        """Pipeline stages (ranks of a replica)."""
        return max(self.ranks) + 1

    @property
    def chunks(self) -> list[int]:
        """The chunks this stage runs, in body order."""
        return [c for c, rank in enumerate(self.ranks) if rank == self.stage]

    def chunk_blocks(self, chunk: int) -> range:
        return stage_ranges(self.balance)[chunk]

    @cached_property
    def local_blocks(self) -> list[int]:
        """The blocks of this stage's chunks."""
        return [i for c in self.chunks for i in self.chunk_blocks(c)]

    def block_stage(self, block: int) -> int:
        """The stage that runs block ``block``."""
        for chunk, blocks in enumerate(stage_ranges(self.balance)):
            if block in blocks:
                return self.ranks[chunk]
        raise IndexError(block)

    @property
    def last_stage(self) -> int:
        """The stage running the last chunk: it computes the loss and owns the state outside the body."""
        return self.ranks[-1]

    @property
    def is_last(self) -> bool:
        return self.stage == self.last_stage

    def owns(self, name: str) -> bool:
        """Whether this stage holds the authoritative value of state ``name`` (body keys: its blocks; others: the
        stage of the last chunk)."""
        if name.startswith(self.body_prefix):
            block = int(name[len(self.body_prefix) :].split(".", 1)[0])
            return block in self.local_blocks
        return self.is_last


class StageBody(nn.Module):
    """The blocks of one stage, registered under their indices in the whole body.

    Its ``state_dict`` keys are the indices in the whole body (``2.weight``). Called with what the previous stage
    sent (one tensor, or the tensors of a tuple), it runs its blocks in order as ``nn.Sequential`` does, each block
    taking the previous block's output as its single argument.

    Examples:
        >>> body = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
        >>> stage = StageBody({1: body[1], 2: body[2]})
        >>> list(stage.state_dict())
        ['2.weight', '2.bias']
    """

    def __init__(self, blocks: Mapping[int, nn.Module]) -> None:
        super().__init__()
        for index, block in blocks.items():
            self.add_module(str(index), block)

    def forward(self, *args: Tensor) -> Any:
        x: Any = from_args(args)
        for block in self._modules.values():
            assert block is not None
            x = block(x)
        return x


def prefix_of(module: nn.Module, body: nn.Module) -> str:
    """The ``state_dict`` prefix of submodule ``body`` inside ``module`` (``"body."``)."""
    for name, sub in module.named_modules():
        if sub is body:
            return f"{name}."
    raise AssertionError("the body is not a submodule")  # pragma: no cover
