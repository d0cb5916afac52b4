"""The replicas of lost ranks a survivor runs beside its own under fault-tolerant local SGD.

Between synchronisations each rank's parameters and inner optimizer state are its own, so a lost rank's share of a
period cannot be averaged from what the survivors hold. At every synchronisation each rank therefore hands the inner
optimizer state of every logical rank it trains to the next member in rank order
(:func:`~lightning_dp_strategies.core.handover.handover_plan`; :func:`start_exchange` sends it while training goes
on). When ranks are lost, the members that kept their states send them to the lost ranks' takers
(:func:`~lightning_dp_strategies.core.handover.takeover_plan`), and each taker rebuilds the lost replica from that
state and the anchor it belongs to (the parameters every rank held at that synchronisation), replays the lost rank's
micro-batches since, and from then on steps it beside its own replica: a :class:`Replicas` swaps a replica's
parameters, gradients, buffers and optimizer state into the module and the optimizer for its step and back out after
it.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_dp_strategies.comm.failures import wait_work

__all__ = ["InnerStates", "Pending", "Replica", "Replicas", "exchange", "start_exchange"]

InnerStates = dict[int, dict[int, dict[str, Any]]]
"""Logical rank -> its inner optimizer state (``optimizer.state`` entries by parameter index)."""


_TENSOR = "lightning_dp_strategies/tensor"


def _packed(obj: object) -> list[Tensor]:
    """``obj`` as byte tensors to be sent one after another: its tensors' bytes (views, not copies), then its outline
    (``obj`` with each tensor replaced by its place, saved by ``torch.save``), then the outline's length (8 bytes).
    A state's bytes are copied once, into the message, and no pickling runs over them."""
    parts: list[Tensor] = []
    offset = 0

    def outline(value: Any) -> Any:
        nonlocal offset
        if isinstance(value, Tensor):
            flat = value.detach().reshape(-1)
            place = {_TENSOR: (offset, str(value.dtype).removeprefix("torch."), list(value.shape))}
            parts.append(flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat)
            offset += flat.numel() * flat.element_size()
            return place
        if isinstance(value, Mapping):
            return {k: outline(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(outline(v) for v in value)
        return value

    buffer = io.BytesIO()
    torch.save(outline(obj), buffer)
    head = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    return [*parts, head, torch.tensor([head.numel()], dtype=torch.int64).view(torch.uint8)]


def _unpacked(message: Tensor) -> Any:
    """What :func:`_packed` packed, its tensors copied out of ``message``."""
    size = int(message[-8:].clone().view(torch.int64).item())
    outline = torch.load(io.BytesIO(message[-8 - size : -8].numpy().tobytes()), weights_only=True)

    def build(value: Any) -> Any:
        if isinstance(value, dict) and _TENSOR in value:
            offset, dtype_name, shape = value[_TENSOR]
            dtype = getattr(torch, dtype_name)
            nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            return message[offset : offset + nbytes].clone().view(dtype).reshape(shape)
        if isinstance(value, dict):
            return {k: build(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(build(v) for v in value)
        return value

    return build(outline)


HANDOVER = "A hand-over of inner optimizer states"


class Pending:
    """An :func:`start_exchange`'s bytes in flight: :meth:`wait` for the objects received, :meth:`arrived` to ask
    without waiting."""

    def __init__(
        self, work: dist.Work, received: Tensor, splits: list[int], members: list[int], sources: Sequence[int]
    ) -> None:
        self.work, self.received, self.splits, self.members, self.sources = work, received, splits, members, sources

    def arrived(self) -> bool:
        """Whether the bytes arrived complete (never waits; ``False`` while in flight or where the exchange failed)."""
        if not self.work.is_completed():
            return False
        try:
            self.work.wait()
        except RuntimeError:
            return False
        return True

    def wait(self, interrupt: Callable[[], str | None] | None = None) -> dict[int, Any]:
        """Wait for the bytes (polling ``interrupt``); the object received from each source.

        Raises:
            PeerLostError: if ``interrupt`` gave the exchange up.
            RuntimeError: what the backend raises when a peer is lost (a failed connection or the group's timeout).
        """
        wait_work(self.work, interrupt, HANDOVER)
        chunks = dict(zip(self.members, torch.split(self.received, self.splits), strict=True))
        return {src: _unpacked(chunks[src]) for src in self.sources}


def start_exchange(
    outgoing: Mapping[int, object],
    sources: Sequence[int],
    group: dist.ProcessGroup,
    interrupt: Callable[[], str | None] | None = None,
) -> Pending:
    """Start sending each ``outgoing[dst]`` to global rank ``dst`` of ``group`` and receiving one object from each of
    ``sources``: two all-to-all collectives over ``group``, every rank of the group taking part. The sizes are
    exchanged before this returns (``interrupt`` polled, as in :meth:`Pending.wait`); the bytes travel on the group's
    threads until :meth:`Pending.wait`."""
    members = dist.get_process_group_ranks(group)
    payloads = {dst: _packed(obj) for dst, obj in outgoing.items()}
    sizes = [sum(part.numel() for part in payloads.get(m, [])) for m in members]
    send_sizes = torch.tensor(sizes, dtype=torch.int64)
    recv_sizes = torch.empty_like(send_sizes)
    sent = torch.cat([part for m in members for part in payloads.get(m, [])] or [torch.empty(0, dtype=torch.uint8)])
    wait_work(dist.all_to_all_single(recv_sizes, send_sizes, group=group, async_op=True), interrupt, HANDOVER)
    received = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8)
    splits_in, splits_out = send_sizes.tolist(), recv_sizes.tolist()
    work = dist.all_to_all_single(received, sent, splits_out, splits_in, group=group, async_op=True)
    assert work is not None
    return Pending(work, received, splits_out, members, sources)


def exchange(
    outgoing: Mapping[int, object],
    sources: Sequence[int],
    group: dist.ProcessGroup,
    interrupt: Callable[[], str | None] | None = None,
) -> dict[int, Any]:
    """:func:`start_exchange`, then wait for what it receives.

    Raises:
        PeerLostError: if ``interrupt`` gave the exchange up.
        RuntimeError: what the backend raises when a peer is lost (a failed connection or the group's timeout).
    """
    return start_exchange(outgoing, sources, group, interrupt).wait(interrupt)


@dataclass
class Replica:
    """A lost logical rank's replica: its parameters, gradients, buffers and inner optimizer state, kept outside the
    module while this rank's own are in it."""

    params: list[Tensor]
    buffers: list[Tensor]
    state: dict[int, dict[str, Any]]
    grads: list[Tensor | None] = field(default_factory=list)


class Replicas:
    """The replicas of lost logical ranks this rank trains beside its own.

    ``params`` and ``buffers`` are the module's trainable parameters and averaged buffers (local SGD's), ``optimizer``
    the inner optimizer over them. Runtime state: ``shadows`` (logical rank -> :class:`Replica`) and
    ``buffers_at_sync`` (the buffers' values at the last synchronisation).

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
        self.buffers_at_sync: list[Tensor] = [b.detach().clone() for b in buffers]

    def states(self, own_rank: int) -> InnerStates:
        """The inner states of every logical rank trained here: this rank's own and each replica's (the tensors
        themselves, not copies: an inner step changes them)."""
        own = {i: self.optimizer.state[p] for i, p in enumerate(self.params) if p in self.optimizer.state}
        return {own_rank: own, **{r: s.state for r, s in self.shadows.items()}}

    def adopt(
        self,
        logical_rank: int,
        state: dict[int, dict[str, Any]],
        params: Sequence[Tensor],
        buffers: Sequence[Tensor] | None = None,
    ) -> None:
        """Start a replica of ``logical_rank`` from an inner ``state`` and parameter values ``params`` (an anchor),
        with ``buffers`` (default: those of the last synchronisation)."""
        values = [v.detach().to(p.dtype, copy=True) for v, p in zip(params, self.params, strict=True)]
        buffers = [b.clone() for b in (self.buffers_at_sync if buffers is None else buffers)]
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
