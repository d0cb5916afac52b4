"""16-mixed under sharded state: a rank whose pieces hold an Inf skips the step, and so does every other rank."""

from __future__ import annotations

import pytest
import torch

from lightning_dp_strategies.sharding import agree_on_nonfinite
from tests.helpers.distributed import run_distributed


def _one_rank_overflows(rank: int, world_size: int, agreed: bool) -> None:
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    scaler.scale(torch.ones(()))  # the scale is made at the first use, as a training step makes it
    param.grad = torch.full((3,), float("inf") if rank == 0 else 1.0)
    if agreed:
        assert agree_on_nonfinite([param.grad]) is True  # on both ranks: rank 0 found it
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    stepped = not torch.equal(param.detach(), torch.ones(3))
    skipped_everywhere = [False] * world_size
    torch.distributed.all_gather_object(skipped_everywhere, not stepped)
    if agreed:
        assert skipped_everywhere == [True] * world_size, skipped_everywhere
        assert scaler.get_scale() == 1.0  # backed off on every rank alike
        assert type(scaler) is torch.amp.GradScaler  # the scaler itself is untouched
    else:  # without the agreement the ranks part ways: the case the agreement exists for
        assert skipped_everywhere == [True, False], skipped_everywhere


def _all_finite(rank: int, world_size: int) -> None:
    grad = torch.full((3,), float(rank + 1))
    assert agree_on_nonfinite([grad, None]) is False
    assert torch.equal(grad, torch.full((3,), float(rank + 1)))  # nothing written where no rank found one


@pytest.mark.parametrize("agreed", [True, False])
@pytest.mark.timeout(120)
def test_every_rank_skips_when_one_rank_finds_inf(agreed: bool) -> None:
    run_distributed(_one_rank_overflows, 2, agreed)


@pytest.mark.timeout(120)
def test_finite_gradients_are_left_alone() -> None:
    run_distributed(_all_finite, 2)
