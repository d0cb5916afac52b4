"""What ``reducer="auto"`` chooses among, and how: its candidate reductions for a job's layout
(:meth:`AutoChoice.candidates`) and the choice by predicted step (:func:`choose`).

:class:`~lightning_dp_strategies.reducers.AutoReducer` chooses at run time with the measured compute, links and CPU
costs; :func:`~lightning_dp_strategies.plan.predict` chooses for a strategy built with it from a workload's, through
the same two functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_dp_strategies.plan.cluster import CpuCosts, Topology
from lightning_dp_strategies.plan.step import Reduction, buckets_step

__all__ = ["ALLOWED", "LOSSY_MARGIN", "AutoChoice", "allowed", "choose"]

LOSSY_MARGIN = 0.05
"""How much faster (a fraction of the step) a lossy candidate must be predicted than the best lossless one."""

ALLOWED = {"all": ("none", "bf16", "powersgd"), "lossless": ("none",)}
"""The named restrictions of ``AutoReducer``'s ``allow``; a tuple of ``"none"``, ``"bf16"``, ``"powersgd"``
names the candidates itself."""


def allowed(allow: str | Sequence[str]) -> tuple[str, ...]:
    """The compressions ``allow`` names, the plain ring first (it is always a candidate: it reduces the warm-up).

    Examples:
        >>> allowed("lossless"), allowed(("powersgd",))
        (('none',), ('none', 'powersgd'))
    """
    names = ALLOWED.get(allow) if isinstance(allow, str) else tuple(allow)
    known = ALLOWED["all"]
    if not names or any(n not in known for n in names):
        raise ValueError(
            f"Unknown `allow` {allow!r} for reducer='auto': use 'all', 'lossless' (the plain ring only, one or two "
            f"levels) or a tuple of {list(known)}."
        )
    return tuple(dict.fromkeys(("none", *names)))


@dataclass(frozen=True)
class AutoChoice:
    """The options of a ``reducer="auto"`` that decide its candidates: the compressions it may pick, PowerSGD's
    rank, and its levels (``None``: one and two where there are several nodes of several processes).

    Examples:
        >>> list(AutoChoice().candidates(nodes=2, per_node=1))
        ['flat plain', 'flat bf16', 'flat powersgd r4']
        >>> list(AutoChoice(allow=("none", "bf16")).candidates(nodes=2, per_node=4))
        ['two-level plain', 'two-level bf16', 'flat plain', 'flat bf16']
    """

    allow: tuple[str, ...] = ALLOWED["all"]
    rank: int = 4
    two_level: bool | None = None

    def candidates(self, nodes: int, per_node: int) -> dict[str, Reduction]:
        """Every reduction it may pick on ``nodes`` nodes of ``per_node`` processes, by label (PowerSGD one level)."""
        levels = [level for level in (True, False) if self.two_level in (None, level)]
        if nodes < 2 or per_node < 2:
            levels = [False] if self.two_level is not True else [True]
        made = {}
        for two in levels:
            for compression in self.allow:
                if not (two and compression == "powersgd"):
                    how = Reduction(compression, rank=self.rank, two_level=two)
                    made[how.label] = how
        return made


def choose(
    candidates: dict[str, Reduction],
    buckets: Sequence[tuple[float, Sequence[Sequence[int]]]],
    compute_seconds: float,
    backward_seconds: float,
    topology: Topology,
    cpu: CpuCosts | None,
) -> tuple[str, dict[str, float]]:
    """The candidate with the shortest predicted step, and every candidate's prediction. A lossless candidate
    (no compression) within :data:`LOSSY_MARGIN` of the fastest is kept over a lossy one: the step model is not
    sharper than that, so a lossy reduction must be predicted clearly faster to be worth its rounding. Ties go to
    the first listed.

    Examples:
        >>> from lightning_dp_strategies.plan import Link, Reduction, Topology, CpuCosts
        >>> buckets = [(4.0 * 2**20, [(1024, 1024)])] * 12  # 50 MB of fp32 gradients
        >>> options = {"plain": Reduction(), "bf16": Reduction("bf16"), "powersgd": Reduction("powersgd")}
        >>> cpu = CpuCosts(add=4e-11, add_low=1e-10, cast=1e-10, powersgd=4e-9)
        >>> slow, fast = Link(5e-5, 1.25e8), Link(5e-6, 2.5e10)  # 1 GbE and 200 Gbit/s
        >>> choose(options, buckets, 0.1, 0.06, Topology(2, 1, slow), cpu)[0]
        'powersgd'
        >>> choose(options, buckets, 0.1, 0.06, Topology(2, 1, fast), cpu)[0]
        'plain'
        >>> one_node = Topology(1, 2, fast)  # predicted alike: the lossless ring is kept
        >>> choose({"bf16": Reduction("bf16"), "plain": Reduction()}, buckets[:1], 0.1, 0.06, one_node, CpuCosts())[0]
        'plain'
    """
    backward = min(backward_seconds, compute_seconds)
    predicted = {
        label: buckets_step(buckets, compute_seconds, backward, topology, how, cpu).step_seconds
        for label, how in candidates.items()
    }
    fastest = min(predicted.values())
    close = [label for label, how in candidates.items() if predicted[label] <= fastest * (1 + LOSSY_MARGIN)]
    lossless = [label for label in close if candidates[label].compression == "none"]
    return min(lossless or close, key=predicted.__getitem__), predicted
