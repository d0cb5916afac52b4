"""Run every replica on its chunk at once, one thread each, carrying the caller's grad mode and autocast along."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from lightning_dp_strategies.data_parallel.devices import SUPPORTED_DEVICE_TYPES, DeviceLike, as_devices

__all__ = ["ThreadContext", "parallel_apply"]


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

    Its lazy initialisation is not safe against concurrent first calls: threads racing into a process's first
    vector-math call (``torch.tanh``) could compute with other bits, so two ``dp`` runs could differ. One call in the
    calling thread first prevents it (the CHANGELOG has the measurement). Once per process; a forked child inherits
    the initialised library.
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
    context = _replica_context(targets, one_at_a_time)
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

    _run_replicas(run, len(functions), one_at_a_time)
    _raise_first(errors, targets)
    return results


def _replica_context(targets: Sequence[torch.device], one_at_a_time: bool) -> ThreadContext:
    """The caller's thread context for the replicas' threads, with each CPU replica's share of intra-op threads.

    Replicas sharing one CPU at once share its intra-op threads (none on CUDA, where each has its own device); run one
    at a time, each gets all of them.
    """
    cpu_share: int | None = None
    if targets[0].type == "cpu":
        if len(targets) > 1:
            _initialise_vector_math()  # before the replicas' threads can race into its lazy set-up
        cpu_share = torch.get_num_threads() if one_at_a_time else max(1, torch.get_num_threads() // len(targets))
    return ThreadContext.capture(intra_op_threads=cpu_share)


def _run_replicas(run: Callable[[int], None], count: int, one_at_a_time: bool) -> None:
    """``run(i)`` for every replica: 0 in the calling thread, the others in a thread each, at once or in order.

    Every started thread is joined, and the caller's intra-op thread count restored, however the runs end.
    """
    threads = [threading.Thread(target=run, args=(i,), name=f"replica-{i}") for i in range(1, count)]
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


def _raise_first(errors: Sequence[BaseException | None], targets: Sequence[torch.device]) -> None:
    """Re-raise the first replica's exception, noting which replica and device raised it."""
    for i, err in enumerate(errors):
        if err is not None:
            if hasattr(err, "add_note"):
                err.add_note(f"(raised in replica {i} of {len(errors)}, on {targets[i]})")
            raise err
