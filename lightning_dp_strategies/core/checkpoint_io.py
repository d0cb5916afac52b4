"""Atomic checkpoint files: a crash while saving never leaves a truncated checkpoint at the target path.

Lightning's ``TorchCheckpointIO`` serialises into memory, then lets ``fsspec`` write a temporary file in the system's
temporary folder and ``shutil.move`` it onto the target. When that folder is on another file system (a ``tmpfs``
``/tmp``, a container's scratch disk), the move is a *copy into the target path*: a crash during it leaves a truncated
``last.ckpt`` behind, and nothing is ever ``fsync``-ed, so a power loss can leave an empty file. Here the bytes go to a
temporary file in the target's own folder, are flushed and ``fsync``-ed, and ``os.replace`` swaps it onto the target
in one step::

    torch.save ──▶ .last.ckpt.<random>.tmp ──flush, fsync──▶ os.replace ──▶ last.ckpt ──▶ fsync(folder)
                   (same folder as the target)                (atomic)

Readers see either the previous checkpoint or the new one, whole. Remote (``fsspec``) paths keep Lightning's own
behaviour.
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from collections.abc import Callable
from typing import IO, Any

import fsspec
import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from typing_extensions import override

from lightning_dp_strategies.core.checkpoint_files import complete_or_newest

__all__ = ["AtomicByDefault", "AtomicCheckpointIO", "atomic_write", "can_stream", "with_atomic_default"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are atomic: write a temporary file, ``fsync``, ``os.replace``.

    The default ``checkpoint_io`` of the three strategies of this package. On an exception during the save (a full
    disk, an unpicklable object, ``KeyboardInterrupt``) the temporary file is removed and the previous file at the
    target path is left as it was. A process killed outright (``SIGKILL``, power loss) may leave a hidden
    ``.<name>.<random>.tmp`` file next to the target, never a partial target; Lightning's ``ckpt_path="last"`` does not
    pick such files up. Paths with a remote protocol (``s3://``, ``gs://``, ...) are saved as
    :class:`~lightning.fabric.plugins.TorchCheckpointIO` saves them.

    Examples:
        >>> import tempfile, pathlib
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> io = AtomicCheckpointIO()
        >>> io.save_checkpoint({"step": 1}, folder / "last.ckpt")
        >>> io.save_checkpoint({"step": 2}, folder / "last.ckpt")  # replaces the file in one step
        >>> io.load_checkpoint(folder / "last.ckpt")["step"], sorted(p.name for p in folder.iterdir())
        (2, ['last.ckpt'])
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` to ``path``; on a local file system atomically (see the class docstring).

        Args:
            checkpoint: the state Lightning dumps (model, optimizers, loops, callbacks, ...).
            path: the target file; its folder is created if missing.
            storage_options: not supported (as in ``TorchCheckpointIO``); subclass to give it a meaning.

        Raises:
            TypeError: if ``storage_options`` is given.
        """
        if storage_options is not None:
            raise TypeError(
                f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by {type(self).__name__}: "
                "implement your own CheckpointIO (subclass this one) to give `storage_options` a meaning."
            )
        if fsspec.utils.get_protocol(str(path)) != "file":
            super().save_checkpoint(checkpoint, path)
            return
        atomic_write(path, lambda file: torch.save(checkpoint, file))

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load as ``TorchCheckpointIO`` does; a local file in ``torch.save``'s zip format is memory-mapped
        (``mmap=True``), so a tensor's bytes are read only when it is used: a pipeline stage reads only its own part.

        A local file that is incomplete (cut short while written or copied) is skipped with a warning for the newest
        complete ``*.ckpt`` in its folder (:func:`~.checkpoint_files.complete_or_newest`)."""
        if fsspec.utils.get_protocol(str(path)) == "file":
            local = str(complete_or_newest(fsspec.core.strip_protocol(str(path))))
            if os.path.isfile(local) and _is_zip(local):
                return torch.load(local, map_location=map_location, weights_only=weights_only, mmap=True)
            path = local
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)


def _is_zip(path: str) -> bool:
    with open(path, "rb") as file:
        return file.read(4) == b"PK\x03\x04"


def atomic_write(path: _PATH, write: Callable[[IO[bytes]], None]) -> None:
    """Call ``write(file)`` on a temporary file in ``path``'s folder, ``fsync`` it and ``os.replace`` it onto ``path``.

    On an exception the temporary file is removed and ``path`` is left as it was. ``path`` is a local path.

    Examples:
        >>> import tempfile, pathlib
        >>> target = pathlib.Path(tempfile.mkdtemp()) / "state.pt"
        >>> atomic_write(target, lambda file: torch.save({"step": 3}, file))
        >>> torch.load(target)["step"]
        3
    """
    target = os.path.abspath(fsspec.core.strip_protocol(str(path)))
    folder = os.path.dirname(target)
    os.makedirs(folder, exist_ok=True)
    temp = os.path.join(folder, f".{os.path.basename(target)}.{uuid.uuid4().hex[:12]}.tmp")
    # O_EXCL: never write into a file someone else holds; mode 0o666 lets the umask apply as for open(..., "wb")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temp)
        raise
    _fsync_folder(folder)


def can_stream(checkpoint_io: CheckpointIO, path: _PATH, storage_options: Any | None) -> bool:
    """Whether a checkpoint can be written as its tensors arrive (:func:`atomic_write` to a local path by the default
    :class:`AtomicCheckpointIO`), rather than saved whole by ``checkpoint_io``.

    Examples:
        >>> can_stream(AtomicCheckpointIO(), "last.ckpt", None), can_stream(TorchCheckpointIO(), "last.ckpt", None)
        (True, False)
        >>> can_stream(AtomicCheckpointIO(), "s3://bucket/last.ckpt", None)
        False
    """
    local = fsspec.utils.get_protocol(str(path)) == "file"
    return type(checkpoint_io) is AtomicCheckpointIO and storage_options is None and local


def _fsync_folder(folder: str) -> None:
    """Make the rename itself durable (POSIX); a no-op where folders cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems (network mounts) refuse fsync on a folder: the replace has happened regardless
    finally:
        os.close(fd)


def with_atomic_default(checkpoint_io: CheckpointIO | None) -> CheckpointIO:
    """The ``checkpoint_io`` a strategy of this package uses: the one given, else an :class:`AtomicCheckpointIO`.

    A wrapping plugin without a base (``AsyncCheckpointIO()``) gets an ``AtomicCheckpointIO`` as its base. Called by
    the strategies' ``checkpoint_io`` property, which Lightning reads when it saves or loads.

    Args:
        checkpoint_io: what the user gave (``Strategy(checkpoint_io=...)`` or ``Trainer(plugins=[...])``), if anything.

    Examples:
        >>> type(with_atomic_default(None)).__name__
        'AtomicCheckpointIO'
        >>> mine = TorchCheckpointIO()
        >>> with_atomic_default(mine) is mine
        True
    """
    if checkpoint_io is None:
        return AtomicCheckpointIO()
    # the Trainer's wrapping plugins (AsyncCheckpointIO); an instance exists only once their module is imported, so
    # looking it up in sys.modules spares the Fabric side an import of lightning.pytorch
    wrapper_module = sys.modules.get("lightning.pytorch.plugins.io.wrapper")
    wrapping = getattr(wrapper_module, "_WrappingCheckpointIO", None)
    if wrapping is not None and isinstance(checkpoint_io, wrapping):
        # the wrapper's setter fills in the base only where none was configured (Lightning's own rule)
        checkpoint_io.checkpoint_io = AtomicCheckpointIO()
    return checkpoint_io


class AtomicByDefault:
    """A strategy's ``checkpoint_io`` attribute: the one given (``_checkpoint_io``), else an
    :class:`AtomicCheckpointIO` made on first read (see :func:`with_atomic_default`); Lightning sets and reads it as
    it does its own strategies' property.

    Examples:
        >>> class Strategy:
        ...     checkpoint_io = AtomicByDefault()
        ...     _checkpoint_io = None
        >>> type(Strategy().checkpoint_io).__name__
        'AtomicCheckpointIO'
    """

    def __get__(self, obj: Any, owner: type) -> Any:
        if obj is None:
            return self
        obj._checkpoint_io = with_atomic_default(obj._checkpoint_io)
        return obj._checkpoint_io

    def __set__(self, obj: Any, io: CheckpointIO) -> None:
        obj._checkpoint_io = io
