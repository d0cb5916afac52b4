"""Micro-batching rules: how many equal micro-batches a batch is cut into, and the checks made before training.

The rule, in one place:

* The configured per-replica batch size must be a multiple of ``micro_batches`` (so at least ``micro_batches``);
  otherwise training refuses to start (:func:`check_micro_batches`), naming the sizes that would work.
* A batch that is smaller than configured and cannot be cut into ``micro_batches`` equal parts (the last batch of
  an epoch with ``drop_last=False``, or an evaluation batch) runs with the largest number of equal micro-batches
  that divides it (:func:`effective_micro_batches`), at most ``micro_batches``. Its gradient is still exactly the
  gradient of the batch mean: every micro-batch loss is weighted ``1 / M`` of equal-sized parts.

Micro-batches are always equal: ``torch.distributed.pipelining`` sizes its receive buffers from the first
micro-batch of a step.
"""

from __future__ import annotations

from lightning_dp_strategies.plan.sizing import divisors

__all__ = ["check_micro_batches", "effective_micro_batches", "valid_batch_sizes"]


def effective_micro_batches(batch_size: int, micro_batches: int) -> int:
    """The largest ``m <= micro_batches`` that divides ``batch_size`` (1 for an empty batch).

    Examples:
        >>> [effective_micro_batches(b, 4) for b in (8, 6, 2, 5, 1)]
        [4, 3, 2, 1, 1]
    """
    if micro_batches < 1:
        raise ValueError(f"`micro_batches` must be >= 1, got {micro_batches}.")
    for m in range(min(micro_batches, max(batch_size, 1)), 0, -1):
        if batch_size % m == 0:
            return m
    return 1


def valid_batch_sizes(micro_batches: int, around: int, count: int = 3) -> list[int]:
    """A few batch sizes near ``around`` that ``micro_batches`` equal micro-batches divide.

    Examples:
        >>> valid_batch_sizes(4, 6)
        [4, 8, 12]
    """
    low = max(micro_batches, (around // micro_batches) * micro_batches)
    return [low + k * micro_batches for k in range(count)]


def check_micro_batches(batch_size: int, micro_batches: int, where: str = "the training DataLoader") -> None:
    """Raise if ``batch_size`` (per data-parallel replica) cannot be cut into ``micro_batches`` equal micro-batches.

    Examples:
        >>> check_micro_batches(8, 4)
        >>> check_micro_batches(6, 4)
        Traceback (most recent call last):
        ...
        ValueError: The batch size 6 of the training DataLoader cannot be cut into micro_batches=4 equal ...
    """
    if micro_batches < 1:
        raise ValueError(f"`micro_batches` must be >= 1, got {micro_batches}.")
    if batch_size < micro_batches:
        raise ValueError(
            f"The batch size {batch_size} of {where} is smaller than micro_batches={micro_batches}: a micro-batch "
            f"needs at least one sample. Use a batch size of at least {micro_batches} per data-parallel replica "
            f"(e.g. {valid_batch_sizes(micro_batches, batch_size)}), or micro_batches <= {batch_size}."
        )
    if batch_size % micro_batches:
        raise ValueError(
            f"The batch size {batch_size} of {where} cannot be cut into micro_batches={micro_batches} equal "
            f"micro-batches. Use a batch size that is a multiple of {micro_batches} "
            f"(e.g. {valid_batch_sizes(micro_batches, batch_size)}), or micro_batches in "
            f"{divisors(batch_size, up_to=micro_batches)}."
        )
