"""``reducer="auto"``: measure the link and the step, predict every candidate reduction, keep the fastest.

At setup :class:`AutoReducer` makes every candidate it may pick (the plain ring, bf16 on the wire, PowerSGD; flat,
and two-level when the job spans several nodes of several processes) and probes the links
(:func:`~lightning_dp_strategies.comm.probe.probe_ring`: the ring itself, timed as the reductions load the links). The
first ``warmup_steps`` optimizer steps are reduced losslessly by the layout's plain ring, and timed: one rank's
compute is the step's time less what it waited for communication (so the step's own overheads, its copies into the
buckets, and on a CPU what the overlapped reduction takes from backward count as compute). Then every rank measures
at once what reducing costs on buffers of its largest bucket's size, on the buckets' device
(:func:`~lightning_dp_strategies.reducers.calibrate_cpu`); the ranks take the slowest rank's compute and the median
rank's costs (the machine's, as most ranks measured them), each candidate's step is predicted
(:func:`~lightning_dp_strategies.plan.buckets_step`), and rank 0's choice (the same on every rank: the inputs are)
reduces every later step. The decision and the predictions behind it are logged once, on rank 0, at INFO on the
``lightning_dp_strategies`` logger, and kept as :attr:`AutoReducer.decision`.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_dp_strategies.comm import new_duplex_group
from lightning_dp_strategies.comm.groups import new_group
from lightning_dp_strategies.comm.probe import probe_ring
from lightning_dp_strategies.plan import CpuCosts, Link, Reduction, Topology
from lightning_dp_strategies.plan.auto import ALLOWED, LOSSY_MARGIN, AutoChoice, allowed, choose
from lightning_dp_strategies.reducers.base import GradBucket, ReducerBase, StepTiming
from lightning_dp_strategies.reducers.builtin import RingReducer
from lightning_dp_strategies.reducers.calibrate import calibrate_cpu
from lightning_dp_strategies.reducers.casts import bf16_compress
from lightning_dp_strategies.reducers.powersgd import PowerSGD
from lightning_dp_strategies.reducers.two_level import TwoLevelReducer

__all__ = ["ALLOWED", "LOSSY_MARGIN", "AutoDecision", "AutoReducer", "StepTiming", "choose", "visible"]
# ALLOWED, LOSSY_MARGIN and choose live in the planning layer (plan.auto), which prices reducer="auto" with them

log = logging.getLogger("lightning_dp_strategies")


def visible(logger: logging.Logger) -> logging.Logger:
    """``logger`` at INFO unless its level was set, printing to stderr when the program configured no logging (as
    Lightning does for its own logger)."""
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logging.getLogger().hasHandlers() and not logger.handlers:
        logger.addHandler(logging.StreamHandler())
    return logger


def repeat_hint(how: Reduction) -> str:
    """The log's last line: the fixed arguments that reduce as ``how`` in every launch."""
    return (
        "The choice follows these timings, so another launch may choose otherwise: for a run that reduces alike in "
        f'every launch, pass {how.arguments} in place of reducer="auto".'
    )


@dataclass(frozen=True)
class AutoDecision:
    """What :class:`AutoReducer` chose, and the measurements and predictions it chose by.

    Examples:
        >>> from lightning_dp_strategies.plan import Link
        >>> predicted = {"flat plain": 0.2, "flat bf16": 0.15}
        >>> decision = AutoDecision("flat bf16", predicted, 0.1, 0.06, Topology(2, 1, Link(0, 1.25e9)), CpuCosts())
        >>> print(decision.describe())  # doctest: +NORMALIZE_WHITESPACE
        reducer='auto' chose 'flat bf16' for 2 node(s) x 1 process(es): compute 100.0 ms a step (60.0 ms backward),
        link between nodes 1250 MB/s, inside a node 1250 MB/s.
          flat bf16                  150.0 ms predicted <-
          flat plain                 200.0 ms predicted
        >>> from dataclasses import replace
        >>> print(replace(decision, reduction=Reduction("bf16")).describe().splitlines()[-1])
        ... # doctest: +NORMALIZE_WHITESPACE
        The choice follows these timings, so another launch may choose otherwise: for a run that reduces alike in
        every launch, pass two_level=False, reducer=bf16_compress("ring") in place of reducer="auto".
    """

    chosen: str
    predicted_step_seconds: dict[str, float]
    compute_seconds: float
    backward_seconds: float
    topology: Topology
    cpu: CpuCosts
    reduction: Reduction | None = None
    """The chosen reduction, whose fixed arguments the log's last line names (``None``: no such line)."""

    def describe(self) -> str:
        """A few lines for the log: the choice, the measured inputs, every candidate's predicted step."""
        t = self.topology
        inter, intra = t.inter.bandwidth_bytes_per_s / 1e6, t.intra_link.bandwidth_bytes_per_s / 1e6
        links = (
            f"inside the node {intra:.0f} MB/s"
            if t.nodes == 1
            else f"between nodes {inter:.0f} MB/s, inside a node {intra:.0f} MB/s"
        )
        lines = [
            f"reducer='auto' chose {self.chosen!r} for {t.nodes} node(s) x {t.per_node} process(es): compute "
            f"{self.compute_seconds * 1e3:.1f} ms a step ({self.backward_seconds * 1e3:.1f} ms backward), link "
            f"{links}.",
        ]
        for label, seconds in sorted(self.predicted_step_seconds.items(), key=lambda kv: kv[1]):
            lines.append(f"  {label:22s} {seconds * 1e3:9.1f} ms predicted" + (" <-" if label == self.chosen else ""))
        if self.reduction is not None:
            lines.append(repeat_hint(self.reduction))
        return "\n".join(lines)


@dataclass
class _Runtime:
    group: dist.ProcessGroup | None = None
    candidates: dict[str, tuple[Reduction, ReducerBase]] = field(default_factory=dict)
    active: ReducerBase | None = None
    topology: Topology | None = None
    buckets: dict[int, tuple[float, list[tuple[int, ...]]]] = field(default_factory=dict)
    timings: list[StepTiming] = field(default_factory=list)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where the buckets live: the probes' and the calibration's tensors go there too."""


def _device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a collective over ``group`` takes its tensors: the current CUDA device on NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class AutoReducer(ReducerBase):
    """Pick the fastest reduction for this job's link and model after a few timed steps (see the module doc).

    Args:
        allow: which candidates it may pick: ``"all"`` (default), ``"lossless"`` (the plain ring only: flat or two
            levels, results exact to summation order) or a tuple of ``"none"``, ``"bf16"``, ``"powersgd"``.
        warmup_steps: optimizer steps reduced by the plain ring and timed before the choice (the first of them, which
            pays the setup, is not counted).
        rank: PowerSGD's rank when it is a candidate.
        per_node: processes on every node (the strategies set it from Lightning's environment).
        two_level: ``None``: try one and two levels where there are several nodes of several processes; ``True`` or
            ``False``: only that.

    Examples:
        >>> AutoReducer(allow="lossless").allow
        ('none',)
        >>> AutoReducer(allow=("fp8",))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Unknown `allow` ('fp8',) for reducer='auto': ...
    """

    def __init__(
        self,
        allow: str | Sequence[str] = "all",
        warmup_steps: int = 6,
        rank: int = 4,
        per_node: int = 1,
        two_level: bool | None = None,
    ) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 2:
            raise ValueError(f"`warmup_steps` must be an integer >= 2 (the first is not timed), got {warmup_steps!r}.")
        self.allow = allowed(allow)
        self.warmup_steps = warmup_steps
        self.rank = rank
        self.per_node = per_node
        self.two_level = two_level
        self.decision: AutoDecision | None = None
        """The choice, once made (``None`` during the warm-up steps)."""
        self._run = _Runtime()

    def with_layout(self, per_node: int, two_level: bool | None) -> AutoReducer:
        """The same reducer, not yet set up, for nodes of ``per_node`` processes, its levels ``two_level`` (the
        strategy's option) where that is not ``None``.

        Examples:
            >>> AutoReducer(two_level=True).with_layout(2, None).two_level
            True
            >>> AutoReducer(two_level=True).with_layout(2, False).two_level
            False
        """
        levels = self.two_level if two_level is None else two_level
        return AutoReducer(self.allow, self.warmup_steps, self.rank, per_node, levels)

    # ------------------------------------------------------------------ setup
    @property
    def choice(self) -> AutoChoice:
        """The options that decide its candidates (what :func:`~lightning_dp_strategies.plan.predict` prices)."""
        return AutoChoice(self.allow, self.rank, self.two_level)

    def _make_candidates(self, nodes: int) -> dict[str, tuple[Reduction, ReducerBase]]:
        made: dict[str, tuple[Reduction, ReducerBase]] = {}
        for label, how in self.choice.candidates(nodes, self.per_node).items():
            inner: ReducerBase = bf16_compress("ring") if how.compression == "bf16" else RingReducer()
            made[label] = (how, TwoLevelReducer(self.per_node, inner) if how.two_level else inner)
        return made

    def setup(self, group: dist.ProcessGroup | None, ranks: Sequence[int], backend: str | None = None) -> None:
        """Make every candidate's groups and probe the links (collective over the world, as every reducer's setup)."""
        if len(ranks) % self.per_node:
            raise ValueError(
                f"{len(ranks)} ranks do not split into nodes of {self.per_node} processes: every node must run the "
                "same number of processes."
            )
        nodes = len(ranks) // self.per_node
        candidates = self._make_candidates(nodes)
        for _, reducer in candidates.values():
            reducer.setup(group, ranks, backend)
        topology = self._probe(group, list(ranks), nodes, backend)
        if dist.get_rank() in ranks:
            plain = next(label for label, (how, _) in candidates.items() if how.compression == "none")
            self._run = _Runtime(group, candidates, candidates[plain][1], topology, device=_device(group))

    def _probe(self, group: dist.ProcessGroup | None, ranks: list[int], nodes: int, backend: str | None) -> Topology:
        """The links as the reductions load them, the same on every rank of ``ranks``: every node's link at once (the
        ranks of one local rank, one a node: the two-level hop across nodes), every node inside at once, and the
        flat ring over all ranks."""
        n, me = self.per_node, dist.get_rank()
        kinds = []  # (slot in the figures, the groups of ranks probed at once)
        if nodes > 1:
            kinds.append((0, [ranks[local::n] for local in range(n)]))
        if n > 1:
            kinds.append((1, [ranks[node * n : (node + 1) * n] for node in range(nodes)]))
        if nodes > 1 and n > 1:
            kinds.append((2, [ranks]))
        figures = torch.zeros(9, dtype=torch.float64)  # per slot: latency, 1 / bandwidth, busy
        for slot, members in kinds:
            # collective: every rank makes each group (and, at two ranks on gloo, the ring's second connection)
            made = [(m, new_group(m, backend), new_duplex_group(m, backend)) for m in members]
            for m, probed, duplex in made:
                if me in m:
                    result = probe_ring(probed, duplex=duplex, device=_device(probed))
                    link = result.link
                    figures[3 * slot : 3 * slot + 3] = torch.tensor(
                        [link.latency_s, 1 / link.bandwidth_bytes_per_s, result.busy]
                    )
                    for group_made in (probed, duplex):
                        if isinstance(group_made, dist.ProcessGroup):
                            dist.destroy_process_group(group_made)
        if me in ranks:
            slowest = figures.to(_device(group))
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
            figures = slowest.cpu()
        # the hop across nodes was measured with the node's n streams crossing at once: the node's link is n of them
        inter, intra, flat = (
            Link(float(figures[3 * i]), (n if i == 0 else 1) / float(figures[3 * i + 1]))
            if figures[3 * i + 1] > 0
            else None
            for i in range(3)
        )
        busy = [float(figures[3 * i + 2]) for i in range(3)]
        return Topology(nodes, n, inter or intra or Link(0.0, 1e12), intra, flat, *busy)

    # ------------------------------------------------------------------ each bucket and step
    def __call__(self, bucket: GradBucket) -> Future[Tensor]:
        run = self._run
        if run.active is None:
            raise RuntimeError("AutoReducer was handed a bucket before its setup: call `setup_reducer(...)` first.")
        if self.decision is None and bucket.index not in run.buckets:
            shapes = [tuple(s) for s in bucket.shapes]
            run.buckets[bucket.index] = (float(bucket.buffer.numel() * bucket.buffer.element_size()), shapes)
            run.device = bucket.buffer.device
        return run.active(bucket)

    def observe_step(self, timing: StepTiming) -> None:
        """After every optimizer step (on every rank of the group): decide once the warm-up steps are timed."""
        if self.decision is not None or self._run.active is None:
            return
        self._run.timings.append(timing)
        if len(self._run.timings) >= self.warmup_steps:
            self._decide()

    def _decide(self) -> None:
        run = self._run
        assert run.topology is not None
        timed = run.timings[1:]
        compute = statistics.median(t.interval - t.exposed for t in timed)
        backward = statistics.median(t.backward for t in timed)
        matrices = [(s[0], math.prod(s[1:])) for _, shapes in run.buckets.values() for s in shapes if len(s) >= 2]
        rows, cols = max(matrices, key=math.prod, default=(256, 256))
        largest = int(max((nbytes for nbytes, _ in run.buckets.values()), default=0))
        nbytes = min(max(largest, 1 << 20), 256 << 20)  # the largest bucket's, as the reducers touch them
        dist.barrier(group=run.group)  # every rank calibrates at once: they share the cores as they will in a step
        cpu = calibrate_cpu(nbytes, rank=self.rank, matrix=(min(rows, 2048), min(cols, 2048)), device=run.device)
        mine = torch.tensor(
            [compute, backward, cpu.add, cpu.add_low, cpu.cast, cpu.powersgd, cpu.overlap],
            dtype=torch.float64,
            device=_device(run.group),
        )
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(run.group))]
        dist.all_gather(everyone, mine, group=run.group)
        figures = torch.stack(everyone).cpu()
        # the slowest rank's step; the machine's costs as most ranks measured them (a rank whose process lost its
        # core for a while during the calibration does not set them)
        compute, backward = figures[:, :2].max(dim=0).values.tolist()
        add, add_low, cast, powersgd, overlap = figures[:, 2:].quantile(0.5, dim=0).tolist()
        cpu = CpuCosts(add, add_low, cast, powersgd, powersgd_rank=self.rank, overlap=overlap)
        buckets = [run.buckets[i] for i in sorted(run.buckets)]
        options = {label: how for label, (how, _) in run.candidates.items()}
        best, predicted = choose(options, buckets, compute, backward, run.topology, cpu)
        labels = list(run.candidates)
        choice = torch.tensor([labels.index(best)], device=_device(run.group))
        dist.broadcast(choice, src=dist.get_global_rank(run.group, 0) if run.group else 0, group=run.group)
        chosen = labels[int(choice.item())]
        how, reducer = run.candidates[chosen]
        run.active = PowerSGD(reducer, rank=self.rank) if how.compression == "powersgd" else reducer
        self.decision = AutoDecision(chosen, predicted, compute, backward, run.topology, cpu, how)
        if dist.get_rank(run.group) == 0:
            visible(log).info(self.decision.describe())

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Close every candidate (PowerSGD, when chosen, closes its inner ring)."""
        run = self._run
        inner = run.active.inner if isinstance(run.active, PowerSGD) else None
        if run.active is not None and inner is not None:
            run.active.close()
        for _, reducer in run.candidates.values():
            if reducer is not inner:
                reducer.close()

    def __repr__(self) -> str:
        chosen = f", chose {self.decision.chosen!r}" if self.decision else ""
        return f"AutoReducer(allow={self.allow!r}{chosen})"

    def __getstate__(self) -> dict[str, Any]:  # picklable before setup (spawn launchers pickle the strategy)
        return {**self.__dict__, "_run": _Runtime()}
