"""Where a rank sits in the ``pipeline_stages x data_parallel`` mesh and which blocks and state it owns."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from lightning_dp_strategies.pipeline import stage_ranges

__all__ = ["Layout", "prefix_of"]


@dataclass
class Layout:
    """Where this rank sits and what it holds; built at setup."""

    stage: int
    replica: int
    replicas: int
    pipeline_group: dist.ProcessGroup
    data_group: dist.ProcessGroup
    body_name: str
    blocks: list[nn.Module]
    balance: list[int]
    full_keys: list[str]  # the whole module's state_dict keys, in order
    param_order: list[str]  # the whole module's parameter names, in order
    body_prefix: str = ""

    @property
    def local_blocks(self) -> range:
        return stage_ranges(self.balance)[self.stage]

    @property
    def is_last(self) -> bool:
        return self.stage == len(self.balance) - 1

    def owns(self, name: str) -> bool:
        """Whether this stage holds the authoritative value of state ``name`` (body keys: its blocks; others: last)."""
        if name.startswith(self.body_prefix):
            block = int(name[len(self.body_prefix) :].split(".", 1)[0])
            return block in self.local_blocks
        return self.is_last


def prefix_of(module: nn.Module, body: nn.Module) -> str:
    for name, sub in module.named_modules():
        if sub is body:
            return f"{name}."
    raise AssertionError("the body is not a submodule")  # pragma: no cover
