"""Suite-wide collection order: the longest test files first.

With ``-n 2 --dist loadfile`` (the README's command) each file runs whole on one worker, handed out in collection
order; a long file collected last leaves the other worker idle until it ends. Files not named keep their order.
"""

from __future__ import annotations

import pytest

LONGEST_FIRST = (
    "tests/test_docs.py",
    "tests/test_benchmarks.py",
    "tests/reliability/test_determinism.py",
    "tests/test_notebooks.py",
    "tests/strategies/test_ring_allreduce.py",
    "tests/compare/test_user_model.py",
    "tests/reliability/test_rank_agreement.py",
    "tests/reliability/test_dead_rank.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
