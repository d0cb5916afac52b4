"""``sync_every="auto"`` in one process: the choice it logs names the fixed options that repeat it."""

from __future__ import annotations

import logging

import pytest
from torch import nn

from lightning_dp_strategies.local_sgd import FlatAverager, LocalSGD, LocalSGDConfig
from lightning_dp_strategies.reducers import NativeReducer


def test_the_logged_choice_names_the_fixed_period_and_delay_that_repeat_it(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    local = LocalSGD(LocalSGDConfig(sync_every="auto", fragments=2, delay=1), FlatAverager(NativeReducer()))
    local.start(model)
    with caplog.at_level(logging.INFO, logger="lightning_dp_strategies"):
        for _ in range(4):  # the trial period: each fragment leaves once, one a step, and is applied a step later
            local.after_step()
    local.close()
    chosen = [r.getMessage() for r in caplog.records if "sync_every='auto'" in r.getMessage()]
    assert len(chosen) == 1, caplog.text
    assert f"pass sync_every={local.sync_every}, delay={local.delay}." in chosen[0], chosen[0]
