"""The comparison's fixed choices, importable without torch (the command's parser uses them)."""

from __future__ import annotations

__all__ = ["DEMO_GLOBAL_BATCH", "PRECISIONS"]

PRECISIONS = ("32-true", "64-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed")
"""The ``precision`` values the comparison passes to the Trainer (the command's choices, and ``compare()``'s)."""
DEMO_GLOBAL_BATCH = 64
"""``DemoConfig().global_batch``, here without importing the demo (and torch)."""
