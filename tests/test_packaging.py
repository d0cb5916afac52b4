"""The packaging metadata, read statically: pyproject.toml, LICENSE, py.typed, the version and the changelog."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from typing import Any

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_dp_strategies"


@pytest.fixture(scope="module")
def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def literal_version() -> str:
    """``__version__`` as setuptools reads it: a string literal assigned in ``__init__.py``, found without importing."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__version__"]:
            assert isinstance(node.value, ast.Constant) and isinstance(node.value.value, str), ast.dump(node)
            return node.value.value
    raise AssertionError("no `__version__ = '...'` in lightning_dp_strategies/__init__.py")


def test_classifiers_match_what_the_package_is(pyproject: dict[str, Any]) -> None:
    project = pyproject["project"]
    classifiers = project["classifiers"]
    assert "Framework :: Pytest" not in classifiers  # not a pytest plugin
    assert "Typing :: Typed" in classifiers
    # setuptools >= 77 refuses License :: classifiers beside an SPDX expression
    assert not [c for c in classifiers if c.startswith("License ::")]
    versions = [re.fullmatch(r"Programming Language :: Python :: 3\.(\d+)", c) for c in classifiers]
    minors = [int(m.group(1)) for m in versions if m]
    lowest = int(project["requires-python"].removeprefix(">=3."))
    assert min(minors) == lowest, (minors, project["requires-python"])
    assert sys.version_info.minor in minors, f"the Python running the tests, 3.{sys.version_info.minor}, is not listed"


def test_license_is_the_apache_text_and_declared_as_spdx(pyproject: dict[str, Any]) -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    assert "Copyright 2026 The lightning-dp-strategies authors" in text
    assert pyproject["project"]["license"] == "Apache-2.0"
    assert pyproject["project"]["license-files"] == ["LICENSE"]
    assert pyproject["build-system"]["requires"] == ["setuptools>=77.0.3"]  # the first with PEP 639 fields


def test_py_typed_ships_in_the_wheel(pyproject: dict[str, Any]) -> None:
    assert (PACKAGE / "py.typed").is_file()
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["lightning_dp_strategies"]


def test_the_version_lives_in_one_place(pyproject: dict[str, Any]) -> None:
    project = pyproject["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lightning_dp_strategies.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", literal_version())


def test_changelog_has_the_version_under_its_heading() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## \[([^\]]+)\]", changelog, flags=re.MULTILINE)
    assert headings[0] == "Unreleased"
    assert headings[1] == literal_version(), "the newest released section is not the package's __version__"


def test_no_repository_address_is_invented_and_the_sdist_contents_are_declared(pyproject: dict[str, Any]) -> None:
    """The project has no public repository address yet: the metadata, README, docs, notebooks and changelog name
    none (a user is told to clone this repository or install the wheel instead)."""
    assert "urls" not in pyproject["project"]
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "pyproject.toml", *ROOT.glob("docs/**/*.md")]
    files += list(ROOT.glob("notebooks/*.ipynb"))
    invented = [str(f.relative_to(ROOT)) for f in files if "github.com/lightning-dp-strategies" in f.read_text()]
    assert not invented, invented
    manifest = (ROOT / "MANIFEST.in").read_text()
    assert "CHANGELOG.md" in manifest and "constraints.txt" in manifest


# import name -> distribution name, for the packages whose names differ
DISTRIBUTION = {"typing_extensions": "typing-extensions"}


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level third-party modules the package imports (anywhere in a file), with the files that import them."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top not in sys.stdlib_module_names and not top.startswith("lightning_dp_strategies"):
                    found.setdefault(top, set()).add(path.relative_to(ROOT).as_posix())
    return found


def _requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower()


def test_every_imported_package_is_a_declared_dependency(pyproject: dict[str, Any]) -> None:
    """A module imported only because Lightning happens to depend on it breaks when Lightning drops it."""
    project = pyproject["project"]
    required = {_requirement_name(r) for r in project["dependencies"]}
    optional = {_requirement_name(r) for r in project["optional-dependencies"]["compare"]}
    imported = _third_party_imports()
    assert {"torch", "lightning", "typing_extensions"} <= set(imported)  # the scan sees the package's imports
    undeclared = {
        name: sorted(files)
        for name, files in imported.items()
        if DISTRIBUTION.get(name, name) not in required | optional
    }
    assert not undeclared, f"imported but not declared in [project] dependencies (or the compare extra): {undeclared}"
    # the compare extra's packages are imported only where the comparison needs them
    for name in optional:
        assert imported.get(name, set()) <= {
            "lightning_dp_strategies/compare/report.py",
            "lightning_dp_strategies/compare/task.py",
        }, (name, imported.get(name))


def _release(text: str) -> tuple[int, ...]:
    numbers = tuple(int(part) for part in text.split("+")[0].split("."))
    return numbers + (0,) * (3 - len(numbers))


def test_the_oldest_environment_pins_each_dependencys_lower_bound_and_the_readme_states_them(
    pyproject: dict[str, Any],
) -> None:
    """``.ci/oldest`` tests the package under ``.ci/oldest.txt``: a bound raised or lowered in one and not the other
    would leave a lower bound untested; the README's requirements line is what a user reads of them."""
    bounds = {}
    for requirement in pyproject["project"]["dependencies"]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", requirement)
        assert match, f"{requirement!r}: each dependency takes a lower bound only, `name>=version`"
        bounds[match.group(1).lower()] = _release(match.group(2))
    lines = (ROOT / ".ci" / "oldest.txt").read_text().splitlines()
    pins = {name.lower(): _release(version) for name, version in (line.split("==") for line in lines if "==" in line)}
    assert pins == bounds
    readme = (ROOT / "README.md").read_text()
    python = pyproject["project"]["requires-python"].removeprefix(">=")
    stated = f"Requires Python >= {python}, torch >= {bounds['torch'][0]}.{bounds['torch'][1]}, lightning >= "
    stated += f"{bounds['lightning'][0]}.{bounds['lightning'][1]}"
    assert stated in readme.replace("\n", " ")
