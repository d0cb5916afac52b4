"""What the Trainer and Fabric strategies share about launching: a clear refusal of a launcher Jupyter cannot run,
and of ``devices`` that do not match the processes torchrun started on a node."""

from __future__ import annotations

import os
from typing import Any, Protocol

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.imports import _IS_INTERACTIVE

__all__ = ["check_interactive_launch", "check_launch", "check_processes_per_node"]


class _Launched(Protocol):
    @property
    def cluster_environment(self) -> Any: ...

    @property
    def parallel_devices(self) -> list[Any] | None: ...


def check_launch(strategy: Any, where: str) -> None:
    """Both launch checks, from a strategy's ``_configure_launcher`` (``where``: ``"Trainer"`` or ``"Fabric"``)."""
    check_interactive_launch(strategy, strategy._launcher, strategy._start_method, strategy.registered_name, where)
    check_processes_per_node(strategy, where)


def check_interactive_launch(
    strategy: object, launcher: object, start_method: str, name: str | None, where: str
) -> None:
    """Refuse, with the fix, a launcher that cannot start processes from Jupyter or an interactive shell.

    ``name`` is the strategy's registered name (its ``_notebook`` variant is suggested) and ``where`` what takes the
    strategy: ``"Trainer"`` or ``"Fabric"``. The Trainer's error is Lightning's ``MisconfigurationException``, as
    for its own strategies; Fabric's a ``RuntimeError``.
    """
    if not _IS_INTERACTIVE or launcher is None or getattr(launcher, "is_interactive_compatible", True):
        return
    kind = type(strategy).__name__
    by_name = f"{where}(strategy='{name}_notebook')` or `" if name else ""
    error = MisconfigurationException if where == "Trainer" else RuntimeError
    raise error(
        f"{kind}(start_method={start_method!r}) cannot launch processes inside Jupyter or an interactive shell. "
        f"Use `{by_name}{kind}(start_method='fork')` there, or run your code as a script."
    )


def check_processes_per_node(strategy: _Launched, where: str) -> None:
    """Refuse, with the fix, ``devices`` other than the processes torchrun started on this node (its
    ``LOCAL_WORLD_SIZE``), on every rank as the Trainer or Fabric is made (``where``: ``"Trainer"`` or ``"Fabric"``).

    ``devices`` counts the processes a node, ``num_nodes`` the nodes. With ``devices=1, num_nodes=3`` under
    ``torchrun --nproc_per_node 3`` on one machine the world size matches, which is all Lightning checks, and ranks 1
    and 2 would fail later with an ``IndexError`` looking up their device while rank 0 waits for them.
    """
    environment = strategy.cluster_environment
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if environment is None or not environment.creates_processes_externally or not local.isdigit():
        return
    devices = len(strategy.parallel_devices or [])
    if int(local) == devices:
        return
    raise ValueError(
        f"The launcher started {local} processes on this node (LOCAL_WORLD_SIZE={local}, as torchrun sets it), but "
        f"`{where}(devices={devices})` asks for {devices}: `devices` is the number of processes a node and `num_nodes` "
        f"the number of nodes. Pass `{where}(devices={local}, num_nodes=<nodes>)`, or start {devices} a node "
        f"(`torchrun --nproc_per_node {devices}`)."
    )
