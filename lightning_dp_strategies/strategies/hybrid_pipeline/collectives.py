"""Lightning's collectives under the pipeline mesh: values over the data-parallel group, votes over every rank.

The stages of one replica hold the same logged values and metrics (every stage receives the last stage's output), so
the ``D`` replicas are the data-parallel ranks of a one-process-per-replica run: values reduce and gather over them
(:func:`data_group_or`, torchmetrics through :class:`MetricGroups`), decisions go over every rank (:func:`vote`).
Whether the stages of each replica read the same batch is checked over every rank too (:func:`check_same_targets`).
See docs/strategies/hybrid_pipeline.md.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_dp_strategies.core.distinct_batches import gather_world, tensor_digest as target_digest
from lightning_dp_strategies.pipeline.layout import Layout

__all__ = ["MetricGroups", "check_same_targets", "data_group_or", "point_to_point_device", "target_digest", "vote"]


def data_group_or(group: Any | None, layout: Layout | None) -> Any | None:
    """The group a value collective runs over: ``group`` if given, else this stage's data-parallel group.

    Args:
        group: the group the caller named, or ``None``.
        layout: this rank's place in the mesh (``None`` outside a run: the default group is used).

    Returns:
        ``group``, or the layout's data-parallel group when ``group`` is ``None`` and a layout is set.

    Examples:
        >>> data_group_or("mine", None), data_group_or(None, None)
        ('mine', None)
    """
    if group is None and layout is not None:
        return layout.data_group
    return group


def vote(decision: bool, require_all: bool, world_size: int, device: torch.device) -> bool:
    """A decision voted over every rank (every stage of every replica).

    Args:
        decision: this rank's decision.
        require_all: ``True``: holds when every rank decides ``True``; ``False``: when any rank does.
        world_size: the number of ranks.
        device: where the vote's tensor lives (the backend's device).

    Returns:
        The outcome of the vote, the same on every rank; ``decision`` itself outside a multi-process run.

    Examples:
        >>> vote(True, require_all=True, world_size=1, device=torch.device("cpu"))
        True
    """
    if not dist.is_initialized() or world_size == 1:
        return decision
    votes = torch.tensor(int(decision), device=device)
    dist.all_reduce(votes, op=dist.ReduceOp.SUM)
    return bool(votes == world_size) if require_all else bool(votes)


def check_same_targets(target: torch.Tensor | None, layout: Layout, device: torch.device, where: str) -> None:
    """Raise on every rank when the stages of one replica hold different targets for the same step.

    The first stage trains on a batch's inputs and the last stage on its targets, each from its own DataLoader;
    stages that read different batches would train every input against another sample's target, silently. The
    digests of every rank's target are gathered over all ranks, so every rank sees every replica and raises alike.

    Args:
        target: this rank's target for the step; ``None`` for a batch with no target (counts as a digest of 0).
        layout: this rank's place in the mesh (rank ``r`` is stage ``r // D`` of replica ``r % D``).
        device: where the gathered digests live (the backend's device).
        where: the step, named in the error.
    """
    if layout.stages == 1 or not dist.is_initialized():
        return
    mine = torch.tensor([0 if target is None else target_digest(target)], dtype=torch.int64, device=device)
    digests = [int(d) for d in gather_world(mine).reshape(-1).tolist()]
    replicas = layout.replicas
    for replica in range(replicas):
        ranks = list(range(replica, len(digests), replicas))
        differ = [r for r in ranks[1:] if digests[r] != digests[ranks[0]]]
        if differ:
            raise RuntimeError(
                f"The stages of one pipeline read different batches: at {where}, rank {ranks[0]} (stage 0 of replica "
                f"{replica}) and rank {differ[0]} (stage {differ[0] // replicas}) hold different targets. The first "
                "stage trains on a batch's inputs and the last on its targets, so every stage of a replica must load "
                f"the same batches. {_sharding_fix(replicas, len(digests))}"
            )


def _sharding_fix(replicas: int, world_size: int) -> str:
    """How to give every stage of a replica the same batches, for the error of :func:`check_same_targets`."""
    if replicas == 1:
        shard = f"every rank reads the loader whole: drop the sampler that splits it over the {world_size} processes"
    else:
        shard = (
            f"shard the data over the {replicas} data-parallel replicas, not the {world_size} processes: "
            f"`DistributedSampler(dataset, num_replicas={replicas}, rank=trainer.global_rank % {replicas})`"
        )
    return (
        "Build the dataset alike on every rank (random data from a seeded generator). With "
        f"`use_distributed_sampler=False`, {shard}, and shuffle, if at all, with the same seed on every rank; or "
        "leave `use_distributed_sampler=True`, whose sampler does this."
    )


def point_to_point_device(root_device: torch.device) -> torch.device:
    """Where point-to-point tensors travel: the CPU on gloo, this rank's device otherwise.

    Args:
        root_device: this rank's device.

    Returns:
        The device a tensor is sent from and received on.
    """
    if dist.is_initialized() and dist.get_backend() == "gloo":
        return torch.device("cpu")
    return root_device


class MetricGroups:
    """The torchmetrics of the module synchronise over the data-parallel group from setup to teardown.

    The stages of a replica hold equal metric states, so a metric counts each replica once.

    Examples:
        >>> groups = MetricGroups()
        >>> groups.bind(nn.Linear(1, 1), group=None)  # no metric inside: nothing to bind
        >>> groups.restore()
    """

    def __init__(self) -> None:
        self._saved: list[tuple[Any, Any]] = []

    def bind(self, module: nn.Module, group: Any) -> None:
        """Make every torchmetrics ``Metric`` inside ``module`` sync over ``group``; their own groups are kept.

        Args:
            module: the LightningModule.
            group: the data-parallel group of this rank's stage.
        """
        try:
            from torchmetrics import Metric
        except ImportError:  # pragma: no cover - torchmetrics comes with Lightning
            return
        for sub in module.modules():
            if isinstance(sub, Metric):
                self._saved.append((sub, sub.process_group))
                sub.process_group = group

    def restore(self) -> None:
        """Give every metric :meth:`bind` changed its own group back."""
        for metric, group in self._saved:
            metric.process_group = group
        self._saved = []
