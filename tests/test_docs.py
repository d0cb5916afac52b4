"""The docs' promises: the guide's example strategy trains, and every public name has a docstring with an example."""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

import pytest

from tests.helpers.distributed import run_script

PUBLIC_MODULES = [
    "lightning_dp_strategies",
    "lightning_dp_strategies.comm",
    "lightning_dp_strategies.bucketing",
    "lightning_dp_strategies.reducers",
    "lightning_dp_strategies.reducers.comm_hooks",
    "lightning_dp_strategies.plan",
    "lightning_dp_strategies.data_parallel",
    "lightning_dp_strategies.core.agreement",
    "lightning_dp_strategies.core.checkpoint_io",
    "lightning_dp_strategies.strategies.bucketed",
    "lightning_dp_strategies.compare",
    "lightning_dp_strategies.pipeline",
    "lightning_dp_strategies.fabric",
]


def public_objects() -> list[tuple[str, object]]:
    seen: dict[int, tuple[str, object]] = {}
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", []):
            obj = getattr(module, name)
            # a class by its real type: on Python 3.10 `inspect.isclass` holds for a type alias such as
            # `Callable[..., Any]`, whose docstring is `Callable`'s
            if issubclass(type(obj), type) or inspect.isfunction(obj):
                seen.setdefault(id(obj), (f"{module_name}.{name}", obj))
    return sorted(seen.values(), key=lambda item: item[0])


@pytest.mark.parametrize(("name", "obj"), public_objects(), ids=lambda v: v if isinstance(v, str) else "")
def test_public_names_have_a_docstring_with_an_example(name: str, obj: object) -> None:
    doc = inspect.getdoc(obj) or ""
    assert doc, f"{name} has no docstring"
    assert "Example" in doc or ">>>" in doc, f"{name}'s docstring has no example"


@pytest.mark.timeout(300)
def test_write_your_own_strategy_guide_example_trains() -> None:
    output = run_script(["docs/examples/bf16_ring_strategy.py", "6"], timeout=240)
    assert "bytes bf16/fp32 = 0.50" in output


@pytest.mark.timeout(300)
def test_override_one_method_example_trains_to_parity() -> None:
    output = run_script(["docs/examples/native_allreduce_strategy.py", "6"], timeout=240)
    assert "max |dθ| against single-device training" in output  # the script asserts <= 1e-5 itself


@pytest.mark.parametrize(
    "example", ["bf16_ring_strategy.py", "native_allreduce_strategy.py", "bucketed_ddp_strategy.py"]
)
def test_a_new_strategy_takes_well_under_40_lines(example: str) -> None:
    """From the first import to the name's registration: the whole strategy, blank lines and docstrings included."""
    from pathlib import Path

    source = (Path(__file__).resolve().parents[1] / "docs" / "examples" / example).read_text()
    body = source[source.index("\nfrom ") : source.index('if __name__ == "__main__":')]
    assert len(body.strip().splitlines()) < 30, body


@pytest.mark.timeout(300)
def test_a_strategy_written_against_the_base_trains_to_parity() -> None:
    output = run_script(["docs/examples/bucketed_ddp_strategy.py", "6"], timeout=240)
    assert "max |dθ| against single-device training" in output  # the script asserts <= 1e-5 itself


@pytest.mark.timeout(300)
def test_readme_parity_example_matches_a_plain_single_process_loop() -> None:
    """`examples/ring_allreduce_parity.py`, which the README points to: 2 ranks, SGD with momentum and weight decay."""
    import re

    output = run_script(["examples/ring_allreduce_parity.py"], timeout=240)  # also exits non-zero above 1e-5
    diff = re.search(r"max \|ring_allreduce - single-process loop\| = (\S+) \(tolerance 1e-05\)", output)
    assert diff is not None, output
    assert float(diff.group(1)) <= 1e-5, output


@pytest.mark.timeout(180)
def test_quickstart_example_trains_with_ring_allreduce() -> None:
    output = run_script(["docs/examples/quickstart.py"], timeout=150)
    assert "CommStats(bytes_sent=" in output and "synced_backwards=" in output


@pytest.mark.timeout(180)
def test_fabric_page_example_trains_with_ring_allreduce(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[1] / "docs" / "examples" / "fabric_ring_allreduce.py"
    output = run_script([str(script)], timeout=150, env={"LDPS_FABRIC_EXAMPLE_DIR": str(tmp_path)})
    assert output.count("synced_backwards=1, skipped_backwards=1") == 2, output  # rank 0: 2 steps of 2 backwards
    assert (tmp_path / "fabric-ring.ckpt").is_file()
    assert '--8<-- "docs/examples/fabric_ring_allreduce.py"' in (script.parents[1] / "fabric.md").read_text()


def test_guide_includes_the_tested_example_verbatim() -> None:
    from pathlib import Path

    docs = Path(__file__).resolve().parents[1] / "docs"
    assert '--8<-- "docs/examples/bf16_ring_strategy.py"' in (docs / "extending.md").read_text()
    assert '--8<-- "docs/examples/native_allreduce_strategy.py"' in (docs / "extending.md").read_text()
    assert '--8<-- "docs/examples/bucketed_ddp_strategy.py"' in (docs / "extending.md").read_text()
    assert '--8<-- "docs/examples/quickstart.py"' in (docs / "quickstart.md").read_text()
    assert sys.version_info >= (3, 10)


def test_the_api_pages_data_parallel_member_list_is_the_packages_all() -> None:
    """docs/api.md lists the data_parallel names by hand (in data-flow order): a name added to __all__ goes there."""
    import re
    from pathlib import Path

    import lightning_dp_strategies.data_parallel as data_parallel

    api = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    listed = re.search(r"::: lightning_dp_strategies\.data_parallel\n(?:.*\n)*?\s+members: \[(.*)\]", api)
    assert listed is not None
    assert sorted(name.strip() for name in listed.group(1).split(",")) == sorted(data_parallel.__all__)


def test_the_local_sgd_pages_cost_example_prints_what_the_page_shows(capsys: pytest.CaptureFixture[str]) -> None:
    """The local SGD page's planning example runs, and prints the lines written under it as comments."""
    import re

    page = (Path(__file__).resolve().parents[1] / "docs" / "strategies" / "local_sgd.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", page, flags=re.DOTALL) if "plan.predict" in b]
    shown = [line.removeprefix("# ") for line in block.splitlines() if line.startswith("# ")]
    exec(compile(block, "docs/strategies/local_sgd.md", "exec"), {})
    assert capsys.readouterr().out.splitlines() == shown and len(shown) == 2
