"""PowerSGD: low-rank compression of each matrix gradient, with error feedback (Vogels et al., 2019)."""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor
from torch.futures import Future

from lightning_dp_strategies.reducers.base import GradBucket, Reducer, ReducerWrapper
from lightning_dp_strategies.reducers.builtin import resolve_reducer
from lightning_dp_strategies.reducers.thread import CommThread

__all__ = ["PowerSGD"]


def _orthonormalize(matrix: Tensor, eps: float = 1e-8) -> None:
    """Gram-Schmidt on the columns of ``matrix``, in place (as torch's PowerSGD hook does for small ranks)."""
    for i in range(matrix.shape[1]):
        column = matrix[:, i : i + 1]
        column.div_(column.norm().clamp_min(eps))
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1 :]
            rest.sub_(column @ (column.T @ rest))


class PowerSGD(ReducerWrapper):
    """PowerSGD (Vogels et al., 2019): rank-``r`` approximation of each gradient matrix, with error feedback.

    For each gradient reshaped to an ``n x m`` matrix ``M`` (first dimension by the rest) where ``r (n + m) < n m``:
    ``M += error``; ``P = M Q`` averaged over ranks; orthonormalise ``P``; ``Q = M^T P`` averaged; the gradient becomes
    ``P Q^T`` and ``error = M - P Q^T`` (kept on this rank, added next step, so nothing is lost for good; only the
    timing of its arrival changes). For a ``"sum"`` bucket, whose inputs were divided by the world size ``N`` on the
    way in (as the strategies send them), this rank's share of the result is ``P Q^T / N``, and the error is taken
    against that. ``Q`` starts from the same seed on every rank and is reused (warm start). Vectors,
    small matrices and the presence flags are averaged uncompressed. Each of the three reductions goes through
    ``inner``, so compressions stack (``PowerSGD(bf16_compress("ring"))``).

    The two rounds depend on each other, so each bucket's work runs on a PowerSGD thread (buckets one at a time, in
    launch order, the same on every rank) that waits for ``inner``; backward goes on meanwhile. Its optional steps
    are ``inner``'s (:class:`~lightning_dp_strategies.reducers.ReducerWrapper`); :meth:`close` stops its thread too.

    Args:
        inner: the reducer of the compressed factors and the uncompressed rest (default ``"ring"``).
        rank: the approximation rank ``r`` (1 to 4 is typical).
        seed: seed of the initial ``Q``; must be the same on every rank.
        min_compression: compress a matrix only if ``n m / (r (n + m))`` is at least this.

    Examples:
        >>> torch.manual_seed(0) is not None
        True
        >>> grad = torch.outer(torch.arange(1.0, 5.0), torch.ones(6))  # a rank-1 4 x 6 gradient
        >>> bucket = GradBucket(grad.flatten().clone(), shapes=[grad.shape])
        >>> reducer = PowerSGD("ring", rank=1)
        >>> out = reducer(bucket).wait()
        >>> torch.allclose(out.view(4, 6), grad, atol=1e-5), bucket.counter.bytes_sent  # exact for rank 1; 1 process
        (True, 0)
        >>> reducer.close()
    """

    def __init__(
        self,
        inner: str | Reducer | None = "ring",
        rank: int = 2,
        seed: int = 0,
        min_compression: float = 2.0,
    ) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerSGD `rank` must be an integer >= 1 (1 to 4 is typical), got {rank!r}.")
        if not min_compression >= 1:
            raise ValueError(f"PowerSGD `min_compression` must be >= 1, got {min_compression!r}.")
        super().__init__(resolve_reducer(inner))
        self.rank = rank
        self.seed = seed
        self.min_compression = float(min_compression)
        # runtime state, per (bucket index, slot): the warm-start Q and the error feedback
        self.q: dict[tuple[int, int], Tensor] = {}
        self.error: dict[tuple[int, int], Tensor] = {}
        self._thread = CommThread("ldps-powersgd")

    def compresses(self, shape: torch.Size) -> bool:
        """Whether a gradient of ``shape`` is sent as low-rank factors (a matrix the factors make smaller).

        Examples:
            >>> PowerSGD(rank=2).compresses(torch.Size([256, 128])), PowerSGD(rank=2).compresses(torch.Size([256]))
            (True, False)
        """
        if len(shape) < 2:
            return False
        n, m = shape[0], math.prod(shape[1:])
        return n * m >= self.min_compression * self.rank * (n + m)

    def __call__(self, bucket: GradBucket) -> Future[Tensor]:
        if not bucket.shapes:
            return self.inner(bucket)  # no layout: nothing to factor
        return self._thread.submit(functools.partial(self._reduce, bucket), bucket.buffer.device)

    def _reduce(self, bucket: GradBucket) -> Tensor:
        grads = bucket.gradients()
        slots = [i for i, g in enumerate(grads) if self.compresses(g.shape)]
        plain = [i for i in range(len(grads)) if i not in set(slots)]
        matrices = [grads[i].reshape(grads[i].shape[0], -1) for i in slots]
        for slot, matrix in zip(slots, matrices, strict=True):
            key = (bucket.index, slot)
            if key in self.error:
                matrix.add_(self.error[key])
            if key not in self.q:
                generator = torch.Generator().manual_seed(self.seed + 1_000_003 * bucket.index + slot)
                q = torch.randn(matrix.shape[1], self.rank, generator=generator, dtype=torch.float32)
                self.q[key] = q.to(device=matrix.device, dtype=matrix.dtype)
        # round 1: the uncompressed rest (vectors, small matrices, flags) and P = M Q, in one buffer
        rest = [grads[i].reshape(-1) for i in plain] + ([bucket.flags] if bucket.num_flags else [])
        ps = [m @ self.q[(bucket.index, s)] for s, m in zip(slots, matrices, strict=True)]
        first = torch.cat([*rest, *(p.reshape(-1) for p in ps)]) if rest or ps else bucket.buffer[:0]
        self._inner(bucket, first)
        offset = 0
        for tensor in rest:
            tensor.copy_(first[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
        for p in ps:
            p.copy_(first[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        if not slots:
            return bucket.buffer
        # round 2: Q = M^T P with P orthonormalised, averaged; the gradient becomes P Q^T
        for p in ps:
            _orthonormalize(p)
        qs = [m.T @ p for m, p in zip(matrices, ps, strict=True)]
        second = torch.cat([q.reshape(-1) for q in qs])
        self._inner(bucket, second)
        offset = 0
        # this rank's share of the result: the result itself for "avg"; for "sum" (inputs divided by the world
        # size on the way in, as the strategies send them) 1/N of it, in the scale of this rank's M
        share = 1.0 / bucket.world_size if bucket.op == "sum" else 1.0
        for slot, matrix, p, q in zip(slots, matrices, ps, qs, strict=True):
            q.copy_(second[offset : offset + q.numel()].view_as(q))
            offset += q.numel()
            key = (bucket.index, slot)
            approx = p @ q.T
            self.error[key] = matrix - share * approx  # what this rank's M lost to the approximation
            self.q[key] = q
            matrix.copy_(approx)
        return bucket.buffer

    def _inner(self, bucket: GradBucket, buffer: Tensor) -> None:
        if buffer.numel():
            self.inner(bucket.with_buffer(buffer, keep_layout=False)).wait()

    def close(self) -> None:
        """Stop the PowerSGD thread and close the inner reducer (the error feedback and ``Q`` are kept)."""
        self._thread.close()
        super().close()
