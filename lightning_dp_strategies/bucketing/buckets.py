"""Gradient buckets: reverse-order assignment, flat buffers, readiness hooks, and reduction overlapped with backward.

How one synchronised backward pass goes (DDP's reducer, rebuilt on post-accumulate-grad hooks):

1. ``arm()`` before backward. Parameters were assigned to buckets in reverse registration order (gradients of the last
   layers are ready first), each bucket a flat buffer of one dtype and device, capped in size, the first one small.
2. Each parameter's hook divides its ``.grad`` by the world size into its slot (one pass: the division is fused
   into the copy, as torch DDP does) and points ``.grad`` at that slot at once (DDP's ``gradient_as_bucket_view``), so
   the gradient autograd just allocated is freed while backward goes on and its memory is reused by the next one.
   When every slot of bucket ``i`` is filled and buckets ``0..i-1`` are launched, bucket ``i`` is handed to the
   reducer (:mod:`lightning_dp_strategies.reducers`) to be summed (``op="sum"``: it is already divided), which
   returns a future at once; the default ring reducer works on its own communication thread while backward goes on.
   Buckets launch strictly in index order, so every rank issues the same sequence of collectives.
3. ``finish()`` after backward. Slots whose hook never fired (a parameter unused on this rank) are filled the same way
   from the local ``.grad`` if one exists, else with zeros, and the remaining buckets launch. Then it waits for all of
   them; every ``.grad`` some rank produced is now its averaged slice of the bucket (no copy back; a gradient that
   still is that view next step, e.g. after ``zero_grad(set_to_none=False)``, is divided in place, not copied).

Unused parameters need no flag: each bucket carries one presence flag per parameter (1 where this rank has a
gradient), reduced with the gradients. A parameter no rank has a gradient for keeps ``.grad is None``, exactly as in
single-device training; one that some rank used gets the average on every rank.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter

from lightning_dp_strategies.bucketing.bucket import Bucket
from lightning_dp_strategies.bucketing.layout import assign_buckets
from lightning_dp_strategies.bucketing.stats import CommStats
from lightning_dp_strategies.comm import divide
from lightning_dp_strategies.comm.failures import PeerLostError, announce_failure
from lightning_dp_strategies.plan.sizing import ring_bytes_per_rank
from lightning_dp_strategies.reducers.base import GradBucket, Reducer, as_reducer, close_reducer
from lightning_dp_strategies.reducers.bucket import TIMED_OUT, wait_for
from lightning_dp_strategies.reducers.builtin import resolve_reducer

__all__ = ["Bucket", "GradientBuckets"]


class GradientBuckets:
    """Averages the gradients of ``named_params`` over ``group`` during every armed backward pass.

    Args:
        named_params: ``(name, parameter)`` pairs in registration order (``module.named_parameters()``). Parameters
            that do not require grad are left out, and the buckets are rebuilt when that set changes (unfreezing).
        group: the process group to average over (``None``: the world).
        reducer: how a bucket is averaged: a name in :data:`~lightning_dp_strategies.reducers.REDUCERS`
            (``"ring"``, ``"native"``, ``"per_tensor"``), or a callable ``reducer(bucket) -> Future`` (see
            :class:`~lightning_dp_strategies.reducers.Reducer`); default ``None``, a new ring reducer.
        bucket_cap_mb: cap of every bucket but the first, in MiB.
        first_bucket_cap_mb: cap of the first bucket, small so communication starts early in backward.
        duplex_group: deprecated (the ring reducer makes its own second connection in its setup step, see
            :func:`~lightning_dp_strategies.reducers.setup_reducer`); a group given here is still handed to the
            reducer with every bucket.
        allow_no_trainable: allow a parameter set with nothing to train (no bucket until one is unfrozen).
        timeout: seconds to wait for a bucket's reduction after backward before failing with an error that names
            the bucket (``None``: wait as long as the reducer takes).

    With a reducer whose ``scatters`` is true (:class:`~lightning_dp_strategies.reducers.ScatterReducer`) only this
    rank's chunk of each bucket is averaged: ``.grad`` stays ``None``, a sharded optimizer takes the chunk.

    A reducer with a true ``hands_raw_gradients`` attribute (a torch DDP communication hook,
    :class:`~lightning_dp_strategies.comm_hooks.CommHookReducer`) gets each bucket's gradients undivided and without
    the presence flags, and averages them itself; the flags are then summed apart, in one small all-reduce after the
    buckets complete.

    Examples:
        >>> model = torch.nn.Linear(3, 2)
        >>> buckets = GradientBuckets(model.named_parameters(), reducer="ring")  # one process
        >>> buckets.layout()
        [[('bias', (2,), 'torch.float32'), ('weight', (2, 3), 'torch.float32')]]
        >>> buckets.arm(); model(torch.ones(4, 3)).sum().backward(); buckets.finish(); buckets.close()
        >>> model.weight.grad.tolist(), buckets.totals.synced_backwards
        ([[4.0, 4.0, 4.0], [4.0, 4.0, 4.0]], 1)
    """

    def __init__(
        self,
        named_params: Iterable[tuple[str, Parameter]],
        group: dist.ProcessGroup | None = None,
        reducer: str | Reducer | None = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        duplex_group: dist.ProcessGroup | None = None,
        allow_no_trainable: bool = False,
        timeout: float | None = None,
    ) -> None:
        # configuration
        self.named_params = list(named_params)
        self.allow_no_trainable = allow_no_trainable
        """Whether no trainable parameter is allowed (no bucket; a parameter unfrozen later gets one at ``arm``)."""
        self.group = group
        if duplex_group is not None:
            warnings.warn(
                "GradientBuckets(duplex_group=...) is deprecated: the ring reducer makes its own second connection "
                "in its setup step; call lightning_dp_strategies.reducers.setup_reducer(reducer, group) on every "
                "rank instead. It will be removed in 0.3.",
                DeprecationWarning,
                stacklevel=2,
            )
        self.duplex_group = duplex_group
        self.reducer: Reducer = resolve_reducer(reducer)
        declared = as_reducer(self.reducer)  # its optional steps, as ReducerBase declares them
        self._raw = declared.hands_raw_gradients
        self._scatters = declared.scatters
        self.timeout = timeout
        self.bucket_cap_mb = bucket_cap_mb
        self.first_bucket_cap_mb = first_bucket_cap_mb
        # runtime state
        self.buckets: list[Bucket] = []
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._built_for: tuple[bool, ...] = ()
        self.builds = 0  # layouts built: one more each time the set of trainable parameters changes
        self._armed = False
        self._accepting: set[int] | None = None
        """With ``arm(deferred=True)``: the ids of the parameters whose next gradient is final (see ``accept``)."""
        self._base: dict[int, Tensor] = {}
        self._flushed = False
        self._slot_of: dict[int, tuple[int, int]] = {}
        self._next_launch = 0
        self._world_size = 1
        """The group's size, read at every ``arm()``: buckets built before ``init_process_group`` still average."""
        self.sync_blocked = False
        """Set while the owner deliberately skips communication (accumulation, ``no_sync``)."""
        self.interrupt: Callable[[], str | None] | None = None
        """Polled while waiting: a reason (a peer known lost) fails the wait at once with ``PeerLostError``."""
        self._warned_unarmed = False
        # statistics
        self.totals = CommStats()
        self._build()

    # ------------------------------------------------------------------ layout
    def _trainable_signature(self) -> tuple[bool, ...]:
        return tuple(p.requires_grad for _, p in self.named_params)

    def _build(self) -> None:
        self._remove_hooks()
        trainable = [(n, p) for n, p in self.named_params if p.requires_grad]
        if not trainable and not self.allow_no_trainable:
            raise ValueError(
                "The model has no parameter that requires grad, so there is no gradient to average. "
                "Unfreeze at least one parameter (`param.requires_grad_(True)`) before training."
            )
        assignment = assign_buckets([p for _, p in trainable], self.bucket_cap_mb, self.first_bucket_cap_mb)
        self.buckets = []
        self._slot_of = {}
        for index, members in enumerate(assignment):
            params = [trainable[i][1] for i in members]
            offsets = [0, *(p.numel() for p in params)]
            offsets = [sum(offsets[: k + 1]) for k in range(len(params))]
            numel = sum(p.numel() for p in params)
            buffer = torch.zeros(numel + len(params), dtype=params[0].dtype, device=params[0].device)
            bucket = Bucket(index, params, [trainable[i][0] for i in members], offsets, buffer)
            bucket.reset()
            self.buckets.append(bucket)
            for slot, param in enumerate(params):
                self._slot_of[id(param)] = (index, slot)
                hook = functools.partial(self._on_grad_ready, index, slot)
                self._hooks.append(param.register_post_accumulate_grad_hook(hook))
        self._built_for = self._trainable_signature()
        self.builds += 1

    def layout(self) -> list[list[tuple[str, tuple[int, ...], str]]]:
        """Per bucket, the ``(name, shape, dtype)`` of its parameters: identical on every rank of a healthy job."""
        return [
            [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(b.names, b.params, strict=True)] for b in self.buckets
        ]

    @property
    def gradient_bytes(self) -> int:
        """Bytes of trainable gradients (the presence flags excluded)."""
        return sum(b.numel * b.buffer.element_size() for b in self.buckets)

    # ------------------------------------------------------------------ one backward
    def arm(self, deferred: bool = False, base: Mapping[Parameter, Tensor | None] | None = None) -> None:
        """Reduce the gradients of the next backward pass (call right before it).

        ``deferred``: a parameter's gradient is taken only once :meth:`accept` named it (its next gradient is
        final), for a backward made of several passes (micro-batches). ``base``: gradients accumulated earlier,
        per parameter, that the reduction adds to the new ones (``.grad`` itself was cleared for the passes).
        """
        if self._trainable_signature() != self._built_for:
            self._build()
        for bucket in self.buckets:
            bucket.reset()
        self._next_launch = 0
        self._world_size = dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1
        self._accepting = set() if deferred else None
        self._base = {id(p): grad for p, grad in (base or {}).items() if grad is not None}
        self._flushed = False
        self._armed = True

    def accept(self, params: Iterable[Tensor]) -> None:
        """The next gradient of each of ``params`` is final: bucket it as soon as it is accumulated."""
        if self._accepting is not None:
            self._accepting.update(id(p) for p in params if id(p) in self._slot_of)

    def take(self, params: Iterable[Tensor]) -> None:
        """The gradients of ``params`` are final now: bucket those not bucketed yet (gradients written without the
        accumulate-grad hook, or none in the last pass) and launch the buckets that are complete."""
        if not self._armed:
            return
        for param in params:
            where = self._slot_of.get(id(param))
            if where is not None and not self.buckets[where[0]].ready[where[1]]:
                self._take(self.buckets[where[0]], where[1], param)

    def skip(self) -> None:
        """Count a backward pass that accumulates locally without communicating."""
        self.totals.skipped_backwards += 1

    def _on_grad_ready(self, bucket_index: int, slot: int, param: Tensor) -> None:
        if not self._armed:
            if not self.sync_blocked and not self._warned_unarmed:
                self._warned_unarmed = True
                warnings.warn(
                    f"Parameter {self.buckets[bucket_index].names[slot]!r} got a gradient from a backward pass that "
                    "was not synchronised, so it is not averaged across ranks. Call backward through the strategy "
                    "(`self.manual_backward(loss)` in manual optimization, `fabric.backward(loss)` under Fabric), or "
                    "wrap deliberate local backward passes in `strategy.no_backward_sync()`.",
                    stacklevel=2,
                )
            return
        if self._accepting is not None and id(param) not in self._accepting:
            return  # an earlier pass of a deferred backward: more gradient is coming
        bucket = self.buckets[bucket_index]
        if bucket.ready[slot]:
            raise RuntimeError(
                f"Parameter {bucket.names[slot]!r} received its gradient twice in one synchronised backward pass. "
                "Call backward once per step (sum the losses first), or run the extra backward inside "
                "`strategy.no_backward_sync()`."
            )
        self._take(bucket, slot, param)

    def _take(self, bucket: Bucket, slot: int, param: Tensor) -> None:
        self._fill(bucket, slot, param)
        bucket.ready[slot] = True
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_in_order()

    def _fill(self, bucket: Bucket, slot: int, param: Tensor) -> None:
        """Put ``param.grad / world_size`` into its slot and make ``.grad`` that slot; zeros and flag 0 without one."""
        view, grad = bucket.grad_view(slot), param.grad
        if grad is not None and grad.is_sparse:
            raise RuntimeError(
                f"Parameter {bucket.names[slot]!r} has a sparse gradient, which bucketed all-reduce cannot average. "
                "Use dense gradients (for example `nn.Embedding(..., sparse=False)`)."
            )
        base = self._base.get(id(param))
        if base is not None:  # what accumulating into .grad would hold, summed into the slot (averaged below)
            grad = base if grad is None else torch.add(base, grad, out=view)
        if grad is None:
            view.zero_()
            bucket.flags[slot] = 0
            return
        if self._raw:  # the reducer averages (a torch DDP hook): the slot gets the local gradient as it is
            if grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
        elif self._world_size > 1 or grad.data_ptr() != view.data_ptr():
            # one pass: copy and average; in place when .grad already is the slot (accumulation, set_to_none=False)
            divide(grad, self._world_size, out=view)
        # Free autograd's fresh gradient now, not at finish(): with all of them alive until the end of backward, the
        # allocator hands their memory back to the OS and the next backward pays page faults on all of it.
        param.grad = view
        bucket.flags[slot] = 1

    def _launch_in_order(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            bucket = self.buckets[self._next_launch]
            bucket.future = self.reducer(
                GradBucket(
                    bucket.buffer[: bucket.numel] if self._raw else bucket.buffer,
                    self.group,
                    bucket.counter,
                    bucket.index,
                    [p.shape for p in bucket.params],
                    num_flags=0 if self._raw else len(bucket.params),
                    # the gradients were divided by the world size on their way into the bucket, unless the reducer
                    # averages them itself
                    op="avg" if self._raw else "sum",
                    duplex=self.duplex_group,
                    params=list(bucket.params),
                    last=bucket.index == len(self.buckets) - 1,
                )
            )
            self._next_launch += 1

    def flush(self) -> None:
        """Fill every slot still empty from ``.grad`` and launch every bucket, without waiting."""
        if not self._armed or self._flushed:
            return
        self._flushed = True
        self.totals.overlapped_buckets += self._next_launch
        for bucket in self.buckets[self._next_launch :]:
            for slot, param in enumerate(bucket.params):
                if not bucket.ready[slot]:
                    self._fill(bucket, slot, param)
                    bucket.ready[slot] = True
            bucket.pending = 0
        self._launch_in_order()

    def _wait(self) -> None:
        waited = time.perf_counter()
        for bucket in self.buckets:
            future = bucket.future
            assert future is not None
            gave_up = None if future.done() else wait_for(future, self.timeout, self.interrupt)
            if gave_up == TIMED_OUT:
                late = f"not complete after {self.timeout:g} s (the strategy's `timeout`)"
                raise TimeoutError(self._failure_message(bucket, late))
            if gave_up is not None:
                raise PeerLostError(self._failure_message(bucket, f"given up: {gave_up}"))
            try:
                future.wait()
            except Exception as error:
                raise RuntimeError(self._failure_message(bucket, f"{type(error).__name__}: {error}")) from error
        if self._raw:
            self._sum_flags()
        self.totals.exposed_seconds += time.perf_counter() - waited

    def _sum_flags(self) -> None:
        """Sum every bucket's presence flags over the group, in one all-reduce (for reducers that left them out)."""
        if self._world_size == 1 or not self.buckets:
            return
        flat = torch.cat([b.flags.float() for b in self.buckets])
        dist.all_reduce(flat, group=self.group)
        start = 0
        for bucket in self.buckets:
            bucket.flags.copy_(flat[start : start + len(bucket.params)])
            start += len(bucket.params)
        self.totals.bytes_sent += int(ring_bytes_per_rank(flat.numel() * flat.element_size(), self._world_size))

    def finish(self) -> None:
        """Launch what is left, wait for every bucket, and write the averaged gradients into ``.grad``."""
        if not self._armed:
            return
        self.flush()
        self._armed = False
        self._wait()
        for bucket, flags in zip(self.buckets, self.reduced_flags(), strict=True):
            for slot, param in enumerate(bucket.params):
                if self._scatters:  # only this rank's chunk is reduced: the sharded optimizer steps it from there
                    param.grad = None
                elif flags[slot] > 0:
                    # .grad becomes a view of the bucket (no copy back): valid until the next synchronised backward
                    # refills the bucket, exactly when a new gradient replaces it anyway
                    param.grad = bucket.grad_view(slot)
            self.totals.add_counter(bucket.counter)
        self.totals.synced_backwards += 1

    def _failure_message(self, bucket: Bucket, what: str) -> str:
        rank = dist.get_rank() if dist.is_initialized() else 0
        members = dist.get_process_group_ranks(self.group or dist.group.WORLD) if dist.is_initialized() else [rank]
        peers = [r for r in members if r != rank]
        message = (
            f"Reducing gradient bucket {bucket.index} ({len(bucket.params)} parameters from {bucket.names[0]!r}) "
            f"over {len(members)} ranks failed on rank {rank} (its peers: ranks {peers}): {what}"
        )
        if self.interrupt is not None:  # fault_tolerant: the survivors go on, so no error logged, no advice to resume
            return message
        return announce_failure(f"{message}\n{as_reducer(self.reducer).failure_hint}")

    def reduced_flags(self) -> list[list[float]]:
        """Every bucket's reduced presence flags, in one device-to-host transfer when the buckets share a device."""
        if not self.buckets:
            return []
        if len({b.buffer.device for b in self.buckets}) > 1:
            return [b.flags.tolist() for b in self.buckets]
        flat = torch.cat([b.flags.float() for b in self.buckets]).tolist()  # one sync on CUDA, not one per bucket
        out, start = [], 0
        for bucket in self.buckets:
            out.append(flat[start : start + len(bucket.params)])
            start += len(bucket.params)
        return out

    def abort(self) -> None:
        """Drop an armed backward that did not complete (an exception mid-step) without communicating further."""
        self._armed = False

    # ------------------------------------------------------------------ teardown
    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def close(self) -> None:
        """Remove the hooks and stop the communication thread."""
        self._remove_hooks()
        self._armed = False
        close_reducer(self.reducer)
