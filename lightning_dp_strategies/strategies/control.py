"""Lightning's collectives over the survivors, surviving a lost rank between optimizer steps.

Between steps Lightning's collectives run over the survivors' control group: validation's ``sync_dist`` reductions and
metric syncs, the checkpoint callback's broadcasts and barriers, a checkpoint's save. :class:`ControlCollectives` runs
each on the group's own threads and waits by polling the membership, so a rank lost during validation or a checkpoint
save is noticed within the heartbeat's ``stale_s`` however the collective routes its messages. Then the survivors agree
(each announcing how many control collectives it completed), re-form their groups, and redo the collective over the new
ones; a loss while they recover starts the recovery again. A collective can complete on some ranks and fail on others
(the lost rank's part had arrived): the ranks one collective behind take its result from a rank that completed it, so
every survivor acts on the same decisions. A survivor one optimizer step behind (its step failed while the others'
completed) takes the step's state from one that completed it and then meets the others in the collective they redo.

Inside an optimizer step (``active`` is off: ``training_step``'s ``sync_dist`` reductions, a metric synced there) the
wait is polled the same way, so every survivor notices a loss within ``stale_s``, and it gives up after ``timeout_s``
as the step's gradient reduction does (a hung rank); the failure propagates, and the step's own recovery redoes it.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_dp_strategies.comm.failures import PeerLostError, wait_work
from lightning_dp_strategies.core.fault_tolerance import Recovery, Survivors
from lightning_dp_strategies.core.membership import ExcludedError, is_peer_failure

__all__ = [
    "ControlCollectives",
    "all_reduce",
    "barrier",
    "broadcast_object",
    "copied",
    "gather",
    "gather_object",
    "redone",
]

T = TypeVar("T")
Interrupt = Callable[[], str | None] | None
"""Polled while a collective waits: why it cannot complete (a peer known lost), or ``None``; ``None``: not polled."""


GAVE_UP_HINT = (
    "If no rank was lost in these failures (the lowest live rank logs each one, saying whether it lost any), the "
    "ranks are alive but not running the same collectives: ranks given different numbers of training batches in an "
    "epoch, as from an `IterableDataset` split by rank, end this way. So does a rank slower than `timeout_s` in "
    "each try (the failures say a rank is hung) that reaches the agreement in time: raise `FaultTolerance(timeout_s)`."
)
"""Appended by :func:`redone` to the error of what it gives up after repeated peer failures."""


def redone(attempt: Callable[[BaseException | None], T], tries: int, gave_up: Exception) -> T:
    """``attempt(failure)``, tried again after each peer failure, at most ``tries`` times; ``failure`` is the last
    one (``None`` at first), and the attempt recovers from it first. The recovery runs inside the attempt, so a loss
    while the survivors recover is met like any other and the recovery starts again. ``ExcludedError`` (this rank was
    left out) and every other error propagate; after ``tries`` failures, an error of ``gave_up``'s type with its
    message and :data:`GAVE_UP_HINT`.

    Examples:
        >>> failures = [PeerLostError("a peer is gone")]
        >>> def attempt(failure):
        ...     if failures:
        ...         raise failures.pop()
        ...     return f"done after {failure}"
        >>> redone(attempt, 2, RuntimeError("given up"))
        'done after a peer is gone'
    """
    failure: BaseException | None = None
    for _ in range(tries):
        try:
            return attempt(failure)
        except Exception as error:
            if isinstance(error, ExcludedError) or not is_peer_failure(error):
                raise
            failure = error
    raise type(gave_up)(f"{gave_up} {GAVE_UP_HINT}") from failure


def barrier(group: dist.ProcessGroup, interrupt: Interrupt) -> None:
    wait_work(dist.barrier(group=group, async_op=True), interrupt, "A barrier")


def all_reduce(tensor: Tensor, op: Any, group: dist.ProcessGroup, interrupt: Interrupt) -> Tensor:
    """The reduction of a copy of ``tensor`` (``tensor`` itself is left as it is, so a failed attempt can be redone)."""
    result = tensor.detach().clone()
    wait_work(dist.all_reduce(result, op=op, group=group, async_op=True), interrupt, "A reduction")
    return result


def broadcast_object(obj: Any, src: int, group: dist.ProcessGroup, interrupt: Interrupt) -> Any:
    """Global rank ``src``'s ``obj`` (pickled), on every rank of ``group``."""
    mine = dist.get_rank() == src
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if mine else None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
    wait_work(dist.broadcast(size, src, group=group, async_op=True), interrupt, "A broadcast")
    if payload is None:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    wait_work(dist.broadcast(payload, src, group=group, async_op=True), interrupt, "A broadcast")
    return obj if mine else pickle.loads(payload.numpy().tobytes())


def gather_object(obj: Any, dst: int, group: dist.ProcessGroup, interrupt: Interrupt) -> list[Any] | None:
    """Every rank's ``obj`` of ``group`` (pickled), in rank order, on global rank ``dst``; ``None`` on the others."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    largest = all_reduce(torch.tensor([payload.numel()]), dist.ReduceOp.MAX, group, interrupt)
    padded = torch.zeros(int(largest.item()), dtype=torch.uint8)  # pickle.loads ignores the bytes past its end
    padded[: payload.numel()] = payload
    out = [torch.empty_like(padded) for _ in range(dist.get_world_size(group))] if dist.get_rank() == dst else None
    wait_work(dist.gather(padded, out, dst=dst, group=group, async_op=True), interrupt, "A gather")
    return None if out is None else [pickle.loads(t.numpy().tobytes()) for t in out]


def gather(tensor: Tensor, group: dist.ProcessGroup, interrupt: Interrupt = None) -> list[Tensor]:
    """Every rank's ``tensor`` of ``group``, in rank order, their shapes allowed to differ (what torchmetrics'
    ``gather_all_tensors`` returns)."""
    ranks = dist.get_world_size(group)
    tensor = tensor.detach().contiguous()
    shape = torch.tensor(tensor.shape, dtype=torch.int64)
    shapes = [torch.empty_like(shape) for _ in range(ranks)]
    wait_work(dist.all_gather(shapes, shape, group=group, async_op=True), interrupt, "A gather")
    largest = torch.stack(shapes).amax(dim=0) if tensor.dim() else shape
    padded = tensor.new_zeros(torch.Size(largest.tolist()))
    padded[tuple(slice(0, n) for n in tensor.shape)] = tensor
    out = [torch.empty_like(padded) for _ in range(ranks)]
    wait_work(dist.all_gather(out, padded, group=group, async_op=True), interrupt, "A gather")
    return [t[tuple(slice(0, int(n)) for n in s)] for t, s in zip(out, shapes, strict=True)]


class ControlCollectives:
    """The collectives between optimizer steps, redone over the survivors after a peer failure (see the module
    docstring). ``recover(error)`` agrees on the survivors (this rank announcing ``completed``) and re-forms their
    groups; ``catch_up(record)`` takes part in handing a completed step's state to the survivors one step behind."""

    def __init__(
        self,
        survivors: Survivors,
        recover: Callable[[BaseException], Recovery],
        catch_up: Callable[[Recovery], object],
    ) -> None:
        self.survivors = survivors
        self._recover = recover
        self._catch_up = catch_up
        self.completed = 0
        """Control collectives this rank completed since the world was last formed: what it announces on a failure."""
        self.active = True
        """Whether a peer failure is survived here; off inside an optimizer step (its own recovery redoes it)."""
        self._last: Any = None  # the last completed collective's result, for the ranks one behind
        self._step: list[Any] = []  # the results of this attempt of an optimizer step's collectives
        self._replay: list[Any] = []  # what the next collectives return without running (a step redone, behind)
        self._metrics: list[Any] = []
        self.refusing: str | None = None
        """Why no collective can run now (set while this rank trains a lost rank's micro-batch), or ``None``."""

    def check(self) -> None:
        """Raise ``RuntimeError`` with :attr:`refusing`, where set: a collective now would meet no partner."""
        if self.refusing is not None:
            raise RuntimeError(self.refusing)

    def run(self, attempt: Callable[[dist.ProcessGroup, Interrupt], T]) -> T:
        """``attempt(group, interrupt)`` over the control group, polled once the survivors watch each other; while
        ``active``, redone over the survivors after each peer failure."""
        self.check()
        if self._replay:  # this rank redoes a step the others completed: the results they got
            self._last = self._replay.pop(0)
            self._step.append(self._last)
            return copied(self._last)
        if not self.survivors.started:
            return self._done(attempt(self._group(), None))
        if not self.active:  # in an optimizer step: the failure propagates, and the step is redone
            result = self._done(attempt(self._group(), self._bounded_as_the_step()))
            self._step.append(copied(result))
            return result

        def once(failure: BaseException | None) -> T:
            if failure is not None:
                record = self._recover(failure)
                if record.behind:  # a survivor's optimizer step failed while this rank's completed
                    self._catch_up(record)
                    if self._replay:  # this rank's collective completed on the others, then a step of theirs failed
                        return self._replay.pop(0)
                elif record.behind_control:
                    handed = self.hand_over(record)
                    if dist.get_rank() in record.behind_control:
                        return handed
            return attempt(self._group(), self.survivors.interrupted)

        tries = self.survivors.world_size
        gave_up = PeerLostError(f"A collective between optimizer steps met {tries} peer failures in a row; giving up.")
        return self._done(redone(once, tries, gave_up))

    def _bounded_as_the_step(self) -> Interrupt:
        """The survivors' interrupt, which also gives up ``timeout_s`` from now: inside an optimizer step a rank that
        does not come is taken for hung after the bound its gradient reduction has."""
        timeout_s = self.survivors.options.timeout_s
        deadline = time.monotonic() + timeout_s

        def interrupt() -> str | None:
            reason = self.survivors.interrupted()
            if reason is None and time.monotonic() > deadline:
                return f"it did not complete within timeout_s={timeout_s:g} s (a rank is hung)"
            return reason

        return interrupt

    def _group(self) -> dist.ProcessGroup:
        group = self.survivors.control_group
        return group if group is not None else dist.distributed_c10d._get_default_group()  # before they are formed

    def _done(self, result: T) -> T:
        self.completed += 1
        self._last = result
        return result

    def hand_over(self, record: Recovery) -> Any:
        """The last result of the lowest survivor that completed one collective more than the others (every
        survivor takes part, those in an optimizer step's recovery too)."""
        source = min(r for r in record.members if r not in record.behind_control and r not in record.behind)
        return broadcast_object(self._last, source, self._group(), None)

    @contextmanager
    def in_step(self) -> Iterator[None]:
        """Inside: an optimizer step, whose failures propagate (the step is redone); nothing of it is replayed after."""
        between_steps, self.active = self.active, False
        try:
            yield
        finally:
            self.active, self._step, self._replay = between_steps, [], []

    def new_attempt(self) -> None:
        """An attempt of an optimizer step starts: nothing of it recorded yet."""
        self._step = []

    def fall_behind(self, handed: list[Any]) -> None:
        """This rank redoes a step that the others completed: its collectives return, in order, what they returned
        in its failed attempt, then ``handed`` (what the others got from the collective that failed here)."""
        self._replay, self._step = [*self._step, *handed], []

    # ------------------------------------------------------------------ Lightning's collectives
    def barrier(self) -> None:
        self.run(barrier)

    def broadcast(self, obj: Any, src: int) -> Any:
        """Global rank ``src``'s ``obj``; rank 0's is the leader's (the lowest live rank) at the time it is sent."""
        return self.run(
            lambda group, wait: broadcast_object(obj, self.survivors.leader if src == 0 else src, group, wait)
        )

    def reduce(self, tensor: Tensor, reduce_op: Any) -> Tensor:
        """Lightning's reduce of ``tensor``, in place as Lightning's: ``"mean"`` (``"avg"``) is the sum over the
        survivors divided by their number; another name, or a ``ReduceOp``, is that reduction."""
        mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
        op = getattr(dist.ReduceOp, "SUM" if mean else reduce_op.upper()) if isinstance(reduce_op, str) else reduce_op

        def attempt(group: dist.ProcessGroup, wait: Interrupt) -> Tensor:
            result = all_reduce(tensor, op, group, wait)
            return result / dist.get_world_size(group) if mean else result

        return tensor.copy_(self.run(attempt))

    def all_gather(self, tensor: Tensor) -> Tensor:
        """Lightning's all-gather: the survivors' ``tensor`` stacked in rank order."""
        return torch.stack(self.run(lambda group, wait: gather(tensor, group, wait)))

    def restart(self) -> None:
        """The world was formed anew (replacements admitted): every rank counts from zero again."""
        self.completed, self._last = 0, None

    # ------------------------------------------------------------------ torchmetrics
    def watch_metrics(self, metrics: Iterable[Any]) -> None:
        """Sync each torchmetrics metric through :meth:`run` (the instance's ``_sync_dist`` is set; :meth:`close`
        removes it, so the class's own is used again)."""
        for metric in metrics:
            if "_sync_dist" not in vars(metric):
                _warn_own_sync_unused(metric)
                metric._sync_dist = self._metric_sync(metric)
                self._metrics.append(metric)

    def _metric_sync(self, metric: Any) -> Callable[..., None]:
        own = type(metric)._sync_dist

        def sync(dist_sync_fn: Any = None, process_group: Any = None) -> None:
            def attempt(group: dist.ProcessGroup, interrupt: Interrupt) -> dict[str, Any]:
                own(metric, lambda tensor, group: gather(tensor, group, interrupt), process_group=group)
                return {attr: copied(getattr(metric, attr)) for attr in metric._reductions}

            for attr, value in self.run(attempt).items():
                setattr(metric, attr, value)

        return sync

    def close(self) -> None:
        """The metrics' own ``_sync_dist`` again."""
        for metric in self._metrics:
            del metric._sync_dist
        self._metrics = []


def _warn_own_sync_unused(metric: Any) -> None:
    """Say (on global rank 0) that a metric's own ``dist_sync_fn`` or ``process_group`` is set aside: its states are
    gathered over the survivors' control group instead."""
    own = [f"`{name}`" for name in ("dist_sync_fn", "process_group") if getattr(metric, name, None) is not None]
    if own:
        rank_zero_warn(
            f"{type(metric).__name__}'s {' and '.join(own)} is not used under `fault_tolerant=True`: the strategy "
            "gathers the metric's states over the survivors, with a wait that notices a lost rank. Construct the "
            "metric without it to silence this warning."
        )


def copied(value: Any) -> Any:
    """``value`` with every tensor in it (in dicts and lists, at any depth) detached and cloned."""
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [copied(v) for v in value]
    return value
