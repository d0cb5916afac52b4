"""Which checkpoint to resume from: only complete files, the newest first, an incomplete one skipped with a warning.

``torch.save`` writes a zip archive whose central directory - the list of every record and where it lies - comes
last, after the last tensor's bytes. A ``pipeline_stages`` checkpoint of ``hybrid_pipeline`` is one such archive,
written by rank 0 while the other stages stream their tensors to it, so its central directory is the marker that
every stage's part arrived. A file cut short anywhere (a copy that stopped, a save by a ``CheckpointIO`` that writes in
place, a file system that lost the tail) has none, or one that points past the end of the file::

    [record data.pkl][record data/0] ... [record data/N] [central directory] [end record]
    |<-------------- every part written ------------->|  |<- written last: "complete" ->|

The strategies' own saves (:class:`~.checkpoint_io.AtomicCheckpointIO`) never leave such a file at the target; the
check guards against files that came another way.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.types import _PATH

__all__ = ["complete_or_newest", "is_complete_checkpoint", "latest_checkpoint"]

_ZIP_MAGIC = b"PK\x03\x04"


def is_complete_checkpoint(path: _PATH) -> bool:
    """Whether the local file ``path`` holds a whole checkpoint.

    A ``torch.save`` zip archive is complete when its central directory reads and every record lies inside the file.
    A non-empty file in another format (``torch.save(..., _use_new_zipfile_serialization=False)``) counts as complete:
    it cannot be checked without reading it all.

    Examples:
        >>> import io, tempfile, torch
        >>> buffer = io.BytesIO(); torch.save({"w": torch.ones(100)}, buffer)
        >>> whole, cut = (tempfile.NamedTemporaryFile(delete=False, suffix=".ckpt") for _ in range(2))
        >>> _ = whole.write(buffer.getvalue()); _ = cut.write(buffer.getvalue()[:-200])
        >>> whole.close(); cut.close()
        >>> is_complete_checkpoint(whole.name), is_complete_checkpoint(cut.name)
        (True, False)
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as file:
            magic = file.read(len(_ZIP_MAGIC))
        if magic != _ZIP_MAGIC:
            return size > 0
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
    except (OSError, ValueError, zipfile.BadZipFile):
        return False
    return bool(records) and all(r.header_offset + r.compress_size <= size for r in records)


def latest_checkpoint(folder: _PATH, pattern: str = "*.ckpt") -> Path | None:
    """The newest complete checkpoint in ``folder`` whose name matches ``pattern``, or ``None`` (a fresh start).

    Hidden files (the temporary files of unfinished atomic saves) are never taken; an incomplete file is skipped
    with a warning. The Fabric side of the restart recipe::

        last = latest_checkpoint("checkpoints/")
        if last is not None:
            fabric.load(last, state)

    Examples:
        >>> import tempfile, torch
        >>> folder = Path(tempfile.mkdtemp())
        >>> latest_checkpoint(folder) is None
        True
        >>> torch.save({"epoch": 1}, folder / "last.ckpt")
        >>> latest_checkpoint(folder).name
        'last.ckpt'
    """
    root = Path(folder)
    if not root.is_dir():
        return None
    found = [p for p in root.glob(pattern) if p.is_file() and not p.name.startswith(".")]
    for path in sorted(found, key=lambda p: p.stat().st_mtime, reverse=True):
        if is_complete_checkpoint(path):
            return path
        rank_zero_warn(f"Skipping the checkpoint {str(path)!r}: it is incomplete (cut short while written or copied).")
    return None


def complete_or_newest(path: _PATH) -> Path:
    """``path`` if it is complete (or not a file); else, with a warning, the newest complete ``*.ckpt`` beside it.

    Raises:
        RuntimeError: if ``path`` is incomplete and no complete checkpoint lies in its folder.

    Examples:
        >>> import tempfile, torch, warnings
        >>> folder = Path(tempfile.mkdtemp())
        >>> torch.save({"epoch": 0}, folder / "epoch=0.ckpt")
        >>> _ = (folder / "last.ckpt").write_bytes((folder / "epoch=0.ckpt").read_bytes()[:-30])
        >>> with warnings.catch_warnings(record=True):
        ...     complete_or_newest(folder / "last.ckpt").name
        'epoch=0.ckpt'
    """
    target = Path(path)
    if not target.is_file() or is_complete_checkpoint(target):
        return target
    others = [p for p in target.parent.glob("*.ckpt") if p != target]
    newest = max(
        (p for p in others if p.is_file() and not p.name.startswith(".") and is_complete_checkpoint(p)),
        key=lambda p: p.stat().st_mtime,
        default=None,
    )
    if newest is None:
        raise RuntimeError(
            f"The checkpoint {str(target)!r} is incomplete (cut short while written or copied) and its folder holds "
            "no complete `*.ckpt` to fall back on. Resume from another checkpoint, or start without `ckpt_path`."
        )
    rank_zero_warn(
        f"Skipping the checkpoint {str(target)!r}: it is incomplete (cut short while written or copied). Loading "
        f"{str(newest)!r}, the newest complete checkpoint beside it, instead."
    )
    return newest
