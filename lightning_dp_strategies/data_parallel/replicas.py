"""One replica of a module per device, through which gradients reach the module's own parameters.

On CUDA :func:`torch.nn.parallel.replicate` broadcasts the parameters; on CPU the replicas are *logical*: shallow copies
of the submodules whose parameters alias the root's, and whose gradients one backward node sums in replica order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.nn import Module

from lightning_dp_strategies.data_parallel.devices import DeviceLike, as_devices

__all__ = ["check_replicable", "replicate"]

M = TypeVar("M", bound=Module)


def replicate(module: M, devices: Sequence[DeviceLike]) -> list[M]:
    """One replica of ``module`` per device, through which gradients reach ``module``'s own parameters.

    On CUDA this is :func:`torch.nn.parallel.replicate` (differentiable broadcasts of the parameters). On CPU the
    replicas are logical: shallow copies of every submodule whose parameters alias ``module``'s (the same memory, no
    copy). With grad enabled each replica holds its own autograd alias of every trainable parameter, and one backward
    node sums the replicas' gradients in replica order before they reach ``.grad`` - as the CUDA broadcast's backward
    does - so the sum does not depend on the order autograd happens to visit the replicas' threads (which depends on
    what ran before in the process). Under ``torch.no_grad()`` the replicas share the ``Parameter`` objects. As in
    :class:`torch.nn.DataParallel`, replica 0 shares ``module``'s buffers (its BatchNorm running-statistics updates
    are kept) and every other replica gets its own copy (its updates are dropped) - no two threads ever write to one
    buffer.

    Examples:
        >>> net = torch.nn.Linear(2, 2)
        >>> a, b = replicate(net, ["cpu", "cpu"])
        >>> a is not net and a.weight.data_ptr() == b.weight.data_ptr() == net.weight.data_ptr()
        True
        >>> (a(torch.ones(1, 2)).sum() + b(torch.ones(1, 2)).sum()).backward()
        >>> net.bias.grad  # both replicas' gradients, summed into the root parameter
        tensor([2., 2.])
    """
    check_replicable(module)
    targets = as_devices(devices)
    if targets[0].type == "cuda":
        from torch.nn.parallel import replicate as cuda_replicate

        return cuda_replicate(module, targets, detach=not torch.is_grad_enabled())
    return _logical_replicas(module, len(targets))


def check_replicable(module: Module) -> None:
    """Refuse ``module`` if it or a submodule is ``torch.compile``'d: an ``OptimizedModule``'s compiled forward is
    bound to the module it compiled, and it forwards attribute writes there, so copying it for a replica (here or in
    :func:`torch.nn.parallel.replicate`) would overwrite that module's own parameters and submodules.

    Examples:
        >>> check_replicable(torch.nn.Sequential(torch.nn.Linear(2, 2)))
        >>> check_replicable(torch.nn.Sequential(torch.compile(torch.nn.Linear(2, 2))))
        Traceback (most recent call last):
        ...
        ValueError: Cannot replicate the module: its submodule `0` is compiled with torch.compile, ...
    """
    from torch._dynamo import OptimizedModule  # as Lightning's Fabric imports it

    compiled = [name for name, m in module.named_modules() if isinstance(m, OptimizedModule)]
    if compiled:
        what = "the module is" if compiled[0] == "" else f"its submodule `{compiled[0]}` is"
        raise ValueError(
            f"Cannot replicate the module: {what} compiled with torch.compile, and a compiled module runs the copy "
            "it compiled, so a replica could not run its own. Data parallelism in one process copies the module at "
            "every forward: train without torch.compile here, or with one process per device "
            "(strategy='ring_allreduce' or 'ddp'), where compiled modules train as usual."
        )


class _ReplicaAliases(torch.autograd.Function):
    """Forward: ``count`` aliases of every parameter (replica-major). Backward: their gradients summed in replica order.

    One node for all replicas, so autograd hands it every replica's gradient before it sums them: the order of the
    additions is fixed here, not by the engine's scheduling of the replicas' graphs (``torch.nn.parallel``'s
    ``Broadcast`` / ``ReduceAddCoalesced`` pair plays this role on CUDA).
    """

    @staticmethod
    def forward(ctx: Any, count: int, *params: Tensor) -> tuple[Tensor, ...]:
        ctx.count = count
        ctx.set_materialize_grads(False)  # a replica that did not use a parameter gives None, not zeros
        return tuple(p.detach() for _ in range(count) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        per_replica = len(grads) // ctx.count
        sums: list[Tensor | None] = []
        for j in range(per_replica):
            total: Tensor | None = None
            for i in range(ctx.count):
                grad = grads[i * per_replica + j]
                if grad is not None:
                    total = grad if total is None else total + grad  # out of place: replica 0 + 1 + 2 + ...
            sums.append(total)
        return (None, *sums)


def _logical_replicas(module: M, count: int) -> list[M]:
    modules = list(module.modules())  # shared submodules appear once, and stay shared in the replica
    index = {id(m): i for i, m in enumerate(modules)}
    trainable: dict[int, Tensor] = {}  # tied parameters appear once, and stay tied in the replica
    if torch.is_grad_enabled():
        for m in modules:
            for p in m._parameters.values():
                if p is not None and p.requires_grad:
                    trainable.setdefault(id(p), p)
    params = list(trainable.values())
    aliases = _ReplicaAliases.apply(count, *params) if params else ()
    replicas: list[M] = []
    for r in range(count):
        alias = {id(p): aliases[r * len(params) + j] for j, p in enumerate(params)}
        copies = [m._replicate_for_data_parallel() for m in modules]
        cloned: dict[int, Tensor] = {}
        for original, replica in zip(modules, copies, strict=True):
            replica._former_parameters = {}  # as torch.nn.parallel.replicate
            for key, param in original._parameters.items():
                if param is None or id(param) not in alias:
                    replica._parameters[key] = param  # frozen, or no grad: the parameter itself
                else:
                    setattr(replica, key, alias[id(param)])  # not a leaf: a plain attribute, as on CUDA
                    replica._former_parameters[key] = alias[id(param)]
            if r > 0:
                for key, buf in original._buffers.items():
                    if buf is not None:
                        if id(buf) not in cloned:
                            cloned[id(buf)] = buf.clone()
                        replica._buffers[key] = cloned[id(buf)]
            for key, child in original._modules.items():
                replica._modules[key] = None if child is None else copies[index[id(child)]]
        replicas.append(copies[0])
    return replicas
