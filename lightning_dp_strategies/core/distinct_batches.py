"""Whether the data-parallel ranks read different batches, checked once a fit at its first training batch (under
Fabric: at the model's first training forward, on its inputs).

Under data parallelism every rank loads its own part of the global batch. A loader that every rank reads whole
(``use_distributed_sampler=False`` with no sampler of one's own, or an ``IterableDataset`` that does not split itself
by rank: Lightning splits only map-style datasets) gives every rank the same batches. Nothing fails: each step
averages the gradients of copies of one batch, so the global batch is one rank's and the other ranks' compute changes
nothing. :class:`DistinctBatches` takes a 64-bit digest of each rank's first training batch of a fit, gathers the
digests over the ranks and warns when ranks that average together hold the same batch.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.warnings import PossibleUserWarning
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_dp_strategies.comm.failures import guarded

Owner = Literal["trainer", "fabric"]
"""Whose API a warning's fix is written for: Lightning's ``Trainer`` or Fabric."""

__all__ = ["DistinctBatches", "Owner", "batch_digest", "gather_world", "repeated_ranks", "tensor_digest"]


def tensor_digest(tensor: Tensor) -> int:
    """A 64-bit digest of a tensor's shape, dtype and values: equal for equal tensors on any machine.

    Examples:
        >>> a = torch.tensor([1, 2, 3])
        >>> tensor_digest(a) == tensor_digest(a.clone()), tensor_digest(a) == tensor_digest(a.flip(0))
        (True, False)
    """
    data = tensor.detach().reshape(-1).contiguous().cpu()
    digest = hashlib.blake2b(f"{tuple(tensor.shape)} {tensor.dtype}".encode(), digest_size=8)
    digest.update(data.view(torch.uint8).numpy().tobytes())
    return int.from_bytes(digest.digest(), "little", signed=True)


def _tensors(batch: Any) -> list[Tensor]:
    """The dense tensors of ``batch`` (nested mappings, lists and tuples), in order."""
    if isinstance(batch, Tensor):
        return [batch] if batch.layout == torch.strided else []
    if isinstance(batch, Mapping):
        return [t for key in sorted(batch, key=str) for t in _tensors(batch[key])]
    if isinstance(batch, (list, tuple)):
        return [t for item in batch for t in _tensors(item)]
    return []


def batch_digest(batch: Any) -> int:
    """A 64-bit digest of every dense tensor in ``batch``, in order; 0 when it holds none (nothing to compare).

    Examples:
        >>> x, y = torch.ones(2, 3), torch.tensor([0, 1])
        >>> batch_digest({"x": x, "y": y}) == batch_digest({"y": y.clone(), "x": x.clone()})
        True
        >>> batch_digest((x, y)) == batch_digest((x, y.flip(0))), batch_digest(["text"])
        (False, 0)
    """
    tensors = _tensors(batch)
    if not tensors:
        return 0
    digest = hashlib.blake2b(digest_size=8)
    for tensor in tensors:
        digest.update(tensor_digest(tensor).to_bytes(8, "little", signed=True))
    return int.from_bytes(digest.digest(), "little", signed=True) or 1  # 0 stands for "no tensor" alone


def repeated_ranks(digests: Sequence[int], groups: Sequence[Sequence[int]]) -> list[list[int]]:
    """The ranks of one group that hold the same batch, one list for each batch held more than once. ``digests`` holds
    every global rank's, in rank order; a digest of 0 (unknown) is never the same as another.

    Examples:
        >>> repeated_ranks([7, 7, 5, 7], [[0, 1, 2, 3]]), repeated_ranks([7, 7, 5, 7], [[0, 2], [1, 3]])
        ([[0, 1, 3]], [[1, 3]])
        >>> repeated_ranks([0, 0], [[0, 1]])
        []
    """
    repeats = []
    for group in groups:
        held: dict[int, list[int]] = {}
        for rank in group:
            if digests[rank] != 0:
                held.setdefault(digests[rank], []).append(rank)
        repeats += [ranks for ranks in held.values() if len(ranks) > 1]
    return repeats


def same_batch_warning(repeats: list[list[int]], group_size: int, world_size: int, owner: Owner = "trainer") -> str:
    """The warning for ``repeats`` (from :func:`repeated_ranks`), naming the fix in the words of ``owner``'s API."""
    said = "; ".join(f"ranks {', '.join(map(str, ranks))}" for ranks in repeats)
    if group_size == world_size:
        sampler = f"`DistributedSampler(dataset, num_replicas={owner}.world_size, rank={owner}.global_rank)`"
    else:
        sampler = f"a `DistributedSampler` with `num_replicas={group_size}` and the rank's place among them"
    read, where, who = "read the same first training batch", "", "Lightning"
    if owner == "fabric":
        read, where, who = (
            "gave the model the same inputs at its first training forward",
            " in `setup_dataloaders`",
            "Fabric",
        )
    return (
        f"Data-parallel ranks {read} ({said}): each step averages their gradients over copies of one batch, so the "
        "global batch is smaller than intended and the copies' compute changes nothing. Give every rank its own "
        f"part of the data. A map-style dataset: leave `use_distributed_sampler=True`{where} ({who} then adds a "
        f"`DistributedSampler`) or pass {sampler}. An `IterableDataset`: split it by `{owner}.global_rank` and "
        f"`{owner}.world_size` in its `__iter__` ({who} adds no sampler to one). If the ranks are meant to read the "
        "same data, ignore this warning (a `PossibleUserWarning`)."
    )


def gather_world(tensor: Tensor) -> Tensor:
    """Every rank's ``tensor`` over the default group, stacked in rank order (torch's own all-gather: Lightning's
    ``all_gather`` goes through a deprecated torch function that warns)."""
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return torch.stack(gathered)


GATHER_WHAT = "Comparing the ranks' first training batches"
"""What the check's gather is called in the error a peer's failure in it raises."""


class DistinctBatches:
    """Warns once a fit, on rank 0, when ranks that average together read the same first training batch.

    Set :attr:`pending` when a fit is set up; call :meth:`check` at every training batch's start (after the first it
    returns at once). Costs one all-gather of one integer a fit, and a digest of one batch on each rank. Fabric has
    no batch hook: :meth:`watch` checks the inputs of a module's first training forward instead.
    """

    def __init__(self, owner: Owner = "trainer") -> None:
        self.owner: Owner = owner
        """Whose API the warning's fix names."""
        self.pending = False
        """Whether the next training batch is the first of a fit."""
        self.gather: Callable[[Tensor], Tensor] = functools.partial(guarded, GATHER_WHAT, gather_world)
        """How every rank's digest is gathered, stacked in rank order (a fault-tolerant run: over the survivors); by
        default a peer's failure in it is raised with what it most likely means."""

    def watch(self, module: nn.Module, device: torch.device) -> RemovableHandle:
        """Arm the check for ``module``'s first training forward (train mode, gradients on) and run it there, on the
        forward's arguments, over the whole world; the hook then removes itself. Every rank runs that forward, as
        every rank runs each step's; the returned handle removes the hook earlier (a teardown before any step)."""
        self.pending = True
        world = [list(range(dist.get_world_size()))]

        def first_forward(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if module.training and torch.is_grad_enabled():
                handle.remove()
                self.check((args, kwargs), world, device)

        handle = module.register_forward_pre_hook(first_forward, with_kwargs=True)
        return handle

    def check(self, batch: Any, groups: list[list[int]], device: torch.device) -> list[list[int]]:
        """At the fit's first batch: gather every rank's digest and warn when ranks of one of ``groups`` (lists of
        global ranks, together the world) hold the same batch. Returns those ranks; ``[]`` otherwise, on later
        batches, and where fewer ranks answer than ``groups`` name."""
        if not self.pending:
            return []
        self.pending = False
        if all(len(group) < 2 for group in groups):  # decided alike on every rank: all gather or none does
            return []
        world_size = sum(len(group) for group in groups)
        found = self.gather(torch.tensor([batch_digest(batch)], dtype=torch.int64, device=device)).reshape(-1)
        if len(found) != world_size:
            return []
        repeats = repeated_ranks([int(d) for d in found.tolist()], groups)
        if repeats:
            group_size = max(len(group) for group in groups)
            warning = same_batch_warning(repeats, group_size, world_size, self.owner)
            rank_zero_warn(warning, category=PossibleUserWarning)
        return repeats
