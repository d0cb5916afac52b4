"""Measure a link on the live process group: the package's ring all-reduce timed at a few sizes, fitted to a latency
and a bandwidth.

The probe runs what the gradient reduction runs (:func:`~lightning_dp_strategies.comm.ring_all_reduce`, with its
second connection at two ranks when one is given): every byte it times was sent, received and added in by the same
code, on the same sockets, as a bucket's. The ranks start each run together (a barrier, not timed); the slowest rank's
median of each size, the same on every rank, is fitted with :meth:`~lightning_dp_strategies.plan.Link.fit` as the
step model prices a ring (``2(N-1)`` messages carrying ``2(N-1)/N`` of the tensor), so the fitted link is the ring's
own throughput: wire, socket copies and the adds it does not hide behind the wire. :func:`probe_ring` also reports
how busy the ring kept this process's CPU (near 1 where the CPU, not the wire, sets its pace). Between nodes, give it a
group of one rank a node; inside a node, the node's ranks.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

import torch
import torch.distributed as dist
from typing_extensions import Unpack

from lightning_dp_strategies.comm.ring import ring_all_reduce, ring_workspace_numel
from lightning_dp_strategies.plan import Link

__all__ = ["PROBE_SIZES", "ProbeSettings", "RingProbe", "probe_link", "probe_ring"]

PROBE_SIZES = (1024 * 1024, 32 * 1024 * 1024)
"""Bytes of the tensors the default probe all-reduces: a small one that the per-message costs dominate, and one the
size of a gradient bucket (about half a second over 1 GbE between two ranks), large enough that a shaped link's burst
allowance does not pass for bandwidth."""


@dataclass(frozen=True)
class RingProbe:
    """What :func:`probe_ring` measured: the link, and the share of the largest ring's time this process's CPU was
    busy (all its threads, system time included: socket copies, adds), the largest over the group's ranks.

    Examples:
        >>> RingProbe(Link(1e-4, 1e9), busy=0.9).busy
        0.9
    """

    link: Link
    busy: float


def _ring_seconds(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, workspace: torch.Tensor, duplex: dist.ProcessGroup | None
) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one ring all-reduce of ``tensor``, started together."""
    dist.barrier(group=group)
    start, cpu = time.perf_counter(), time.process_time()
    ring_all_reduce(tensor, "sum", group, workspace=workspace, duplex=duplex)
    if tensor.device.type == "cuda":
        torch.cuda.synchronize(tensor.device)
    return time.perf_counter() - start, time.process_time() - cpu


def probe_ring(
    group: dist.ProcessGroup | None = None,
    sizes: Sequence[int] = PROBE_SIZES,
    repeats: int = 3,
    duplex: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> RingProbe:
    """Time a ring all-reduce of each of ``sizes`` bytes over ``group`` (``repeats`` runs after one untimed run that
    opens the connections) and fit the :class:`~lightning_dp_strategies.plan.Link` to the slowest rank's medians;
    the same result on every rank. Arguments as :func:`probe_link`'s.

    Collective: call it on every rank of ``group``. Groups of other ranks may be probed at the same time (each rank
    in one), which measures the links as a reduction that runs on all of them at once loads them.
    """
    size = dist.get_world_size(group)
    if size < 2:
        raise ValueError("Probing a link needs a group of two or more ranks: there is no link to measure in one.")
    if len(set(sizes)) < 2:
        raise ValueError(
            f"Probing a link needs two or more different sizes to fit a latency and a bandwidth, got {sizes}."
        )
    numels = [max(1, n // 4) for n in sorted(sizes)]
    workspace = torch.empty(ring_workspace_numel(max(numels), size), device=device)
    tensors = [torch.zeros(n, device=device) for n in numels]
    _ring_seconds(tensors[0], group, workspace, duplex)  # the first message pays the handshake
    runs = [[_ring_seconds(t, group, workspace, duplex) for _ in range(repeats)] for t in tensors]
    medians = [statistics.median(wall for wall, _ in run) for run in runs]
    busy = sum(cpu for _, cpu in runs[-1]) / sum(wall for wall, _ in runs[-1])
    slowest = torch.tensor([*medians, busy], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    messages = 2 * (size - 1)
    samples = [(messages, messages / size * 4 * n, t) for n, t in zip(numels, slowest.tolist(), strict=False)]
    return RingProbe(Link.fit(samples), busy=min(1.0, float(slowest[-1].item())))


class ProbeSettings(TypedDict, total=False):
    """:func:`probe_ring`'s settings after the group, by keyword (see :func:`probe_link` for each)."""

    sizes: Sequence[int]
    repeats: int
    duplex: dist.ProcessGroup | None
    device: torch.device | str | None


def probe_link(group: dist.ProcessGroup | None = None, **settings: Unpack[ProbeSettings]) -> Link:
    """The :class:`~lightning_dp_strategies.plan.Link` a ring over ``group`` (default: the world) runs on.

    Collective: call it on every rank of ``group``. Every rank returns the same link. With one rank there is nothing
    to measure: ``ValueError``.

    Args:
        group: the ranks to measure between (one a node, for the link between nodes).
        **settings: by keyword (:class:`ProbeSettings`): ``sizes``, bytes of the tensors timed (two or more sizes);
            ``repeats``, timed runs of each size (the median counts); ``duplex``, the second group the ring sends
            one direction over at two ranks on gloo (:func:`~lightning_dp_strategies.comm.new_duplex_group` over the
            same ranks, made on every rank of the world), as the ring reducer uses one: without it two ranks share
            one connection both ways, and the probe measures less than the reducer gets; ``device``, where the
            probed tensors live: the gradients' device (``"cuda"`` on NCCL); default the CPU.

    Examples:
        >>> import torch.distributed as dist
        >>> link = probe_link(dist.new_group([0, 1]))  # doctest: +SKIP
        >>> link.bandwidth_bytes_per_s / 1e6  # doctest: +SKIP
        118.7
    """
    return probe_ring(group, **settings).link
