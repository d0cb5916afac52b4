"""A view of Lightning's precision plugin whose clipping by norm is the strategy's own (a norm over several ranks)."""

from __future__ import annotations

from collections.abc import Callable

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dp_strategies.strategies.bucketed import BucketedDataParallel

__all__ = ["ClipByNorm", "PrecisionView", "global_norm_view"]

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


class PrecisionView(BucketedDataParallel):
    """Mixed in ahead of the base: from setup to teardown (while ``_precision_view`` is set) the strategy hands
    Lightning a view of its precision plugin (see :func:`global_norm_view`) instead of the plugin itself."""

    _precision_view: Precision | None = None

    @property
    @override
    def precision_plugin(self) -> Precision:
        """Lightning's precision plugin; from setup to teardown a view of it that clips by a norm over the ranks.

        The view (:func:`global_norm_view`) shares the plugin's state and class; the plugin itself is not changed.
        """
        view = self.__dict__.get("_precision_view")
        return view if view is not None else super().precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        self._precision_view = None
        BucketedDataParallel.precision_plugin.fset(self, precision_plugin)  # type: ignore[attr-defined]
