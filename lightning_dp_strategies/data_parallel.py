"""The four steps of ``torch.nn.DataParallel.forward`` as pure functions: scatter, replicate, parallel_apply, gather.

They know nothing of Lightning. On CUDA they use the ``torch.nn.parallel`` primitives; on CPU the replicas are
*logical*: several modules on the one CPU device that share the root module's parameters, so the whole data flow
runs (and is tested) without a GPU::

    inputs ──scatter──▶ chunk 0 ─▶ replica 0 ─┐
      (dim 0, even      chunk 1 ─▶ replica 1 ─┼─parallel_apply (threads)──▶ outputs ──gather──▶ root device
       split ± 1)       chunk 2 ─▶ replica 2 ─┘                               (cat along dim 0)

Gradients need no averaging step: the replicas' parameters are differentiable aliases of the root parameters (CPU)
or differentiable broadcasts of them (CUDA), so autograd sums each replica's contribution into the root ``.grad``, in
replica order (bitwise the same sum in every run). A loss computed on
the gathered outputs is the loss of the whole batch, hence the gradients are the single-device gradients, also when
the batch does not split evenly.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.nn import Module

__all__ = ["ThreadContext", "as_devices", "gather", "parallel_apply", "replicate", "scatter", "split_sizes"]

T = TypeVar("T")
M = TypeVar("M", bound=Module)
DeviceLike = torch.device | str | int
SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")


# ---------------------------------------------------------------------------------------------------- devices
def as_devices(devices: Sequence[DeviceLike]) -> list[torch.device]:
    """Normalise ``devices`` (``torch.device``, ``"cuda:1"``, or a CUDA index) and check they are one supported type.

    Examples:
        >>> as_devices(["cpu", torch.device("cpu")])
        [device(type='cpu'), device(type='cpu')]
    """
    if isinstance(devices, (str, int, torch.device)) or len(devices) == 0:
        raise ValueError(
            f"Expected a non-empty list of devices such as ['cuda:0', 'cuda:1'] or ['cpu'] * 3, got {devices!r}."
        )
    out: list[torch.device] = []
    for device in devices:
        try:
            out.append(torch.device("cuda", device) if isinstance(device, int) else torch.device(device))
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"Unknown device {device!r}: use 'cpu', 'cuda:<index>' or a torch.device.") from err
    types = sorted({d.type for d in out})
    if len(types) > 1:
        raise ValueError(
            f"The devices {[str(d) for d in out]} mix the device types {types}: scatter/gather data parallelism needs "
            "devices of one type, e.g. ['cuda:0', 'cuda:1'] or ['cpu'] * 3 (logical CPU replicas)."
        )
    if types[0] not in SUPPORTED_DEVICE_TYPES:
        raise ValueError(
            f"Device type {types[0]!r} is not supported: replicas run on {list(SUPPORTED_DEVICE_TYPES)} devices. Use "
            "accelerator='cuda' (one replica per GPU) or accelerator='cpu' (logical replicas on the CPU)."
        )
    return out


# ---------------------------------------------------------------------------------------------------- structures
def _is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _is_dataclass_instance(obj: object) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _children(obj: Any) -> list[tuple[str, Any]] | None:
    """``(path suffix, child)`` pairs of a container this module recurses into, or ``None`` for a leaf."""
    if isinstance(obj, Tensor):
        return None
    if _is_namedtuple(obj):
        return [(f".{name}", value) for name, value in zip(obj._fields, obj, strict=True)]
    if isinstance(obj, (tuple, list)):
        return [(f"[{i}]", value) for i, value in enumerate(obj)]
    if isinstance(obj, dict):
        return [(f"[{key!r}]", value) for key, value in obj.items()]
    if _is_dataclass_instance(obj):
        return [(f".{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj) if hasattr(obj, f.name)]
    return None


def _rebuild(obj: Any, values: list[Any]) -> Any:
    """A container of the same type as ``obj`` holding ``values`` (in the order of :func:`_children`)."""
    if _is_namedtuple(obj):
        return type(obj)(*values)
    if isinstance(obj, (tuple, list)):
        return type(obj)(values)
    if isinstance(obj, dict):
        pairs = list(zip(obj.keys(), values, strict=True))
        if isinstance(obj, defaultdict):
            return type(obj)(obj.default_factory, pairs)
        return type(obj)(pairs)
    # dataclass: a shallow copy with the fields replaced (no __init__/__post_init__ rerun; frozen ones too)
    new = copy.copy(obj)
    names = [f.name for f in dataclasses.fields(obj) if hasattr(obj, f.name)]
    for name, value in zip(names, values, strict=True):
        object.__setattr__(new, name, value)
    return new


def _tensors(obj: Any, path: str) -> Iterator[tuple[str, Tensor]]:
    if isinstance(obj, Tensor):
        yield path, obj
        return
    for suffix, child in _children(obj) or []:
        yield from _tensors(child, path + suffix)


# ---------------------------------------------------------------------------------------------------- scatter
def split_sizes(batch_size: int, num_devices: int) -> list[int]:
    """Sizes of the chunks: as even as possible, the first ``batch_size % n`` one larger, never an empty chunk.

    Examples:
        >>> split_sizes(10, 3)
        [4, 3, 3]
        >>> split_sizes(2, 4)  # a batch smaller than the number of devices uses fewer replicas
        [1, 1]
    """
    if batch_size < 0 or num_devices < 1:
        raise ValueError(f"Need batch_size >= 0 and num_devices >= 1, got {batch_size} and {num_devices}.")
    n = max(1, min(num_devices, batch_size))
    base, extra = divmod(batch_size, n)
    return [base + 1] * extra + [base] * (n - extra)


def _batch_size(inputs: Any, dim: int, name: str) -> int | None:
    first: tuple[str, int] | None = None
    for path, tensor in _tensors(inputs, name):
        if tensor.dim() == 0:
            continue  # a scalar has no batch dimension: it is copied to every replica
        if tensor.dim() <= dim:
            raise ValueError(
                f"Cannot split {path} (shape {tuple(tensor.shape)}) along dim {dim}: every tensor argument needs "
                f"the batch dimension {dim}. Pass per-batch constants as module buffers or attributes instead."
            )
        if first is None:
            first = (path, tensor.shape[dim])
        elif tensor.shape[dim] != first[1]:
            raise ValueError(
                f"Cannot split the batch: {path} has {tensor.shape[dim]} rows along dim {dim} but {first[0]} has "
                f"{first[1]}. Every tensor that is split must share the batch size; pass tensors shared by all "
                "samples as module buffers/attributes, or expand them to the batch size."
            )
    return None if first is None else first[1]


def scatter(inputs: T, devices: Sequence[DeviceLike], dim: int = 0, name: str = "inputs") -> list[T]:
    """Split ``inputs`` into one piece per replica, each moved to its device.

    Tensors are split along ``dim`` (which every non-scalar tensor must share in size) into chunks as even as
    :func:`split_sizes` makes them, recursing through tuples, lists, dicts, named tuples and dataclasses; 0-dim tensors
    and non-tensors are copied (by reference) to every replica. A batch smaller than ``len(devices)`` gives fewer
    pieces; inputs without a tensor to split give one piece.

    Args:
        inputs: any nesting of the containers above, e.g. ``(args, kwargs)`` of a forward call.
        devices: the replicas' devices, one type (see :func:`as_devices`).
        dim: the batch dimension.
        name: how error messages call ``inputs``.

    Examples:
        >>> pieces = scatter({"x": torch.arange(5), "tag": "a"}, ["cpu"] * 2)
        >>> [p["x"].tolist() for p in pieces], [p["tag"] for p in pieces]
        ([[0, 1, 2], [3, 4]], ['a', 'a'])
    """
    targets = as_devices(devices)
    batch = _batch_size(inputs, dim, name)
    sizes = split_sizes(batch or 0, len(targets))
    return [_take(inputs, i, sizes, dim, targets[i]) for i in range(len(sizes))]


def _take(obj: Any, index: int, sizes: list[int], dim: int, device: torch.device) -> Any:
    if isinstance(obj, Tensor):
        if obj.dim() == 0 or len(sizes) == 1:
            return obj.to(device)
        start = sum(sizes[:index])
        return obj.narrow(dim, start, sizes[index]).to(device, non_blocking=device.type == "cuda")
    children = _children(obj)
    if children is None:
        return obj
    return _rebuild(obj, [_take(child, index, sizes, dim, device) for _, child in children])


# ---------------------------------------------------------------------------------------------------- replicate
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
    targets = as_devices(devices)
    if targets[0].type == "cuda":
        from torch.nn.parallel import replicate as cuda_replicate

        return cuda_replicate(module, targets, detach=not torch.is_grad_enabled())
    return _logical_replicas(module, len(targets))


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


# ---------------------------------------------------------------------------------------------------- parallel_apply
@dataclasses.dataclass(frozen=True)
class ThreadContext:
    """The thread-local state a replica's thread must share with the caller: grad mode, inference mode, autocast.

    ``intra_op_threads`` (CPU replicas only) is the share of the caller's intra-op threads each replica's thread
    uses, so that N replicas on one CPU do not oversubscribe its cores N times over.

    Examples:
        >>> with torch.no_grad():
        ...     context = ThreadContext.capture()
        >>> context.grad_enabled, context.inference_mode, context.autocast
        (False, False, ())
        >>> with context.apply(torch.device("cpu")):  # e.g. in a replica's thread
        ...     torch.is_grad_enabled()
        False
    """

    grad_enabled: bool
    inference_mode: bool
    autocast: tuple[tuple[str, torch.dtype, bool], ...]  # (device type, dtype, cache enabled) of each active one
    intra_op_threads: int | None = None

    @classmethod
    def capture(cls, intra_op_threads: int | None = None) -> ThreadContext:
        """The calling thread's state."""
        active = tuple(
            (kind, torch.get_autocast_dtype(kind), torch.is_autocast_cache_enabled())
            for kind in SUPPORTED_DEVICE_TYPES
            if torch.is_autocast_enabled(kind)
        )
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), active, intra_op_threads)

    @contextmanager
    def apply(self, device: torch.device, stream: Any = None) -> Iterator[None]:
        """Enter this state (and ``device`` with its ``stream`` on CUDA) in the current thread."""
        with ExitStack() as stack:
            if self.inference_mode:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for kind, dtype, cache in self.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, cache_enabled=cache))
            if device.type == "cuda":
                stack.enter_context(torch.cuda.device(device))
                if stream is not None:
                    stack.enter_context(torch.cuda.stream(stream))
            if self.intra_op_threads is not None and self.intra_op_threads != torch.get_num_threads():
                # OpenMP and MKL keep the count per thread; the caller of parallel_apply restores its own
                torch.set_num_threads(self.intra_op_threads)
            yield


_vector_math_ready = False


def _initialise_vector_math() -> None:
    """Let MKL's vector-math library initialise itself in this thread, before replicas first call it at once.

    Its lazy initialisation is not safe against concurrent first calls. Measured with the torch 2.13 CPU wheel and
    ``OMP_NUM_THREADS=1``: when 8 threads made a process's first vector-math call (``torch.tanh``) at the same moment,
    one of them got other bits in 14 of 9,000 forked processes; after one ``torch.exp`` in the calling thread, in none
    of 6,000. Through ``dp`` that made a resumed run differ from the uninterrupted one (~4e-6 after 10 Adam steps)
    about once in 100 fresh processes. Once per process; a forked child inherits the initialised library.
    """
    global _vector_math_ready
    if not _vector_math_ready:
        for dtype in (torch.float32, torch.float64):
            torch.exp(torch.zeros(16, dtype=dtype))
        _vector_math_ready = True


def parallel_apply(
    functions: Sequence[Callable[..., Any]],
    inputs: Sequence[tuple[Sequence[Any], Mapping[str, Any]]],
    devices: Sequence[DeviceLike],
) -> list[Any]:
    """Call ``functions[i](*args_i, **kwargs_i)`` for all ``i`` at once, one thread each, on ``devices[i]``.

    Grad mode, inference mode and autocast of the calling thread are carried into every thread (they are
    thread-local in PyTorch); on CUDA each thread runs on its device's current stream, on CPU with an equal share of
    the caller's intra-op threads. Function 0 runs in the calling thread. An exception in any replica is re-raised
    here, after all threads finished.

    CPU replicas draw random numbers (dropout) from the one CPU generator. Under
    ``torch.use_deterministic_algorithms(True)`` (what ``Trainer(deterministic=True)`` sets) their threads therefore
    run one after another, in replica order, each with all of the caller's intra-op threads, so that every run gives
    every replica the same random numbers; otherwise they run at once and draw in whatever order they reach it.

    Args:
        functions: one callable per replica, usually ``replica.forward`` or the replica itself.
        inputs: ``(args, kwargs)`` per replica, as :func:`scatter` returns for ``(args, kwargs)``.
        devices: the device of each replica.

    Examples:
        >>> inputs = [((torch.ones(1),), {}), ((torch.zeros(1),), {})]
        >>> [out.tolist() for out in parallel_apply([torch.neg, torch.exp], inputs, ["cpu"] * 2)]
        [[-1.0], [1.0]]
    """
    targets = as_devices(devices)
    if not len(functions) == len(inputs) == len(targets):
        raise ValueError(
            f"Need one input and one device per function, got {len(functions)} functions, {len(inputs)} inputs "
            f"and {len(targets)} devices."
        )
    # CPU replicas draw random numbers (dropout) from the one CPU generator, in whatever order their threads reach it;
    # under torch.use_deterministic_algorithms(True) (Trainer(deterministic=True)) they run one after another, in
    # replica order, so every run hands every replica the same random numbers
    one_at_a_time = targets[0].type == "cpu" and torch.are_deterministic_algorithms_enabled()
    if targets[0].type == "cpu" and len(functions) > 1:
        _initialise_vector_math()  # before the replicas' threads can race into its lazy set-up
    # replicas sharing one CPU at once share its intra-op threads (none on CUDA, where each has its own device)
    cpu_share: int | None = None
    if targets[0].type == "cpu":
        cpu_share = torch.get_num_threads() if one_at_a_time else max(1, torch.get_num_threads() // len(targets))
    context = ThreadContext.capture(intra_op_threads=cpu_share)
    streams = [torch.cuda.current_stream(d) if d.type == "cuda" else None for d in targets]
    results: list[Any] = [None] * len(functions)
    errors: list[BaseException | None] = [None] * len(functions)

    def run(i: int) -> None:
        try:
            args, kwargs = inputs[i]
            with context.apply(targets[i], streams[i]):
                results[i] = functions[i](*args, **kwargs)
        except BaseException as err:
            errors[i] = err

    threads = [threading.Thread(target=run, args=(i,), name=f"replica-{i}") for i in range(1, len(functions))]
    own_threads = torch.get_num_threads()
    try:
        if one_at_a_time:
            run(0)
            for thread in threads:
                thread.start()
                thread.join()
        else:
            for thread in threads:
                thread.start()
            run(0)
    finally:
        for thread in threads:
            if thread.ident is not None:  # started
                thread.join()
        if torch.get_num_threads() != own_threads:
            torch.set_num_threads(own_threads)
    for i, err in enumerate(errors):
        if err is not None:
            if hasattr(err, "add_note"):
                err.add_note(f"(raised in replica {i} of {len(functions)}, on {targets[i]})")
            raise err
    return results


# ---------------------------------------------------------------------------------------------------- gather
def gather(outputs: Sequence[Any], device: DeviceLike, dim: int = 0) -> Any:
    """Merge the replicas' outputs on ``device``: tensors concatenated along ``dim``, containers recursively.

    Every replica must return the same structure. Non-tensor leaves equal in all replicas are kept once, otherwise
    returned as the list of per-replica values. 0-dim tensors (for example a loss computed inside ``forward``) are
    stacked into a vector with one value per replica, with a warning: their mean is not the batch mean when the split
    is uneven.

    Examples:
        >>> gather([(torch.zeros(2), "a"), (torch.ones(1), "a")], "cpu")
        (tensor([0., 0., 1.]), 'a')
    """
    if len(outputs) == 0:
        raise ValueError("Nothing to gather: `outputs` is empty.")
    return _merge(list(outputs), as_devices([device])[0], dim, "output")


def _merge(values: list[Any], device: torch.device, dim: int, path: str) -> Any:
    first = values[0]
    if isinstance(first, Tensor):
        if not all(isinstance(v, Tensor) for v in values):
            raise ValueError(
                f"{path} is a tensor in replica 0 but not in every replica; forward must return one structure."
            )
        moved = [v.to(device) for v in values]
        if all(v.dim() == 0 for v in moved):
            if len(moved) > 1:
                warnings.warn(
                    f"forward returned the 0-dim tensor {path} (a loss?); its {len(moved)} per-replica values were "
                    "stacked into a vector, whose mean is not the batch mean when the batch splits unevenly. Return "
                    "per-sample values (e.g. reduction='none') and reduce them in the step: that gives exactly the "
                    "single-device gradients.",
                    stacklevel=2,
                )
            return torch.stack(moved) if len(moved) > 1 else moved[0]
        return torch.cat(moved, dim) if len(moved) > 1 else moved[0]
    children = _children(first)
    if children is None:
        return first if _all_equal(values) else values
    keys = [key for key, _ in children]
    per_replica = [children]
    for i, other in enumerate(values[1:], start=1):
        other_children = _children(other) if type(other) is type(first) else None
        if other_children is None or [key for key, _ in other_children] != keys:
            found = [key for key, _ in other_children or []]
            raise ValueError(
                f"The replicas returned different structures at {path}: {type(first).__name__} with {keys} in "
                f"replica 0, {type(other).__name__} with {found} in replica {i}. forward must return the same "
                "structure for every chunk of the batch."
            )
        per_replica.append(other_children)
    merged = [
        _merge([child_list[j][1] for child_list in per_replica], device, dim, path + key) for j, key in enumerate(keys)
    ]
    return _rebuild(first, merged)


def _all_equal(values: list[Any]) -> bool:
    try:
        return all(v is values[0] or bool(v == values[0]) for v in values[1:])
    except Exception:  # an __eq__ that does not give a truth value
        return False
