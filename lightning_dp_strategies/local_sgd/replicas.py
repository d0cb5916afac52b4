"""The replicas of lost ranks a survivor runs beside its own under fault-tolerant local SGD.

Between synchronisations each rank's parameters and inner optimizer state are its own, so a lost rank's share of a
period cannot be averaged from what the survivors hold. At every synchronisation each rank therefore hands the inner
optimizer state of every logical rank it trains to the next member in rank order
(:func:`~lightning_dp_strategies.core.handover.handover_plan`). When ranks are lost, the members that kept their states
send them to the lost ranks' takers (:func:`~lightning_dp_strategies.core.handover.takeover_plan`), and each
taker rebuilds the lost replica from that state and the anchor (the parameters every rank held at the
synchronisation), replays the lost rank's micro-batches since, and from then on steps it beside its own replica: a
:class:`Replicas` swaps a replica's parameters, gradients, buffers and optimizer state into the module and the
optimizer for its step and back out after it.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_dp_strategies.comm.failures import wait_work

__all__ = ["InnerStates", "Replica", "Replicas", "exchange"]

InnerStates = dict[int, dict[int, dict[str, Any]]]
"""Logical rank -> its inner optimizer state (``optimizer.state`` entries by parameter index)."""


def _to_bytes(obj: object) -> Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


HANDOVER = "A hand-over of inner optimizer states"


def exchange(
    outgoing: Mapping[int, object],
    sources: Sequence[int],
    group: dist.ProcessGroup,
    interrupt: Callable[[], str | None] | None = None,
) -> dict[int, Any]:
    """Send each ``outgoing[dst]`` to global rank ``dst`` of ``group`` and receive one object from each of
    ``sources``: two all-to-all collectives over ``group`` (the sizes, then the bytes), every rank of the group
    taking part. ``interrupt`` is polled while waiting: what it returns instead of ``None`` gives the exchange up.

    Raises:
        PeerLostError: if ``interrupt`` gave the exchange up.
        RuntimeError: what the backend raises when a peer is lost (a failed connection or the group's timeout).
    """
    members = dist.get_process_group_ranks(group)
    payloads = {dst: _to_bytes(obj) for dst, obj in outgoing.items()}
    empty = torch.empty(0, dtype=torch.uint8)
    send_sizes = torch.tensor([payloads[m].numel() if m in payloads else 0 for m in members], dtype=torch.int64)
    recv_sizes = torch.empty_like(send_sizes)
    wait_work(dist.all_to_all_single(recv_sizes, send_sizes, group=group, async_op=True), interrupt, HANDOVER)
    sent = torch.cat([payloads.get(m, empty) for m in members])
    received = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8)
    splits_in, splits_out = send_sizes.tolist(), recv_sizes.tolist()
    work = dist.all_to_all_single(received, sent, splits_out, splits_in, group=group, async_op=True)
    wait_work(work, interrupt, HANDOVER)
    chunks = dict(zip(members, torch.split(received, splits_out), strict=True))
    return {src: torch.load(io.BytesIO(chunks[src].numpy().tobytes()), weights_only=True) for src in sources}


@dataclass
class Replica:
    """A lost logical rank's replica: its parameters, gradients, buffers and inner optimizer state, kept outside the
    module while this rank's own are in it."""

    params: list[Tensor]
    buffers: list[Tensor]
    state: dict[int, dict[str, Any]]
    grads: list[Tensor | None] = field(default_factory=list)


class Replicas:
    """The replicas of lost logical ranks this rank trains beside its own, and the inner states handed to it.

    ``params`` and ``buffers`` are the module's trainable parameters and averaged buffers (local SGD's), ``optimizer``
    the inner optimizer over them. Runtime state: ``shadows`` (logical rank -> :class:`Replica`), ``handed`` (the
    inner states handed to this rank at the last synchronisation every rank completed, logical rank -> state) and
    ``buffers_at_sync`` (the buffers' values then).

    Examples:
        >>> model = nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> replicas = Replicas(list(model.parameters()), [], optimizer)
        >>> replicas.adopt(1, {}, [torch.zeros(1, 2), torch.zeros(1)])
        >>> with replicas.swapped(1):
        ...     model.weight.abs().sum().item()
        0.0
        >>> model.weight.abs().sum().item() > 0, sorted(replicas.shadows)
        (True, [1])
    """

    def __init__(self, params: list[nn.Parameter], buffers: list[Tensor], optimizer: Optimizer) -> None:
        self.params = params
        self.buffers = buffers
        self.optimizer = optimizer
        self.shadows: dict[int, Replica] = {}
        self.handed: InnerStates = {}
        self.buffers_at_sync: list[Tensor] = [b.detach().clone() for b in buffers]

    def own_state(self) -> dict[int, dict[str, Any]]:
        """This rank's inner optimizer state, copied, by parameter index."""
        return {i: _clone(self.optimizer.state[p]) for i, p in enumerate(self.params) if p in self.optimizer.state}

    def states(self, own_rank: int) -> InnerStates:
        """The inner states of every logical rank trained here: this rank's own and each replica's (copies)."""
        return {own_rank: self.own_state(), **{r: _clone(s.state) for r, s in self.shadows.items()}}

    def adopt(self, logical_rank: int, state: dict[int, dict[str, Any]], params: Sequence[Tensor]) -> None:
        """Start a replica of ``logical_rank`` from an inner ``state`` and parameter values ``params`` (the anchor),
        with the buffers of the last synchronisation."""
        values = [v.detach().to(p.dtype, copy=True) for v, p in zip(params, self.params, strict=True)]
        buffers = [b.clone() for b in self.buffers_at_sync]
        self.shadows[logical_rank] = Replica(values, buffers, _clone(state), [None] * len(values))

    def give(self, logical_rank: int) -> dict[str, Any]:
        """The replica of ``logical_rank``, as :meth:`take` installs it on another rank (it stays here until its
        ``shadows`` entry is dropped)."""
        replica = self.shadows[logical_rank]
        return {"params": replica.params, "buffers": replica.buffers, "state": replica.state}

    def take(self, logical_rank: int, given: Mapping[str, Any]) -> None:
        """Install the replica of ``logical_rank`` another rank trained until now (:meth:`give`)."""
        params = [v.to(p.dtype) for v, p in zip(given["params"], self.params, strict=True)]
        state = dict(given["state"])
        self.shadows[logical_rank] = Replica(params, list(given["buffers"]), state, [None] * len(params))

    def reset(self, indices: Sequence[int], values: Sequence[Tensor]) -> None:
        """Every replica's parameters ``indices`` set to ``values`` and its buffers to this rank's (after an outer
        step, where every replica holds the new global values)."""
        with torch.no_grad():
            for replica in self.shadows.values():
                for i, value in zip(indices, values, strict=True):
                    replica.params[i].copy_(value)
                for mine, own in zip(replica.buffers, self.buffers, strict=True):
                    mine.copy_(own)

    def changes(self, anchor: Sequence[Tensor], indices: Sequence[int]) -> list[Tensor]:
        """The replicas' summed changes ``anchor - params`` of ``indices`` (fp32), then their summed buffers."""
        sums = [torch.zeros_like(anchor[i]) for i in indices]
        buffers = [torch.zeros_like(b) for b in self.buffers]
        for replica in self.shadows.values():
            for total, i in zip(sums, indices, strict=True):
                total += anchor[i] - replica.params[i].to(torch.float32)
            for total, buffer in zip(buffers, replica.buffers, strict=True):
                total += buffer
        return sums + buffers

    @contextmanager
    def swapped(self, logical_rank: int) -> Generator[None, None, None]:
        """Inside: the module's parameters, gradients and buffers and the optimizer's state are the replica's."""
        replica = self.shadows[logical_rank]
        self._swap(replica)
        try:
            yield
        finally:
            self._swap(replica)

    def _swap(self, replica: Replica) -> None:
        state = self.optimizer.state
        for i, param in enumerate(self.params):
            param.data, replica.params[i] = replica.params[i], param.data
            param.grad, replica.grads[i] = replica.grads[i], param.grad
            own = state.pop(param, None)
            if i in replica.state:
                state[param] = replica.state.pop(i)
            if own is not None:
                replica.state[i] = own
        for i, buffer in enumerate(self.buffers):
            buffer.data, replica.buffers[i] = replica.buffers[i], buffer.data


def _clone(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {k: _clone(v) for k, v in value.items()}
    return value
