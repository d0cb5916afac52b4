"""Local SGD and DiLoCo: local optimizer steps, then the average parameter change applied by an outer optimizer.

Every rank takes ``sync_every = H`` optimizer steps on its own (its inner optimizer's state stays on the rank); then
the ranks average the change since the last synchronisation, the *pseudo-gradient* ``anchor - params``, in one
all-reduce (:class:`~lightning_dp_strategies.local_sgd.averaging.FlatAverager`, through any reducer), and an outer
optimizer over the anchor parameters takes one step with it::

    step 1 .. H         params_r <- inner_r(params_r, g_r)            (no communication)
    step H (sync)       delta    <- mean_r(anchor - params_r)          (one all-reduce, buffers averaged with it)
                        anchor   <- outer(anchor, grad=delta)          (plain averaging: anchor - delta)
                        params_r <- anchor                             (every rank alike)

Streaming DiLoCo (``fragments``, ``delay``, ``mixing``, ``outer_precision``) synchronises runs of parameters in
staggered turns, each every ``H`` steps, sends a fragment's change while the inner steps go on and applies it
``delay`` steps later (:mod:`.streaming`). Only the change travels in ``outer_precision``: buffers and the averaged
model a checkpoint or an evaluation takes are averaged exactly.

Plain averaging (no outer optimizer) gives ``mean_r(params_r)``; DiLoCo is SGD with Nesterov momentum as the outer
optimizer (:func:`diloco_outer_optimizer`). During ``warmup_steps`` the gradients are averaged every step instead
(post-local SGD), and the anchor is taken when the warm-up ends. :class:`LocalSGD` is what a Trainer or Fabric
strategy holds; it knows nothing of either.

- :mod:`.config`: the options (:class:`LocalSGDConfig`) and the outer optimizer's factory, DiLoCo's among them.
- :mod:`.algorithm`: :class:`LocalSGD`, the anchor, the period and the synchronisation.
- :mod:`.streaming`: fragments, their turns, and the thread the changes travel on.
- :mod:`.averaging`: tensors averaged in one flat all-reduce through any reducer; torch's periodic model averaging.
- :mod:`.checkpoint`: each rank's own state gathered into one checkpoint entry, and restored from it.
"""

from lightning_dp_strategies.local_sgd.algorithm import LocalSGD
from lightning_dp_strategies.local_sgd.averaging import (
    FlatAverager,
    PeriodicAverager,
    averageable,
    outer_averager,
    outer_reducer,
)
from lightning_dp_strategies.local_sgd.checkpoint import gather_to_zero, local_checkpoint_record, restore_local_record
from lightning_dp_strategies.local_sgd.config import (
    OUTER_PRECISIONS,
    LocalSGDConfig,
    OuterOptimizerFactory,
    diloco_outer_optimizer,
    make_outer_optimizer,
)
from lightning_dp_strategies.local_sgd.streaming import InFlight, OuterChannel, split_fragments, turns

__all__ = [
    "OUTER_PRECISIONS",
    "FlatAverager",
    "InFlight",
    "LocalSGD",
    "LocalSGDConfig",
    "OuterChannel",
    "OuterOptimizerFactory",
    "PeriodicAverager",
    "averageable",
    "diloco_outer_optimizer",
    "gather_to_zero",
    "local_checkpoint_record",
    "make_outer_optimizer",
    "outer_averager",
    "outer_reducer",
    "restore_local_record",
    "split_fragments",
    "turns",
]
