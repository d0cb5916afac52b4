"""A module path of an earlier release: importing it warns and forwards to the module's new home (the paths and
their new homes: ``MOVED`` in :mod:`lightning_dp_strategies.core.registry`)."""

from lightning_dp_strategies.core.registry import forward_moved

forward_moved(__name__)
