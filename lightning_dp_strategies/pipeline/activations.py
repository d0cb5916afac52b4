"""What travels between blocks and stages: one tensor, or a tuple of tensors that share the batch dimension.

The body is an ``nn.Sequential``, so on one device each block receives the previous block's output as its single
argument: a block that returns ``(hidden, mask)`` is followed by a block whose ``forward`` takes that tuple. The
pipeline keeps exactly this contract. Between stages ``torch.distributed.pipelining`` sends a tuple as separate
tensors, and the receiving stage packs them back into a tuple (:func:`from_args`). Micro-batches are cut and the last
stage's outputs merged along dimension 0, so every tensor of an activation has the batch as its first dimension.
:func:`check_blocks` runs the body once on fake tensors (no memory, no compute, the random state put back) and refuses
anything else, naming the block and what it returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeGuard

import torch
from torch import Tensor, nn

__all__ = [
    "Activation",
    "as_args",
    "batch_size",
    "check_activation",
    "check_blocks",
    "describe",
    "detach",
    "from_args",
    "is_activation",
    "signature",
]

Activation = Tensor | tuple[Tensor, ...]
"""One tensor, or a tuple of at least two tensors whose first dimension is the batch."""


def as_args(x: Activation) -> tuple[Tensor, ...]:
    """The positional arguments that carry ``x`` to a pipeline stage (a tuple is sent as its tensors)."""
    return tuple(x) if isinstance(x, tuple) else (x,)


def from_args(args: Sequence[Tensor]) -> Activation:
    """What a stage received, as its first block takes it: one tensor, or the tuple the previous stage returned.

    Examples:
        >>> a, b = torch.zeros(2), torch.ones(2)
        >>> from_args((a,)) is a, from_args((a, b)) == (a, b)
        (True, True)
    """
    return args[0] if len(args) == 1 else tuple(args)


def is_activation(x: object) -> TypeGuard[Activation]:
    """Whether ``x`` is a tensor or a non-empty tuple of tensors.

    Examples:
        >>> is_activation(torch.zeros(1)), is_activation((torch.zeros(1), None)), is_activation(())
        (True, False, False)
    """
    tensors = x if isinstance(x, tuple) else (x,)
    return bool(tensors) and all(isinstance(t, Tensor) for t in tensors)


def batch_size(x: Activation) -> int:
    """The batch dimension of ``x`` (of its first tensor, for a tuple)."""
    return int(as_args(x)[0].shape[0])


def detach(x: Any) -> Any:
    """``x`` detached: a tensor, or each tensor of a tuple."""
    if isinstance(x, tuple):
        return tuple(t.detach() if isinstance(t, Tensor) else t for t in x)
    return x.detach() if isinstance(x, Tensor) else x


def signature(x: Activation) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """The shapes and dtypes of ``x``'s tensors: equal signatures can share a stage's receive buffers."""
    return tuple((tuple(t.shape), t.dtype) for t in as_args(x))


def describe(x: object) -> str:
    """``x`` in a few words, for an error message.

    Examples:
        >>> describe((torch.zeros(4, 3), None))
        'a tuple (a tensor of shape (4, 3), a NoneType)'
    """
    if isinstance(x, Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} ({', '.join(describe(item) for item in x)})"
    return f"a {type(x).__name__}"


def check_activation(x: object, batch: int, what: str) -> None:
    """Raise unless ``x`` is one tensor or a tuple of at least two tensors, each with ``batch`` rows first."""
    fix = (
        "Blocks of a pipelined body must return one tensor or a tuple of at least two tensors (the next block takes "
        "it as its single argument), each with the batch as its first dimension: the pipeline cuts micro-batches and "
        "sends activations between stages along it."
    )
    if isinstance(x, tuple) and len(x) == 1 and isinstance(x[0], Tensor):
        raise TypeError(f"{what} returned a tuple of one tensor; return the tensor itself. {fix}")
    if not is_activation(x):
        raise TypeError(f"{what} returned {describe(x)}. {fix}")
    for t in as_args(x):
        if t.dim() == 0 or t.shape[0] != batch:
            raise ValueError(
                f"{what} returned {describe(x)}, but the batch has {batch} rows: a tensor whose first dimension is "
                f"not the batch cannot be cut into micro-batches. {fix}"
            )


def check_blocks(blocks: Sequence[nn.Module], example: Activation, source: str = "the body's input") -> None:
    """Run ``blocks`` in order on a fake copy of ``example`` and check what each returns (:func:`check_activation`).

    ``source`` names where ``example`` came from, in the error messages.

    Nothing is allocated or computed and the random state is put back, so the check costs no memory and changes no
    later result; a block the fake run cannot follow (an operation that depends on values) ends the check
    there, and the real run decides.

    Examples:
        >>> class Pair(nn.Module):
        ...     def forward(self, x):
        ...         return x, x.sum()
        >>> check_blocks([nn.Linear(4, 4), Pair()], torch.zeros(8, 4))
        Traceback (most recent call last):
        ...
        ValueError: Block 1 (Pair) of the body, run on the body's input, returned a tuple (a tensor of shape (8, 4), ...
    """
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensorMode,
        UnsupportedOperatorException,
    )
    from torch.func import functional_call

    batch, device = batch_size(example), as_args(example)[0].device
    check_activation(example, batch, source)
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x: Any = detach(example)
        x = tuple(mode.from_tensor(t) for t in as_args(x))
        x = from_args(x)
        for index, block in enumerate(blocks):
            state = {
                name: torch.empty_like(t, device=device).requires_grad_(t.requires_grad)
                for name, t in [*block.named_parameters(), *block.named_buffers()]
            }
            try:
                x = functional_call(block, state, (x,))
            except (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException):
                return
            except Exception as error:
                raise RuntimeError(
                    f"Block {index} ({type(block).__name__}) of the body failed on "
                    f"{source if index == 0 else f'what block {index - 1} returned'}, {describe(x)} (run on "
                    f"{source}): {error}"
                ) from error
            check_activation(x, batch, f"Block {index} ({type(block).__name__}) of the body, run on {source},")
