"""Lightning's precision plugin, wrapped so that clipping by norm takes the norm over several ranks.

Under sharded optimizer state each rank's optimizer holds pieces of the parameters, and under a pipeline each stage's
holds its stage's: ``gradient_clip_val`` must clip by the norm over all of them, which the plugin's own
``clip_grad_by_norm`` cannot see. :class:`GlobalNormClipping` holds the plugin and forwards every call of the
``Precision`` interface to it, except clipping by norm, which goes to the strategy's function. The plugin itself is
not changed, and the wrapper is handed to Lightning only from the strategy's setup to its teardown.

Lightning keys the plugin's checkpoint state by the plugin's class name: :func:`checkpoint_key` gives the wrapped
plugin's, and the strategy reads and writes the state under it, so checkpoints stay loadable by any strategy.

:func:`averaged_backward` is Lightning's backward with the strategy's ``post_backward`` moved ahead of the plugin's,
which calls ``on_after_backward``, so that the hook gets the averaged gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

__all__ = [
    "ClipByNorm",
    "ClippingAcrossRanks",
    "GlobalNormClipping",
    "averaged_backward",
    "checkpoint_key",
    "readable_by_wrapper",
    "stored_under_plugin_name",
]

ClipByNorm = Callable[[Optimizer, float], None]


def averaged_backward(
    strategy: Strategy, closure_loss: Tensor, optimizer: Optimizer | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Tensor:
    """Lightning's ``Strategy.backward`` with the strategy's ``post_backward`` before the plugin's, which calls the
    ``on_after_backward`` hooks.

    A strategy whose ``post_backward`` waits until the gradients are averaged so hands the hooks the averaged
    gradients, as torch DDP does (its reducer waits when the backward pass ends). In Lightning's order the hooks would
    read ``.grad`` while its bucket is still being reduced, and a change they made to it would race with the reduction
    or be replaced by its result.
    """
    module = strategy.lightning_module
    assert module is not None
    plugin = strategy.precision_plugin
    strategy.pre_backward(closure_loss)
    closure_loss = plugin.pre_backward(closure_loss, module)
    plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
    strategy.post_backward(closure_loss.detach())
    return plugin.post_backward(closure_loss, module)


def checkpoint_key(plugin: Precision) -> str:
    """The key Lightning stores ``plugin``'s state under in a checkpoint: the wrapped plugin's class name."""
    inner = plugin.inner if isinstance(plugin, GlobalNormClipping) else plugin
    return type(inner).__qualname__


def stored_under_plugin_name(checkpoint: dict[str, Any], plugin: Precision) -> dict[str, Any]:
    """``checkpoint`` with the state Lightning stored under the wrapper's class name moved to the plugin's own.

    Examples:
        >>> wrapped = GlobalNormClipping(Precision(), lambda optimizer, value: None)
        >>> stored_under_plugin_name({"GlobalNormClipping": {"scale": 2.0}, "epoch": 1}, wrapped)
        {'epoch': 1, 'Precision': {'scale': 2.0}}
    """
    wrapper = GlobalNormClipping.__qualname__
    if wrapper not in checkpoint:
        return checkpoint
    moved = {k: v for k, v in checkpoint.items() if k != wrapper}
    moved[checkpoint_key(plugin)] = checkpoint[wrapper]
    return moved


def readable_by_wrapper(checkpoint: dict[str, Any], plugin: Precision) -> dict[str, Any]:
    """``checkpoint`` with the plugin's state also under the wrapper's class name, where Lightning will look for it
    while the wrapper is handed out (the same object: nothing is copied)."""
    key = checkpoint_key(plugin)
    if key in checkpoint:
        checkpoint.setdefault(GlobalNormClipping.__qualname__, checkpoint[key])
    return checkpoint


def _forwarded(name: str) -> Any:
    """A method of :class:`GlobalNormClipping` that calls the wrapped plugin's method ``name`` with its arguments."""

    def forward(self: GlobalNormClipping, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.inner, name)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = f"The wrapped plugin's ``{name}``."
    return forward


class GlobalNormClipping(Precision):
    """``inner`` with its clipping by norm replaced by ``clip_grad_by_norm`` (see the module docstring).

    Examples:
        >>> plugin = Precision()
        >>> calls = []
        >>> wrapped = GlobalNormClipping(plugin, lambda optimizer, value: calls.append(value))
        >>> wrapped.clip_gradients(None, 0.5), calls, wrapped.precision, wrapped.inner is plugin
        (None, [0.5], '32-true', True)
    """

    def __init__(self, inner: Precision, clip_grad_by_norm: ClipByNorm) -> None:
        self.inner = inner
        self._clip_by_norm = clip_grad_by_norm

    def __getattr__(self, name: str) -> Any:  # the plugin's own attributes (``scaler``, ``device``, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def precision(self) -> Any:  # type: ignore[override]  # the wrapped plugin's, read-only
        return self.inner.precision

    # ------------------------------------------------------------------ clipping: by norm over the ranks
    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val > 0 and gradient_clip_algorithm == GradClipAlgorithmType.NORM:
            self._clip_by_norm(optimizer, float(clip_val))
        else:
            self.inner.clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self._clip_by_norm(optimizer, float(clip_val))

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self.inner.clip_grad_by_value(optimizer, clip_val)

    # ------------------------------------------------------------------ everything else: the plugin's
    connect = _forwarded("connect")
    pre_backward = _forwarded("pre_backward")
    backward = _forwarded("backward")
    post_backward = _forwarded("post_backward")
    optimizer_step = _forwarded("optimizer_step")
    main_params = _forwarded("main_params")
    unscale_gradients = _forwarded("unscale_gradients")
    convert_module = _forwarded("convert_module")
    convert_input = _forwarded("convert_input")
    convert_output = _forwarded("convert_output")
    tensor_init_context = _forwarded("tensor_init_context")
    module_init_context = _forwarded("module_init_context")
    forward_context = _forwarded("forward_context")
    train_step_context = _forwarded("train_step_context")
    val_step_context = _forwarded("val_step_context")
    test_step_context = _forwarded("test_step_context")
    predict_step_context = _forwarded("predict_step_context")
    state_dict = _forwarded("state_dict")
    load_state_dict = _forwarded("load_state_dict")
    on_load_checkpoint = _forwarded("on_load_checkpoint")
    on_save_checkpoint = _forwarded("on_save_checkpoint")
    teardown = _forwarded("teardown")


class ClippingAcrossRanks:
    """A strategy's ``precision_plugin`` attribute: Lightning's plugin, or, while the strategy's ``_clipping`` holds
    a :class:`GlobalNormClipping` (from its setup to its teardown), that wrapper. Setting a plugin drops the wrapper;
    Lightning sets and reads it as it does its own strategies' property.

    Examples:
        >>> from lightning.pytorch.strategies import SingleDeviceStrategy
        >>> class Strategy(SingleDeviceStrategy):
        ...     precision_plugin = ClippingAcrossRanks()
        >>> strategy = Strategy("cpu", precision_plugin=Precision())
        >>> strategy._clipping = GlobalNormClipping(strategy.precision_plugin, lambda optimizer, value: None)
        >>> type(strategy.precision_plugin).__name__
        'GlobalNormClipping'
        >>> strategy.precision_plugin = Precision()
        >>> type(strategy.precision_plugin).__name__, strategy._clipping
        ('Precision', None)
    """

    def __get__(self, obj: Any, owner: type) -> Any:
        if obj is None:
            return self
        clipping = obj.__dict__.get("_clipping")
        return clipping if clipping is not None else Strategy.precision_plugin.fget(obj)  # type: ignore[attr-defined]

    def __set__(self, obj: Any, plugin: Precision | None) -> None:
        obj._clipping = None
        Strategy.precision_plugin.fset(obj, plugin)  # type: ignore[attr-defined]
