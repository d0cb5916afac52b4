"""Suite-wide collection order: the longest test files first.

With ``-n 3 --dist worksteal`` (the README's command) each worker starts on its share of the tests in collection
order and takes tests from the other's queue once its own is empty; long tests collected last would leave one worker
running them alone at the end. Files not named keep their order.
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
