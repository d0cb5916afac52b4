"""The precision plugin as the pipeline strategy hands it to Lightning: clipping by norm over every stage."""

from __future__ import annotations

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer

from lightning_dp_strategies.pipeline import clip_grad_norm_across
from lightning_dp_strategies.pipeline.layout import Layout
from lightning_dp_strategies.strategies._precision import PrecisionView, global_norm_view

__all__ = ["GlobalNormClipping", "global_norm_view"]


class GlobalNormClipping(PrecisionView):
    """The precision plugin of :class:`HybridPipelineStrategy` (mixed in ahead of its base): from setup to teardown
    a view of Lightning's plugin that clips by the norm over every stage."""

    layout: Layout | None
    _precision_view: Precision | None

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """Lightning's clip-by-norm (``gradient_clip_val``) with the norm over every stage of the pipeline."""
        assert self.layout is not None
        params = list(super().precision_plugin.main_params(optimizer))
        clip_grad_norm_across(params, clip_val, group=self.layout.pipeline_group, device=self.root_device)
