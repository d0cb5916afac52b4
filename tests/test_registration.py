"""Importing the package registers its strategy names with Lightning, the plain way: whatever is imported first, twice,
after a reload, with no import hook; the module paths of earlier releases are shim modules that warn and forward.

Each case runs in a fresh interpreter, so it sees a first import and cannot disturb the test process's modules.
"""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_dp_strategies.core.registry import MOVED, discover

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_dp_strategies"
NAME = "lightning_dp_strategies"


def run_python(code: str) -> str:
    """The last line ``code`` prints in a fresh interpreter started in the repository."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "first",
    [
        NAME,
        "lightning",
        "lightning.fabric",  # Fabric's side alone: the Trainer's registry is loaded by the package's own import
        f"{NAME}.core.checkpoint_io",  # a submodule: Python runs the package's __init__ first
    ],
)
def test_the_strategy_names_are_registered_whatever_is_imported_first(first: str) -> None:
    code = (
        f"import {first}\n"
        "import lightning, lightning_dp_strategies\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
        "print(all(n in StrategyRegistry for n in ('ring_allreduce', 'dp', 'hybrid_pipeline', 'local_sgd')),"
        " all(n in STRATEGY_REGISTRY for n in ('ring_allreduce', 'scatter_gather', 'local_sgd')),"
        " type(lightning.__loader__).__name__)"
    )
    assert run_python(code).split() == ["True", "True", "SourceFileLoader"]


def test_importing_the_package_imports_lightning_and_registers_the_names() -> None:
    code = (
        "import sys, lightning_dp_strategies\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "print('lightning' in sys.modules, 'ring_allreduce' in StrategyRegistry)"
    )
    assert run_python(code).split() == ["True", "True"]


# the finders installed before the package is imported: lightning's own imports may add some (setuptools' vendored
# importers, where an old setuptools is installed), which are not the package's to answer for
RELOAD = """
import importlib, json, sys
import lightning, torch
hooks = list(sys.meta_path)
import lightning_dp_strategies
lightning_dp_strategies.register_all()
importlib.reload(lightning_dp_strategies)
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

trainer = lightning.Trainer(strategy="ring_allreduce", accelerator="cpu", devices=1, logger=False)
fabric = lightning.Fabric(strategy="ring_allreduce", accelerator="cpu", devices=2)
print(json.dumps({
    "trainer": type(trainer.strategy).__name__,
    "fabric": type(fabric.strategy).__name__,
    "trainer_entry": StrategyRegistry["ring_allreduce"]["strategy"] is lightning_dp_strategies.RingAllReduceStrategy,
    "fabric_entry": STRATEGY_REGISTRY["ring_allreduce"]["strategy"]
    is lightning_dp_strategies.FabricRingAllReduceStrategy,
    "meta_path_unchanged": sys.meta_path == hooks,
    "package_finders": [
        repr(f) for f in sys.meta_path if getattr(f, "__module__", "").split(".")[0] == "lightning_dp_strategies"
    ],
}))
"""


def test_registering_twice_and_reloading_the_package_keep_the_names_working_and_install_no_finder() -> None:
    result = json.loads(run_python(RELOAD))
    assert result == {
        "trainer": "RingAllReduceStrategy",
        "fabric": "FabricRingAllReduceStrategy",
        "trainer_entry": True,
        "fabric_entry": True,
        "meta_path_unchanged": True,
        "package_finders": [],
    }


def test_the_package_never_touches_the_import_system() -> None:
    uses = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in {"meta_path", "path_hooks"}
    ]
    assert not uses, f"import hooks: {uses}"


PROBE_INIT = """
class Base:
    registered_name = None
"""
PROBE_STRATEGIES = """
from ldps_discover_probe import Base


class Found(Base):
    registered_name = "found"


class ClaimsToBeAClass:
    # what a generic alias such as `Callable[[Any], Any]` is on Python 3.10: `isinstance(alias, type)` holds (its
    # `__class__` is forwarded to `type`), and `issubclass(alias, Base)` raises
    @property
    def __class__(self):
        return type


ALIAS = ClaimsToBeAClass()
"""


def test_discovery_passes_over_a_module_value_that_only_claims_to_be_a_class(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A strategy module's type alias (``CommHook = Callable[...]``) is such a value on Python 3.10, where the
    package must still import; the probe's value stands in for it on any Python."""
    probe = tmp_path / "ldps_discover_probe"
    probe.mkdir()
    (probe / "__init__.py").write_text(PROBE_INIT)
    (probe / "strategies.py").write_text(PROBE_STRATEGIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        package = importlib.import_module("ldps_discover_probe")
        assert isinstance(importlib.import_module("ldps_discover_probe.strategies").ALIAS, type)  # the probe holds
        found = discover("ldps_discover_probe", package.Base)
    finally:
        for name in ("ldps_discover_probe", "ldps_discover_probe.strategies"):
            sys.modules.pop(name, None)
    assert [cls.__qualname__ for cls in found] == ["Found"]


def shim_paths() -> set[str]:
    """The package's modules whose only statement past the docstring and import is ``forward_moved(__name__)``."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        calls = [
            node
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "forward_moved"
        ]
        if calls:
            found.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
    return found


def test_every_moved_path_has_its_shim_module_and_every_shim_is_listed() -> None:
    assert shim_paths() == set(MOVED)
    assert all(not name.endswith("__init__") for name in MOVED)


MOVED_IMPORTS = """
import importlib, json, sys, warnings
from lightning_dp_strategies.core.registry import MOVED, discover
found = {}
for old, new in MOVED.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        __import__(old)  # as an import statement does: the warning points here, at "<string>"
    module = sys.modules[old]
    target = importlib.import_module(new)
    names = list(getattr(target, "__all__", []))
    found[old] = {
        "warnings": [[w.category.__name__, str(w.message), w.filename] for w in caught],
        "names": len(names),
        "forwarded": all(getattr(module, n) is getattr(target, n) for n in names),
        "all": list(getattr(module, "__all__", [])) == names,
    }
print(json.dumps(found))
"""


# session scope: with --dist worksteal the module's tests can be split up, and a module-scoped fixture would start its
# interpreter again each time the module came back to a worker
@pytest.fixture(scope="session")
def moved_imports() -> dict[str, Any]:
    result: dict[str, Any] = json.loads(run_python(MOVED_IMPORTS))
    return result


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_path_warns_naming_the_new_path_and_forwards(old: str, moved_imports: dict[str, Any]) -> None:
    found = moved_imports[old]
    # one warning, naming the new path, and pointing at the line that imports the old path
    assert found["warnings"] == [
        ["DeprecationWarning", f"`{old}` moved to `{MOVED[old]}`; the old path will be removed in 0.3.", "<string>"]
    ]
    assert found["names"] > 0, f"{MOVED[old]} has no __all__"
    assert found["forwarded"] and found["all"]
