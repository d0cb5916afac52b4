"""Resuming under the Trainer: atomic checkpoint files by default, and the resumed epoch's sample order."""

from __future__ import annotations

from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.strategies import Strategy
from typing_extensions import override

from lightning_dp_strategies.core.checkpoint_io import AtomicCheckpoints


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
