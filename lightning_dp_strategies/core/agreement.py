"""Rank agreement at setup: every rank describes its model and options, and any difference fails on every rank.

Ranks that disagree about the model do not fail cleanly on their own: a different parameter shape makes the
broadcast of rank 0's weights or a gradient bucket's all-reduce hang or error on some ranks only, and a different
option (a bucket cap, a reducer, an accumulation factor) silently pairs up collectives that do not belong together.
So before anything else is communicated, each rank gathers every rank's fingerprint and compares them; since all
ranks see the same list, all raise the same error together and none waits forever.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.fabric
import torch
import torch.distributed as dist
from torch import nn

from lightning_dp_strategies.bucketing import assign_buckets
from lightning_dp_strategies.core.module_state import quoted_names
from lightning_dp_strategies.core.options import BucketedConfig, ReductionOptions
from lightning_dp_strategies.reducers import hook_name

__all__ = [
    "RankMismatchError",
    "bucketed_options",
    "check_ranks_agree",
    "model_fingerprint",
    "require_dense_gradients",
    "require_materialized",
]


class RankMismatchError(RuntimeError):
    """Ranks built different models or were given different options; raised on every rank at setup.

    Examples:
        >>> issubclass(RankMismatchError, RuntimeError)  # caught by ``except RuntimeError`` as well
        True
    """


def model_fingerprint(module: nn.Module, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A JSON-able description of ``module`` (parameters, buffers) and ``options``, comparable across ranks.

    Parameters are listed with name, shape, dtype and whether they train (which fixes the bucket layout, given equal
    bucket caps among the options); buffers with name, shape and dtype. Option values are compared by ``repr``.

    Examples:
        >>> fingerprint = model_fingerprint(nn.Linear(3, 2), {"bucket_cap_mb": 25.0})
        >>> fingerprint["parameters"][0], fingerprint["options"]
        (['weight', [2, 3], 'torch.float32', True], {'bucket_cap_mb': '25.0'})
    """
    return {
        "parameters": [[n, list(p.shape), str(p.dtype), p.requires_grad] for n, p in module.named_parameters()],
        "buffers": [[n, list(b.shape), str(b.dtype)] for n, b in module.named_buffers()],
        "options": {k: repr(v) for k, v in sorted((options or {}).items())},
    }


def _digest(fingerprint: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()


def _first_difference(reference: Mapping[str, Any], other: Mapping[str, Any]) -> str:
    """A human-readable account of the first difference between two fingerprints."""
    for key, value in reference["options"].items():
        if other["options"].get(key) != value:
            return f"option {key!r} is {value} on rank 0 but {other['options'].get(key, '(missing)')} there"
    for key in other["options"]:
        if key not in reference["options"]:
            return f"option {key!r} is set there but not on rank 0"
    for kind in ("parameters", "buffers"):
        mine, theirs = reference[kind], other[kind]
        for a, b in zip(mine, theirs, strict=False):
            if a != b:
                return f"{kind[:-1]} {a[0]!r} is {a[1:]} on rank 0 but {b[0]!r} {b[1:]} there"
        if len(mine) != len(theirs):
            return f"rank 0 has {len(mine)} {kind}, that rank {len(theirs)}"
    return "the fingerprints differ"


def check_ranks_agree(fingerprint: Mapping[str, Any], group: dist.ProcessGroup | None = None) -> None:
    """Gather every rank's ``fingerprint`` over ``group`` and raise :class:`RankMismatchError` on all ranks if any
    differs from rank 0's. Only a digest travels unless they differ. A no-op without an initialised process group.

    Examples:
        >>> check_ranks_agree(model_fingerprint(nn.Linear(3, 2)))  # one process: nothing to compare
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    world = dist.get_world_size(group)
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, _digest(fingerprint), group=group)
    if len(set(digests)) == 1:
        return
    everything: list[Any] = [None] * world
    dist.all_gather_object(everything, dict(fingerprint), group=group)
    lines = [
        f"  rank {rank}: {_first_difference(everything[0], fp)}"
        for rank, fp in enumerate(everything)
        if digests[rank] != digests[0]
    ]
    raise RankMismatchError(
        "The ranks do not agree on the model or the strategy options, so training would hang or silently corrupt "
        "the parameters:\n"
        + "\n".join(lines)
        + "\nEvery rank must run the same code with the same configuration: build the model the same way on every "
        "rank (no rank-dependent layers or sizes), pass the same strategy options and Trainer or Fabric "
        "arguments, and make sure every node runs the same version of your code."
    )


def bucketed_options(
    strategy: object, reduction: ReductionOptions, config: BucketedConfig, module: nn.Module, precision: object
) -> dict[str, Any]:
    """The options every rank of a bucketed strategy, Trainer or Fabric, must agree on besides the model: the
    strategy, its options, how buckets are reduced, the bucket layout, the precision and the versions.

    Examples:
        >>> from lightning_dp_strategies.core.options import BucketedConfig, ReductionOptions
        >>> options = bucketed_options(None, ReductionOptions("native"), BucketedConfig(), nn.Linear(2, 2), "32-true")
        >>> options["reducer"], options["bucket_layout"], options["bucket_cap_mb"]
        ('native', [[1, 0]], 25.0)
    """
    require_materialized(module, type(strategy).__name__)
    reducer = reduction.reducer
    kind = reducer if isinstance(reducer, str) or reducer is None else type(reducer)
    # sizes and dtypes only: a pipeline rank holds the blocks it does not own on the meta device
    trainable = [torch.empty(p.shape, dtype=p.dtype, device="meta") for p in module.parameters() if p.requires_grad]
    return {
        "strategy": type(strategy).__qualname__,
        **vars(config),
        "reducer": getattr(kind, "__qualname__", kind),
        "ddp_comm_hook": hook_name(reduction.comm_hook),
        "ddp_comm_state": type(reduction.ddp_comm_state).__qualname__,
        "bucket_layout": assign_buckets(trainable, config.bucket_cap_mb, config.first_bucket_cap_mb),
        "precision": getattr(precision, "precision", type(precision).__name__),
        "world_size": dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1,
        "torch": torch.__version__,
        "lightning": lightning.fabric.__version__,
    }


def require_trainable(module: nn.Module, strategy: str, fix: str) -> None:
    """A clear error, on every rank, when ``module`` has no parameter that requires grad.

    Examples:
        >>> require_trainable(nn.Linear(2, 2).requires_grad_(False), "RingAllReduceStrategy", "train elsewhere")
        Traceback (most recent call last):
        ...
        ValueError: Linear has no parameter that requires grad, so RingAllReduceStrategy has nothing to train. ...
    """
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError(
            f"{type(module).__name__} has no parameter that requires grad, so {strategy} has nothing to train. "
            f"Unfreeze at least one parameter before `trainer.fit`, or {fix}."
        )


def require_dense_gradients(module: nn.Module, named_params: Sequence[tuple[str, nn.Parameter]]) -> None:
    """A clear error, at setup and on every rank alike, when a trainable parameter of ``named_params`` (those the
    gradient buckets average) is the table of an embedding of ``module`` that makes sparse gradients: the buckets hold
    dense gradients, and would fail at the first backward.

    Examples:
        >>> model = nn.Sequential(nn.Embedding(10, 3, sparse=True), nn.Linear(3, 2))
        >>> require_dense_gradients(model, list(model[1].named_parameters()))  # the table is not averaged here
        >>> require_dense_gradients(model, list(model.named_parameters()))
        Traceback (most recent call last):
        ...
        ValueError: `0.weight` (`nn.Embedding(..., sparse=True)`) gets sparse gradients, which the gradient buckets ...
    """
    averaged = {id(p) for _, p in named_params if p.requires_grad}
    sparse = [
        f"`{name + '.' if name else ''}weight` (`nn.{type(sub).__name__}(..., sparse=True)`)"
        for name, sub in module.named_modules()
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse and id(sub.weight) in averaged
    ]
    if sparse:
        raise ValueError(
            f"{', '.join(sparse)} get{'s' if len(sparse) == 1 else ''} sparse gradients, which the gradient buckets "
            "cannot average: they hold dense gradients. Pass `sparse=False` (the gradient is then dense: the whole "
            "table is averaged every step), or train with `local_sgd` / `streaming_diloco` without `warmup_steps`, "
            "which average no gradients."
        )


def require_materialized(module: nn.Module, strategy: str) -> None:
    """A clear error when ``module`` has parameters a lazy module (``nn.LazyLinear``...) has not made yet: the
    strategy lays out, broadcasts or replicates every parameter as it sets up.

    Examples:
        >>> require_materialized(nn.Linear(2, 2), "RingAllReduceStrategy")
        >>> require_materialized(nn.Sequential(nn.LazyLinear(2)), "RingAllReduceStrategy")
        Traceback (most recent call last):
        ...
        ValueError: RingAllReduceStrategy needs every parameter when it sets up, and `0.weight`, `0.bias` do not ...
    """
    lazy = [name for name, p in module.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        names = quoted_names(lazy)
        raise ValueError(
            f"{strategy} needs every parameter when it sets up, and {names} do not exist yet: a lazy module "
            "(nn.LazyLinear and the like) makes them in its first forward. Run one forward on a sample batch before "
            "training (at the end of your module's `__init__`, say), or give those layers their input sizes."
        )
