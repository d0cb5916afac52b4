"""A 16-mixed gradient scaler that finds Inf or NaN on every rank when any rank's pieces hold one.

``GradScaler.unscale_`` checks the gradients of the optimizer's parameters, which under sharded optimizer state are
this rank's pieces only: one rank could skip a step that another takes, and their loss scales would part.
:func:`agree_on_nonfinite` runs after the reduced gradients reach the pieces and before the scaler unscales them:
the ranks agree (one all-reduce of a flag) whether any piece holds a non-finite value, and a rank whose own pieces
are finite while another's are not writes an Inf into one of its gradients. Every rank's scaler then finds what the
others find, skips the step alike and lowers its scale alike, through its public ``unscale_``/``step``/``update``;
the scaler itself is not touched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["agree_on_nonfinite"]


def agree_on_nonfinite(gradients: Sequence[Tensor | None], group: dist.ProcessGroup | None = None) -> bool:
    """Whether any rank of ``group`` holds a non-finite value in its ``gradients``; where this rank holds none but
    another does, an Inf is written into this rank's first gradient so that its scaler finds one too.

    Examples:
        >>> grads = [torch.ones(2), torch.tensor([1.0, float("nan")])]
        >>> agree_on_nonfinite(grads)  # one process: its own finding
        True
        >>> agree_on_nonfinite([torch.ones(2)])
        False
    """
    present = [g for g in gradients if g is not None and g.numel()]
    device = present[0].device if present else torch.device("cpu")
    local = any(not bool(torch.isfinite(g).all()) for g in present)
    flag = torch.tensor([float(local)], device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    found = bool(flag.item())
    if found and not local and present:
        present[0].view(-1)[0] = float("inf")
    return found
