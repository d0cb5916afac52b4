"""The user's optimizer stepping only this rank's pieces: its parameter groups re-pointed at views of the pieces.

:meth:`ShardedParameters.bind` keeps the optimizer object (learning-rate schedulers and Lightning hold it) and
replaces each group's ``params`` with the pieces of those parameters this rank owns (:class:`~.layout.Piece`), each a
view of the parameter's own storage: an optimizer step writes straight into the parameters. After a synchronised
backward each piece's ``.grad`` is its slice of the reduced bucket (:meth:`ShardedParameters.take_gradients`), and
after the step the buckets' chunks travel round the ring so every rank holds every parameter again
(:mod:`lightning_dp_strategies.sharding.gather`).

Only element-wise optimizers can step a parameter in pieces and match stepping it whole: the update of each element
depends on that element's gradient and state alone (SGD, Adam, AdamW, ...). Others (LBFGS, Adafactor's factored
moments) are refused at setup.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer

from lightning_dp_strategies.sharding.layout import Piece, ShardLayout

__all__ = ["ELEMENTWISE_OPTIMIZERS", "ShardedOptimizer", "ShardedParameters", "check_elementwise"]

ELEMENTWISE_OPTIMIZERS: tuple[type[Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.ASGD,
    torch.optim.Rprop,
)
"""The optimizers whose update is element-wise (and their subclasses): each can step a parameter in pieces. A class
of your own with a true ``elementwise`` class attribute is accepted too."""


def check_elementwise(optimizer: Optimizer) -> None:
    """A clear error unless ``optimizer`` updates every element from that element's gradient and state alone.

    Examples:
        >>> check_elementwise(torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))]))
        >>> check_elementwise(torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(1))]))
        Traceback (most recent call last):
        ...
        TypeError: shard_optimizer_state=True steps each rank's part of every parameter, ...
    """
    if isinstance(optimizer, ELEMENTWISE_OPTIMIZERS) or getattr(type(optimizer), "elementwise", False) is True:
        return
    names = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
    raise TypeError(
        "shard_optimizer_state=True steps each rank's part of every parameter, which equals stepping the whole "
        f"parameter only for element-wise optimizers; {type(optimizer).__name__} is not known to be one. Use one of "
        f"{names} (or a subclass), set `elementwise = True` on your optimizer class if its update of each element "
        "depends on that element alone, or train with shard_optimizer_state=False."
    )


@dataclass
class ShardedOptimizer:
    """One optimizer bound to this rank's pieces: its original parameter groups and the pieces now in their place."""

    optimizer: Optimizer
    groups: list[list[Parameter]]
    """Each parameter group's original parameters (what a single-device optimizer numbers its state by)."""
    pieces: list[list[Piece]]
    """Each group's pieces on this rank, in the order of the group's ``params`` now."""
    buckets: list[int] = field(default_factory=list)
    """The buckets its parameters lie in, in order (the same on every rank)."""


class ShardedParameters:
    """This rank's pieces as tensors an optimizer steps, and the optimizers bound to them.

    Args:
        layout: the buckets' shard layout.
        rank: this rank's index in the group the buckets are reduced over.
    """

    def __init__(self, layout: ShardLayout, rank: int) -> None:
        self.layout = layout
        self.rank = rank
        self.views: dict[Piece, Parameter] = {}
        for piece in layout.pieces_of_rank(rank):
            param = layout.params[piece.param]
            if not param.is_contiguous():
                raise ValueError(
                    f"A parameter of shape {tuple(param.shape)} is not contiguous, so shard_optimizer_state=True "
                    "cannot step it in pieces. Make it contiguous before training (`p.data = p.data.contiguous()`)."
                )
            self.views[piece] = Parameter(param.detach().view(-1)[piece.start : piece.stop])
        self._view_ids = {id(view) for view in self.views.values()}
        self._storage_of = {param: param.untyped_storage().data_ptr() for param in layout.params}
        """Where each parameter kept its elements at setup: the pieces are views of it, and every rank gathers every
        parameter into it (so every rank checks every parameter, and all fail together)."""
        self.optimizers: list[ShardedOptimizer] = []
        self._taken: dict[Piece, Tensor] = {}  # the bucket slices the pieces' .grad still are

    def bind(self, optimizer: Optimizer) -> ShardedOptimizer:
        """Point ``optimizer``'s parameter groups at this rank's pieces of their parameters (state it already holds
        is sliced the same way)."""
        check_elementwise(optimizer)
        mine = {piece.param: piece for piece in self.layout.pieces_of_rank(self.rank)}
        groups: list[list[Parameter]] = [list(group["params"]) for group in optimizer.param_groups]
        indices = [[i for p in params if (i := self._index_of(p)) is not None] for params in groups]
        pieces = [[mine[i] for i in group if i in mine] for group in indices]
        held = {id(p): optimizer.state[p] for params in groups for p in params if p in optimizer.state}
        for group, group_pieces in zip(optimizer.param_groups, pieces, strict=True):
            group["params"] = [self.views[piece] for piece in group_pieces]
        optimizer.state.clear()
        for piece in (piece for group_pieces in pieces for piece in group_pieces):
            state = held.get(id(self.layout.params[piece.param]))
            if state:
                optimizer.state[self.views[piece]] = slice_state(state, self.layout.params[piece.param], piece)
        # every rank gathers the same buckets: those holding any of the optimizer's parameters, owned here or not
        wanted = {i for group in indices for i in group}
        buckets = [b for b, members in enumerate(self.layout.bucket_params) if wanted.intersection(members)]
        bound = ShardedOptimizer(optimizer, groups, pieces, buckets)
        self.optimizers.append(bound)
        return bound

    def _index_of(self, param: Tensor) -> int | None:
        """``param``'s position in the layout; ``None`` for a frozen one (never bucketed, never stepped)."""
        index = self.layout.index.get(id(param))
        if index is None and param.requires_grad:
            raise ValueError(
                f"The optimizer holds a parameter of shape {tuple(param.shape)} that is not a trainable parameter of "
                "the LightningModule, so no bucket reduces its gradient. Optimize only the module's own parameters "
                "(`self.parameters()` in `configure_optimizers`) with shard_optimizer_state=True."
            )
        return index

    def bound(self, optimizer: Optimizer) -> ShardedOptimizer:
        """The binding of ``optimizer`` (or of the optimizer a Lightning wrapper holds)."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        for bound in self.optimizers:
            if bound.optimizer is optimizer:
                return bound
        raise ValueError(f"{type(optimizer).__name__} was not set up by the strategy, so it cannot be sharded.")

    def check_bound(self) -> None:
        """A clear error if a bound optimizer got parameters of its own since (``add_param_group``): they would
        never be stepped; or if a parameter's storage was replaced (``param.data = ...``): its pieces would be
        stepped where the module no longer reads."""
        moved = [p for p, v in self._storage_of.items() if p.untyped_storage().data_ptr() != v]
        if moved:
            raise RuntimeError(
                f"The storage of {len(moved)} parameter(s) (the first of shape {tuple(moved[0].shape)}) was replaced "
                "during training (`param.data = ...`, as Lightning's ModelPruning does when it resets the weights "
                "for the lottery ticket hypothesis); with shard_optimizer_state=True the optimizer steps views of "
                "the storage the parameters had at setup, which the module no longer reads. Update parameters in "
                "place (`param.data.copy_(...)`), pass `ModelPruning(use_lottery_ticket_hypothesis=False)`, or train "
                "with shard_optimizer_state=False."
            )
        for bound in self.optimizers:
            foreign = [p for g in bound.optimizer.param_groups for p in g["params"] if id(p) not in self._view_ids]
            if foreign:
                raise RuntimeError(
                    f"{type(bound.optimizer).__name__} holds {len(foreign)} parameter(s) added after setup (e.g. by "
                    "`add_param_group` in a fine-tuning callback); with shard_optimizer_state=True they would never "
                    "be stepped. Put every trainable parameter in the optimizer in `configure_optimizers`, or train "
                    "with shard_optimizer_state=False."
                )

    # ------------------------------------------------------------------ gradients
    def keep_gradients(self) -> None:
        """Before a synchronised backward: a piece whose ``.grad`` still is its bucket slice (not stepped yet, or
        zeroed in place) gets its own copy, since the backward refills the bucket."""
        for piece, view in self.views.items():
            taken = self._taken.pop(piece, None)
            if taken is not None and view.grad is taken:
                view.grad = taken.clone()

    def take_gradients(self, buffers: Sequence[Tensor], flags: Sequence[Sequence[float]]) -> None:
        """After a synchronised backward: each piece's ``.grad`` is its slice of the reduced bucket (added to the
        gradient it holds, if any); a piece of a parameter no rank had a gradient for keeps what it has.

        Args:
            buffers: each bucket's buffer, this rank's chunk reduced.
            flags: each bucket's summed presence flags, per parameter in bucket order.
        """
        first = [members[0] for members in self.layout.bucket_params]
        for piece, view in self.views.items():
            if flags[piece.bucket][piece.param - first[piece.bucket]] <= 0:
                continue
            reduced = buffers[piece.bucket][piece.offset : piece.offset + piece.numel]
            if view.grad is None:
                view.grad = reduced
                self._taken[piece] = reduced
            else:
                view.grad.add_(reduced)

    def state_numel(self) -> int:
        """Elements of optimizer state (tensors the shape of a piece) this rank holds, over every bound optimizer."""
        total = 0
        for bound in self.optimizers:
            for view, state in bound.optimizer.state.items():
                total += sum(v.numel() for v in state.values() if isinstance(v, Tensor) and v.shape == view.shape)
        return total


def slice_state(state: dict[str, object], param: Tensor, piece: Piece) -> dict[str, object]:
    """A parameter's optimizer state cut to ``piece``: tensors shaped like the parameter are sliced (copies), the
    rest (``step``, ...) kept.

    Examples:
        >>> w = torch.zeros(2, 3)
        >>> cut = slice_state({"step": torch.tensor(4.0), "exp_avg": torch.arange(6.0).view(2, 3)}, w,
        ...                   Piece(param=0, rank=0, start=2, stop=5, bucket=0, offset=0))
        >>> cut["step"].item(), cut["exp_avg"].tolist()
        (4.0, [2.0, 3.0, 4.0])
    """
    return {
        key: value.reshape(-1)[piece.start : piece.stop].clone()
        if isinstance(value, Tensor) and is_elementwise(value, param.shape)
        else value
        for key, value in state.items()
    }


def is_elementwise(value: object, shape: torch.Size) -> bool:
    """Whether a state entry holds one value per element of a tensor of ``shape``."""
    return isinstance(value, Tensor) and value.shape == shape
