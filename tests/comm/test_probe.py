"""``probe_ring`` / ``probe_link``: the ring itself timed on the live group, the same answer on every rank."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lightning_dp_strategies.comm import new_duplex_group
from lightning_dp_strategies.comm.probe import probe_link, probe_ring
from tests.helpers.distributed import point_to_point_log, run_distributed

SIZES = (64 * 1024, 1024 * 1024)  # small: this checks what is measured, not how fast loopback is


def _probe_two_ranks(rank: int, world_size: int) -> None:
    duplex = new_duplex_group()
    assert probe_link(sizes=SIZES, repeats=1, duplex=duplex).bandwidth_bytes_per_s > 0
    with pytest.raises(ValueError, match="two or more different sizes"):
        probe_ring(sizes=(SIZES[0], SIZES[0]))
    alone = [dist.new_group([0]), dist.new_group([1])]  # collective: both ranks make both
    with pytest.raises(ValueError, match="two or more ranks"):
        probe_ring(alone[rank], sizes=SIZES)
    # last: the spy cannot be taken off again in this process
    with point_to_point_log() as calls:
        result = probe_ring(sizes=SIZES, repeats=2, duplex=duplex)
    # the ring reducer's two connections: rank 1 sends over the second group, rank 0 receives over it
    sent_over = {group for name, group, _ in calls if name == "send"}
    assert sent_over == ({duplex} if rank == 1 else {dist.group.WORLD}), sent_over
    assert 0.0 <= result.busy <= 1.0 and result.link.bandwidth_bytes_per_s > 0
    everyone: list[object] = [None] * world_size
    dist.all_gather_object(everyone, (result.link, result.busy))
    assert all(r == everyone[0] for r in everyone)  # the slowest rank's figures, on every rank


@pytest.mark.timeout(120)
def test_two_ranks_probe_the_ring_over_both_connections_and_agree() -> None:
    run_distributed(_probe_two_ranks, 2)
