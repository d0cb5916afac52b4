"""The file tree is the architecture: layers import only those below them, no cycles, small modules and functions,
Lightning only where it belongs, one top-level module. (Registration on import and the moved module paths:
test_registration.py.)
"""

from __future__ import annotations

import ast
import subprocess
from collections import defaultdict
from pathlib import Path

from lightning_dp_strategies.core.registry import MOVED

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_dp_strategies"
NAME = "lightning_dp_strategies"

LAYERS = {
    "plan": 0,
    "comm": 1,
    "reducers": 2,
    "bucketing": 3,
    "sharding": 5,
    "data_parallel": 4,
    "pipeline": 4,
    "local_sgd": 4,
    "core": 6,
    "strategies": 7,
    "fabric": 7,
    "compare": 8,
    "cli": 9,
}
"""Bottom up; the package root's own modules (``__init__``, ``_imports``, ``__main__``, the shims of moved paths)
sit above them all."""
ROOT_LAYER = 10
LIGHTNING_ALLOWED = {
    "core": ("lightning.fabric",),
    "fabric": ("lightning.fabric",),
    "strategies": ("lightning",),
    "compare": ("lightning",),
    "cli": ("lightning",),
}
"""The layers that may import Lightning, and which part of it (the Fabric side never imports ``lightning.pytorch``)."""
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> tuple[int, str]:
    """``(layer, top-level subpackage)`` of a package module; the root's own modules are the top layer."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    return (LAYERS[top], top) if top in LAYERS else (ROOT_LAYER, "")


def is_module(name: str) -> bool:
    path = PACKAGE.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports(path: Path) -> list[str]:
    """Every module ``path`` imports, anywhere in the file (functions and ``TYPE_CHECKING`` blocks included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            submodules = [f"{node.module}.{a.name}" for a in node.names if is_module(f"{node.module}.{a.name}")]
            # `from package import submodule` needs the submodule; the package is already being imported
            found += submodules if len(submodules) == len(node.names) else [node.module, *submodules]
    return found


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def graph() -> dict[str, set[str]]:
    modules = {module_name(p) for p in package_files()}
    edges: dict[str, set[str]] = defaultdict(set)
    for path in package_files():
        source = module_name(path)
        for target in imports(path):
            if target.startswith(NAME) and target in modules and target != source:
                edges[source].add(target)
    return edges


def test_every_import_goes_down_a_layer_or_stays_in_its_own_package() -> None:
    wrong = []
    for source, targets in graph().items():
        (low, top) = layer_of(source)
        for target in targets:
            (t_low, t_top) = layer_of(target)
            if not (t_low < low or (t_top == top and top) or (low == ROOT_LAYER)):
                wrong.append(f"{source} -> {target}")
    assert not wrong, "imports that go up or across a layer:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle_among_the_packages_modules() -> None:
    edges = graph()
    # the root's own modules resolve public names lazily from every layer, and nothing imports them back but
    # `lightning_dp_strategies` itself, which every submodule's import runs first: leave them out
    edges = {
        s: {t for t in ts if layer_of(t)[0] != ROOT_LAYER} for s, ts in edges.items() if layer_of(s)[0] != ROOT_LAYER
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in list(edges):
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


def test_lightning_is_imported_only_by_its_layers() -> None:
    wrong = []
    for path in package_files():
        source = module_name(path)
        allowed = LIGHTNING_ALLOWED.get(layer_of(source)[1], ())
        for target in imports(path):
            if target == "lightning" or target.startswith(("lightning.", "pytorch_lightning")):
                if not any(target == a or target.startswith(a + ".") for a in allowed):
                    wrong.append(f"{source} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_modules_and_functions_are_small() -> None:
    long_modules = [
        f"{p.relative_to(ROOT)}: {n}"
        for p in package_files()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    long_functions = []
    for path in package_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length}")
    assert not long_modules, f"modules over {MAX_MODULE_LINES} lines: {long_modules}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"


def test_the_root_holds_at_most_three_modules_and_the_package_is_the_only_top_level_module() -> None:
    # besides the shim modules of moved paths, which only forward (test_registration.py)
    root_modules = sorted(p.name for p in PACKAGE.glob("*.py") if f"{NAME}.{p.stem}" not in MOVED)
    assert len(root_modules) <= 3, root_modules
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    top_level = [f for f in tracked.stdout.split() if "/" not in f]
    assert top_level == [], f"Python modules outside the package: {top_level}"
    assert "py-modules" not in (ROOT / "pyproject.toml").read_text()
