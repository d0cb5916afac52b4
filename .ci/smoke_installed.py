"""Checks an installed lightning-dp-strategies wheel and the sdist beside it: `python smoke_installed.py DIST_DIR`.

Run by .ci/package.sh with the fresh environment's interpreter, from outside the repository, so the import below
can only find the installed copy.
"""

from __future__ import annotations

import sys
import tarfile
from importlib import metadata, resources
from pathlib import Path

DIST_NAME = "lightning-dp-strategies"
STRATEGY_NAMES = ("ring_allreduce", "hybrid_pipeline", "scatter_gather", "dp")
FABRIC_NAMES = ("ring_allreduce", "scatter_gather")
SDIST_FILES = ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "constraints.txt", "PKG-INFO")


def check_installed() -> str:
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_dp_strategies

    location = Path(lightning_dp_strategies.__file__).resolve()
    assert "site-packages" in location.parts, f"imported from {location}, not from the installed wheel"

    version = metadata.version(DIST_NAME)
    assert lightning_dp_strategies.__version__ == version, (lightning_dp_strategies.__version__, version)

    missing = [name for name in STRATEGY_NAMES if name not in StrategyRegistry]
    assert not missing, f"not in Lightning's StrategyRegistry after import: {missing}"
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    missing = [name for name in FABRIC_NAMES if name not in STRATEGY_REGISTRY]
    assert not missing, f"not in Lightning Fabric's STRATEGY_REGISTRY after import: {missing}"

    assert resources.files("lightning_dp_strategies").joinpath("py.typed").is_file(), "py.typed not installed"

    dist = metadata.distribution(DIST_NAME)
    assert dist.metadata["License-Expression"] == "Apache-2.0", dist.metadata["License-Expression"]
    licenses = [f for f in dist.files or [] if f.name == "LICENSE"]
    assert licenses and licenses[0].read_text().lstrip().startswith("Apache License"), "LICENSE not in the metadata"

    (script,) = [e for e in metadata.entry_points(group="console_scripts") if e.name == DIST_NAME]
    assert callable(script.load())
    check_help()
    return version


def check_help() -> None:
    """The console script's `compare --help` comes from the installed package's parser; the names are registered."""
    import subprocess

    code = "import sys, lightning_dp_strategies.cli as c\ntry:\n    c.main(['compare', '--help'])\nexcept SystemExit:\n"
    code += "    from lightning.pytorch.strategies import StrategyRegistry\n"
    code += "    print('ring_allreduce' in StrategyRegistry, c.__file__)\n"
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True).stdout
    registered, location = out.strip().splitlines()[-1].split(" ", 1)
    assert registered == "True", "the names were not registered when the command started"
    assert "site-packages" in Path(location).parts, f"the parser module came from {location}, not the wheel"


def check_sdist(dist_dir: Path, version: str) -> None:
    (sdist,) = dist_dir.glob("*.tar.gz")
    root = f"lightning_dp_strategies-{version}"
    with tarfile.open(sdist) as tar:
        names = set(tar.getnames())
    expected = [f"{root}/{name}" for name in (*SDIST_FILES, "lightning_dp_strategies/py.typed")]
    missing = [name for name in expected if name not in names]
    assert not missing, f"{sdist.name} lacks {missing}"
    assert f"{root}/lightning_dp_strategies/__init__.py" in names
    assert f"{root}/lightning_dp_strategies/cli/parser.py" in names
    assert len(list(dist_dir.glob(f"lightning_dp_strategies-{version}-py3-none-any.whl"))) == 1


def main() -> None:
    version = check_installed()
    check_sdist(Path(sys.argv[1]), version)
    print(f"smoke: {DIST_NAME} {version} installed from its wheel: imports, registers {', '.join(STRATEGY_NAMES)}")


if __name__ == "__main__":
    main()
