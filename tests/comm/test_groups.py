"""The package's process groups time out as the default group does, not after torch's 30 minutes for a new group.

A collective on a group whose peer is alive but silent waits for that group's timeout; the strategy's ``timeout``
option is the default group's, so every group the package makes must carry it too.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.distributed_c10d import _get_default_store, _set_pg_timeout

from lightning_dp_strategies.bucketing.sync import GradientSync
from lightning_dp_strategies.comm.groups import group_timeout, new_group, time_out_as_world, world_timeout
from lightning_dp_strategies.comm.two_level import NodeLayout, new_two_level_groups
from lightning_dp_strategies.reducers import RingReducer
from tests.helpers.distributed import run_distributed

TIMEOUT = timedelta(seconds=3)


def _groups_time_out_as_world(rank: int, world_size: int) -> None:
    _set_pg_timeout(TIMEOUT, None)  # what init_process_group(timeout=...) gives the default group
    assert world_timeout() == TIMEOUT
    sync = GradientSync()
    reducer = RingReducer()
    sync.make_groups([[0, 1]], rank, "gloo", reducer)  # the gradient group, and the ring's second connection
    two_level = new_two_level_groups(NodeLayout(nodes=2, per_node=1))
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pipeline", "data_parallel"))
    meshed = [mesh.get_group(name) for name in ("pipeline", "data_parallel")]
    for group in meshed:
        time_out_as_world(group)
    groups = {
        "gradients": sync.group,
        "duplex": reducer.duplex_group(sync.group),
        **{f"two-level {i}": g for i, g in enumerate(two_level.made) if g != dist.GroupMember.NON_GROUP_MEMBER},
        "mesh pipeline": meshed[0],
        "mesh data_parallel": meshed[1],
        "given": new_group([0, 1], timeout=timedelta(seconds=7)),
    }
    found = {name: group_timeout(group) for name, group in groups.items() if group is not None}
    assert len(found) == len(groups), f"a group was not made: {groups}"
    expected = {name: TIMEOUT for name in found} | {"given": timedelta(seconds=7)}
    assert found == expected
    # a silent peer: the collective fails after the default group's timeout, not torch's 30 minutes
    store = _get_default_store()
    if rank == 0:
        with pytest.raises(RuntimeError, match="Timed out waiting 3000ms"):
            dist.all_reduce(torch.ones(4), group=sync.group)
        store.set("done", "1")
    else:
        store.wait(["done"], timedelta(seconds=90))
    reducer.close()


@pytest.mark.timeout(150)
def test_every_group_the_package_makes_times_out_as_the_default_group() -> None:
    run_distributed(_groups_time_out_as_world, 2, timeout=120)


def test_without_a_default_group_a_new_group_is_left_to_torch() -> None:
    assert world_timeout() is None
    time_out_as_world(dist.GroupMember.WORLD)  # nothing to copy from: left alone, no error
