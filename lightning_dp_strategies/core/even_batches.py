"""Whether the data-parallel ranks run as many training batches an epoch, checked at every batch's start.

Every training batch a rank runs joins collectives that every other rank must join too: a gradient bucket's
all-reduce, local SGD's average, Lightning's own per-batch broadcast. A rank given fewer batches ends its epoch early
and goes on to validation or the next epoch while the others wait in the next batch's collective; the job then fails
only when the strategy's ``timeout`` runs out, without saying why (Lightning's ``ddp`` waits just as long).
Lightning's ``DistributedSampler`` gives every rank the same count (it pads the last batch); a sampler of one's own
(``use_distributed_sampler=False``) or an ``IterableDataset`` split by rank need not.

:class:`EvenBatches` raises :class:`UnevenBatchesError` on every rank as soon as the ranks disagree, before any
collective goes astray:

- at the first batch of every epoch it gathers each rank's batch count for the epoch, :data:`UNKNOWN` where the loader
  cannot tell (no length, or an ``IterableDataset``, whose length need not be what it yields); known counts that
  differ fail there;
- where some rank's count is unknown it counts, at every batch of that epoch, the ranks for which it is the last;
  some but not all fails there (the flags are then gathered to name the ranks). That costs one all-reduce of one
  integer a batch, which the epochs of loaders of known length do not pay. A ``training_step(dataloader_iter)``
  learns of the end only from its own ``next()``: the iterator it is given counts, at each ``next()``, the ranks
  that ran out instead (:meth:`EvenBatches.reading`).

A rank with no batch at all in an epoch never reaches the check, and the others' comparison fails only at the
``timeout``; that rank warns on its own of the epochs it had no batch in, at its next batch or when training ends.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp_strategies.comm.failures import guarded
from lightning_dp_strategies.core.distinct_batches import gather_world

__all__ = ["UNKNOWN", "BatchPosition", "EvenBatches", "UnevenBatchesError", "total_world"]

UNKNOWN = -1
"""The batch count of an epoch whose loader cannot tell it in advance."""

SAME_COUNT_FIX = (
    "Give every rank the same number of training batches an epoch: leave `use_distributed_sampler=True` (Lightning's "
    "`DistributedSampler` pads the ranks' shares to one length), give a sampler of your own the same length on every "
    "rank, or set `limit_train_batches` to the smallest count."
)
ITERABLE_FIX = (
    "An `IterableDataset` split by rank must yield the same number of batches on every rank: stop each rank's "
    "iterator at the smallest share (drop the remainder), pad the shorter shares, or set `limit_train_batches` to at "
    "most the smallest count."
)


T = TypeVar("T")

CHECK_WHAT = "Comparing the ranks' numbers of training batches"
"""What the check's collectives are called in the error a peer's failure in them raises."""


class UnevenBatchesError(RuntimeError):
    """The ranks have different numbers of training batches in an epoch; raised on every rank, before the batch at
    which they part.

    Examples:
        >>> issubclass(UnevenBatchesError, RuntimeError)  # caught by ``except RuntimeError`` as well
        True
    """


@dataclass(frozen=True)
class BatchPosition:
    """Where a rank stands at the start of a training batch, as the check needs it."""

    epoch: int
    batch_idx: int
    count: int
    """This rank's number of training batches in the epoch; :data:`UNKNOWN` where its loader cannot tell."""
    ends: bool | None
    """Whether this batch is the last of this rank's epoch; ``None`` where only the training step's own ``next()``
    tells (a ``training_step(dataloader_iter)``)."""


def _ranks(ranks: list[int], verb: tuple[str, str]) -> str:
    """``ranks`` and ``verb`` (``("end", "ends")``) as one sentence's subject and verb."""
    plural = len(ranks) > 1
    return f"rank{'s' if plural else ''} {', '.join(map(str, ranks))} {verb[0] if plural else verb[1]}"


def count_message(epoch: int, counts: list[int]) -> str:
    """The error for differing known ``counts`` (every rank's, in rank order).

    Examples:
        >>> count_message(0, [5, 4])[:86]
        'The ranks have different numbers of training batches in epoch 0 (rank 0: 5, rank 1: 4)'
    """
    said = ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(counts))
    return (
        f"The ranks have different numbers of training batches in epoch {epoch} ({said}). A rank that "
        "ends its epoch early leaves the others waiting in a collective until the strategy's `timeout`. "
        f"{SAME_COUNT_FIX}"
    )


def ends_message(epoch: int, batch_idx: int, ends: list[int]) -> str:
    """The error for ranks whose epoch ends with batch ``batch_idx`` while others go on (``ends``: every rank's flag,
    in rank order).

    Examples:
        >>> ends_message(1, 3, [0, 1])[:70]
        'The ranks ran out of training batches at different points: rank 1 ends'
    """
    ending = _ranks([rank for rank, flag in enumerate(ends) if flag], ("end", "ends"))
    going = _ranks([rank for rank, flag in enumerate(ends) if not flag], ("have", "has"))
    return (
        f"The ranks ran out of training batches at different points: {ending} epoch {epoch} after "
        f"{batch_idx + 1} batches while {going} more. A rank that ends its epoch early leaves the others waiting in a "
        f"collective until the strategy's `timeout`. {ITERABLE_FIX}"
    )


def empty_message(rank: int, epochs: list[int], world_size: int) -> str:
    """The warning of a rank that had no training batch in ``epochs``.

    Examples:
        >>> empty_message(1, [0, 1], 2)[:68]
        'Rank 1 had no training batch in epochs 0, 1 of this fit, while 2 ran'
    """
    said = f"epoch{'s' if len(epochs) > 1 else ''} {', '.join(map(str, epochs))}"
    return (
        f"Rank {rank} had no training batch in {said} of this fit, while {world_size} ranks train together. Unless no "
        "rank had one (an iterable that is exhausted after one pass, such as a generator, yields nothing in later "
        "epochs), the other ranks waited for this one in a collective until the strategy's `timeout`, and it may "
        f"have ended its fit without an error of its own. {ITERABLE_FIX}"
    )


class EvenBatches:
    """Raises :class:`UnevenBatchesError` on every rank when the ranks' training batches in an epoch differ.

    Call :meth:`begin` when a fit's training loader is set up, :meth:`check` at every training batch's start on every
    rank and :meth:`end` when training ends. Costs one all-gather of one integer at each epoch's first batch, and an
    all-reduce of one at every batch of an epoch whose count some rank cannot tell in advance. A no-op over fewer than
    two ranks or while :attr:`enabled` is false.

    A rank with no batch at all in an epoch never reaches :meth:`check`; it warns, on its own, at its next batch or
    when training ends (the others have by then failed in a collective, or every rank had none).
    """

    def __init__(self) -> None:
        self.enabled = True
        """Whether :meth:`check` checks (a strategy whose ranks may leave mid-fit turns it off)."""
        self.gather: Callable[[Tensor], Tensor] = functools.partial(guarded, CHECK_WHAT, gather_world)
        """How every rank's integer is gathered, stacked in rank order (a peer's failure in it raised with what it
        most likely means)."""
        self.total: Callable[[Tensor], Tensor] = functools.partial(guarded, CHECK_WHAT, total_world)
        """How every rank's integer is summed (likewise)."""
        self._epoch: int | None = None
        self._every_batch = False
        self._reads_checked = False
        self._fetches = 0
        self._last_with_batch: int | None = None

    def begin(self, epoch: int, at_start: bool, reloaded: bool = False) -> None:
        """Training's loader is set up in ``epoch``: at its start, or (``at_start`` false) resumed within it, which may
        leave it no batch to run on any rank; or ``reloaded`` in the fit (``reload_dataloaders_every_n_epochs``),
        which leaves the record of the epochs this rank had batches in as it is. The next batch compares counts
        again, whatever epoch it is in."""
        self._epoch, self._every_batch = None, False
        if not reloaded:
            self._last_with_batch = epoch - 1 if at_start else epoch

    def end(self, epochs: int) -> None:
        """Training ended with ``epochs`` epochs completed (Lightning's ``current_epoch`` then)."""
        if self._active():
            self._warn_empty(epochs)
        self._last_with_batch = None

    def _active(self) -> bool:
        return self.enabled and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _warn_empty(self, epoch: int) -> None:
        """Warn if this rank ran no batch in the epochs since its last batch and before ``epoch``."""
        if self._last_with_batch is not None and epoch > self._last_with_batch + 1:
            empty = list(range(self._last_with_batch + 1, epoch))
            warnings.warn(empty_message(dist.get_rank(), empty, dist.get_world_size()), stacklevel=3)

    def check(self, position: BatchPosition, device: torch.device) -> None:
        """Compare this batch's ``position`` with every rank's and raise :class:`UnevenBatchesError` where they part."""
        if not self._active():
            return
        self._warn_empty(position.epoch)
        self._last_with_batch = position.epoch
        if position.epoch != self._epoch:
            self._epoch, self._fetches = position.epoch, 0
            counts = self._gather(position.count, device)
            known = [count for count in counts if count != UNKNOWN]
            if len(set(known)) > 1:
                raise UnevenBatchesError(count_message(position.epoch, counts))
            self._every_batch = len(known) < len(counts)
        self._reads_checked = self._every_batch and position.ends is None
        if self._every_batch and position.ends is not None:
            self._compare_ends(position.ends, position.batch_idx, device)

    def reading(self, args: tuple[Any, ...], device: torch.device) -> tuple[Any, ...]:
        """A training step's arguments; where the batch's end is told only by the step's own ``next()`` and some
        rank's count is unknown, its one argument, the iterator, wrapped to check each ``next()`` (:meth:`fetched`)."""
        return (CheckedReads(args[0], self, device),) if self._reads_checked and len(args) == 1 else args

    def fetched(self, fetch: Callable[[], T], device: torch.device) -> T:
        """``fetch()``, a ``next()`` of the iterator a training step reads, compared with every rank's: raises
        :class:`UnevenBatchesError` on every rank where some but not all ran out, ``StopIteration`` where all did."""
        try:
            item, ends = fetch(), False
        except StopIteration:
            ends = True
        self._compare_ends(ends, self._fetches - 1, device)
        if ends:
            raise StopIteration
        self._fetches += 1
        return item

    def _compare_ends(self, ends: bool, batch_idx: int, device: torch.device) -> None:
        """Raise on every rank where ``ends`` (whether this rank's epoch ends at batch ``batch_idx``) differs."""
        ending = int(self.total(torch.tensor([int(ends)], dtype=torch.int64, device=device)).item())
        if 0 < ending < dist.get_world_size():  # alike on every rank: all gather the flags to name the ranks
            raise UnevenBatchesError(ends_message(self._epoch or 0, batch_idx, self._gather(int(ends), device)))

    def _gather(self, value: int, device: torch.device) -> list[int]:
        return [int(v) for v in self.gather(torch.tensor([value], dtype=torch.int64, device=device)).reshape(-1)]


def total_world(tensor: Tensor) -> Tensor:
    """``tensor`` summed over the default group, in place (an all-reduce: cheaper than an all-gather)."""
    dist.all_reduce(tensor)
    return tensor


class CheckedReads(Iterator[T]):
    """``inner``, the iterator a training step reads its batches from, each ``next()`` through ``check.fetched``;
    its other attributes (a ``dataloader_iter``'s ``done``, say) the inner one's."""

    def __init__(self, inner: Iterator[T], check: EvenBatches, device: torch.device) -> None:
        self.inner, self.check, self.device = inner, check, device

    def __iter__(self) -> CheckedReads[T]:
        return self

    def __next__(self) -> T:
        return self.check.fetched(self.inner.__next__, self.device)

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)
