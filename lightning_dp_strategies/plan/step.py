"""A step of bucketed data parallelism, predicted: compute, then each bucket's reduction as a small flow shop.

Backward hands the buckets over one by one (bucket ``i`` is ready once backward has produced its share of the
gradient bytes, backward time taken as proportional to bytes). A bucket goes through the reduction's phases in
order, and each phase serves one bucket at a time (its own thread, as the reducers run them)::

    flat ring        [ compress ─ ring over all N ranks (wire + adds) ─ decompress ]
    two-level ring   [ reduce-scatter in the node ] ─▶ [ all-reduce across nodes, compressed ] ─▶ [ all-gather in
                     the node ], a bucket in pieces of ``Reduction.piece_mb`` MiB
    PowerSGD         [ local factor work ─ 2 rounds of ring over the factors and the uncompressed rest ]

    finish(phase p, bucket i) = max(finish(p, i-1), finish(p-1, i)) + time(p, i),  finish(-1, i) = ready(i)

The step is ``compute_seconds + max(0, last finish - backward_seconds)``: what backward does not hide is exposed.
``compute_seconds`` and ``backward_seconds`` are the step's own as the strategy runs it (its hooks, its copies into
the buckets, and on a CPU the cycles the overlapped reduction takes from backward), as ``reducer="auto"`` times them
on its first steps.

A ring over ``N`` ranks takes ``2(N-1)`` messages and sends ``2(N-1)/N`` of its bytes; between nodes the ``k``
processes of a node that cross at once share the node's link (``bandwidth / k`` each), and a flat ring crosses each
node's link with one stream. A :class:`~lightning_dp_strategies.plan.Link` is the ring's own throughput as
:func:`~lightning_dp_strategies.comm.probe.probe_link` measures it, fp32 adds included; the rest of the local work is
priced with :class:`~lightning_dp_strategies.plan.CpuCosts`: a 16-bit ring's casts and the extra cost of its adds,
PowerSGD's factor work. A nominal link (``Link.nominal(125e6)``, ``wire_only=True``: the data sheet's bandwidth, not
a probe) holds none of the ring's own local work, so the model adds what the probe would have timed, after the wire
of each phase and on the CPU: the fp32 adds of the ``(N-1)/N`` of the bytes a reduce-scatter sums (``CpuCosts.add`` a
byte), and the socket copies, one of every byte sent and one of every byte received (``2(N-1)/N`` of the bytes each
way for an all-reduce, half that for a reduce-scatter or an all-gather), each priced as an fp32 add of that byte
(both stream bucket-sized buffers through memory; ``calibrate_cpu`` does not time a socket copy of its own). Without
``CpuCosts`` (all zero) a nominal link prices the wire alone, as a probed one does.

The two-level reducer cuts a bucket into pieces also with one process a node (its hop across nodes then runs a ring
per piece).

The phases share the process's CPU: a phase keeps it busy for the probe's ``busy`` share of a ring's time (scaled to
the largest share any probe saw, what the process gets of a core) plus all of its local work, and the CPU serves the
pieces one after the other, so where the CPU sets the pace (``busy`` near that share: loopback inside a node, a fast
link on a slow CPU) the phases of a two-level reduction take turns instead of overlapping::

    cpu(i) = max(cpu(i-1), ready(i)) + the CPU seconds of its phases,    piece i ends at max(finish, cpu(i))

Local work (casts, PowerSGD's factor products) that runs while backward still runs takes the CPU from backward where
the process has no core to spare for it (:attr:`CpuCosts.overlap` below 1: processes that outnumber the cores): a
piece whose local work starts at ``s`` delays backward, and every later bucket's hand-over, by
``(1 - overlap) * min(local, backward's end - s)``, and the step by as much. The ring's own CPU share is in
``compute_seconds`` already (measured with a ring running).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_dp_strategies.plan.cluster import CpuCosts, Topology
from lightning_dp_strategies.plan.link import Link
from lightning_dp_strategies.plan.sizing import bucket_boundaries, ring_bytes_per_rank

__all__ = ["COMPRESSIONS", "Reduction", "StepTimes", "buckets_step", "buckets_traffic", "ring_buckets", "ring_step"]

COMPRESSIONS = ("none", "bf16", "fp16", "powersgd")
"""What :class:`Reduction` compresses with: nothing, a 16-bit cast of what crosses the link, or PowerSGD."""


@dataclass(frozen=True)
class Reduction:
    """How the buckets are reduced: a compression and one or two levels.

    Examples:
        >>> Reduction("bf16", two_level=True).label, Reduction("powersgd", rank=2).label
        ('two-level bf16', 'flat powersgd r2')
    """

    compression: str = "none"
    rank: int = 4
    """PowerSGD's rank."""
    two_level: bool = False
    piece_mb: float = 4.0
    """The two-level reducer's pieces: a bucket goes through the three phases in pieces of at most this many MiB."""

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"Unknown compression {self.compression!r}: choose one of {', '.join(COMPRESSIONS)}.")
        if self.two_level and self.compression == "powersgd":
            raise ValueError("PowerSGD reduces whole buckets: it has no two-level form; pass two_level=False.")

    @property
    def label(self) -> str:
        """A short name: levels, compression (and PowerSGD's rank)."""
        name = "plain" if self.compression == "none" else self.compression
        return f"{'two-level' if self.two_level else 'flat'} {name}" + (
            f" r{self.rank}" if self.compression == "powersgd" else ""
        )

    @property
    def arguments(self) -> str:
        """The ring strategy's arguments (Trainer or Fabric) that reduce every step this way, as Python: what to pass
        in place of ``reducer="auto"`` for a run that reduces alike in every launch.

        Examples:
            >>> Reduction("bf16", two_level=True).arguments, Reduction("powersgd", rank=2).arguments
            ('two_level=True, reducer=bf16_compress("ring")', 'two_level=False, reducer=PowerSGD("ring", rank=2)')
        """
        reducer = {
            "none": '"ring"',
            "bf16": 'bf16_compress("ring")',
            "fp16": 'fp16_compress("ring")',
            "powersgd": f'PowerSGD("ring", rank={self.rank})',
        }[self.compression]
        return f"two_level={self.two_level}, reducer={reducer}"


@dataclass(frozen=True)
class StepTimes:
    """A predicted step (seconds): ``comm`` from the first bucket's hand-over to the last bucket's end, ``exposed``
    what of it backward does not hide.

    Examples:
        >>> StepTimes(comm_seconds=0.4, exposed_seconds=0.38, step_seconds=0.43).step_seconds
        0.43
    """

    comm_seconds: float
    exposed_seconds: float
    step_seconds: float


def _ring(nbytes: float, ranks: int, link: Link, streams: int = 1) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``ranks``, ``streams`` rings sharing the link."""
    if ranks < 2 or nbytes <= 0:
        return 0.0
    return 2 * (ranks - 1) * link.latency_s + 2 * (ranks - 1) / ranks * nbytes * streams / link.bandwidth_bytes_per_s


def _half_ring(nbytes: float, ranks: int, link: Link) -> float:
    """Seconds of a ring reduce-scatter (or all-gather) of ``nbytes`` over ``ranks``."""
    return _ring(nbytes, ranks, link) / 2


Phase = tuple[float, float, float]
"""A phase of a bucket (or piece): (seconds, seconds of it the process's CPU is busy, at the CPU share it gets,
seconds of it that are local work besides the ring: casts, PowerSGD's products)."""


def _on_ring(seconds: float, busy: float, share: float) -> Phase:
    """A ring's phase: its CPU time is the probe's busy share of it, in seconds at the ``share`` the process gets."""
    return seconds, (seconds * busy / share if share > 0 else 0.0), 0.0


def _plus_local(phase: Phase, seconds: float) -> Phase:
    """``phase`` followed by ``seconds`` of local work (all CPU)."""
    return phase[0] + seconds, phase[1] + seconds, phase[2] + seconds


def _ring_local(nbytes: float, ranks: int, link: Link, cpu: CpuCosts, copies: int, adds: int) -> float:
    """The local work a probe's link holds and a nominal one (``link.wire_only``) lacks, for a ring phase of
    ``nbytes`` (as they cross the wire) over ``ranks``: ``copies`` socket copies and ``adds`` fp32 adds of each of the
    ``(N-1)/N`` of the bytes a half ring moves, every one at ``cpu.add`` a byte (an all-reduce: 4 and 1; a
    reduce-scatter: 2 and 1; an all-gather: 2 and 0). Zero for a probed link.

    Examples:
        >>> cpu = CpuCosts(add=1e-10)  # 0.1 ns a byte
        >>> round(_ring_local(1e8, 2, Link.nominal(1.25e9), cpu, copies=4, adds=1), 6)  # 5 x half of 100 MB
        0.025
        >>> _ring_local(1e8, 2, Link(0.0, 1.25e9), cpu, copies=4, adds=1)  # a probe's link holds them already
        0.0
    """
    if not link.wire_only or ranks < 2:
        return 0.0
    return (copies + adds) * (ranks - 1) / ranks * nbytes * cpu.add


def _compressed_ring(
    nbytes: float, ranks: int, link: Link, busy: tuple[float, float], how: Reduction, cpu: CpuCosts, streams: int = 1
) -> Phase:
    """A ring all-reduce of ``nbytes`` fp32 bytes compressed as ``how`` says (not PowerSGD): the wire at the link's
    rate, which holds the ring's own fp32 adds (see the module docstring), plus what a 16-bit ring adds to it: its
    casts, and what its slower adds cost beyond fp32's on the bytes it sums; on a nominal link, the ring's own adds and
    socket copies too (:func:`_ring_local`). ``busy``: (the link's, the largest)."""
    if how.compression not in ("bf16", "fp16"):
        ring = _on_ring(_ring(nbytes, ranks, link, streams), *busy)
        return _plus_local(ring, _ring_local(nbytes, ranks, link, cpu, copies=4, adds=1))
    wire = nbytes / 2
    extra = (ranks - 1) / ranks * wire * max(0.0, cpu.add_low - cpu.add) + cpu.cast * nbytes
    extra += _ring_local(wire, ranks, link, cpu, copies=4, adds=1)
    return _plus_local(_on_ring(_ring(wire, ranks, link, streams), *busy), extra)


def _phases(
    nbytes: float, matrix_bytes: float, payload: float, topology: Topology, how: Reduction, cpu: CpuCosts
) -> list[Phase]:
    """Each phase of one bucket (or piece) of ``nbytes`` fp32 gradient bytes."""
    t, n, m = topology, topology.per_node, topology.nodes
    share = max(t.inter_busy, t.intra_busy, t.flat_busy)
    if how.two_level and n > 1:
        across = _compressed_ring(nbytes / n, m, t.inter, (t.inter_busy, share), how, cpu, streams=n)
        inside = _on_ring(_half_ring(nbytes, n, t.intra_link), t.intra_busy if t.intra else t.inter_busy, share)
        scatter = _plus_local(inside, _ring_local(nbytes, n, t.intra_link, cpu, copies=2, adds=1))
        gather = _plus_local(inside, _ring_local(nbytes, n, t.intra_link, cpu, copies=2, adds=0))
        return [scatter, across, gather]
    busy = t.flat_busy if t.flat is not None else t.inter_busy if m > 1 or t.intra is None else t.intra_busy
    if how.compression == "powersgd":
        ring = _on_ring(2 * _ring(payload / 2, t.world_size, t.flat_link), busy, share)
        local = cpu.powersgd * matrix_bytes + 2 * _ring_local(payload / 2, t.world_size, t.flat_link, cpu, 4, 1)
        return [_plus_local(ring, local)]
    return [_compressed_ring(nbytes, t.world_size, t.flat_link, (busy, share), how, cpu)]


def _payload(shapes: Sequence[Sequence[int]], rank: int) -> tuple[float, float]:
    """(bytes of the matrices PowerSGD factors, bytes it sends in its two rounds) of fp32 ``shapes``."""
    matrices = sent = 0.0
    for shape in shapes:
        numel = math.prod(shape)
        rows = shape[0] if len(shape) >= 2 else 0
        cols = numel // rows if rows else 0
        if rows and rows * cols >= 2 * rank * (rows + cols):
            matrices += 4 * numel
            sent += 4 * rank * (rows + cols)
        else:
            sent += 4 * numel
    return matrices, sent


def ring_step(
    tensor_bytes: Sequence[int],
    shapes: Sequence[Sequence[int]],
    compute_seconds: float,
    backward_seconds: float,
    topology: Topology,
    how: Reduction,
    cpu: CpuCosts | None = None,
    caps: tuple[float, float] = (25.0, 1.0),
) -> StepTimes:
    """Predict one step of the bucketed ring (module docstring) for gradients of ``tensor_bytes`` (fp32, in
    registration order; ``shapes`` beside them for PowerSGD), cut into buckets of ``caps`` (MiB) as the strategies
    cut them.

    Examples:
        >>> gbe = Link(latency_s=0.0, bandwidth_bytes_per_s=1.25e8)
        >>> sizes = [4 * 1024 * 1024] * 12  # twelve 1024 x 1024 fp32 matrices
        >>> t = ring_step(sizes, [(1024, 1024)] * 12, 0.05, 0.03, Topology(2, 1, gbe), Reduction())
        >>> round(t.comm_seconds, 3), round(t.step_seconds, 3)  # 50 MB cross once at 125 MB/s, behind backward
        (0.403, 0.425)
    """
    return buckets_step(ring_buckets(tensor_bytes, shapes, caps), compute_seconds, backward_seconds, topology, how, cpu)


def ring_buckets(
    tensor_bytes: Sequence[int], shapes: Sequence[Sequence[int]], caps: tuple[float, float] = (25.0, 1.0)
) -> list[tuple[float, list[Sequence[int]]]]:
    """Gradients of ``tensor_bytes`` (``shapes`` beside them, or none) cut into buckets of ``caps`` (MiB) as the
    strategies cut them: ``(fp32 bytes, parameter shapes)`` each, in launch order.

    Examples:
        >>> [b for b, _ in ring_buckets([3 * 2**20] * 3, [], caps=(4.0, 1.0))]  # the first bucket's cap is 1 MiB
        [3145728.0, 3145728.0, 3145728.0]
    """
    return [
        (float(sum(tensor_bytes[i] for i in members)), [shapes[i] for i in members] if shapes else [])
        for members in bucket_boundaries([(None, n) for n in tensor_bytes], *caps)
    ]


def buckets_step(
    buckets: Sequence[tuple[float, Sequence[Sequence[int]]]],
    compute_seconds: float,
    backward_seconds: float,
    topology: Topology,
    how: Reduction,
    cpu: CpuCosts | None = None,
) -> StepTimes:
    """:func:`ring_step` for buckets given as ``(fp32 bytes, parameter shapes)`` in launch order (what
    :class:`~lightning_dp_strategies.reducers.AutoReducer` sees of the real buckets).

    Examples:
        >>> gbe = Link(latency_s=0.0, bandwidth_bytes_per_s=1.25e8)
        >>> t = buckets_step([(50e6, [])], 0.1, 0.0, Topology(2, 1, gbe), Reduction("bf16"))
        >>> round(t.step_seconds, 3)  # 25 MB of bf16 cross at 125 MB/s after 0.1 s of compute
        0.3

        A nominal link adds the ring's adds and socket copies: 5 x 25 MB at 0.2 ns a byte, 25 ms.

        >>> cpu = CpuCosts(add=2e-10)
        >>> probed = buckets_step([(50e6, [])], 0.1, 0.0, Topology(2, 1, gbe), Reduction(), cpu)
        >>> nominal = buckets_step([(50e6, [])], 0.1, 0.0, Topology(2, 1, Link.nominal(1.25e8, 0.0)), Reduction(), cpu)
        >>> round(probed.step_seconds, 3), round(nominal.step_seconds, 3)
        (0.5, 0.525)
    """
    if backward_seconds > compute_seconds:
        raise ValueError(f"backward_seconds ({backward_seconds}) cannot exceed compute_seconds ({compute_seconds}).")
    cpu = cpu or CpuCosts()
    total = sum(nbytes for nbytes, _ in buckets) or 1.0
    first: float | None = None
    finish = done = on_cpu = stolen = 0.0
    finishes: list[float] = []
    for nbytes, bucket_shapes in buckets:
        done += nbytes
        ready = backward_seconds * done / total + stolen  # backward slowed by the local work that ran beside it
        first = ready if first is None else first
        matrices, payload = _payload(bucket_shapes, how.rank) if bucket_shapes else (nbytes, nbytes)
        pieces = math.ceil(nbytes / (how.piece_mb * 2**20)) if how.two_level else 1
        phases = _phases(nbytes / pieces, matrices, payload, topology, how, cpu)
        finishes += [0.0] * (len(phases) - len(finishes))
        for _ in range(pieces):
            previous = ready
            for p, (seconds, _, _) in enumerate(phases):
                finishes[p] = max(finishes[p], previous) + seconds
                previous = finishes[p]
            start = max(on_cpu, ready)
            on_cpu = start + sum(busy for _, busy, _ in phases)  # the phases' turns on the CPU
            local = sum(work for _, _, work in phases)
            stolen += (1 - cpu.overlap) * min(local, max(0.0, backward_seconds + stolen - start))
        finish = max(previous, on_cpu)
    exposed = max(0.0, finish - backward_seconds - stolen)
    return StepTimes(
        comm_seconds=finish - (first or 0.0), exposed_seconds=exposed, step_seconds=compute_seconds + stolen + exposed
    )


def buckets_traffic(
    buckets: Sequence[tuple[float, Sequence[Sequence[int]]]], topology: Topology, how: Reduction
) -> tuple[float, int]:
    """What one rank sends a step reducing ``buckets`` (``(fp32 bytes, parameter shapes)`` each) as ``how`` says:
    ``(bytes over every link it uses, ring steps)``, as the reducers' counters count them.

    A flat ring sends ``2(N-1)/N`` of what crosses in ``2(N-1)`` steps: the fp32 bucket, half of it cast to 16
    bits, or PowerSGD's two rounds of factors and uncompressed rest (its payload, in ``4(N-1)`` steps). Two levels
    send ``2(n-1)/n`` of the bucket inside the node (its reduce-scatter and all-gather) and ``2(m-1)/m`` of the
    rank's shard (``1/n`` of it, compressed) across ``m`` nodes, each piece in ``2(n-1) + 2(m-1)`` steps.

    Examples:
        >>> gbe = Link(0.0, 1.25e8)
        >>> buckets_traffic([(8e6, [])], Topology(2, 1, gbe), Reduction("bf16"))  # half of 8 MB, once
        (4000000.0, 2)
        >>> buckets_traffic([(8e6, [])], Topology(2, 4, gbe), Reduction(two_level=True))  # 12 MB inside, 2 across
        (14000000.0, 16)
    """
    n, m, world = topology.per_node, topology.nodes, topology.world_size
    sent, steps = 0.0, 0
    for nbytes, shapes in buckets:
        wire = nbytes / 2 if how.compression in ("bf16", "fp16") else nbytes
        if how.compression == "powersgd":
            payload = _payload(shapes, how.rank)[1] if shapes else nbytes
            sent, steps = sent + ring_bytes_per_rank(payload, world), steps + 4 * (world - 1)
        elif how.two_level and world > 1:
            pieces = math.ceil(nbytes / (how.piece_mb * 2**20))
            sent += ring_bytes_per_rank(nbytes, n) + ring_bytes_per_rank(wire / n, m)
            steps += pieces * (2 * (n - 1) + 2 * (m - 1))
        elif world > 1:
            sent, steps = sent + ring_bytes_per_rank(wire, world), steps + 2 * (world - 1)
    return sent, steps
