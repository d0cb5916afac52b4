"""Which checkpoint to resume from: an incomplete file is recognised, skipped with a warning, never loaded."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch

from lightning_dp_strategies.core.checkpoint_files import complete_or_newest, is_complete_checkpoint, latest_checkpoint
from lightning_dp_strategies.core.checkpoint_io import AtomicCheckpointIO


def saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def write(path: Path, data: bytes, mtime: float) -> Path:
    path.write_bytes(data)
    os.utime(path, (mtime, mtime))
    return path


@pytest.mark.parametrize("cut", [1, 100, 1000, 4000], ids=lambda cut: f"last-{cut}-bytes-missing")
def test_a_file_cut_short_anywhere_is_incomplete(tmp_path: Path, cut: int) -> None:
    data = saved({"w": torch.ones(2000)})
    assert is_complete_checkpoint(write(tmp_path / "whole.ckpt", data, 1))
    assert not is_complete_checkpoint(write(tmp_path / "cut.ckpt", data[:-cut], 1))


def test_empty_missing_and_legacy_files(tmp_path: Path) -> None:
    assert not is_complete_checkpoint(write(tmp_path / "empty.ckpt", b"", 1))
    assert not is_complete_checkpoint(tmp_path / "missing.ckpt")
    legacy = io.BytesIO()
    torch.save({"w": torch.ones(3)}, legacy, _use_new_zipfile_serialization=False)
    assert is_complete_checkpoint(write(tmp_path / "legacy.ckpt", legacy.getvalue(), 1))


def test_the_newest_complete_checkpoint_is_found_and_an_incomplete_one_skipped(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "nothing-yet") is None
    write(tmp_path / "epoch=0.ckpt", saved({"epoch": 0}), 1)
    write(tmp_path / "epoch=1.ckpt", saved({"epoch": 1}), 2)
    write(tmp_path / ".last.ckpt.0a1b2c.tmp", saved({"epoch": 3}), 4)  # an unfinished atomic save: never taken
    write(tmp_path / "last.ckpt", saved({"epoch": 2})[:-50], 3)
    with pytest.warns(UserWarning, match="last.ckpt.*incomplete"):
        found = latest_checkpoint(tmp_path)
    assert found == tmp_path / "epoch=1.ckpt"


def test_the_loader_falls_back_to_the_newest_complete_checkpoint_with_a_warning(tmp_path: Path) -> None:
    write(tmp_path / "epoch=0.ckpt", saved({"epoch": 0}), 1)
    last = write(tmp_path / "last.ckpt", saved({"epoch": 1})[:-50], 2)
    with pytest.warns(UserWarning, match="Loading .*epoch=0.ckpt"):
        assert AtomicCheckpointIO().load_checkpoint(last)["epoch"] == 0
    assert complete_or_newest(tmp_path / "epoch=0.ckpt") == tmp_path / "epoch=0.ckpt"


def test_an_incomplete_checkpoint_with_nothing_to_fall_back_on_names_the_fix(tmp_path: Path) -> None:
    last = write(tmp_path / "last.ckpt", saved({"epoch": 1})[:-50], 2)
    with pytest.raises(RuntimeError, match=r"incomplete.*start without `ckpt_path`"):
        AtomicCheckpointIO().load_checkpoint(last)
