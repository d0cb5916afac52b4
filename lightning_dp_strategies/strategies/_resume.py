"""Resuming under the Trainer: atomic checkpoint files by default, the resumed epoch's sample order, and process
groups that torchrun's restarts can make again."""

from __future__ import annotations

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.strategies import DDPStrategy, Strategy
from typing_extensions import override

from lightning_dp_strategies.core.checkpoint_io import AtomicCheckpoints
from lightning_dp_strategies.core.elastic import init_restart_safe_process_group


def with_resumed_sampler_epoch(strategy: Strategy, dataloader: object) -> object:
    """Set the epoch of ``dataloader``'s sampler to the one the fit loop is about to train, if it is the train loader.

    Lightning calls ``set_epoch`` on the training sampler (the ``DistributedSampler`` it adds, shuffled with seed 0) at
    the start of every epoch. When it resumes from a checkpoint taken mid-epoch it first restores the loader's
    position (``load_state_dict``) and iterates it once, and only then sets the epoch. A loader that positions itself
    at that first iteration, such as torchdata's ``StatefulDataLoader``, would skip into epoch 0's order instead of
    the resumed epoch's and train on other samples than the uninterrupted run. Setting the epoch here (the strategy's
    ``process_dataloader`` runs before that iteration) changes nothing else: Lightning sets the same value again.
    """
    module = strategy.lightning_module
    trainer = module._trainer if module is not None else None
    if trainer is not None and trainer.training:
        epoch = trainer.fit_loop.epoch_progress.current.processed  # type: ignore[attr-defined]  # as Lightning
        _set_sampler_epoch(dataloader, epoch)
    return dataloader


class CheckpointAndResume(AtomicCheckpoints, Strategy):
    """Mixed in first: an :class:`~.checkpoint_io.AtomicCheckpointIO` unless one was given,
    and the training sampler set to the resumed epoch before its loader is first iterated."""

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """The loader as Lightning prepared it; the train sampler already set to the epoch that is resumed."""
        return with_resumed_sampler_epoch(self, super().process_dataloader(dataloader))


class RestartSafeGroups(DDPStrategy):
    """Mixed in ahead of ``DDPStrategy``: under torchrun the default process group meets under a key prefix of its
    own attempt (:mod:`lightning_dp_strategies.core.elastic`), so workers restarted by ``--max-restarts`` never dial
    the addresses of the attempt that died."""

    @override
    def setup_distributed(self) -> None:
        self.set_world_ranks()
        assert self.cluster_environment is not None
        timeout = self._timeout if self._timeout is not None else default_pg_timeout
        backend = self._get_process_group_backend()
        init_restart_safe_process_group(self.cluster_environment, backend, timeout, self.root_device)
        super().setup_distributed()
