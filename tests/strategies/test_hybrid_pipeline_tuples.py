"""hybrid_pipeline on a body whose blocks take and return tuples of tensors, against the same run on one device.

``pipeline_tuples.TupleNet``: the body's input is ``(tokens, mask)``, each block carries ``(hidden, mask)`` (float and
bool), the last block returns ``(logits, aux)`` to ``pipeline_loss``. Blocks that return what the pipeline cannot carry
are refused before the first schedule runs, on every rank, naming the block and what it returned.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_ranks, run_script

TOLERANCE = 1e-5  # fp32: micro-batches and replicas add the same terms in another order
# bf16-mixed against bf16-mixed on one device: bf16 matmuls round per micro-batch instead of per batch. Measured on
# AVX-512: parameters 0.7e-3 to 0.9e-3 apart after 12 Adam steps, logged losses 1e-3 to 2e-3; bf16 against fp32 on one
# device is 1e-2 apart, so the tolerance also tells a run that left autocast off.
BF16_PARAMS, BF16_LOSSES = 3e-3, 5e-3


def run(tmp: Path, stages: int, world: int, bad: str | None = None, timeout: float = 240, **env: str) -> dict[str, Any]:
    argv = [str(stages), str(world), str(tmp), *([bad] if bad else [])]
    if "LDPS_SIMULATE_NOTEBOOK" in env:  # Lightning's own launcher, whose start method the notebook names choose
        run_script(["-m", "tests.strategies.pipeline_tuples", *argv], timeout=timeout, env=env)
    else:
        run_ranks("tests.strategies.pipeline_tuples", argv, world, timeout=timeout, env=env)
    result: dict[str, Any] = torch.load(tmp / "result.pt", weights_only=False)
    return result


@pytest.fixture(scope="module")
def one_device(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run(tmp_path_factory.mktemp("one_device"), 0, 1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("stages", "world"),
    [
        pytest.param(2, 2, id="S2xD1"),
        pytest.param(2, 4, id="S2xD2", marks=pytest.mark.numerics),  # stands for the others under CI's other kernels
        pytest.param(3, 3, id="S3xD1"),
    ],
)
def test_tuple_activations_train_as_on_one_device(
    tmp_path: Path, one_device: dict[str, Any], stages: int, world: int
) -> None:
    got = run(tmp_path, stages, world)
    assert got["predict"] is not None
    assert_parity(got, one_device, replicas=world // stages)


def params_apart(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max((a["params"][name] - value).abs().max().item() for name, value in b["params"].items())


def losses_apart(a: dict[str, Any], b: dict[str, Any]) -> float:
    losses = [float(row["train_loss"]) for row in a["logged"] if "train_loss" in row]
    expected = [float(row["train_loss"]) for row in b["logged"] if "train_loss" in row]
    assert len(losses) == len(expected) == 12
    return max(abs(x - y) for x, y in zip(losses, expected, strict=True))


def assert_parity(
    got: dict[str, Any], one_device: dict[str, Any], replicas: int, params: float = TOLERANCE, losses: float = TOLERANCE
) -> None:
    assert params_apart(got, one_device) <= params
    assert losses_apart(got, one_device) <= losses
    assert abs(got["validate"][0]["val_loss"] - one_device["validate"][0]["val_loss"]) <= losses
    if got["predict"] is None:  # not returned by Lightning under the fork launcher
        return
    expected_predictions = one_device["predict"][0::replicas]  # rank 0 predicts replica 0's share
    rtol = TOLERANCE if got["predict"].dtype == torch.float32 else 2 * 2**-7  # bf16 logits: two units in the last place
    torch.testing.assert_close(got["predict"].float(), expected_predictions.float(), atol=losses, rtol=rtol)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("bad", "messages"),
    [
        (
            "dict",
            [
                "Block 2 (DictOut) of the body, run on `example_input_array` (the body's input), returned a dict",
                "tuple of at least two tensors",
            ],
        ),
        (
            "pooled",
            [
                "Block 2 (PooledOut) of the body, run on the first batch's inputs, returned a tuple (a tensor of shape "
                "(8, 5, 12), a tensor of shape (5,))",
                "first dimension is not the batch",
            ],
        ),
    ],
    ids=["dict-at-setup", "no-batch-dimension-on-the-first-batch"],
)
def test_blocks_returning_what_the_pipeline_cannot_carry_are_refused_on_every_rank(
    tmp_path: Path, bad: str, messages: list[str]
) -> None:
    with pytest.raises(AssertionError) as failure:
        run(tmp_path, 2, 2, bad, timeout=120)
    output = str(failure.value)
    for message in messages:
        assert output.count(message) >= 2, output[-4000:]  # both ranks raise it
    assert "training started" not in output


@pytest.mark.timeout(240)
def test_notebook_name_trains_where_the_spawn_name_is_refused(tmp_path: Path, one_device: dict[str, Any]) -> None:
    with pytest.raises(AssertionError, match="hybrid_pipeline_notebook"):
        run(tmp_path / "spawn", 2, 2, LDPS_SIMULATE_NOTEBOOK="1", LDPS_STRATEGY="hybrid_pipeline_spawn")
    got = run(tmp_path / "fork", 2, 2, LDPS_SIMULATE_NOTEBOOK="1", LDPS_STRATEGY="hybrid_pipeline_notebook")
    assert_parity(got, one_device, replicas=1)


@pytest.mark.numerics
@pytest.mark.timeout(240)
def test_bf16_mixed_trains_as_bf16_mixed_on_one_device(tmp_path: Path, one_device: dict[str, Any]) -> None:
    reference = run(tmp_path / "one", 0, 1, LDPS_PRECISION="bf16-mixed")
    got = run(tmp_path / "s2d2", 2, 4, LDPS_PRECISION="bf16-mixed")
    assert_parity(got, reference, replicas=2, params=BF16_PARAMS, losses=BF16_LOSSES)
    assert params_apart(got, one_device) > BF16_PARAMS, "the stages ran in fp32: autocast did not reach them"
    assert got["params"]["body.0.proj.weight"].dtype == torch.float32  # the weights stay fp32 under bf16-mixed
