"""The declared reducer contract: ``ReducerBase``'s optional steps, the wrapper that hands them on, the adapter of
plain callables, and the buckets and gradient sync reading the steps through it."""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.futures import Future

from lightning_dp_strategies.bucketing import GradientBuckets
from lightning_dp_strategies.bucketing.sync import GradientSync
from lightning_dp_strategies.comm.failures import PEER_FAILURE_HINT
from lightning_dp_strategies.reducers import (
    AutoReducer,
    CallableReducer,
    CommHookReducer,
    GradBucket,
    NativeReducer,
    PerTensorReducer,
    PowerSGD,
    ReducerBase,
    ReducerWrapper,
    RingReducer,
    ScatterReducer,
    StepTiming,
    TwoLevelReducer,
    as_reducer,
    bf16_compress,
    close_reducer,
    completed,
    setup_reducer,
)

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_dp_strategies"
TIMING = StepTiming(interval=0.1, backward=0.05, exposed=0.01)


class Recording(ReducerBase):
    """Records every optional step it is given; its properties are the opposite of the defaults."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, bucket: GradBucket) -> Future[Any]:
        self.calls.append(("call", bucket.index))
        return completed(bucket.buffer)

    def setup(self, group: dist.ProcessGroup | None, ranks: Sequence[int], backend: str | None = None) -> None:
        self.calls.append(("setup", group, list(ranks), backend))

    def close(self) -> None:
        self.calls.append(("close",))

    def observe_step(self, timing: StepTiming) -> None:
        self.calls.append(("observe_step", timing))

    @property
    def hands_raw_gradients(self) -> bool:
        return True

    @property
    def scatters(self) -> bool:
        return True

    @property
    def failure_hint(self) -> str:
        return "the recording reducer failed"


def test_every_built_in_reducer_declares_the_contract() -> None:
    built_ins: list[ReducerBase] = [
        RingReducer(),
        NativeReducer(),
        PerTensorReducer(),
        ScatterReducer(),
        bf16_compress("native"),
        PowerSGD("native"),
        TwoLevelReducer(per_node=1),
        AutoReducer(),
        CommHookReducer(default_hooks.allreduce_hook),
    ]
    for reducer in built_ins:
        assert isinstance(reducer, ReducerBase) and as_reducer(reducer) is reducer, type(reducer).__name__
        raw, scatters = isinstance(reducer, CommHookReducer), isinstance(reducer, ScatterReducer)
        assert (reducer.hands_raw_gradients, reducer.scatters) == (raw, scatters), type(reducer).__name__
        reducer.observe_step(TIMING)  # AutoReducer before its setup ignores it, as the others always do
        reducer.close()
    assert RingReducer().failure_hint == PEER_FAILURE_HINT
    assert "communication hook" in CommHookReducer(default_hooks.allreduce_hook).failure_hint


def test_a_plain_function_is_adapted_with_the_default_steps() -> None:
    def doubling(bucket: GradBucket) -> Future[Tensor]:
        return completed(bucket.buffer.mul_(2))

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a plain callable declares nothing and is not warned about
        adapted = as_reducer(doubling)
        setup_reducer(doubling, None, ranks=[0])
        close_reducer(doubling)
    assert isinstance(adapted, CallableReducer) and adapted.fn is doubling
    assert (adapted.hands_raw_gradients, adapted.scatters, adapted.failure_hint) == (False, False, PEER_FAILURE_HINT)
    adapted.setup(None, [0]), adapted.observe_step(TIMING), adapted.close()  # the defaults: nothing happens
    assert adapted(GradBucket(torch.ones(2))).wait().tolist() == [2.0, 2.0]
    with pytest.raises(TypeError, match="ReducerBase subclass or a callable"):
        as_reducer(42)  # type: ignore[arg-type]


def test_a_bare_function_reduces_the_buckets() -> None:
    model = torch.nn.Linear(3, 2)
    buckets = GradientBuckets(model.named_parameters(), reducer=lambda bucket: completed(bucket.buffer))
    buckets.arm()
    model(torch.ones(4, 3)).sum().backward()
    buckets.finish()
    buckets.close()
    assert model.weight.grad is not None and model.weight.grad.tolist() == [[4.0] * 3] * 2


@pytest.mark.parametrize(
    "wrap",
    [ReducerWrapper, bf16_compress, lambda inner: PowerSGD(inner, rank=1)],
    ids=["ReducerWrapper", "bf16_compress", "PowerSGD"],
)
def test_a_wrapper_hands_every_optional_step_to_the_wrapped_reducer(wrap: Any) -> None:
    inner = Recording()
    wrapper = wrap(inner)
    assert isinstance(wrapper, ReducerWrapper) and wrapper.inner is inner
    setup_reducer(wrapper, "group", ranks=[0, 1], backend="gloo")  # type: ignore[arg-type]  # any key will do
    wrapper.observe_step(TIMING)
    assert (wrapper.hands_raw_gradients, wrapper.scatters) == (True, True)
    assert wrapper.failure_hint == "the recording reducer failed"
    close_reducer(wrapper)
    assert inner.calls == [("setup", "group", [0, 1], "gloo"), ("observe_step", TIMING), ("close",)]


def test_an_undeclared_step_still_runs_with_a_deprecation_warning() -> None:
    seen: list[tuple[Any, ...]] = []

    class Undeclared:  # the optional steps as plain attributes, written before ReducerBase
        scatters = True

        def __call__(self, bucket: GradBucket) -> Future[Tensor]:
            return completed(bucket.buffer)

        def setup(self, group: object, ranks: list[int], backend: str | None) -> None:
            seen.append(("setup", ranks))

        def close(self) -> None:
            seen.append(("close",))

    reducer = Undeclared()
    with pytest.warns(DeprecationWarning, match="Undeclared has setup, close, scatters without subclassing"):
        setup_reducer(reducer, None, ranks=[0])
    with pytest.warns(DeprecationWarning):
        close_reducer(reducer)
    with pytest.warns(DeprecationWarning):
        assert as_reducer(reducer).scatters and not as_reducer(reducer).hands_raw_gradients
    assert seen == [("setup", [0]), ("close",)]


def test_the_buckets_take_the_declared_properties() -> None:
    class Scattering(ReducerBase):
        def __call__(self, bucket: GradBucket) -> Future[Tensor]:
            return completed(bucket.buffer)

        @property
        def scatters(self) -> bool:
            return True

    model = torch.nn.Linear(3, 2)
    buckets = GradientBuckets(model.named_parameters(), reducer=ReducerWrapper(Scattering()))
    buckets.arm()
    model(torch.ones(4, 3)).sum().backward()
    buckets.finish()
    buckets.close()
    assert model.weight.grad is None and model.bias.grad is None  # only this rank's chunk: the optimizer's to take


def test_a_failed_bucket_names_the_reducers_failure_hint() -> None:
    class Failing(Recording):
        def __call__(self, bucket: GradBucket) -> Future[Any]:
            future: Future[Any] = Future()
            future.set_exception(ValueError("lost"))
            return future

        @property
        def hands_raw_gradients(self) -> bool:
            return False

        @property
        def scatters(self) -> bool:
            return False

    model = torch.nn.Linear(3, 2)
    buckets = GradientBuckets(model.named_parameters(), reducer=Failing())
    buckets.arm()
    model(torch.ones(4, 3)).sum().backward()
    with pytest.raises(RuntimeError, match="ValueError: lost\nthe recording reducer failed"):
        buckets.finish()
    buckets.close()


def test_the_gradient_sync_tells_a_plain_callable_nothing_and_a_declared_reducer_each_step() -> None:
    sync = GradientSync()
    sync.reducer = lambda bucket: completed(bucket.buffer)
    sync.record_step()
    sync.record_step()  # the adapted callable's observe_step does nothing
    recording = Recording()
    sync.reducer = ReducerWrapper(recording)
    sync.record_step()
    assert [call[0] for call in recording.calls] == ["observe_step"]


def test_no_capability_is_looked_up_by_name() -> None:
    """The consumers call the declared steps; only the adapter of undeclared objects reads attributes by name."""
    steps = "setup|close|observe_step|hands_raw_gradients|scatters|failure_hint"
    lookup = re.compile(rf"(getattr|hasattr)\([^)]*[\"']({steps})[\"']")
    found = [
        f"{path.relative_to(PACKAGE)}: {match.group(0)}"
        for folder in ("reducers", "bucketing")
        for path in sorted((PACKAGE / folder).glob("*.py"))
        for match in lookup.finditer(path.read_text())
    ]
    assert not found, found
