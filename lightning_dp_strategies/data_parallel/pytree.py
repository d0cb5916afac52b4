"""The walk through nested containers (tuples, lists, dicts, named tuples, dataclasses) that scatter and gather share.

A container is taken apart with :func:`_children` (``(path suffix, child)`` pairs; the suffixes name a tensor in error
messages, e.g. ``inputs['x'][1]``) and put back together, of the same type, with :func:`_rebuild`.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from torch import Tensor


def _is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _is_dataclass_instance(obj: object) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _children(obj: Any) -> list[tuple[str, Any]] | None:
    """``(path suffix, child)`` pairs of a container this module recurses into, or ``None`` for a leaf."""
    if isinstance(obj, Tensor):
        return None
    if _is_namedtuple(obj):
        return [(f".{name}", value) for name, value in zip(obj._fields, obj, strict=True)]
    if isinstance(obj, (tuple, list)):
        return [(f"[{i}]", value) for i, value in enumerate(obj)]
    if isinstance(obj, dict):
        return [(f"[{key!r}]", value) for key, value in obj.items()]
    if _is_dataclass_instance(obj):
        return [(f".{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj) if hasattr(obj, f.name)]
    return None


def _rebuild(obj: Any, values: list[Any]) -> Any:
    """A container of the same type as ``obj`` holding ``values`` (in the order of :func:`_children`)."""
    if _is_namedtuple(obj):
        return type(obj)(*values)
    if isinstance(obj, (tuple, list)):
        return type(obj)(values)
    if isinstance(obj, dict):
        pairs = list(zip(obj.keys(), values, strict=True))
        if isinstance(obj, defaultdict):
            return type(obj)(obj.default_factory, pairs)
        return type(obj)(pairs)
    # dataclass: a shallow copy with the fields replaced (no __init__/__post_init__ rerun; frozen ones too)
    new = copy.copy(obj)
    names = [f.name for f in dataclasses.fields(obj) if hasattr(obj, f.name)]
    for name, value in zip(names, values, strict=True):
        object.__setattr__(new, name, value)
    return new


def _tensors(obj: Any, path: str) -> Iterator[tuple[str, Tensor]]:
    if isinstance(obj, Tensor):
        yield path, obj
        return
    for suffix, child in _children(obj) or []:
        yield from _tensors(child, path + suffix)
