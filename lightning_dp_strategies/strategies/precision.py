"""Lightning's precision plugin, wrapped so that clipping by norm takes the norm over several ranks.

Under sharded optimizer state each rank's optimizer holds pieces of the parameters, and under a pipeline each stage's
holds its stage's: ``gradient_clip_val`` must clip by the norm over all of them, which the plugin's own
``clip_grad_by_norm`` cannot see. :class:`GlobalNormClipping` holds the plugin and forwards every call of the
``Precision`` interface to it, except clipping by norm, which goes to the strategy's function. The plugin itself is
not changed, and the wrapper is handed to Lightning only from the strategy's setup to its teardown.

Lightning keys the plugin's checkpoint state by the plugin's class name: :func:`checkpoint_key` gives the wrapped
plugin's, and the strategy reads and writes the state under it, so checkpoints stay loadable by any strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

__all__ = ["ClipByNorm", "GlobalNormClipping", "checkpoint_key", "readable_by_wrapper", "stored_under_plugin_name"]

ClipByNorm = Callable[[Optimizer, float], None]


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
    @override
    def connect(self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]) -> Any:
        return self.inner.connect(model, optimizers, lr_schedulers)

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        return self.inner.pre_backward(tensor, module)

    @override
    def backward(self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.inner.backward(tensor, model, optimizer, *args, **kwargs)

    @override
    def post_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        return self.inner.post_backward(tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        return self.inner.optimizer_step(optimizer, model, closure, **kwargs)

    @override
    def main_params(self, optimizer: Optimizer) -> Any:
        return self.inner.main_params(optimizer)

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        self.inner.unscale_gradients(optimizer)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        return self.inner.convert_module(module)

    @override
    def convert_input(self, data: Any) -> Any:
        return self.inner.convert_input(data)

    @override
    def convert_output(self, data: Any) -> Any:
        return self.inner.convert_output(data)

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        return self.inner.tensor_init_context()

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self.inner.module_init_context()

    @override
    def forward_context(self) -> AbstractContextManager:
        return self.inner.forward_context()

    @contextmanager
    @override
    def train_step_context(self) -> Generator[None, None, None]:
        with self.inner.train_step_context():
            yield

    @contextmanager
    @override
    def val_step_context(self) -> Generator[None, None, None]:
        with self.inner.val_step_context():
            yield

    @contextmanager
    @override
    def test_step_context(self) -> Generator[None, None, None]:
        with self.inner.test_step_context():
            yield

    @contextmanager
    @override
    def predict_step_context(self) -> Generator[None, None, None]:
        with self.inner.predict_step_context():
            yield

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.inner.on_load_checkpoint(checkpoint)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.inner.on_save_checkpoint(checkpoint)

    @override
    def teardown(self) -> None:
        self.inner.teardown()
