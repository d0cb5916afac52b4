"""What both Fabric strategies do at ``optimizer.step()``: the ``nonfinite_grads`` check, and the module it needs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning.fabric.strategies import Strategy
from lightning.fabric.utilities.types import Optimizable
from torch import nn
from typing_extensions import override

from lightning_dp_strategies.core.nonfinite import NonfiniteGuard, check_nonfinite_mode


class NonfiniteStep(Strategy):
    """Mixed in ahead of a Fabric strategy: every ``optimizer.step()`` goes through ``self.nonfinite``.

    Fabric has no closure around backward as the Trainer has: by the time the user calls ``optimizer.step()``, the
    gradients are reduced, so the check runs first (an LBFGS-style ``closure`` given to ``step`` is wrapped instead).
    """

    nonfinite: NonfiniteGuard
    _trained: nn.Module | None
    """The module whose parameters the check names (the one set up with trainable parameters)."""

    def _init_nonfinite(self, mode: object) -> None:
        self.nonfinite = NonfiniteGuard(check_nonfinite_mode(mode))
        self._trained = None

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        if self.nonfinite.mode is None or self._trained is None or not hasattr(optimizer, "param_groups"):
            return super().optimizer_step(optimizer, **kwargs)
        named = list(self._guarded_parameters(self._trained))
        closure = kwargs.pop("closure", None)
        if closure is not None:
            kwargs["closure"] = self.nonfinite.wrap(closure, optimizer, named, self.root_device)  # type: ignore[arg-type]
        else:
            self.nonfinite.wrap(lambda: None, optimizer, named, self.root_device)()  # type: ignore[arg-type]
        return super().optimizer_step(optimizer, **kwargs)

    def _guarded_parameters(self, module: nn.Module) -> Iterable[tuple[str, nn.Parameter]]:
        """The names a non-finite gradient is reported under: the module's parameters by default."""
        return module.named_parameters()
