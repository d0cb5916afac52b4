"""Gradient clipping by the global 2-norm of gradients spread over ranks: a pipeline's stages, ZeRO's pieces."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["clip_grad_norm_across"]


def clip_grad_norm_across(
    parameters: Iterable[Tensor],
    max_norm: float,
    group: dist.ProcessGroup | None = None,
    eps: float = 1e-6,
    device: torch.device | None = None,
) -> Tensor:
    """Clip ``.grad`` of ``parameters`` in place so that the 2-norm over *all ranks of* ``group`` is <= ``max_norm``.

    Each rank passes the parameters it holds (a pipeline stage's, or its ZeRO pieces with ``group=None``, the whole
    world); the squared norms are summed over ``group``, so every rank scales by the same factor
    ``min(1, max_norm / (norm + eps))``, exactly as :func:`torch.nn.utils.clip_grad_norm_` on the whole model.
    Returns the global norm (before clipping).
    ``device`` holds the norm when this rank has no gradient (the collective's device: set it on NCCL).

    Example (every rank of the pipeline group, after backward)::

        total = clip_grad_norm_across(stage_module.parameters(), 1.0, group=pipeline_group)
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    device = grads[0].device if grads else (device or torch.device("cpu"))
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        squares += g.detach().float().pow(2).sum()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=group)
    total = squares.sqrt()
    coef = torch.clamp(max_norm / (total + eps), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.dtype))
    return total
