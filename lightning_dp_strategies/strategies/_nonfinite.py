"""The Trainer's side of the ``nonfinite_grads`` option: the optimizer closure goes through the guard."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from lightning.pytorch.strategies import Strategy
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dp_strategies.core.nonfinite import NonfiniteGuard, check_nonfinite_mode


class NonfiniteCheck(Strategy):
    """Mixed in ahead of the Lightning base: every optimizer step's closure goes through ``self.nonfinite``."""

    nonfinite: NonfiniteGuard

    def _init_nonfinite(self, mode: object) -> None:
        self.nonfinite = NonfiniteGuard(check_nonfinite_mode(mode))

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self.lightning_module is not None:
            closure = self.nonfinite.wrap(closure, optimizer, self._guarded_parameters(), self.root_device)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def _guarded_parameters(self) -> Iterable[tuple[str, nn.Parameter]]:
        """The names the guard reports a non-finite gradient under: the module's parameters by default."""
        module = self.lightning_module
        assert module is not None
        return module.named_parameters()
