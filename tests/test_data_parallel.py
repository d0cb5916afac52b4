"""scatter / replicate / parallel_apply / gather: the pure functions under the scatter_gather strategy.

The transparency test is the specification: scatter -> replicate -> parallel_apply -> gather, then a loss on the
gathered outputs, gives the single-device gradients (max abs difference <= 1e-6, fp32) for any split, even or not.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pytest
import torch
from torch import Tensor, nn

from lightning_dp_strategies.data_parallel import (
    ThreadContext,
    as_devices,
    gather,
    parallel_apply,
    replicate,
    scatter,
    split_sizes,
)

# numerically sensitive: CI runs this file again under other CPU kernel paths and thread counts
pytestmark = pytest.mark.numerics


TOLERANCE = 1e-6  # fp32 max absolute difference to single-device results (observed ~1e-8)
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


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        (["cpu", "cuda:0"], "mix the device types"),
        (["tpu:0", "tpu:1"], "Unknown device 'tpu:0'"),
        (["meta", "meta"], "'meta' is not supported"),
        ([], "non-empty list"),
    ],
)
def test_bad_devices_raise_errors_naming_the_fix(devices: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        as_devices(devices)
    with pytest.raises(ValueError, match=message):
        scatter(torch.zeros(4), devices)


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


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(3, 3)
        self.again = self.block  # the same module twice
        self.norm = nn.BatchNorm1d(3)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.again(self.block(x)))


def test_cpu_replicas_share_parameters_and_only_replica_0_shares_buffers() -> None:
    net = Shared()
    replicas = replicate(net, CPU3)
    assert all(r is not net for r in replicas)
    for r in replicas:
        assert r.block is r.again  # shared submodules stay shared inside each replica
        # with grad enabled: autograd aliases of the root's parameters (the same memory), summed in replica order
        assert r.block.weight.data_ptr() == net.block.weight.data_ptr() and r.block.weight.grad_fn is not None
    with torch.no_grad():
        for r in replicate(net, CPU3):
            assert [id(p) for p in r.parameters()] == [id(p) for p in net.parameters()]
    assert replicas[0].norm.running_mean is net.norm.running_mean
    for r in replicas[1:]:
        assert r.norm.running_mean is not net.norm.running_mean
        assert torch.equal(r.norm.running_mean, net.norm.running_mean)


def test_batchnorm_keeps_the_first_replicas_running_statistics() -> None:
    torch.manual_seed(0)
    net, reference = Shared(), Shared()
    reference.load_state_dict(net.state_dict())
    x = torch.randn(10, 3) * 3 + 1
    replicas = replicate(net, CPU3)
    inputs = scatter(((x,), {}), CPU3)
    parallel_apply([r.forward for r in replicas], inputs, CPU3)
    reference(x[:4])  # the first chunk, alone
    # Tolerance, not bits: replica 0 ran with its share of the intra-op threads, the reference with all of them, and
    # a mean reduced over other threads may differ in the last place. Replica 1's chunk would be off by ~0.1-1.
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(net.norm, name), getattr(reference.norm, name), rtol=1e-6, atol=1e-6)
    assert net.norm.num_batches_tracked.item() == 1  # replicas 1 and 2 did not touch the root's buffers


def test_batchnorm_updates_of_other_replicas_are_private() -> None:
    net = Shared()
    replicas = replicate(net, CPU3)
    x = torch.randn(9, 3)
    parallel_apply([r.forward for r in replicas], scatter(((x,), {}), CPU3), CPU3)
    assert replicas[1].norm.num_batches_tracked.item() == 1 and replicas[2].norm.num_batches_tracked.item() == 1
    assert not torch.equal(replicas[1].norm.running_mean, net.norm.running_mean)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))


def data_parallel_outputs(net: nn.Module, x: Tensor, devices: int) -> list[Any]:
    targets = ["cpu"] * devices
    inputs = scatter(((x,), {}), targets)
    replicas = replicate(net, targets[: len(inputs)])
    return parallel_apply([r.forward for r in replicas], inputs, targets[: len(inputs)])


def max_grad_diff(net: nn.Module, expected: list[Tensor]) -> float:
    return max((p.grad - w).abs().max().item() for p, w in zip(net.parameters(), expected, strict=True))  # type: ignore[operator]


@pytest.mark.parametrize(("devices", "batch"), [(2, 7), (3, 10), (4, 11), (4, 3)])
def test_transparency_gradients_equal_single_device_for_uneven_splits(devices: int, batch: int) -> None:
    torch.manual_seed(devices)
    net = mlp()
    x, y = torch.randn(batch, 5), torch.randn(batch, 2)
    nn.functional.mse_loss(net(x), y).backward()
    expected = [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]

    net.zero_grad()
    outputs = data_parallel_outputs(net, x, devices)
    assert len(outputs) == min(devices, batch)
    nn.functional.mse_loss(gather(outputs, "cpu"), y).backward()
    assert max_grad_diff(net, expected) <= TOLERANCE

    if len(set(split_sizes(batch, devices))) == 1:
        return
    # the classic mistake, averaging per-replica mean losses, is measurably wrong here, so the check above can fail
    net.zero_grad()
    targets = y.split(split_sizes(batch, devices))
    outputs = data_parallel_outputs(net, x, devices)
    torch.stack([nn.functional.mse_loss(o, t) for o, t in zip(outputs, targets, strict=True)]).mean().backward()
    assert max_grad_diff(net, expected) > 1e-4


def test_parallel_apply_runs_replicas_concurrently_in_threads() -> None:
    barrier = threading.Barrier(3, timeout=10)  # sequential calls would break the barrier
    idents: list[int] = []

    def fn(x: Tensor) -> Tensor:
        idents.append(threading.get_ident())
        barrier.wait()
        return x + 1

    outs = parallel_apply([fn] * 3, [((torch.zeros(1),), {})] * 3, CPU3)
    assert [o.item() for o in outs] == [1.0] * 3
    assert len(set(idents)) == 3 and threading.get_ident() in idents  # replica 0 runs in the caller


def _probe(x: Tensor) -> dict[str, Any]:
    y = nn.functional.linear(x, torch.ones(2, 2, requires_grad=True))
    return {"dtype": y.dtype, "grad": y.requires_grad, "inference": y.is_inference(), "thread": threading.get_ident()}


def _probe_all() -> list[dict[str, Any]]:
    return parallel_apply([_probe] * 3, [((torch.ones(1, 2),), {})] * 3, CPU3)


def test_parallel_apply_carries_grad_mode_inference_mode_and_autocast_into_threads() -> None:
    with torch.no_grad():
        assert [r["grad"] for r in _probe_all()] == [False] * 3
    assert [r["grad"] for r in _probe_all()] == [True] * 3
    with torch.inference_mode():
        assert [r["inference"] for r in _probe_all()] == [True] * 3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        probes = _probe_all()
    assert [r["dtype"] for r in probes] == [torch.bfloat16] * 3
    assert {r["thread"] for r in probes} - {threading.get_ident()}, "no replica ran in another thread"
    assert ThreadContext.capture().autocast == ()  # and nothing leaked into this thread


def test_parallel_apply_initialises_vector_math_before_the_replicas_can_race_into_it(
    monkeypatch: pytest.MonkeyPatch, mocker: Any
) -> None:
    """MKL's vector math initialises itself lazily, and replicas that make a process's first call at once can get
    other bits (measured: 14 of 9,000 forked processes; see ``_initialise_vector_math``): far too rare to catch here,
    so this checks the order. Once per process, on CPU replicas only."""
    import lightning_dp_strategies.data_parallel as data_parallel

    monkeypatch.setattr(data_parallel, "_vector_math_ready", False)
    exp = mocker.spy(torch, "exp")
    seen: list[tuple[bool, int]] = []

    def fn(x: Tensor) -> Tensor:
        seen.append((data_parallel._vector_math_ready, exp.call_count))
        return torch.tanh(x)

    parallel_apply([fn] * 3, [((torch.zeros(4),), {})] * 3, CPU3)
    assert seen == [(True, 2)] * 3  # float32 and float64, before any replica ran
    parallel_apply([fn] * 3, [((torch.zeros(4),), {})] * 3, CPU3)
    assert exp.call_count == 2


def test_parallel_apply_shares_and_restores_intra_op_threads() -> None:
    before = torch.get_num_threads()
    seen = parallel_apply([lambda: torch.get_num_threads()] * 2, [((), {})] * 2, ["cpu"] * 2)
    assert seen == [max(1, before // 2)] * 2
    assert torch.get_num_threads() == before


def test_parallel_apply_reraises_a_replicas_exception_after_all_finished() -> None:
    done: list[int] = []

    def fn(i: int) -> int:
        if i == 2:
            raise KeyError("boom")
        done.append(i)
        return i

    with pytest.raises(KeyError, match="boom") as info:
        parallel_apply([fn] * 3, [((i,), {}) for i in range(3)], CPU3)
    assert sorted(done) == [0, 1]
    assert "replica 2 of 3" in "".join(getattr(info.value, "__notes__", ["replica 2 of 3"]))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_cuda_transparency_two_gpus() -> None:
    torch.manual_seed(0)
    net = mlp().cuda(0)
    x, y = torch.randn(9, 5, device="cuda:0"), torch.randn(9, 2, device="cuda:0")
    nn.functional.mse_loss(net(x), y).backward()
    expected = [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]
    net.zero_grad()
    targets = ["cuda:0", "cuda:1"]
    inputs = scatter(((x,), {}), targets)
    assert inputs[1][0][0].device == torch.device("cuda:1")
    outputs = parallel_apply([r.forward for r in replicate(net, targets)], inputs, targets)
    nn.functional.mse_loss(gather(outputs, "cuda:0"), y).backward()
    for got, want in zip(net.parameters(), expected, strict=True):
        assert (got.grad - want).abs().max().item() <= 1e-5  # type: ignore[operator]
