"""scatter and gather: uneven splits, nested structures kept by type, and errors that name the fix."""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pytest
import torch
from torch import Tensor

from lightning_dp_strategies.data_parallel import gather, scatter, split_sizes

# numerically sensitive: CI runs this file again under other CPU kernel paths and thread counts
pytestmark = pytest.mark.numerics


CPU3 = ["cpu"] * 3


@dataclass(frozen=True)
class Frozen:
    x: Tensor
    note: str
    derived: int = field(init=False, default=7)


class Pair(NamedTuple):
    left: Tensor
    right: list[Tensor]


def nested(batch: int) -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "pair": Pair(torch.randn(batch, 3), [torch.randn(batch), torch.arange(batch)]),
        "frozen": Frozen(torch.randn(batch, 2, 2), note="tag"),
        "ordered": OrderedDict(a=torch.randn(batch, 1)),
        "tuple": (torch.randn(batch, 4), None, 3.5),
        "scale": torch.tensor(2.0),
        "name": "sample",
    }


def leaves(obj: Any) -> list[Any]:
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in leaves(v)]
    if isinstance(obj, Frozen):
        return [*leaves(obj.x), obj.note, obj.derived]
    return [obj]


@pytest.mark.parametrize(
    ("batch", "devices", "expected"),
    [(10, 3, [4, 3, 3]), (9, 4, [3, 2, 2, 2]), (8, 2, [4, 4]), (2, 4, [1, 1]), (1, 3, [1]), (0, 3, [0])],
)
def test_split_sizes_even_up_to_one_never_empty(batch: int, devices: int, expected: list[int]) -> None:
    assert split_sizes(batch, devices) == expected


def test_scatter_nested_structures_keeps_types_and_splits_rows_unevenly() -> None:
    batch = nested(10)
    pieces = scatter(batch, CPU3)
    assert len(pieces) == 3
    for i, piece in enumerate(pieces):
        assert type(piece["pair"]) is Pair and type(piece["pair"].right) is list
        assert type(piece["frozen"]) is Frozen and piece["frozen"].note == "tag" and piece["frozen"].derived == 7
        assert type(piece["ordered"]) is OrderedDict and type(piece["tuple"]) is tuple
        assert piece["tuple"][1:] == (None, 3.5) and piece["name"] == "sample"
        assert piece["pair"].left.shape[0] == [4, 3, 3][i]
        assert torch.equal(piece["scale"], batch["scale"])  # 0-dim tensors are copied, not split
    # the pieces put back in order are the batch, leaf by leaf
    for whole, *parts in zip(leaves(batch), *map(leaves, pieces), strict=True):
        if isinstance(whole, Tensor) and whole.dim() > 0:
            assert torch.equal(torch.cat(parts), whole)
        else:
            assert all(p is whole or (isinstance(p, Tensor) and torch.equal(p, whole)) for p in parts)


def test_scatter_small_batch_uses_fewer_replicas_and_tensorless_inputs_one() -> None:
    pieces = scatter((torch.arange(2),), ["cpu"] * 4)
    assert [p[0].tolist() for p in pieces] == [[0], [1]]
    assert scatter(("text", {"k": 1}), CPU3) == [("text", {"k": 1})]
    assert len(scatter(torch.zeros(0, 3), CPU3)) == 1


def test_scatter_defaultdict_and_dim_1() -> None:
    d = defaultdict(list, {"x": torch.arange(6).reshape(2, 3)})
    pieces = scatter(d, ["cpu"] * 2, dim=1)
    assert all(type(p) is defaultdict and p.default_factory is list for p in pieces)
    assert [p["x"].tolist() for p in pieces] == [[[0, 1], [3, 4]], [[2], [5]]]


def test_scatter_rejects_batches_that_cannot_be_split() -> None:
    with pytest.raises(ValueError, match=r"inputs\[1\] has 5 rows along dim 0 but inputs\[0\] has 8.*buffers"):
        scatter((torch.zeros(8, 2), torch.zeros(5)), CPU3)
    with pytest.raises(ValueError, match=r"Cannot split inputs\['m'\] \(shape \(4,\)\) along dim 1"):
        scatter({"m": torch.zeros(4)}, CPU3, dim=1)


def test_gather_inverts_scatter_for_nested_structures() -> None:
    batch = nested(7)
    del batch["scale"]  # a 0-dim output is stacked per replica (next tests), not restored
    merged = gather(scatter(batch, ["cpu"] * 4), "cpu")
    assert type(merged["frozen"]) is Frozen and type(merged["pair"]) is Pair
    for a, b in zip(leaves(batch), leaves(merged), strict=True):
        assert torch.equal(a, b) if isinstance(a, Tensor) else a == b


def test_gather_non_tensor_leaves_kept_once_when_equal_else_listed() -> None:
    assert gather([{"n": 1, "t": torch.ones(1)}, {"n": 1, "t": torch.zeros(1)}], "cpu")["n"] == 1
    assert gather([("a",), ("b",)], "cpu") == (["a", "b"],)


def test_gather_scalars_are_stacked_with_a_warning_about_uneven_means() -> None:
    with pytest.warns(UserWarning, match="not the batch mean"):
        out = gather([torch.tensor(1.0), torch.tensor(3.0)], "cpu")
    assert out.tolist() == [1.0, 3.0]


def test_gather_rejects_replicas_with_different_structures() -> None:
    with pytest.raises(ValueError, match=r"different structures at output\[1\]"):
        gather([(torch.ones(1), {"a": torch.ones(1)}), (torch.ones(1), {"b": torch.ones(1)})], "cpu")
    with pytest.raises(ValueError, match="tensor in replica 0 but not in every replica"):
        gather([torch.ones(1), None], "cpu")
