"""The interruptible collectives that ``fault_tolerant`` runs between optimizer steps, on three gloo ranks.

``gather`` must return what torchmetrics' own ``gather_all_tensors`` returns (it replaces it in a metric's sync),
shapes differing between ranks included; ``gather_object`` hands every rank's object, in rank order, to one rank
(local SGD's checkpoint record); a wait whose interrupt gives a reason must end at once with that reason.
The strategies' recovery around them is tested end to end in ``test_fault_tolerant.py``.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.distributed as dist
from pytest_mock import MockerFixture
from torchmetrics import MeanSquaredError
from torchmetrics.utilities.distributed import gather_all_tensors

from lightning_dp_strategies.comm.failures import PeerLostError
from lightning_dp_strategies.strategies.control import (
    ControlCollectives,
    all_reduce,
    barrier,
    broadcast_object,
    gather,
    gather_object,
)
from tests.helpers.distributed import run_distributed


def _collectives(rank: int, world_size: int) -> None:
    group = dist.distributed_c10d._get_default_group()
    never = lambda: None  # noqa: E731  # an interrupt that never fires: the collectives are polled to completion
    for local in (
        torch.full((rank + 1, 2), float(rank)),  # a different first dimension on every rank
        torch.tensor(float(rank) + 0.5),  # a scalar
        torch.arange(3.0) * (rank + 1),  # the same shape everywhere
    ):
        ours = gather(local, group, never)
        theirs = gather_all_tensors(local.clone(), group)
        assert len(ours) == len(theirs) == world_size
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), (ours, theirs)

    value = torch.tensor([float(rank), 1.0])
    total = all_reduce(value, dist.ReduceOp.SUM, group, never)
    assert torch.equal(value, torch.tensor([float(rank), 1.0]))  # the input is left as it was, for a redo
    assert torch.equal(total, torch.tensor([float(sum(range(world_size))), float(world_size)]))

    sent = {"path": "/tmp/epoch=1.ckpt", "tensor": torch.ones(2), "rank": rank}
    received = broadcast_object(sent, 1, group, never)
    assert received["path"] == sent["path"] and received["rank"] == 1 and torch.equal(received["tensor"], torch.ones(2))

    parts = gather_object({"rank": rank, "tensor": torch.ones(rank + 1)}, 1, group, never)  # sizes differ
    if rank == 1:
        assert parts is not None and [part["rank"] for part in parts] == list(range(world_size))
        assert all(torch.equal(part["tensor"], torch.ones(r + 1)) for r, part in enumerate(parts))
    else:
        assert parts is None

    # rank 2 joins a barrier only once the others have given theirs up: a wait that ignored its interrupt would hang
    # here until the test's timeout
    store = dist.distributed_c10d._get_default_store()
    if rank < 2:
        with pytest.raises(PeerLostError, match="A barrier was given up: rank 2 is gone"):
            barrier(group, lambda: "rank 2 is gone")
        store.add("gave_up", 1)
    else:
        while store.add("gave_up", 0) < 2:
            time.sleep(0.01)
        dist.barrier()  # meets the barrier the others left in flight
    dist.barrier()


@pytest.mark.timeout(120)
def test_the_collectives_between_steps_match_torchmetrics_and_give_up_on_an_interrupt() -> None:
    run_distributed(_collectives, 3, timeout=60)


def test_a_metrics_own_sync_function_set_aside_is_said(mocker: MockerFixture) -> None:
    """A metric constructed with its own ``dist_sync_fn`` or ``process_group`` syncs through the survivors' gather
    under ``fault_tolerant``: a warning says so, naming the metric and the argument; a plain metric gets none."""
    control = ControlCollectives(mocker.Mock(), mocker.Mock(), mocker.Mock())
    plain, own = MeanSquaredError(), MeanSquaredError(dist_sync_fn=gather_all_tensors)
    grouped = MeanSquaredError(process_group=object())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        control.watch_metrics([plain])
    with pytest.warns(UserWarning, match=r"MeanSquaredError's `dist_sync_fn` is not used under `fault_tolerant=True`"):
        control.watch_metrics([own])
    with pytest.warns(UserWarning, match=r"MeanSquaredError's `process_group` is not used"):
        control.watch_metrics([grouped])
    assert "_sync_dist" in vars(plain) and "_sync_dist" in vars(own)
    control.close()
    assert "_sync_dist" not in vars(own)
