"""Micro-batching rules: equal micro-batches; errors before training; the fallback for a smaller last batch."""

from __future__ import annotations

import pytest

from lightning_dp_strategies.pipeline import check_micro_batches, effective_micro_batches


def test_effective_micro_batches_is_the_largest_divisor_not_above_the_request() -> None:
    assert [effective_micro_batches(b, 4) for b in (8, 4, 6, 3, 2, 5, 7, 1)] == [4, 4, 3, 3, 2, 1, 1, 1]
    assert effective_micro_batches(12, 8) == 6
    for batch in range(1, 40):
        for micro in range(1, 10):
            m = effective_micro_batches(batch, micro)
            assert 1 <= m <= micro and batch % m == 0
            assert not any(batch % k == 0 for k in range(m + 1, micro + 1))


def test_check_accepts_multiples() -> None:
    check_micro_batches(8, 4)
    check_micro_batches(4, 4)
    check_micro_batches(5, 1)


def test_more_micro_batches_than_the_batch_is_an_error_naming_the_fix() -> None:
    with pytest.raises(
        ValueError, match=r"batch size 2 .* smaller than micro_batches=4.*at least 4.*micro_batches <= 2"
    ):
        check_micro_batches(2, 4)


def test_a_batch_not_divisible_into_micro_batches_is_an_error_naming_the_fix() -> None:
    with pytest.raises(ValueError, match=r"cannot be cut into micro_batches=4 equal.*\[4, 8, 12\].*in \[1, 2, 3\]"):
        check_micro_batches(6, 4)


def test_zero_micro_batches_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        effective_micro_batches(4, 0)
