"""The local SGD package's names are the ones core exports for the strategies, and the package needs no Lightning."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lightning_dp_strategies import local_sgd
from lightning_dp_strategies.core import averaging as core_averaging, local_sgd as core_local_sgd


@pytest.mark.parametrize("core_module", [core_local_sgd, core_averaging])
def test_core_exports_the_same_objects(core_module: object) -> None:
    shared = [n for n in getattr(core_module, "__all__", []) if n in local_sgd.__all__]
    assert shared
    assert all(getattr(core_module, n) is getattr(local_sgd, n) for n in shared)


def test_every_name_of_core_averaging_comes_from_the_package() -> None:
    assert set(core_averaging.__all__) <= set(local_sgd.__all__)


def test_the_package_imports_no_lightning() -> None:
    """The algorithms know nothing of Trainer or Fabric: no module of the package imports Lightning."""
    root = Path(local_sgd.__file__).parent
    found = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [f"{path.name}: {n}" for n in names if n == "lightning" or n.startswith("lightning.")]
    assert not found, found
