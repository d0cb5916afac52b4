"""Post-local SGD under the Trainer: torch's ``PostLocalSGDState`` and hook, with periodic parameter averaging.

As in Lightning's ``DDPStrategy`` (which does it on CUDA only): ``ddp_comm_state=PostLocalSGDState(...)``,
``ddp_comm_hook=post_localSGD_hook`` and ``model_averaging_period=P``. The hook averages the gradients over the
world for ``start_localSGD_iter`` steps, then only inside each node (or not at all); after every optimizer step the
parameters are averaged on torch's ``PeriodicModelAverager`` schedule, here through the package's ring all-reduce
(:class:`~lightning_dp_strategies.core.averaging.PeriodicAverager`), on any device and backend. Where the state
leaves ``subgroup=None``, the intra-node groups are made at setup from the job's layout (torch would size them by
the number of CUDA devices).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dp_strategies.bucketing.sync import destroy_groups
from lightning_dp_strategies.core.averaging import FlatAverager, PeriodicAverager
from lightning_dp_strategies.core.options import ReductionOptions
from lightning_dp_strategies.reducers import resolve_reducer

__all__ = ["PeriodicModelAveraging"]


class PeriodicModelAveraging(DDPStrategy):
    """Mixed in ahead of the Lightning base: the parameter averaging of post-local SGD, when configured."""

    reduction: ReductionOptions
    _post_local_averager: PeriodicAverager | None = None
    _node_groups: list[dist.ProcessGroup] = []

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        period = self.reduction.model_averaging_period
        state = self.reduction.ddp_comm_state
        if period is None or state is None:
            return
        if getattr(state, "subgroup", None) is None:  # given back in teardown
            self._node_groups = [dist.new_group(ranks) for ranks in _nodes(self.num_nodes, self.num_processes)]
            state.subgroup = self._node_groups[self.global_rank // self.num_processes]  # type: ignore[attr-defined]
        averager = FlatAverager(resolve_reducer("ring"))
        averager.setup(None, list(range(self.world_size)), getattr(self, "_process_group_backend", None))
        warmup = int(getattr(state, "start_localSGD_iter", 0))
        self._post_local_averager = PeriodicAverager(averager, period=period, warmup_steps=warmup)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._post_local_averager is not None:
            params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            self._post_local_averager.after_step(params)
        return output

    @override
    def teardown(self) -> None:
        if self._post_local_averager is not None:
            self._post_local_averager.averager.close()
            self._post_local_averager = None
        super().teardown()
        if self._node_groups:
            self.reduction.ddp_comm_state.subgroup = None  # type: ignore[attr-defined]
            destroy_groups(self._node_groups)
            self._node_groups = []


def _nodes(nodes: int, per_node: int) -> list[list[int]]:
    """The global ranks of each node, as Lightning numbers them (``node_rank * per_node + local_rank``)."""
    return [list(range(node * per_node, (node + 1) * per_node)) for node in range(nodes)]
