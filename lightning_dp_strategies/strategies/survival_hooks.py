"""What a strategy adds to :class:`~lightning_dp_strategies.strategies.survival.TrainerSurvival` at fixed points.

The ring needs none of it (:class:`SurvivalHooks` itself: every hook does nothing); local SGD's
:class:`~lightning_dp_strategies.strategies.local_survival.LocalSurvival` overrides them to train the lost ranks'
replicas and to hand their state to replacements.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SurvivalHooks"]


class SurvivalHooks:
    """The survival's extension points, each a no-op here."""

    trains_lost_batches: bool = True
    """Whether backward adds the lost ranks' micro-batches to this rank's step (local SGD trains replicas instead)."""
    recovers_between_steps: bool = True
    """Whether a rank lost between optimizer steps (validation, a checkpoint's save) is survived there (local SGD
    meets it at its next synchronisation only, so a loss there fails the run)."""

    def after_own_step(self) -> None:
        """After each optimizer step of this rank that completed."""

    def on_regroup(self) -> None:
        """On every survivor, once the gradient sync averages over new groups (after a failure, an admission)."""

    def ready_to_admit(self) -> bool:
        """Whether replacements may be admitted at this epoch's start."""
        return True

    def on_admit(self, joining: list[int]) -> dict[str, Any]:
        """On every survivor before the world is re-formed for ``joining`` (collective over the survivors): entries
        added to the leader's training state that the replacements receive."""
        return {}

    def after_admit(self, joining: list[int]) -> None:
        """On every rank of the re-formed world, once the replacements have their state."""
