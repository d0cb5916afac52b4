"""The micro-batches of the logical ranks a survivor trains for the lost ones (global batch kept)."""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, DistributedSampler

__all__ = ["LostBatches"]


class LostBatches:
    """The micro-batches of the logical ranks a survivor trains for the lost ones, as their sampler would give them.

    The train loader must be a map-style ``DataLoader`` with a ``batch_size`` whose sampler is a
    :class:`~torch.utils.data.DistributedSampler` (Lightning injects one by default): logical rank ``r``'s batch
    ``i`` of the sampler's current epoch is rebuilt from the same permutation its process would have drawn.

    Examples:
        >>> import torch
        >>> data = list(range(12))
        >>> loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, 3, 1, shuffle=False))
        >>> LostBatches(loader).batch(logical_rank=2, batch_idx=1)
        tensor([ 8, 11])
    """

    def __init__(self, loader: object) -> None:
        reason = self.unusable(loader)
        if reason is not None:
            raise ValueError(reason)
        assert isinstance(loader, DataLoader) and isinstance(loader.sampler, DistributedSampler)
        self.loader = loader
        self.sampler: DistributedSampler[Any] = loader.sampler
        self._indices: dict[tuple[int, int], list[int]] = {}

    @staticmethod
    def unusable(loader: object) -> str | None:
        """Why ``loader``'s batches cannot be rebuilt for another logical rank, naming the fix; ``None`` if they can."""
        fix = (
            "Pass one map-style DataLoader with a `batch_size` and let Lightning add its DistributedSampler "
            "(`use_distributed_sampler=True`, the default), or pass `fault_tolerant=FaultTolerance("
            "keep_global_batch=False)` to let the global batch shrink when a rank is lost."
        )
        if not isinstance(loader, DataLoader):
            return (
                "`fault_tolerant` keeps the global batch by training a lost rank's batches, but the train loader is "
                f"{type(loader).__name__}, not one DataLoader. {fix}"
            )
        if not isinstance(loader.sampler, DistributedSampler) or loader.batch_size is None:
            return (
                "`fault_tolerant` keeps the global batch by rebuilding a lost rank's batches from its "
                f"DistributedSampler, but the train loader's sampler is {type(loader.sampler).__name__} with "
                f"batch_size={loader.batch_size}. {fix}"
            )
        return None

    def batch(self, logical_rank: int, batch_idx: int, epoch: int | None = None) -> Any:
        """Logical rank ``logical_rank``'s batch ``batch_idx`` of the sampler's epoch ``epoch`` (default: its current
        one), collated (``None`` past its end)."""
        epoch = int(self.sampler.epoch) if epoch is None else epoch
        key = (logical_rank, epoch)
        if key not in self._indices:
            self._indices = {k: v for k, v in self._indices.items() if k[1] >= epoch - 1}
            other: DistributedSampler[Any] = DistributedSampler(
                self.loader.dataset,
                num_replicas=self.sampler.num_replicas,
                rank=logical_rank,
                shuffle=self.sampler.shuffle,
                seed=self.sampler.seed,
                drop_last=self.sampler.drop_last,
            )
            other.set_epoch(epoch)
            self._indices[key] = list(other)
        size = self.loader.batch_size
        assert size is not None
        chunk = self._indices[key][batch_idx * size : (batch_idx + 1) * size]
        if not chunk or (self.loader.drop_last and len(chunk) < size):
            return None
        dataset = self.loader.dataset
        return self.loader.collate_fn([dataset[i] for i in chunk])
