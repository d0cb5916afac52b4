"""Suite-wide settings: one OpenMP thread per process, and the longest test files collected first.

The suite runs several processes per core (the xdist workers, and each multi-process test's ranks): OpenMP threads
beyond the cores only wait for each other. So every test process, and every rank or script a test starts (they
inherit the environment), runs one intra-op thread unless ``OMP_NUM_THREADS`` is set; it is set here, before any test
module imports torch. CI's numerics passes set it themselves (1 and 2).

With ``-n 3 --dist worksteal`` (the README's command) each worker starts on its share of the tests in collection
order and takes tests from the other's queue once its own is empty; long tests collected last would leave one worker
running them alone at the end. Files not named keep their order.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

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
