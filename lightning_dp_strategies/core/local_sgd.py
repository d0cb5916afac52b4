"""Local SGD and DiLoCo: local optimizer steps, then the average parameter change applied by an outer optimizer.

Every rank takes ``sync_every = H`` optimizer steps on its own (its inner optimizer's state stays on the rank); then
the ranks average the change since the last synchronisation, the *pseudo-gradient* ``anchor - params``, in one
all-reduce (:class:`~lightning_dp_strategies.core.averaging.FlatAverager`, through any reducer), and an outer
optimizer over the anchor parameters takes one step with it::

    step 1 .. H         params_r <- inner_r(params_r, g_r)            (no communication)
    step H (sync)       delta    <- mean_r(anchor - params_r)          (one all-reduce, buffers averaged with it)
                        anchor   <- outer(anchor, grad=delta)          (plain averaging: anchor - delta)
                        params_r <- anchor                             (every rank alike)

Plain averaging (no outer optimizer) gives ``mean_r(params_r)``; DiLoCo is SGD with Nesterov momentum as the outer
optimizer (:func:`diloco_outer_optimizer`). During ``warmup_steps`` the gradients are averaged every step instead
(post-local SGD), and the anchor is taken when the warm-up ends. :class:`LocalSGD` is what a Trainer or Fabric
strategy holds; it knows nothing of either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_dp_strategies.bucketing.stats import CommStats
from lightning_dp_strategies.core.averaging import FlatAverager, averageable

__all__ = [
    "HoldsLocalSGD",
    "LocalSGD",
    "LocalSGDConfig",
    "OuterOptimizerFactory",
    "check_not_sharded",
    "check_single_optimizer",
    "diloco_outer_optimizer",
    "gather_to_zero",
    "local_checkpoint_record",
    "restore_local_record",
]

OuterOptimizerFactory = Callable[[list[Tensor]], Optimizer]
"""``factory(anchor_parameters) -> torch.optim.Optimizer``: makes the outer optimizer once, at setup."""


def diloco_outer_optimizer(lr: float = 0.7, momentum: float = 0.9) -> OuterOptimizerFactory:
    """DiLoCo's outer optimizer (Douillard et al., 2023): SGD with Nesterov momentum, ``lr=0.7``, ``momentum=0.9``.

    Examples:
        >>> make = diloco_outer_optimizer()
        >>> opt = make([torch.zeros(2, requires_grad=True)])
        >>> type(opt).__name__, opt.defaults["lr"], opt.defaults["nesterov"]
        ('SGD', 0.7, True)
    """

    def make(params: list[Tensor]) -> Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=True)

    make.__qualname__ = f"diloco_outer_optimizer(lr={lr}, momentum={momentum})"
    return make


def _check_count(name: str, value: object, minimum: int, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum} ({meaning}), got {value!r}.")
    return value


@dataclass(frozen=True)
class LocalSGDConfig:
    """The options of local SGD (validated on creation; see :class:`LocalSGD`).

    Examples:
        >>> LocalSGDConfig(sync_every=4).warmup_steps
        0
        >>> LocalSGDConfig(sync_every=0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `sync_every` must be an int >= 1 (optimizer steps between synchronisations; ...), got 0.
    """

    sync_every: int = 8
    """Optimizer steps between synchronisations (H)."""
    outer_optimizer: OuterOptimizerFactory | None = None
    """Makes the outer optimizer over the anchor parameters; ``None``: plain averaging."""
    warmup_steps: int = 0
    """Optimizer steps at the start whose gradients are averaged every step (post-local SGD)."""
    average_buffers: bool = True
    """Average floating-point buffers (BatchNorm statistics) at each synchronisation."""

    def __post_init__(self) -> None:
        meaning = "optimizer steps between synchronisations; 1 averages every step"
        _check_count("sync_every", self.sync_every, 1, meaning)
        _check_count("warmup_steps", self.warmup_steps, 0, "optimizer steps that average gradients first; 0: none")
        if self.outer_optimizer is not None and not callable(self.outer_optimizer):
            raise TypeError(
                "`outer_optimizer` must be a callable `factory(params) -> torch.optim.Optimizer`, e.g. "
                "`lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)` (DiLoCo), or None "
                f"for plain averaging; got {self.outer_optimizer!r}."
            )
        if not isinstance(self.average_buffers, bool):
            raise TypeError(f"`average_buffers` must be True or False, got {self.average_buffers!r}.")


class LocalSGD:
    """The runtime of local SGD for one module: anchor, outer optimizer, position in the period.

    A strategy calls :meth:`start` once the module is in place (rank 0's weights on every rank), :meth:`after_step`
    after every optimizer step, and :meth:`synchronize` where every rank must hold the same parameters (before
    validation, at the end of training). Configuration is ``config``; runtime state is ``anchor``, ``outer``, ``steps``
    and ``since_sync``; statistics are ``syncs`` and the averager's ``counter``.

    Examples:
        >>> from lightning_dp_strategies.reducers import NativeReducer
        >>> model = nn.Linear(2, 1)
        >>> local = LocalSGD(LocalSGDConfig(sync_every=2), FlatAverager(NativeReducer()))
        >>> local.start(model)
        >>> [local.after_step() for _ in range(4)], local.syncs
        ([False, True, False, True], 2)
    """

    def __init__(self, config: LocalSGDConfig, averager: FlatAverager) -> None:
        self.config = config
        self.averager = averager
        # runtime state
        self.params: list[nn.Parameter] = []
        self.buffers: list[Tensor] = []
        self.anchor: list[Tensor] = []
        self.outer: Optimizer | None = None
        self.steps = 0
        """Optimizer steps taken since training began (the warm-up's included)."""
        self.since_sync = 0
        """Local steps since the last synchronisation (the position in the period)."""
        # statistics
        self.syncs = 0

    # ------------------------------------------------------------------ setup
    def start(self, module: nn.Module) -> None:
        """Take the module's trainable parameters and averaged buffers, copy the anchor, make the outer optimizer."""
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.buffers = [b for b in module.buffers() if averageable(b)] if self.config.average_buffers else []
        self.anchor = [p.detach().to(torch.float32, copy=True).requires_grad_(True) for p in self.params]
        self.outer = make_outer_optimizer(self.config.outer_optimizer, self.anchor)

    @property
    def stats(self) -> CommStats:
        """What the synchronisations sent so far, as gradient statistics count it (all of it exposed)."""
        counter = self.averager.counter
        return CommStats(
            bytes_sent=counter.bytes_sent,
            inter_node_bytes_sent=counter.inter_node_bytes,
            messages=counter.messages,
            ring_operations=counter.operations,
            comm_seconds=counter.seconds,
            exposed_seconds=counter.seconds,
        )

    @property
    def averages_gradients(self) -> bool:
        """Whether the next optimizer step is a warm-up step, whose gradients are averaged over the ranks."""
        return self.steps < self.config.warmup_steps

    @property
    def in_sync(self) -> bool:
        """Whether every rank holds the same parameters now (in the warm-up, or right after a synchronisation)."""
        return self.since_sync == 0

    # ------------------------------------------------------------------ each step
    def after_step(self) -> bool:
        """Count an optimizer step; synchronise when the period is complete. Returns whether it synchronised."""
        self.steps += 1
        if self.steps <= self.config.warmup_steps:
            if self.steps == self.config.warmup_steps:
                self._reset_anchor()
            return False
        self.since_sync += 1
        if self.since_sync >= self.config.sync_every:
            self.synchronize()
            return True
        return False

    def synchronize(self) -> None:
        """Average the pseudo-gradients (and buffers) in one all-reduce and apply the outer step (collective)."""
        if self.in_sync:
            return
        with torch.no_grad():
            deltas = [a - p.detach().to(torch.float32) for a, p in zip(self.anchor, self.params, strict=True)]
            self.averager.average([*deltas, *self.buffers])
            if self.outer is None:
                for anchor, delta in zip(self.anchor, deltas, strict=True):
                    anchor.sub_(delta)
            else:
                for anchor, delta in zip(self.anchor, deltas, strict=True):
                    anchor.grad = delta
                self.outer.step()
                self.outer.zero_grad(set_to_none=True)
            for param, anchor in zip(self.params, self.anchor, strict=True):
                param.copy_(anchor)
        self.since_sync = 0
        self.syncs += 1

    def restart(self) -> None:
        """Make the current parameters the anchor, at the start of a period (a model loaded from elsewhere)."""
        self._reset_anchor()
        self.since_sync = 0

    def _reset_anchor(self) -> None:
        with torch.no_grad():
            for anchor, param in zip(self.anchor, self.params, strict=True):
                anchor.copy_(param)

    # ------------------------------------------------------------------ checkpoints
    def averaged_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (a module's ``state_dict``, this rank's) with its parameters and floating-point buffers averaged
        over the ranks: the model a checkpoint holds. Collective unless the ranks are in sync; the module is left as
        it is."""
        if self.in_sync:
            return state
        averaged = {k: v.detach().clone() if isinstance(v, Tensor) and averageable(v) else v for k, v in state.items()}
        self.averager.average([v for v in averaged.values() if isinstance(v, Tensor) and averageable(v)])
        return averaged

    def state_dict(self) -> dict[str, Any]:
        """What resumes the run besides the module and the inner optimizer: anchor, outer state, position."""
        return {
            "sync_every": self.config.sync_every,
            "warmup_steps": self.config.warmup_steps,
            "steps": self.steps,
            "since_sync": self.since_sync,
            "syncs": self.syncs,
            "anchor": [a.detach().clone() for a in self.anchor],
            "outer": self.outer.state_dict() if self.outer is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s record (after :meth:`start`)."""
        if len(state["anchor"]) != len(self.anchor):
            raise ValueError(
                f"The checkpoint's local SGD anchor has {len(state['anchor'])} tensors, this model trains "
                f"{len(self.anchor)} parameters. Resume with the model the checkpoint was saved from."
            )
        with torch.no_grad():
            for mine, saved in zip(self.anchor, state["anchor"], strict=True):
                mine.copy_(saved)
        if self.outer is not None and state["outer"] is not None:
            self.outer.load_state_dict(state["outer"])
        self.steps, self.since_sync, self.syncs = int(state["steps"]), int(state["since_sync"]), int(state["syncs"])


def make_outer_optimizer(factory: OuterOptimizerFactory | None, anchor: list[Tensor]) -> Optimizer | None:
    """``factory(anchor)``, checked to be an optimizer over exactly the anchor tensors; ``None`` without a factory."""
    if factory is None:
        return None
    optimizer = factory(anchor)
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"`outer_optimizer` returned {type(optimizer).__name__}, not a torch.optim.Optimizer. Pass a factory that "
            "builds one over the parameters it is given, e.g. "
            "`lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)`."
        )
    given = {id(t) for group in optimizer.param_groups for t in group["params"]}
    if given != {id(t) for t in anchor}:
        raise ValueError(
            "`outer_optimizer` must build its optimizer over the parameters it is given (the anchor copies the "
            "strategy keeps), not over the model's: `lambda params: torch.optim.SGD(params, ...)`."
        )
    return optimizer


def gather_to_zero(obj: object) -> list[Any] | None:
    """Every rank's ``obj``, in rank order, on rank 0 (``None`` on the others); ``[obj]`` on one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def local_checkpoint_record(
    local: LocalSGD, module: nn.Module, optimizer_states: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """The checkpoint's ``"local_sgd"`` entry on rank 0 (``None`` on the others); collective, every rank calls it.

    It holds :meth:`LocalSGD.state_dict` and, per rank, ``{"module": its module state (``None`` when the ranks are
    in sync), "optimizer": its inner optimizer states}``.
    """
    own = None if local.in_sync else {k: v.detach().clone() for k, v in module.state_dict().items()}
    ranks = gather_to_zero({"module": own, "optimizer": optimizer_states})
    return None if ranks is None else {**local.state_dict(), "ranks": ranks}


def restore_local_record(local: LocalSGD, module: nn.Module, record: dict[str, Any] | None, rank: int) -> None:
    """Resume from a checkpoint's ``"local_sgd"`` entry (after the averaged model was loaded into ``module``); without
    one (another strategy's checkpoint), the loaded model becomes the anchor."""
    if record is None:
        local.restart()
        return
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if len(record["ranks"]) != world:
        raise ValueError(
            f"This local SGD checkpoint was saved by {len(record['ranks'])} ranks, and {world} are resuming it: each "
            "rank resumes its own parameters and inner optimizer state. Resume with the same number of ranks, or "
            "load only its model (`Model.load_from_checkpoint(path)`: the averaged model) and start a new fit."
        )
    local.load_state_dict(record)
    own = record["ranks"][rank]["module"]
    if own is not None:
        module.load_state_dict(own)


def check_not_sharded(shard_optimizer_state: object) -> None:
    """A clear error for ``shard_optimizer_state=True``: between averages every rank steps its whole model, so every
    rank needs the whole optimizer state.

    Examples:
        >>> check_not_sharded(False)
        >>> check_not_sharded(True)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Local SGD cannot shard the optimizer state: ...
    """
    if shard_optimizer_state:
        raise ValueError(
            "Local SGD cannot shard the optimizer state: between averages every rank steps its whole model on its "
            "own, so every rank needs the whole optimizer state. To save optimizer memory, train with "
            "`RingAllReduceStrategy(shard_optimizer_state=True)`; to save traffic, keep local SGD unsharded."
        )


def check_single_optimizer(optimizers: Sequence[object], strategy: str) -> None:
    """Local SGD counts the steps of one optimizer: a clear error for several."""
    if len(optimizers) > 1:
        raise ValueError(
            f"{strategy} counts `sync_every` in steps of one optimizer, but `configure_optimizers` returned "
            f"{len(optimizers)}. Return one optimizer with a parameter group per part of the model "
            "(`torch.optim.AdamW([{'params': a.parameters()}, {'params': b.parameters(), 'lr': 1e-4}])`), or use "
            "RingAllReduceStrategy."
        )


class HoldsLocalSGD:
    """What a strategy holding a :class:`LocalSGD` as ``local_sgd`` (and its gradient sync as ``grad_sync``) shows of
    it, Trainer and Fabric alike: the statistics, the synchronisation, the options the ranks must agree on."""

    local_config: LocalSGDConfig
    local_sgd: LocalSGD | None
    grad_sync: Any
    _averaged_step: CommStats

    def _local_options(self) -> dict[str, Any]:
        """The local SGD options every rank must agree on (for the ranks' fingerprint)."""
        cfg = self.local_config
        outer = None if cfg.outer_optimizer is None else getattr(cfg.outer_optimizer, "__qualname__", "callable")
        return {
            "sync_every": cfg.sync_every,
            "warmup_steps": cfg.warmup_steps,
            "outer_optimizer": outer,
            "average_buffers": cfg.average_buffers,
        }

    def _after_optimizer_step(self) -> None:
        """Count the step (synchronising at the end of a period) and keep what that synchronisation sent."""
        if self.local_sgd is not None:
            before = self.local_sgd.stats
            self.local_sgd.after_step()
            self._averaged_step = self.local_sgd.stats - before

    @property
    def step_stats(self) -> CommStats:
        """Communication of the last optimizer step: the warm-up's gradients, or the synchronisation it ended with."""
        stats: CommStats = self.grad_sync.step_stats + self._averaged_step
        return stats

    @property
    def comm_stats(self) -> CommStats:
        """Running totals on this rank: the warm-up's gradients and every synchronisation."""
        averaged = self.local_sgd.stats if self.local_sgd is not None else CommStats()
        totals: CommStats = self.grad_sync.totals + averaged
        return totals

    def synchronize(self) -> None:
        """Average the ranks' parameter changes now and apply the outer step (on every rank; nothing when the ranks
        are in sync already). The strategies call it before validation and at the end of training."""
        if self.local_sgd is not None:
            self.local_sgd.synchronize()
