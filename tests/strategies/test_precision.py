"""GlobalNormClipping: Lightning's precision plugin held and forwarded, clipping by norm replaced, checkpoint state kept
under the plugin's own class name."""

from __future__ import annotations

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType

from lightning_dp_strategies.strategies.precision import (
    GlobalNormClipping,
    checkpoint_key,
    readable_by_wrapper,
    stored_under_plugin_name,
)


def scaled_plugin() -> MixedPrecision:
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))  # the scale exists from the first use, as in training
    return MixedPrecision("16-mixed", "cpu", scaler=scaler)


def test_the_wrapper_forwards_the_plugins_interface_and_state() -> None:
    plugin = scaled_plugin()
    wrapped = GlobalNormClipping(plugin, lambda optimizer, value: None)
    assert wrapped.precision == "16-mixed" and wrapped.scaler is plugin.scaler
    assert wrapped.state_dict() == plugin.state_dict() and wrapped.state_dict()["scale"] == 8.0
    with wrapped.forward_context():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
    wrapped.load_state_dict({**plugin.state_dict(), "scale": 2.0})
    assert plugin.scaler.get_scale() == 2.0  # loading reaches the plugin's own scaler


def test_clipping_by_norm_goes_to_the_strategy_and_by_value_to_the_plugin() -> None:
    calls: list[float] = []
    wrapped = GlobalNormClipping(Precision(), lambda optimizer, value: calls.append(value))
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.tensor([5.0, -5.0, 0.5])
    optimizer = torch.optim.SGD([param], lr=0.1)
    wrapped.clip_gradients(optimizer, 0.5, GradClipAlgorithmType.NORM)
    assert calls == [0.5] and param.grad.tolist() == [5.0, -5.0, 0.5]  # the plugin did not clip it locally
    wrapped.clip_gradients(optimizer, 1.0, GradClipAlgorithmType.VALUE)
    assert calls == [0.5] and param.grad.tolist() == [1.0, -1.0, 0.5]


def test_the_checkpoint_entry_keeps_the_plugins_own_name_both_ways() -> None:
    plugin = scaled_plugin()
    wrapped = GlobalNormClipping(plugin, lambda optimizer, value: None)
    assert checkpoint_key(wrapped) == checkpoint_key(plugin) == "MixedPrecision"
    # Lightning stores the state under the class name of the plugin it is handed: the wrapper's
    dumped = {"epoch": 1, type(wrapped).__qualname__: wrapped.state_dict()}
    saved = stored_under_plugin_name(dumped, wrapped)
    assert "GlobalNormClipping" not in saved and saved["MixedPrecision"]["scale"] == 8.0
    # a run that hands Lightning the wrapper looks the state up under the wrapper's name
    loaded = readable_by_wrapper(dict(saved), plugin)
    assert loaded["GlobalNormClipping"] is loaded["MixedPrecision"]
