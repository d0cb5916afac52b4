"""FlatAverager with a lossy outer precision: only the parameter changes go through the lossy reducer; values
(buffers, the averaged model) go through the exact companion. One process: the routing, not the sums (the 2-rank
checkpoint test in ``tests/strategies/test_local_sgd.py`` checks the exact mean)."""

from __future__ import annotations

import pytest
import torch
from pytest_mock import MockerFixture

from lightning_dp_strategies.local_sgd import outer_averager
from lightning_dp_strategies.reducers import NativeReducer, PowerSGD, RingReducer


@pytest.mark.parametrize("precision", ["bf16", "int8", "int4"])
def test_values_after_the_lossy_changes_go_through_the_exact_companion(precision: str, mocker: MockerFixture) -> None:
    averager = outer_averager(precision, RingReducer())
    assert averager.exact is not None and isinstance(averager.exact.reducer, NativeReducer)
    assert averager.exact.counter is averager.counter  # its bytes count with the averager's
    exact = mocker.spy(averager.exact, "average")
    change, buffer = torch.ones(3), torch.full((2,), 5.0)
    averager.average([change, buffer], 1)
    assert [t is buffer for t in exact.call_args.args[0]] == [True]
    averager.average([change, buffer], 0)  # a whole state: every tensor exactly
    assert [t is x for t, x in zip(exact.call_args.args[0], (change, buffer), strict=True)] == [True, True]
    calls = exact.call_count
    averager.average([change, buffer])  # no split asked for: one reduction through the reducer
    assert exact.call_count == calls


def test_an_exact_fp32_reducer_needs_no_companion_and_a_lossy_one_gets_it() -> None:
    assert outer_averager("fp32", RingReducer()).exact is None
    assert outer_averager("fp32", NativeReducer()).exact is None
    assert outer_averager("fp32", PowerSGD("ring", rank=1)).exact is not None
