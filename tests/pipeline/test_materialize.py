"""Deferred initialization: meta-device blocks allocated and initialized one by one, independent of the partition."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dp_strategies.pipeline.materialize import has_meta, materialize


def meta_body() -> nn.Sequential:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def test_values_do_not_depend_on_which_blocks_a_stage_builds() -> None:
    whole, parts = meta_body(), meta_body()
    materialize(enumerate(whole), torch.device("cpu"), seed=3)
    materialize([(4, parts[4])], torch.device("cpu"), seed=3)  # the last stage first
    assert has_meta(parts[0]) and not has_meta(parts[4])
    materialize([(0, parts[0]), (2, parts[2]), (3, parts[3])], torch.device("cpu"), seed=3)
    assert not has_meta(parts)
    for (name, a), (_, b) in zip(whole.state_dict().items(), parts.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(whole[3].running_var, torch.ones(8))  # buffers initialized too, not left as empty memory
    assert not torch.equal(whole[0].weight, whole[2].weight[:, :4])


def test_a_block_that_cannot_be_initialized_is_refused_before_anything_is_allocated() -> None:
    class Raw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(4, 4))

    with torch.device("meta"):
        blocks = [nn.Linear(4, 4), Raw()]
    with pytest.raises(TypeError, match=r"Block 1 \(Raw\) was built on the meta device.*Define `reset_parameters\(\)`"):
        materialize(enumerate(blocks), torch.device("cpu"), seed=0)
    assert has_meta(blocks[0]), "nothing is allocated when one block cannot be initialized"
