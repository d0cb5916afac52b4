"""The precision plugin as the pipeline strategy hands it to Lightning: clipping by norm over every stage."""

from __future__ import annotations

from collections.abc import Callable

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer

__all__ = ["global_norm_view"]

ClipByNorm = Callable[[Optimizer, float], None]


def global_norm_view(plugin: Precision, clip_grad_by_norm: ClipByNorm) -> Precision:
    """A view of ``plugin`` whose ``clip_grad_by_norm`` is the given function; everything else is ``plugin``'s.

    The view is an instance of a subclass of ``type(plugin)`` that shares ``plugin``'s attribute dictionary, so it
    has the same state and passes the same ``isinstance`` checks; ``plugin`` itself is not changed.

    Examples:
        >>> plugin = Precision()
        >>> calls = []
        >>> view = global_norm_view(plugin, lambda optimizer, value: calls.append(value))
        >>> view.clip_gradients(None, 0.5), calls, isinstance(view, Precision), "clip_grad_by_norm" in vars(plugin)
        (None, [0.5], True, False)
    """
    base = type(plugin)

    def clip(self: Precision, optimizer: Optimizer, clip_val: float | int) -> None:
        clip_grad_by_norm(optimizer, float(clip_val))

    view_type = type(f"GlobalNorm{base.__name__}", (base,), {"clip_grad_by_norm": clip, "__module__": __name__})
    view: Precision = object.__new__(view_type)
    view.__dict__ = plugin.__dict__  # shared: the view reads and writes the plugin's own state
    return view
