"""Keep a full garbage collection from stopping a rank's heartbeat for longer than ``stale_s``.

CPython's garbage collector holds the GIL while it runs, and a collection of the oldest generation traverses every
object the collector tracks. A training process holds a few hundred thousand of them once torch and Lightning are
imported: a fraction of a second of CPU for each such collection, and seconds of wall time on a host whose cores are
shared by more processes than it has. No thread runs meanwhile, the heartbeat thread included, so the other ranks
can take a live rank for gone.

:func:`freeze_heap` moves the objects alive when the first heartbeat starts into the collector's permanent generation
(:func:`gc.freeze`), which no collection traverses; objects made later are collected as before, so a full collection
takes milliseconds. :func:`thaw_heap` moves them back (:func:`gc.unfreeze`) when the last heartbeat stops. While they
are frozen, a reference cycle among them that becomes garbage stays in memory until the thaw (objects freed by their
reference count are freed at once, as always).

A heap that something else froze after this module was imported is left as it is: its owner manages the collector,
and a thaw here would undo its freeze. What the interpreter freezes itself at start (Python 3.12 freezes a few hundred
objects of its own) is frozen and thawed with the rest.
"""

from __future__ import annotations

import gc
import threading

__all__ = ["freeze_heap", "thaw_heap"]

_AT_IMPORT = gc.get_freeze_count()  # what was frozen before this module: the interpreter's own
_lock = threading.Lock()
_holders = 0
_froze = False  # whether this module froze the heap the holders share


def freeze_heap() -> bool:
    """Hold the heap frozen: the first holder collects the young generations, then freezes every tracked object,
    unless something else froze the heap since this module was imported. Whether this module froze it.

    Examples:
        >>> frozen = freeze_heap()
        >>> gc.get_freeze_count() > 1000 or not frozen
        True
        >>> thaw_heap()
        >>> gc.get_freeze_count() == 0 or not frozen
        True
    """
    global _holders, _froze
    with _lock:
        if _holders == 0:
            _froze = gc.get_freeze_count() <= _AT_IMPORT
            if _froze:
                gc.collect(1)  # the young garbage is freed, not frozen (a full collection would be the very pause)
                gc.freeze()
        _holders += 1
        return _froze


def thaw_heap() -> None:
    """Give up one hold; the last one thaws the heap where :func:`freeze_heap` froze it (a call without a hold does
    nothing)."""
    global _holders, _froze
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0 and _froze:
            gc.unfreeze()
            _froze = False
