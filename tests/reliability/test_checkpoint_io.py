"""AtomicCheckpointIO: a crash while saving never leaves a truncated checkpoint at the target path.

The crashes are made deterministic: ``torch.save`` writes part of the checkpoint and then raises (an exception: the
temporary file must be removed) or signals and waits to be killed with SIGKILL (no cleanup code runs at all). Either
way the previous ``last.ckpt`` must load with its old contents, and nothing but a hidden ``.last.ckpt.*.tmp`` file may
exist besides it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO

import lightning_dp_strategies
from lightning_dp_strategies.core import checkpoint_io as module
from lightning_dp_strategies.core.checkpoint_io import AtomicCheckpointIO, with_atomic_default
from tests.helpers.distributed import REPO_ROOT

OLD = {"step": 1, "weights": torch.arange(1000.0)}
NEW = {"step": 2, "weights": torch.ones(100_000)}


def write_then_fail(exc: BaseException) -> Any:
    """A ``torch.save`` that writes the first 100 bytes of the real checkpoint to the file, then raises ``exc``."""
    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        import io

        buffer = io.BytesIO()
        real_save(obj, buffer)
        f.write(buffer.getvalue()[:100])
        f.flush()
        raise exc

    return save


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_save_load_and_overwrite_leave_only_the_target(tmp_path: Path) -> None:
    io = AtomicCheckpointIO()
    target = tmp_path / "sub" / "last.ckpt"  # the folder is created
    io.save_checkpoint(OLD, target)
    io.save_checkpoint(NEW, target)
    assert torch.equal(io.load_checkpoint(target)["weights"], NEW["weights"])
    assert files(target.parent) == ["last.ckpt"]


@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"), KeyboardInterrupt()], ids=["ENOSPC", "Ctrl-C"])
def test_an_exception_mid_write_keeps_the_previous_checkpoint_and_removes_the_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: BaseException
) -> None:
    io = AtomicCheckpointIO()
    target = tmp_path / "last.ckpt"
    io.save_checkpoint(OLD, target)
    monkeypatch.setattr(module.torch, "save", write_then_fail(exc))
    with pytest.raises(type(exc)):
        io.save_checkpoint(NEW, target)
    monkeypatch.undo()
    assert files(tmp_path) == ["last.ckpt"]  # no partial file, no temporary file
    loaded = io.load_checkpoint(target)
    assert loaded["step"] == 1 and torch.equal(loaded["weights"], OLD["weights"])


def test_a_failing_rename_removes_the_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    io = AtomicCheckpointIO()
    monkeypatch.setattr(module.os, "replace", lambda *_: (_ for _ in ()).throw(PermissionError("read-only")))
    with pytest.raises(PermissionError):
        io.save_checkpoint(NEW, tmp_path / "last.ckpt")
    assert files(tmp_path) == []


KILLED_MID_SAVE = """
import sys, time, torch
from lightning_dp_strategies.core.checkpoint_io import AtomicCheckpointIO
target, marker = sys.argv[1], sys.argv[2]
real_save = torch.save

def save(obj, f, *args, **kwargs):  # write half of a real checkpoint, tell the test, wait for SIGKILL
    import io
    buffer = io.BytesIO()
    real_save(obj, buffer)
    data = buffer.getvalue()
    f.write(data[: len(data) // 2])
    f.flush()
    open(marker, "w").close()
    time.sleep(60)

torch.save = save
AtomicCheckpointIO().save_checkpoint({"step": 2, "weights": torch.ones(2_000_000)}, target)
"""


@pytest.mark.timeout(120)
def test_a_process_killed_mid_save_leaves_the_previous_checkpoint_whole(tmp_path: Path) -> None:
    """SIGKILL: no cleanup runs; the target is still the old file, the half-written bytes only in a hidden .tmp."""
    folder = tmp_path / "ckpts"
    target, marker = folder / "last.ckpt", tmp_path / "writing"
    AtomicCheckpointIO().save_checkpoint(OLD, target)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_MID_SAVE, str(target), str(marker)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, f"the saving process exited early with {proc.returncode}"
            assert time.monotonic() < deadline, "the saving process never started writing"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    loaded = torch.load(target)
    assert loaded["step"] == 1 and torch.equal(loaded["weights"], OLD["weights"])
    leftovers = [name for name in files(folder) if name != "last.ckpt"]
    assert len(leftovers) == 1 and leftovers[0].startswith(".last.ckpt.") and leftovers[0].endswith(".tmp")
    assert (folder / leftovers[0]).stat().st_size > 0  # it was killed mid-write, not before


def test_the_file_and_its_folder_are_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(module.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    AtomicCheckpointIO().save_checkpoint(OLD, tmp_path / "last.ckpt")
    assert len(synced) == (2 if os.name == "posix" else 1)  # the temporary file, then the folder


def test_permissions_follow_the_umask_like_a_plain_open(tmp_path: Path) -> None:
    AtomicCheckpointIO().save_checkpoint(OLD, tmp_path / "last.ckpt")
    (tmp_path / "plain").write_bytes(b"")
    assert (tmp_path / "last.ckpt").stat().st_mode == (tmp_path / "plain").stat().st_mode


def test_file_urls_are_local_and_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    replaced: list[tuple[str, str]] = []
    real_replace = os.replace
    monkeypatch.setattr(module.os, "replace", lambda a, b: (replaced.append((a, b)), real_replace(a, b))[1])
    AtomicCheckpointIO().save_checkpoint(OLD, f"file://{tmp_path}/last.ckpt")
    assert [Path(b) for _, b in replaced] == [tmp_path / "last.ckpt"]
    assert torch.load(tmp_path / "last.ckpt")["step"] == 1


def test_remote_paths_fall_back_to_lightnings_save(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(module.os, "replace", lambda *_: pytest.fail("a remote path must not take the local path"))
    io = AtomicCheckpointIO()
    io.save_checkpoint(OLD, "memory://ckpts/last.ckpt")
    assert io.load_checkpoint("memory://ckpts/last.ckpt")["step"] == 1
    io.remove_checkpoint("memory://ckpts/last.ckpt")


def test_storage_options_are_refused_as_by_torch_checkpoint_io(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="storage_options"):
        AtomicCheckpointIO().save_checkpoint(OLD, tmp_path / "last.ckpt", storage_options={"x": 1})
    assert files(tmp_path) == []


@pytest.mark.parametrize(("strategy", "devices"), [("dp", 2), ("ring_allreduce", 2), ("hybrid_pipeline", 2)])
def test_atomic_is_the_default_of_every_strategy_and_yields_to_the_users_choice(strategy: str, devices: int) -> None:
    def trainer(**kwargs: Any) -> L.Trainer:
        return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False, **kwargs)

    assert type(trainer().strategy.checkpoint_io) is AtomicCheckpointIO
    mine = TorchCheckpointIO()
    assert trainer(plugins=[mine]).strategy.checkpoint_io is mine
    wrapping = trainer(plugins=[AsyncCheckpointIO()]).strategy.checkpoint_io
    assert isinstance(wrapping, AsyncCheckpointIO) and type(wrapping.checkpoint_io) is AtomicCheckpointIO
    assert lightning_dp_strategies.ScatterGatherStrategy(checkpoint_io=mine).checkpoint_io is mine


def test_with_atomic_default_keeps_a_configured_wrapper_base() -> None:
    base = TorchCheckpointIO()
    wrapper = AsyncCheckpointIO(base)
    assert with_atomic_default(wrapper) is wrapper and wrapper.checkpoint_io is base


def test_a_local_checkpoint_is_memory_mapped_and_a_legacy_one_still_loads(tmp_path: Path, mocker: Any) -> None:
    """A zip-format file is loaded with ``mmap=True`` (a tensor's bytes are read from the file when used); the legacy
    format, which cannot be mapped, loads as before."""
    io = AtomicCheckpointIO()
    io.save_checkpoint(OLD, tmp_path / "new.ckpt")
    torch.save(OLD, tmp_path / "legacy.ckpt", _use_new_zipfile_serialization=False)
    load = mocker.spy(torch, "load")
    assert torch.equal(io.load_checkpoint(tmp_path / "new.ckpt")["weights"], OLD["weights"])
    assert load.call_args.kwargs.get("mmap") is True
    assert torch.equal(io.load_checkpoint(tmp_path / "legacy.ckpt")["weights"], OLD["weights"])
    assert not load.call_args.kwargs.get("mmap")
