"""Process groups that survive torchrun's restarts: each attempt of the job meets under a key prefix of its own.

Under ``torchrun`` (c10d or static rendezvous) the workers do not host the store their process group meets in: the
agent of node 0 does (``TORCHELASTIC_USE_AGENT_STORE=True``), and the same store serves every restart of the job.
torch's ``env://`` initialisation uses it with fixed keys (``default_pg/0//cpu//0/<rank>``, one group after another),
so after a restart the keys of the dead attempt are still there: a new worker that reads a peer's key before that
peer has rewritten it dials the dead worker's address (``Connection refused, remote=[10.77.0.1]:<old port>``) and the
job hangs until the collective timeout. Whether it does depends on which worker starts first: a race, not a rule.

Here the workers of one attempt first agree on a fresh random prefix, then initialise the default process group on
the agent's store under it, so every key of this attempt (the default group's, every ``new_group``'s, barriers')
is new::

    global rank 0 (leader)                                  every other rank r
    nonce = random                                          token = random
                                                            set  hello/<r> = token
    loop: read hello/<every rank>; set ack/<token> = nonce  wait ack/<token>  ─▶ nonce
          until <nonce>/joined == world - 1                 add  <nonce>/joined
    ──────────── init_process_group(store=PrefixStore(<nonce>/, agent store)) on every rank ────────────

A stale ``hello`` of a dead worker only earns an ``ack`` nobody waits for; a fresh one is answered within one poll.
The restart counts (``TORCHELASTIC_RESTART_COUNT``) are not used: they are counted per node and differ between nodes
once a node's agent restarts its workers for a membership change.
"""

from __future__ import annotations

import atexit
import os
import time
import uuid
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import _destroy_dist_connection

from lightning_dp_strategies.core.options import default_timeout

__all__ = [
    "agree_on_attempt",
    "attempt_store",
    "init_restart_safe_process_group",
    "init_strategy_process_group",
    "running_attempt_store",
    "shares_agent_store",
]

PREFIX = "lightning_dp_strategies/attempt"
"""Where the handshake's keys live in the agent's store."""
POLL_S = 0.05


def shares_agent_store() -> bool:
    """Whether this process is a torchrun worker whose process group meets in the agent's long-lived store.

    Examples:
        >>> import os
        >>> os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or shares_agent_store()  # not under torchrun
        False
    """
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_PORT" in os.environ


def agree_on_attempt(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> str:
    """The nonce every rank of this attempt agrees on, whatever keys earlier attempts left in ``store``.

    A collective over the store: every rank of the job calls it (see the module docstring for the protocol).

    Examples:
        >>> import threading
        >>> store = dist.HashStore()
        >>> store.set(f"{PREFIX}/hello/1", "left by a dead worker")
        >>> nonces = {}
        >>> def rank(r): nonces[r] = agree_on_attempt(store, r, 2, timedelta(seconds=10))
        >>> threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
        >>> for t in threads: t.start()
        >>> for t in threads: t.join()
        >>> nonces[0] == nonces[1]
        True

    Raises:
        TimeoutError: if the other ranks do not all take part within ``timeout``, naming the ranks missing.
    """
    if rank != 0:
        token = uuid.uuid4().hex
        store.set(f"{PREFIX}/hello/{rank}", token)
        store.wait([f"{PREFIX}/ack/{token}"], timeout)
        nonce = store.get(f"{PREFIX}/ack/{token}").decode()
        store.add(f"{PREFIX}/{nonce}/joined", 1)
        return nonce
    nonce = uuid.uuid4().hex
    answered: set[str] = set()
    deadline = time.monotonic() + timeout.total_seconds()
    while world_size > 1 and store.add(f"{PREFIX}/{nonce}/joined", 0) < world_size - 1:
        for peer in range(1, world_size):
            key = f"{PREFIX}/hello/{peer}"
            greeting = store.get(key).decode() if store.check([key]) else None
            if greeting is not None and greeting not in answered:
                store.set(f"{PREFIX}/ack/{greeting}", nonce)
                answered.add(greeting)
        if time.monotonic() > deadline:
            joined = store.add(f"{PREFIX}/{nonce}/joined", 0)
            raise TimeoutError(
                f"Only {joined} of the {world_size - 1} other ranks joined this attempt of the job within {timeout} "
                "(greeted by the store at MASTER_ADDR:MASTER_PORT). A worker failed to start or cannot reach the "
                "store: look for the first error in the other workers' logs, or raise the strategy's `timeout`."
            )
        time.sleep(POLL_S)
    return nonce


def attempt_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The agent's store (``MASTER_ADDR:MASTER_PORT``) under the prefix this attempt's ranks agree on.

    Examples:
        >>> import os
        >>> server = dist.TCPStore("127.0.0.1", 0, is_master=True)  # what torchrun's agent hosts
        >>> os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(server.port))
        >>> store = attempt_store(0, 1, timedelta(seconds=10))  # one rank: no peer to wait for
        >>> store.set("key", "value"); [k for k in server.list_keys() if k.endswith("/key")] != []
        True
        >>> for name in ("MASTER_ADDR", "MASTER_PORT"): del os.environ[name]
    """
    agent = dist.TCPStore(
        os.environ.get("MASTER_ADDR", "localhost"),
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timeout,
    )
    nonce = agree_on_attempt(agent, rank, world_size, timeout)
    if rank == 0:
        agent.set(f"{PREFIX}/current", nonce)  # for a replacement that joins the running attempt (fault_tolerant)
    return dist.PrefixStore(f"{PREFIX}/{nonce}/", agent)


def running_attempt_store(suffix: str, timeout: timedelta) -> dist.Store | None:
    """The agent's store under the running attempt's prefix and ``suffix`` (a fault-tolerant job's own keys, which a
    replacement started later reaches the same way); ``None`` where the job does not share torchrun's agent store."""
    if not shares_agent_store():
        return None
    agent = dist.TCPStore(
        os.environ.get("MASTER_ADDR", "localhost"), int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    agent.wait([f"{PREFIX}/current"], timeout)
    return dist.PrefixStore(f"{PREFIX}/{agent.get(f'{PREFIX}/current').decode()}/{suffix}", agent)


def init_restart_safe_process_group(
    environment: ClusterEnvironment, backend: str, timeout: timedelta, device: torch.device
) -> bool:
    """Initialise the default process group under this attempt's own prefix when torchrun shares its store.

    Called by the strategies before Lightning's own initialisation, which then finds the group made and skips its
    ``env://`` one. Elsewhere (no torchrun, or a group already made) it does nothing.

    Args:
        environment: the strategy's cluster environment (ranks and world size).
        backend: the process-group backend (``"gloo"``, ``"nccl"``, ...).
        timeout: the collective timeout, also the handshake's.
        device: this rank's device (passed to ``init_process_group`` as ``device_id`` when it is not the CPU).

    Returns:
        Whether it initialised the default process group.

    Examples:
        >>> from lightning.fabric.plugins.environments import LightningEnvironment
        >>> init_restart_safe_process_group(LightningEnvironment(), "gloo", timedelta(seconds=30), torch.device("cpu"))
        False
    """
    if dist.is_initialized() or not shares_agent_store():
        return False
    rank, world_size = environment.global_rank(), environment.world_size()
    store = attempt_store(rank, world_size, timeout)
    device_id = device if device.type != "cpu" else None
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id
    )
    if "nccl" in backend:  # as Lightning's own initialisation: torch warns about an NCCL group left at exit
        atexit.register(_destroy_dist_connection)
    return True


class DistributedStrategy(Protocol):
    """What :func:`init_strategy_process_group` reads of a Lightning DDP strategy (Trainer's or Fabric's)."""

    cluster_environment: ClusterEnvironment | None
    _timeout: timedelta | None

    @property
    def root_device(self) -> torch.device: ...

    def _get_process_group_backend(self) -> str: ...


def init_strategy_process_group(strategy: DistributedStrategy, init: bool = True) -> None:
    """:func:`init_restart_safe_process_group` for ``strategy``, its world ranks already set: its backend, its device,
    and its collective timeout, which is set to ``default_timeout(backend)`` when none was given (only that with
    ``init=False``).

    Lightning's own initialisation (``super().setup_distributed()``) follows it and uses the same timeout.
    """
    backend = strategy._get_process_group_backend()
    if strategy._timeout is None:
        strategy._timeout = default_timeout(backend)
    if not init:
        return
    assert strategy.cluster_environment is not None
    init_restart_safe_process_group(strategy.cluster_environment, backend, strategy._timeout, strategy.root_device)
