"""Process groups whose collectives time out as the default group's do.

``torch.distributed.new_group`` (and a ``DeviceMesh``'s groups) take their own timeout, and without one torch gives
each new group its backend's default (30 minutes on gloo), whatever ``init_process_group`` was given. A collective
on such a group whose peer hangs (alive but silent: a stuck data loader, a paused node) then waits half an hour
however short the strategy's ``timeout``. Every group the package makes comes from :func:`new_group` or passes
through :func:`time_out_as_world`, so one ``timeout`` bounds them all.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_group, _set_pg_timeout

__all__ = ["group_timeout", "new_group", "time_out_as_world", "world_timeout"]


def group_timeout(group: dist.ProcessGroup) -> timedelta | None:
    """The timeout ``group``'s collectives wait (its backend's), or ``None`` where its backend keeps none."""
    for device in group._device_types:
        timeout = getattr(getattr(group._get_backend(device), "options", None), "_timeout", None)
        if isinstance(timeout, timedelta):
            return timeout
    return None


def world_timeout() -> timedelta | None:
    """The default group's collective timeout (what ``init_process_group`` was given), or ``None`` where there is no
    default group or its backend keeps none.

    Examples:
        >>> world_timeout() is None  # no default group in this process
        True
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return group_timeout(_get_default_group())


def new_group(ranks: Sequence[int] | None = None, backend: str | None = None, **kwargs: Any) -> dist.ProcessGroup:
    """``dist.new_group(ranks, backend=backend, **kwargs)`` with the default group's timeout unless ``timeout`` is
    given. Collective over the world, as ``dist.new_group`` is."""
    kwargs.setdefault("timeout", world_timeout())
    return dist.new_group(list(ranks) if ranks is not None else None, backend=backend, **kwargs)


def time_out_as_world(group: dist.ProcessGroup) -> None:
    """Give a group made elsewhere (a ``DeviceMesh``'s) the default group's timeout; the default group itself and
    groups this rank is not in are left as they are."""
    timeout = world_timeout()
    if timeout is not None and group is not dist.GroupMember.WORLD and group != dist.GroupMember.NON_GROUP_MEMBER:
        _set_pg_timeout(timeout, group)
