"""Sharded optimizer state (ZeRO stage 1): each rank steps, and keeps the optimizer state of, about 1/N of the
parameters.

- :mod:`.layout`: which rank steps which elements (each bucket cut into one chunk per rank, parameters into pieces).
- :mod:`.optimizer`: the user's optimizer re-pointed at this rank's pieces; which optimizers can be (element-wise).
- :mod:`.gather`: the parameters all-gathered after a step, overlapped bucket by bucket.
- :mod:`.checkpoint`: the whole optimizer state streamed to one writer; a rank's pieces cut from a whole state.
- :mod:`.scaler`: a 16-mixed gradient scaler that skips a step on every rank alike.
- :mod:`.state`: all of it as one object a strategy holds.

Clipping by the 2-norm over every rank's pieces is :func:`clip_grad_norm_across` with ``group=None``; it lives in
:mod:`~lightning_dp_strategies.comm.clipping`, below both this package and the pipeline that clips across stages.
"""

from lightning_dp_strategies.comm.clipping import clip_grad_norm_across
from lightning_dp_strategies.sharding.layout import Piece, ShardLayout
from lightning_dp_strategies.sharding.optimizer import ELEMENTWISE_OPTIMIZERS, ShardedParameters, check_elementwise
from lightning_dp_strategies.sharding.scaler import agree_on_nonfinite
from lightning_dp_strategies.sharding.state import OptimizerSharding

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "OptimizerSharding",
    "Piece",
    "ShardLayout",
    "ShardedParameters",
    "agree_on_nonfinite",
    "check_elementwise",
    "clip_grad_norm_across",
]
