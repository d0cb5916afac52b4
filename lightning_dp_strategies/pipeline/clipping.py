"""Gradient clipping by the global norm across the stages (the function lives in :mod:`..comm.clipping`)."""

from lightning_dp_strategies.comm.clipping import clip_grad_norm_across

__all__ = ["clip_grad_norm_across"]
