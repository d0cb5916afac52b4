"""Fabric's process groups that torchrun's restarts can make again (see :mod:`lightning_dp_strategies.core.elastic`)."""

from __future__ import annotations

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import DDPStrategy
from typing_extensions import override

from lightning_dp_strategies.core.elastic import init_restart_safe_process_group


class RestartSafeGroups(DDPStrategy):
    """Mixed in ahead of Fabric's ``DDPStrategy``: under torchrun the default process group meets under a key prefix
    of its own attempt, so workers restarted by ``--max-restarts`` never dial the addresses of the attempt that
    died."""

    @override
    def _setup_distributed(self) -> None:
        self._set_world_ranks()
        assert self.cluster_environment is not None
        timeout = self._timeout if self._timeout is not None else default_pg_timeout
        backend = self._get_process_group_backend()
        init_restart_safe_process_group(self.cluster_environment, backend, timeout, self.root_device)
        super()._setup_distributed()
