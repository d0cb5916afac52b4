"""Module state every rank must share: rank 0's parameters and buffers at setup, its buffers before each step; and
the values themselves, which a module built on the meta device does not have yet."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import _get_default_group
from torch.distributed.utils import _sync_module_states as _torch_sync_module_states

__all__ = [
    "BUFFER_BROADCAST_BYTES",
    "broadcast_module_buffers",
    "quoted_names",
    "require_storage",
    "sync_module_states",
]

BUFFER_BROADCAST_BYTES = 250 * 1024 * 1024
"""Bytes per coalesced broadcast: torch DDP's bucket size for broadcasting parameters and buffers."""


def sync_module_states(module: nn.Module, src: int = 0) -> None:
    """Give every rank global rank ``src``'s (default 0) parameters and buffers, as torch DDP does when it wraps a
    module (torch's own helper, honouring ``module._ddp_params_and_buffers_to_ignore``); a no-op on one process or
    before ``torch.distributed`` is initialised.

    Examples:
        >>> sync_module_states(nn.Linear(2, 2))  # one process: nothing to do
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
        _torch_sync_module_states(module, _get_default_group(), BUFFER_BROADCAST_BYTES, src, ignore)


def broadcast_module_buffers(module: nn.Module, group: dist.ProcessGroup | None = None, src: int = 0) -> None:
    """Give every rank of ``group`` (default: the world) global rank ``src``'s buffers (BatchNorm statistics), as
    torch DDP does before each training forward."""
    buffers = list(module.buffers())
    if buffers and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        pg = group if group is not None else _get_default_group()
        dist._broadcast_coalesced(pg, buffers, BUFFER_BROADCAST_BYTES, dist.get_group_rank(pg, src))


def quoted_names(names: list[str], shown: int = 4) -> str:
    """The first ``shown`` of ``names`` in backquotes, and how many more there are, for an error message.

    Examples:
        >>> quoted_names(["a.weight", "a.bias"]), quoted_names(list("abcdef"))
        ('`a.weight`, `a.bias`', '`a`, `b`, `c`, `d` and 2 more')
    """
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(f"`{name}`" for name in names[:shown]) + more


def require_storage(module: nn.Module, strategy: str) -> None:
    """A clear error when ``module`` has parameters or buffers on the meta device (built under
    ``torch.device("meta")``): a strategy that holds the whole model on each of its devices has no values to put there.

    Examples:
        >>> import torch
        >>> require_storage(nn.Linear(2, 2), "RingAllReduceStrategy")
        >>> with torch.device("meta"):
        ...     deferred = nn.Linear(2, 2)
        >>> require_storage(deferred, "RingAllReduceStrategy")
        Traceback (most recent call last):
        ...
        ValueError: RingAllReduceStrategy holds the whole model on each of its devices, and `weight`, `bias` are on ...
    """
    meta = [name for name, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    if meta:
        names = quoted_names(meta)
        raise ValueError(
            f"{strategy} holds the whole model on each of its devices, and {names} are on the meta device (built "
            "under `torch.device('meta')` for deferred initialization): they have no values to put there. Build the "
            "model on the CPU, or train with strategy='hybrid_pipeline', which allocates and initializes each "
            "pipeline stage's blocks only on the ranks that run them."
        )
