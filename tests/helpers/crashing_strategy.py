"""Registers ``"crashes_at_setup"``, a strategy that fails when training starts (for the comparison's isolation)."""

from typing import Any

from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry


class CrashesAtSetup(SingleDeviceStrategy):
    def setup(self, trainer: Any) -> None:
        raise RuntimeError("this strategy always fails at setup")


StrategyRegistry.register("crashes_at_setup", CrashesAtSetup, override=True, device="cpu")
