"""The whole optimizer state from the ranks' pieces, streamed to one writer, and each rank's pieces of a whole state.

A save is a collective in two calls, as Lightning makes it: :meth:`ShardedSave.describe` for each optimizer (every
rank tells rank 0 which state its pieces hold: keys, dtypes and small values such as ``step``), then
:meth:`ShardedSave.write`::

    describe: ranks ──(keys, dtypes, step)──▶ rank 0: a single-device state_dict, each whole state tensor a stand-in
    write:    rank 0 writes the file; for each stand-in in turn it receives every piece from the rank that owns it

The file holds what one optimizer over the whole module would save (numbered by its original parameter groups), so
any strategy and single-device training load it. No rank holds more than its own pieces and one buffer the size of
the largest whole tensor, which each arrives in. Loading (:func:`local_state`) cuts a whole state to this rank's
pieces under the current layout, whatever the world size that saved it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import IO, Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp_strategies.pipeline.streamed import Inbox, Remote, write_streamed
from lightning_dp_strategies.sharding.layout import Piece
from lightning_dp_strategies.sharding.optimizer import ShardedOptimizer, ShardedParameters, is_elementwise, slice_state

__all__ = ["ShardedSave", "finish_save", "local_state"]

WRITER = 0
"""The rank that writes the file (global rank 0), and the one source every stand-in is adopted under."""


@dataclass(frozen=True)
class _PerElement:
    """In a description: a state tensor with one value per element of the piece."""

    dtype: torch.dtype


@dataclass
class _Stand:
    """What fills one stand-in: a parameter's pieces in element order, and the writer's own tensors among them."""

    pieces: list[Piece]
    own: dict[Piece, Tensor]


def _describe_pieces(shards: ShardedParameters, bound: ShardedOptimizer, sends: list[Tensor]) -> dict[int, Any]:
    """Per layout index of a parameter, the state keys of this rank's piece (per-element ones as their dtype);
    per-element tensors queue in ``sends`` in the order the writer receives them."""
    described: dict[int, dict[str, Any]] = {}
    mine = {piece.param: piece for pieces in bound.pieces for piece in pieces}
    order = [shards.layout.index.get(id(p), -1) for params in bound.groups for p in params]
    for piece in (mine[i] for i in order if i in mine):  # the writer's order: the optimizer's own numbering
        view = shards.views[piece]
        state = bound.optimizer.state.get(view)
        if not state:
            continue
        entry: dict[str, Any] = {}
        for key, value in state.items():
            if is_elementwise(value, view.shape):
                entry[key] = _PerElement(value.dtype)
                sends.append(value.detach())
            else:
                entry[key] = value.detach().cpu() if isinstance(value, Tensor) else value
        described[piece.param] = entry
    return described


@dataclass
class ShardedSave:
    """One checkpoint being saved: the writer's stand-ins and, on every other rank, its tensors to send."""

    inbox: Inbox = field(default_factory=Inbox)
    stands: list[_Stand] = field(default_factory=list)
    sends: list[Tensor] = field(default_factory=list)

    def describe(self, shards: ShardedParameters, bound: ShardedOptimizer, rank: int, world: int) -> dict[str, Any]:
        """The whole ``state_dict`` of ``bound``'s optimizer on the writer (whole state tensors as stand-ins that
        :meth:`write` fills in), this rank's own ``state_dict`` elsewhere. A collective over the default group."""
        sends: list[Tensor] = []
        described = _describe_pieces(shards, bound, sends)
        gathered: list[Any] | None = [None] * world if rank == WRITER else None
        dist.gather_object(described, gathered, dst=WRITER)
        if gathered is None:
            self.sends += sends
            return bound.optimizer.state_dict()
        layout, state, number = shards.layout, {}, 0
        for params in bound.groups:
            for param in params:
                i = layout.index.get(id(param), -1)
                pieces = layout.pieces_of_param(i) if i >= 0 else []
                entries = [gathered[p.rank][i] for p in pieces if i in gathered[p.rank]]
                if entries:
                    own = {p: bound.optimizer.state[shards.views[p]] for p in pieces if p.rank == rank}
                    state[number] = self._whole_entry(entries[0], param, pieces, own)
                number += 1
        groups, first = [], 0
        for group, params in zip(bound.optimizer.state_dict()["param_groups"], bound.groups, strict=True):
            groups.append({**group, "params": list(range(first, first + len(params)))})
            first += len(params)
        return {"state": state, "param_groups": groups}

    def _whole_entry(
        self, entry: Mapping[str, Any], param: Tensor, pieces: list[Piece], own: Mapping[Piece, Mapping[str, Any]]
    ) -> dict[str, Any]:
        whole: dict[str, Any] = {}
        for key, value in entry.items():
            if isinstance(value, _PerElement):
                whole[key] = self.inbox.adopt(Remote(len(self.stands), tuple(param.shape), value.dtype), WRITER)
                self.stands.append(_Stand(pieces, {p: state[key] for p, state in own.items()}))
            else:
                whole[key] = value
        return whole

    # ------------------------------------------------------------------ write
    def receive(self) -> Callable[[int, Tensor], None]:
        """The writer's ``receive(src, buffer)``: fills the next stand-in's whole tensor from its pieces' owners."""
        stands = iter(self.stands)

        def fill(_: int, buffer: Tensor) -> None:
            stand, flat = next(stands), buffer.view(-1)
            for piece in stand.pieces:
                into = flat[piece.start : piece.stop]
                if piece.rank == WRITER:
                    into.copy_(stand.own[piece])
                else:
                    dist.recv(into, src=piece.rank)

        return fill

    def send(self, device: torch.device) -> None:
        """On a rank other than the writer: send this rank's pieces of every stand-in, in the writer's order."""
        sends, self.sends = self.sends, []
        for tensor in sends:
            dist.send(tensor.contiguous().to(device), dst=WRITER)

    def write(self, checkpoint: Any, file: IO[bytes], device: torch.device) -> None:
        """On the writer: write ``checkpoint`` to ``file`` as ``torch.save`` would, the stand-ins filled as their
        pieces arrive."""
        write_streamed(checkpoint, file, self.inbox, self.receive(), device)

    def fill(self, checkpoint: Any, device: torch.device) -> Any:
        """On the writer: ``checkpoint`` with every stand-in received whole (for a ``checkpoint_io`` that cannot
        stream)."""
        return self.inbox.fill(checkpoint, self.receive(), device)

    def drain(self, device: torch.device) -> None:
        """On the writer, after a failure: receive whatever is still expected, so that no sender waits forever."""
        self.inbox.drain(self.receive(), device)


def local_state(whole: Mapping[str, Any], shards: ShardedParameters, bound: ShardedOptimizer) -> dict[str, Any]:
    """This rank's ``state_dict`` for ``bound``'s optimizer, cut from the state_dict of a whole optimizer (as
    :meth:`ShardedSave.describe` or any single-device run saves it) with the same parameter groups.

    Raises:
        ValueError: the whole state's groups do not match the optimizer's (another model or optimizer).
    """
    groups = whole["param_groups"]
    sizes = [len(g["params"]) for g in groups]
    if sizes != [len(params) for params in bound.groups]:
        raise ValueError(
            f"The checkpoint's optimizer has parameter groups of {sizes} parameters, but this optimizer has "
            f"{[len(params) for params in bound.groups]}: it was saved for another model or optimizer."
        )
    layout, saved = shards.layout, whole["state"]
    local_state: dict[int, Any] = {}
    local_groups, number = [], 0
    for group, params, group_pieces in zip(groups, bound.groups, bound.pieces, strict=True):
        mine = {piece.param: piece for piece in group_pieces}
        local_ids = []
        for saved_id, param in zip(group["params"], params, strict=True):
            piece = mine.get(layout.index.get(id(param), -1))
            if piece is None:
                continue
            if saved_id in saved:
                local_state[number] = slice_state(saved[saved_id], param, piece)
            local_ids.append(number)
            number += 1
        local_groups.append({**group, "params": local_ids})
    return {"state": local_state, "param_groups": local_groups}


def finish_save(
    save: ShardedSave,
    checkpoint: Any,
    writer: bool,
    device: torch.device,
    stream: Callable[[Callable[[IO[bytes]], None]], None] | None,
    save_whole: Callable[[Any], None],
) -> None:
    """End ``save``: the other ranks send their pieces while the writer writes ``checkpoint``.

    Args:
        save: the save ``checkpoint``'s optimizer states were described into.
        checkpoint: what Lightning (or Fabric) dumped, with stand-ins on the writer.
        writer: this is global rank 0.
        device: where the pieces travel (the process group's device).
        stream: ``stream(fill)`` opens the target file for ``fill`` to write (atomically); ``None`` where the
            checkpoint cannot be streamed (a remote path, another ``checkpoint_io``): the writer then receives
            every stand-in whole before saving.
        save_whole: saves a checkpoint with nothing left to receive, as the strategy saves any.
    """
    if not writer:
        save.send(device)
        return
    if not len(save.inbox):
        save_whole(checkpoint)
        return
    try:
        if stream is not None:
            stream(lambda file: save.write(checkpoint, file, device))
        else:
            save_whole(save.fill(checkpoint, device))
    finally:
        save.drain(device)  # after a failure: no sender is left waiting
