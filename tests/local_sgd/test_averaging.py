"""FlatAverager with a lossy outer precision: only the parameter changes go through the lossy reducer; values
(buffers, the averaged model) go through the exact companion. One process: the routing, not the sums (the 2-rank
checkpoint test in ``tests/strategies/test_local_sgd.py`` checks the exact mean). Two processes: what an average
whose peer never answers raises, in every precision's way of failing."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
from pytest_mock import MockerFixture

from lightning_dp_strategies.comm.failures import PEER_FAILURE_HINT
from lightning_dp_strategies.comm.groups import new_group
from lightning_dp_strategies.local_sgd import outer_averager
from lightning_dp_strategies.reducers import NativeReducer, PowerSGD, RingReducer
from tests.helpers.distributed import run_distributed


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


def _average_with_a_silent_peer(rank: int, world_size: int, precision: str) -> None:
    group = new_group([0, 1], timeout=timedelta(seconds=3))
    averager = outer_averager("fp32" if precision == "maximum" else precision, NativeReducer())
    averager.setup(group, [0, 1], "gloo")
    if rank == 1:  # alive, but never joins the average
        time.sleep(6)
        return
    with pytest.raises(RuntimeError) as raised:
        if precision == "maximum":  # the ranks agreeing on their slowest timings (sync_every="auto")
            averager.maximum(torch.ones(2))
        else:
            averager.average([torch.ones(300)])
    message = str(raised.value)
    assert message.startswith("Averaging over 2 ranks failed on rank 0: RuntimeError:"), message
    assert "Timed out waiting 3000ms" in message and PEER_FAILURE_HINT in message


@pytest.mark.timeout(120)
@pytest.mark.parametrize("precision", ["fp32", "int8", "maximum"])
def test_an_average_whose_peer_never_answers_fails_with_what_it_most_likely_means(precision: str) -> None:
    # The 8-bit reducer exchanges before it returns its future, so its failure comes from the call, not the wait;
    # "maximum" is the agreement on the slowest timings that sync_every="auto" makes.
    run_distributed(_average_with_a_silent_peer, 2, precision, timeout=90)
