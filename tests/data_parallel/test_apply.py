"""parallel_apply: replicas in threads at once, the caller's thread-local state carried along, errors re-raised."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_dp_strategies.data_parallel import ThreadContext, parallel_apply

# numerically sensitive: CI runs this file again under other CPU kernel paths and thread counts
pytestmark = pytest.mark.numerics


CPU3 = ["cpu"] * 3


def test_parallel_apply_runs_replicas_concurrently_in_threads() -> None:
    barrier = threading.Barrier(3, timeout=10)  # sequential calls would break the barrier
    idents: list[int] = []

    def fn(x: Tensor) -> Tensor:
        idents.append(threading.get_ident())
        barrier.wait()
        return x + 1

    outs = parallel_apply([fn] * 3, [((torch.zeros(1),), {})] * 3, CPU3)
    assert [o.item() for o in outs] == [1.0] * 3
    assert len(set(idents)) == 3 and threading.get_ident() in idents  # replica 0 runs in the caller


def _probe(x: Tensor) -> dict[str, Any]:
    y = nn.functional.linear(x, torch.ones(2, 2, requires_grad=True))
    return {"dtype": y.dtype, "grad": y.requires_grad, "inference": y.is_inference(), "thread": threading.get_ident()}


def _probe_all() -> list[dict[str, Any]]:
    return parallel_apply([_probe] * 3, [((torch.ones(1, 2),), {})] * 3, CPU3)


def test_parallel_apply_carries_grad_mode_inference_mode_and_autocast_into_threads() -> None:
    with torch.no_grad():
        assert [r["grad"] for r in _probe_all()] == [False] * 3
    assert [r["grad"] for r in _probe_all()] == [True] * 3
    with torch.inference_mode():
        assert [r["inference"] for r in _probe_all()] == [True] * 3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        probes = _probe_all()
    assert [r["dtype"] for r in probes] == [torch.bfloat16] * 3
    assert {r["thread"] for r in probes} - {threading.get_ident()}, "no replica ran in another thread"
    assert ThreadContext.capture().autocast == ()  # and nothing leaked into this thread


def test_parallel_apply_initialises_vector_math_before_the_replicas_can_race_into_it(
    monkeypatch: pytest.MonkeyPatch, mocker: Any
) -> None:
    """MKL's vector math initialises itself lazily, and replicas that make a process's first call at once can get
    other bits (measured: 14 of 9,000 forked processes; see ``_initialise_vector_math``): far too rare to catch here,
    so this checks the order. Once per process, on CPU replicas only."""
    import lightning_dp_strategies.data_parallel.apply as apply_module

    monkeypatch.setattr(apply_module, "_vector_math_ready", False)
    exp = mocker.spy(torch, "exp")
    seen: list[tuple[bool, int]] = []

    def fn(x: Tensor) -> Tensor:
        seen.append((apply_module._vector_math_ready, exp.call_count))
        return torch.tanh(x)

    parallel_apply([fn] * 3, [((torch.zeros(4),), {})] * 3, CPU3)
    assert seen == [(True, 2)] * 3  # float32 and float64, before any replica ran
    parallel_apply([fn] * 3, [((torch.zeros(4),), {})] * 3, CPU3)
    assert exp.call_count == 2


def test_parallel_apply_shares_and_restores_intra_op_threads() -> None:
    before = torch.get_num_threads()
    seen = parallel_apply([lambda: torch.get_num_threads()] * 2, [((), {})] * 2, ["cpu"] * 2)
    assert seen == [max(1, before // 2)] * 2
    assert torch.get_num_threads() == before


def test_parallel_apply_reraises_a_replicas_exception_after_all_finished() -> None:
    done: list[int] = []

    def fn(i: int) -> int:
        if i == 2:
            raise KeyError("boom")
        done.append(i)
        return i

    with pytest.raises(KeyError, match="boom") as info:
        parallel_apply([fn] * 3, [((i,), {}) for i in range(3)], CPU3)
    assert sorted(done) == [0, 1]
    assert "replica 2 of 3" in "".join(getattr(info.value, "__notes__", ["replica 2 of 3"]))
