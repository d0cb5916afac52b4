"""The engine the Trainer and Fabric strategies hold, on its own: what it counts as a step's communication."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dp_strategies.core.engine import BucketedEngine
from lightning_dp_strategies.core.options import BucketedConfig, ReductionOptions
from lightning_dp_strategies.local_sgd import LocalSGDConfig
from lightning_dp_strategies.reducers import resolve_reducer
from tests.helpers.distributed import run_distributed


def _a_late_synchronisation_is_counted(rank: int, world_size: int) -> None:
    engine = BucketedEngine(BucketedConfig(), ReductionOptions(), None)
    engine.make_groups([list(range(world_size))], rank, "gloo", resolve_reducer("ring"))
    engine.start_local_sgd(LocalSGDConfig(sync_every=4), resolve_reducer("ring"), world_size, "gloo")
    model = nn.Linear(4, 2)
    assert engine.local_sgd is not None
    engine.local_sgd.start(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):  # two local steps of a period of four: nothing sent
        with torch.no_grad():
            model.weight.add_(rank + 1.0)
        engine.after_step(optimizer)
    assert engine.step_stats.bytes_sent == 0 and engine.comm_stats.bytes_sent == 0
    engine.synchronize()  # as before validation or at the end of fit
    assert engine.step_stats.bytes_sent > 0
    assert engine.comm_stats.bytes_sent == engine.step_stats.bytes_sent
    engine.after_step(optimizer)  # the next step sends nothing: its statistics start again
    assert engine.step_stats.bytes_sent == 0 and engine.comm_stats.bytes_sent > 0
    engine.close()
    engine.destroy_groups()


@pytest.mark.timeout(120)
def test_a_synchronisation_after_the_last_step_shows_in_step_stats() -> None:
    run_distributed(_a_late_synchronisation_is_counted, 2)
