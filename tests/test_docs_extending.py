"""The extending guide's code blocks run: each on its own, and its ``LoggingReducer`` on two ranks, where the wrapped
ring must get its setup step (its second connection) through the wrapper."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_dp_strategies.reducers import GradBucket, ReducerBase, ReducerWrapper, RingReducer, setup_reducer
from tests.helpers.distributed import run_distributed

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def code_blocks() -> list[str]:
    """The guide's Python blocks written on the page (the ``--8<--`` includes are run by their own tests)."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)
    return [block for block in blocks if "--8<--" not in block]


def run_block(marker: str) -> dict[str, Any]:
    """Execute the one block that contains ``marker``; its names."""
    (block,) = [block for block in code_blocks() if marker in block]
    namespace: dict[str, Any] = {"__name__": "extending_guide"}
    exec(compile(block, f"{GUIDE}:{marker}", "exec"), namespace)
    return namespace


def test_the_guide_has_its_reducer_examples_inline() -> None:
    blocks = code_blocks()
    assert any("class MyReducer(ReducerBase)" in block for block in blocks)
    assert any("class LoggingReducer(ReducerWrapper)" in block for block in blocks)


@pytest.mark.parametrize("index", range(len(code_blocks())))
def test_every_code_block_of_the_guide_runs(index: int) -> None:
    exec(compile(code_blocks()[index], f"{GUIDE} block {index}", "exec"), {"__name__": "extending_guide"})


def test_the_contract_example_reduces_a_bucket() -> None:
    reducer = run_block("class MyReducer")["MyReducer"]()
    assert isinstance(reducer, ReducerBase)
    assert reducer(GradBucket(torch.ones(3))).wait().tolist() == [1.0, 1.0, 1.0]


def _check_logging_reducer(rank: int, world_size: int) -> None:
    names = run_block("class LoggingReducer")
    reducer = names["LoggingReducer"](RingReducer())
    assert isinstance(reducer, ReducerWrapper) and names["strategy"] is not None
    ring = reducer.inner
    assert isinstance(ring, RingReducer)
    setup_reducer(reducer, None, list(range(world_size)))  # as the strategy does, on every rank
    duplex = ring.duplex_group(None)
    assert duplex is not None, "the wrapper did not hand the ring its setup step: no second connection"
    assert dist.get_process_group_ranks(duplex) == [0, 1]
    bucket = GradBucket(torch.full((6,), float(rank + 1)), op="avg")
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert torch.equal(reducer(bucket).wait(), torch.full((6,), 1.5))  # (1 + 2) / 2: exact
    assert printed.getvalue() == "bucket 0: 6 elements over 2 ranks\n"
    reducer.close()
    assert ring.duplex_group(None) is None  # closed through the wrapper, with the ring's groups


@pytest.mark.timeout(120)
def test_the_guides_logging_reducer_hands_the_ring_its_setup_step() -> None:
    run_distributed(_check_logging_reducer, 2)
