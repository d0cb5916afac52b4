"""What the Trainer strategies share that is the Trainer's alone: the resumed epoch's sample order, where a training
batch stands in its epoch, when to log, the ranks a failed launching process started, the callbacks refused and the
hooks warned of."""

from __future__ import annotations

import atexit
import math
import time
from collections.abc import Callable, Mapping

from lightning.fabric.utilities.data import _set_sampler_epoch, has_iterable_dataset
from lightning.pytorch.callbacks import BaseFinetuning, ModelPruning
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _get_sigkill_signal
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

from lightning_dp_strategies.core.even_batches import UNKNOWN, BatchPosition

STOP_GRACE_S = 10.0
"""How long the ranks a failed launching process started get to end on their own (to raise their own error, as
every rank does for bad input) before they are stopped."""


def with_resumed_sampler_epoch(
    strategy: Strategy, dataloader: object, starting: Callable[[int, bool, bool], None] | None = None
) -> object:
    """Set the epoch of ``dataloader``'s sampler to the one the fit loop is about to train, if it is the train loader,
    and tell ``starting`` that epoch, whether training starts at its start rather than resumed within it, and whether
    the loader is reloaded in the fit rather than set up for it.

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
        if starting is not None:  # an epoch the fit loop has started but not processed is resumed within
            started = trainer.fit_loop.epoch_progress.current.started  # type: ignore[attr-defined]
            starting(epoch, started == epoch, trainer.train_dataloader is not None)
    return dataloader


def _loaders(iterables: object) -> list[object]:
    """The loaders of a ``train_dataloader`` collection (a loader, or mappings and sequences of them)."""
    if isinstance(iterables, Mapping):
        return [loader for value in iterables.values() for loader in _loaders(value)]
    if isinstance(iterables, (list, tuple)):
        return [loader for value in iterables for loader in _loaders(value)]
    return [iterables]


def batch_position(strategy: Strategy, batch_idx: int) -> BatchPosition:
    """Where the training batch whose ``on_train_batch_start`` runs stands in its epoch, on this rank of ``strategy``.

    The epoch's count is Lightning's (``num_training_batches``, limits applied) where the loaders have a length and
    none holds an ``IterableDataset`` (whose length need not be what it yields), else unknown. The batch ends this
    rank's epoch if it is its last: Lightning knows that here (it fetches one batch ahead), and validates after it. A
    rank at its epoch's last batch therefore parts from one that is not even where ``max_steps`` stops both there:
    only the first validates. A ``training_step(dataloader_iter)`` fetches its batch itself: there it is not known.
    """
    assert strategy.lightning_module is not None
    trainer = strategy.lightning_module.trainer
    progress = trainer.fit_loop.epoch_loop.batch_progress
    count = trainer.num_training_batches
    known = not math.isinf(count) and not any(has_iterable_dataset(dl) for dl in _loaders(trainer.train_dataloader))
    last = progress.is_last_batch or progress.current.ready == count
    reads = is_param_in_hook_signature(strategy.lightning_module.training_step, "dataloader_iter", explicit=True)
    return BatchPosition(trainer.current_epoch, batch_idx, int(count) if known else UNKNOWN, None if reads else last)


def should_log(strategy: Strategy, enabled: bool) -> bool:
    """Whether ``strategy`` logs its statistics now: ``enabled``, a logger exists, and this is a
    ``log_every_n_steps`` step."""
    module = strategy.lightning_module
    if not enabled or module is None or module.logger is None:
        return False
    every = int(getattr(module.trainer, "log_every_n_steps", 1))
    return every > 0 and module.trainer.global_step % every == 0


def stop_started_ranks(launcher: object, grace_s: float = STOP_GRACE_S) -> None:
    """Stop the ranks Lightning's script launcher started from this process, once they have had ``grace_s`` seconds
    to end on their own (nothing elsewhere: torchrun's ranks and forked ones have no such list)."""
    if not isinstance(launcher, _SubprocessScriptLauncher) or not getattr(launcher, "procs", None):
        return
    deadline = time.monotonic() + grace_s
    while any(proc.poll() is None for proc in launcher.procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    launcher.kill(_get_sigkill_signal())


class StartedRanks:
    """The ranks Lightning's script launcher started from this process that a failed run left behind, stopped (see
    :func:`stop_started_ranks`) when this process exits unless a later run gathered every rank again.

    Lightning stops them itself after Ctrl-C and when one of them fails, but not when the launching process raises:
    a rank alive but silent (stuck in its data loader, say), which the launching process gave up on after the
    collective timeout, would otherwise run on after the job ended, holding its memory and devices. They are not
    stopped at the exception itself: a script that catches it and fits again (a sweep, a smaller batch after an
    out-of-memory error) does so on every rank, and needs them."""

    def __init__(self) -> None:
        self._launchers: list[_SubprocessScriptLauncher] = []

    def stop_at_exit(self, launcher: object) -> None:
        """From ``on_exception``: stop the ranks ``launcher`` started when this process exits."""
        if not isinstance(launcher, _SubprocessScriptLauncher) or not getattr(launcher, "procs", None):
            return
        if not self._launchers:
            atexit.unregister(self._stop)
            atexit.register(self._stop)
        if launcher not in self._launchers:
            self._launchers.append(launcher)

    def gathered(self) -> None:
        """Every rank joined this run's process group: those left behind are live, so none is stopped at exit."""
        self._launchers.clear()

    def _stop(self) -> None:
        for launcher in self._launchers:
            stop_started_ranks(launcher)
        self._launchers.clear()


STARTED_RANKS = StartedRanks()
"""This process's :class:`StartedRanks`."""


def check_no_finetuning(trainer: object, where: str, why: str) -> None:
    """Refuse a ``BaseFinetuning`` callback among ``trainer``'s, on every rank, before anything is sent: ``where``
    says where it cannot run ("under local SGD"), ``why`` (with the fix) ends the message.

    Examples:
        >>> check_no_finetuning(object(), "with this strategy", "...")
    """
    found = [type(c).__name__ for c in getattr(trainer, "callbacks", []) if isinstance(c, BaseFinetuning)]
    if found:
        raise ValueError(f"{found[0]} (a BaseFinetuning callback) cannot run {where}: {why}")


def check_no_lottery_ticket(trainer: object, where: str, why: str) -> None:
    """Refuse, on every rank before anything is sent, a ``ModelPruning`` callback of ``trainer`` that resets weights
    for the lottery ticket hypothesis (its default): it replaces their storage (``param.data = ...``). ``where`` says
    where it cannot run, ``why`` (with the fix) ends the message.

    Examples:
        >>> check_no_lottery_ticket(object(), "with this strategy", "...")
    """
    for callback in getattr(trainer, "callbacks", []):
        if isinstance(callback, ModelPruning) and callback._use_lottery_ticket_hypothesis:
            raise ValueError(
                "ModelPruning with `use_lottery_ticket_hypothesis` (its default) cannot run "
                f"{where}: it resets the pruned layers' weights by replacing their storage (`param.data = ...`), {why}"
            )


GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step")
"""The hooks Lightning calls with the step's gradients in ``.grad``."""


def warn_gradient_hooks(trainer: object, what: str) -> None:
    """Warn on rank 0 when the module or a callback of ``trainer`` overrides a hook of :data:`GRADIENT_HOOKS`; the
    message names them, then says ``what`` they will find in the module's ``.grad`` (with the fix).

    Examples:
        >>> warn_gradient_hooks(object(), "will find no gradient here: ...")
    """
    module = getattr(trainer, "lightning_module", None)
    owners = ([module] if module is not None else []) + list(getattr(trainer, "callbacks", []))
    found = [f"{type(o).__name__}.{hook}" for o in owners for hook in GRADIENT_HOOKS if is_overridden(hook, o)]
    if found:
        rank_zero_warn(f"{', '.join(found)} {what}")
