"""How the strategies are built: Lightning's base plus held collaborators, and the extension point's guarantees.

Every registered strategy (Trainer and Fabric) is at most four classes of this package deep; the package swaps no
object's class and installs no import hook; a subclass that only picks its reducer keeps the two levels it is asked
for and is refused sharded optimizer state when it is made, naming why.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import lightning_dp_strategies
from lightning_dp_strategies import FabricRingAllReduceStrategy, RingAllReduceStrategy
from lightning_dp_strategies.fabric import fabric_strategies
from lightning_dp_strategies.reducers import NativeReducer, Reducer
from lightning_dp_strategies.reducers.two_level import TwoLevelReducer
from lightning_dp_strategies.strategies import trainer_strategies

PACKAGE = Path(lightning_dp_strategies.__file__).parent
MAX_OWN_CLASSES = 4


def own_classes(cls: type) -> list[str]:
    return [k.__qualname__ for k in cls.__mro__ if k.__module__.startswith("lightning_dp_strategies")]


@pytest.mark.parametrize("strategy", [*trainer_strategies(), *fabric_strategies()], ids=lambda c: c.__name__)
def test_every_registered_strategy_is_at_most_four_of_the_packages_classes_deep(strategy: type) -> None:
    mine = own_classes(strategy)
    assert len(mine) <= MAX_OWN_CLASSES, mine


def test_no_class_swap_and_no_import_hook_in_the_package() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr == "__class__":
                    found.append(f"{path.name}:{node.lineno} assigns __class__")
            if isinstance(node, ast.Attribute) and node.attr == "meta_path":
                found.append(f"{path.name}:{node.lineno} uses sys.meta_path")
    assert not found, found


class _OwnTrainer(RingAllReduceStrategy):
    def configure_reducer(self) -> Reducer:
        return NativeReducer()


class _OwnFabric(FabricRingAllReduceStrategy):
    def configure_reducer(self) -> Reducer:
        return NativeReducer()


@pytest.mark.parametrize("own", [_OwnTrainer, _OwnFabric], ids=["trainer", "fabric"])
def test_a_reducer_of_your_own_is_refused_sharded_state_when_the_strategy_is_made(own: type) -> None:
    with pytest.raises(
        ValueError, match=rf"cannot be combined with `{own.__name__}.configure_reducer`.*reduce-scatter"
    ):
        own(shard_optimizer_state=True)
    assert type(own().configure_reducer()) is NativeReducer  # unsharded, the reducer is the author's


@pytest.mark.parametrize("own", [_OwnTrainer, _OwnFabric], ids=["trainer", "fabric"])
def test_a_reducer_of_your_own_still_reduces_in_two_levels_when_asked(own: type) -> None:
    """``two_level=True`` on two nodes of two processes: the author's reducer becomes the hop across nodes, as the
    ``reducer=`` option's would; by default it reduces the buckets itself, in one flat ring."""
    strategy = own(two_level=True, parallel_devices=[torch.device("cpu")] * 2)
    strategy.num_nodes = 2
    arranged = strategy.arrange_reducer(strategy.configure_reducer())
    assert isinstance(arranged, TwoLevelReducer) and type(arranged.inter_node) is NativeReducer
    flat = own(parallel_devices=[torch.device("cpu")] * 2)
    flat.num_nodes = 2
    assert type(flat.arrange_reducer(flat.configure_reducer())) is NativeReducer


@pytest.mark.parametrize("own", [_OwnTrainer, _OwnFabric], ids=["trainer", "fabric"])
def test_two_levels_forced_on_a_whole_bucket_reducer_of_your_own_fail_at_setup_naming_the_fix(own: type) -> None:
    from lightning_dp_strategies.reducers import PowerSGD

    class OwnPowerSGD(own):  # type: ignore[valid-type,misc]
        def configure_reducer(self) -> Reducer:
            return PowerSGD("ring", rank=2)

    strategy = OwnPowerSGD(two_level=True, parallel_devices=[torch.device("cpu")] * 2)
    with pytest.raises(ValueError, match=r"reduces whole buckets.*two_level=None"):
        strategy.arrange_reducer(strategy.configure_reducer())
