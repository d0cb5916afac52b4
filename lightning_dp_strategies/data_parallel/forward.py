"""One forward call across devices as four overridable steps: scatter, replicate, parallel_apply, gather."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import Module

from lightning_dp_strategies.data_parallel.apply import parallel_apply
from lightning_dp_strategies.data_parallel.replicas import replicate
from lightning_dp_strategies.data_parallel.scatter_gather import gather, scatter

__all__ = ["ParallelForward", "ScatterGatherStats"]


@dataclass
class ScatterGatherStats:
    """What the strategy did since setup (one process, so plain counters)."""

    forward_calls: int = 0
    """Calls of the LightningModule's forward that went through scatter -> replicate -> parallel_apply -> gather."""
    replica_calls: int = 0
    """Replica forwards run, summed over those calls (``replica_calls / forward_calls`` replicas per call)."""
    last_num_replicas: int = 0
    """Replicas used by the latest call (fewer than the devices when the batch is smaller)."""


class ParallelForward:
    """One forward call across devices as four overridable steps, :meth:`scatter` -> :meth:`replicate` ->
    :meth:`parallel_apply` -> :meth:`gather` (see :meth:`parallel_forward`): what the Trainer's
    :class:`~lightning_dp_strategies.ScatterGatherStrategy` and Fabric's
    (:class:`~lightning_dp_strategies.FabricScatterGatherStrategy`) share. A strategy says
    :meth:`replica_devices` and sets ``dim`` and ``stats``.
    """

    dim: int
    """The batch dimension that inputs are split and outputs concatenated along."""
    stats: ScatterGatherStats

    def replica_devices(self) -> list[torch.device]:
        """The devices the replicas run on, the root device (where outputs are gathered) first."""
        raise NotImplementedError

    def parallel_forward(self, module: Module, /, *args: Any, **kwargs: Any) -> Any:
        """One forward call of ``module`` across the devices; reads like ``torch.nn.DataParallel.forward``.

        Called with ``module``'s own ``forward`` in place (not the redirection), so replicas copy the real one.
        """
        devices = self.replica_devices()
        inputs = self.scatter(args, kwargs, devices)
        self.stats.forward_calls += 1
        self.stats.replica_calls += len(inputs)
        self.stats.last_num_replicas = len(inputs)
        if len(inputs) == 1:
            return module.forward(*inputs[0][0], **inputs[0][1])
        replicas = self.replicate(module, devices[: len(inputs)])
        outputs = self.parallel_apply(replicas, inputs, devices[: len(inputs)])
        return self.gather(outputs, devices[0])

    def scatter(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], devices: Sequence[torch.device]
    ) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        """Split forward's arguments into ``(args, kwargs)`` per replica (see :func:`~.data_parallel.scatter`)."""
        try:
            return scatter((args, kwargs), devices, dim=self.dim, name="forward(...)")
        except ValueError as err:
            raise ValueError(
                f"{type(self).__name__} cannot split the arguments of forward ([0] = positional, [1] = keyword) "
                f"across {len(devices)} replicas: {err}"
            ) from err

    def replicate(self, module: Module, devices: Sequence[torch.device]) -> list[Module]:
        """One replica of ``module`` per device (see :func:`~.data_parallel.replicate`)."""
        return replicate(module, devices)

    def parallel_apply(
        self,
        replicas: Sequence[Module],
        inputs: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
        devices: Sequence[torch.device],
    ) -> list[Any]:
        """Run every replica's ``forward`` on its inputs in its own thread (see :func:`~.data_parallel.parallel_apply`).

        ``forward`` is called, not the replica: hooks registered on the LightningModule itself run once, on the whole
        batch, around the gathered call; hooks on its submodules run in every replica.
        """
        return parallel_apply([replica.forward for replica in replicas], inputs, devices)

    def gather(self, outputs: Sequence[Any], device: torch.device) -> Any:
        """Merge the replicas' outputs on the root device (see :func:`~.data_parallel.gather`)."""
        return gather(outputs, device, dim=self.dim)
