"""What travels between blocks: the fake-tensor check of a body, and the packing of tuples between stages."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from lightning_dp_strategies.pipeline import balance_by_time
from lightning_dp_strategies.pipeline.activations import as_args, check_blocks, from_args
from lightning_dp_strategies.pipeline.layout import StageBody


class WithMask(nn.Module):
    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x, x[:, 0] > 0


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.dropout = nn.Dropout(0.5)

    def forward(self, inputs: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        hidden, mask = inputs
        return self.dropout(self.linear(hidden)) * mask.unsqueeze(-1), mask


class First(nn.Module):
    def forward(self, inputs: tuple[Tensor, Tensor]) -> Tensor:
        return inputs[0]


class Returns(nn.Module):
    def __init__(self, make: object) -> None:
        super().__init__()
        self.make = make

    def forward(self, x: Tensor) -> object:
        return self.make(x)  # type: ignore[operator]


def test_a_body_passing_tuples_passes_and_draws_no_random_number() -> None:
    blocks = [WithMask(), Masked(), Masked(), First(), nn.Linear(4, 2)]
    x = torch.randn(8, 4)
    state = torch.get_rng_state()
    check_blocks(blocks, x)
    assert torch.equal(torch.get_rng_state(), state), "the check changed the random state (dropout ran for real)"
    assert all(p.grad is None for block in blocks for p in block.parameters())


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda x: {"hidden": x}, TypeError, "Block 1 (Returns) of the body, run on the body's input, returned a dict"),
        (lambda x: None, TypeError, "returned a NoneType"),
        (lambda x: (x,), TypeError, "returned a tuple of one tensor; return the tensor itself"),
        (lambda x: (x, 3), TypeError, "returned a tuple (a tensor of shape (8, 4), a int)"),
        (lambda x: (x, x.sum(0)), ValueError, "a tensor of shape (4,)), but the batch has 8 rows"),
        (lambda x: x.sum(), ValueError, "returned a tensor of shape (), but the batch has 8 rows"),
    ],
    ids=["dict", "none", "one-tuple", "non-tensor", "no-batch-dimension", "scalar"],
)
def test_what_the_pipeline_cannot_carry_is_refused_naming_the_block(
    make: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as raised:
        check_blocks([nn.Linear(4, 4), Returns(make), nn.Identity()], torch.randn(8, 4))
    assert message in str(raised.value)


def test_a_block_that_cannot_take_what_the_previous_returned_is_named() -> None:
    with pytest.raises(RuntimeError, match=r"Block 2 \(Masked\) of the body failed on what block 1 returned"):
        check_blocks([WithMask(), First(), Masked()], torch.randn(8, 4))


def test_blocks_the_fake_run_cannot_follow_and_meta_blocks_are_left_to_the_real_run() -> None:
    class DataDependent(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x[x > 0]  # its shape depends on the values

    check_blocks([DataDependent(), Returns(lambda x: None)], torch.randn(8, 4))  # stops at the first block
    with torch.device("meta"):
        meta = nn.Linear(4, 4)  # a block not materialized yet
    check_blocks([meta, WithMask()], torch.randn(8, 4))


def test_stage_body_packs_what_the_previous_stage_sent_as_the_block_takes_it() -> None:
    torch.manual_seed(0)
    body = nn.Sequential(WithMask(), Masked().eval(), First())
    x = torch.randn(8, 4)
    hidden, mask = body[0](x)
    stage = StageBody({1: body[1], 2: body[2]})
    assert torch.equal(stage(*as_args((hidden, mask))), body(x))
    assert from_args(as_args(x)) is x


def test_balance_by_time_takes_a_tuple_input() -> None:
    blocks = [Masked(), Masked(), First(), nn.Linear(4, 4)]
    sample = (torch.randn(8, 4), torch.ones(8, dtype=torch.bool))
    assert sum(balance_by_time(blocks, sample, 2)) == 4
