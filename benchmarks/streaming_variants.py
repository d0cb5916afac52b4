"""Streaming DiLoCo's merge knobs as strategy names the comparison command can run
(``lightning-dp-strategies compare --import streaming_variants``, from this folder).

``"streaming_diloco"`` chooses its period from timings; these fix the period it chooses on a slow link (4 fragments,
one leaving a step, int4) so that a stored run repeats, and turn one knob each:

    streaming_delay_1      the average applied one inner step after it leaves, replacing the fragment's parameters
                           (the inner step taken meanwhile is dropped from that fragment), as "streaming_diloco" does
    streaming_delay_0      the average applied at once (the loop waits for it): nothing dropped
    streaming_mixing_half  one step late, the new values mixed half and half with the parameters the rank holds then
"""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from lightning_dp_strategies import LocalSGDStrategy

FIXED = {"sync_every": 4, "fragments": 4, "outer_precision": "int4"}

VARIANTS: dict[str, dict[str, object]] = {
    "streaming_delay_1": {**FIXED, "delay": 1},
    "streaming_delay_0": {**FIXED, "delay": 0},
    "streaming_mixing_half": {**FIXED, "delay": 1, "mixing": 0.5},
}
"""Each name's ``LocalSGDStrategy`` options."""

for _name, _options in VARIANTS.items():
    StrategyRegistry.register(_name, LocalSGDStrategy, description=f"LocalSGDStrategy(**{_options})", **_options)
