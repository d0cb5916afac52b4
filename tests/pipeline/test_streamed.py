"""The streamed checkpoint writer: the file is what torch.save writes, the stand-ins filled in as tensors arrive."""

from __future__ import annotations

import io
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_dp_strategies.pipeline.streamed import Inbox, Outbox, write_streamed


def owner_and_writer() -> tuple[dict[str, Any], dict[str, Any], Inbox, list[Tensor]]:
    """Rank 2 owns a state and an optimizer state; the writer's checkpoint holds its own tensors and stand-ins."""
    torch.manual_seed(0)
    remote_state = {"body.1.weight": torch.randn(3, 4), "body.1.bias": torch.randn(3).bfloat16()}
    remote_optimizer = {"state": {"body.1.weight": {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 4)}}}
    outbox, inbox = Outbox(), Inbox()
    state = inbox.adopt(outbox.describe(remote_state), 2)
    optimizer = inbox.adopt(outbox.describe(remote_optimizer), 2)
    own = torch.randn(5, 5)
    checkpoint = {
        "state_dict": OrderedDict([("body.0.weight", own), ("body.0.row", own[1]), *state.items()]),
        "optimizer": optimizer,
        "epoch": 3,
        "buffer": torch.arange(3),
    }
    expected = {
        "state_dict": OrderedDict([("body.0.weight", own), ("body.0.row", own[1]), *remote_state.items()]),
        "optimizer": remote_optimizer,
        "epoch": 3,
        "buffer": torch.arange(3),
    }
    return checkpoint, expected, inbox, list(outbox.tensors)


def assert_same(got: Any, want: Any) -> None:
    if isinstance(want, Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            assert_same(got[key], want[key])
    else:
        assert got == want


@pytest.mark.parametrize("mmap", [False, True])
def test_the_file_loads_as_what_torch_save_writes_for_the_real_tensors(tmp_path: Path, mmap: bool) -> None:
    checkpoint, expected, inbox, sent = owner_and_writer()
    arrived: list[tuple[int, tuple[int, ...]]] = []
    buffers: set[int] = set()

    def receive(src: int, buffer: Tensor) -> None:
        arrived.append((src, tuple(buffer.shape)))
        buffers.add(buffer.untyped_storage().data_ptr())
        buffer.copy_(sent.pop(0))

    with open(tmp_path / "streamed.ckpt", "wb") as file:
        write_streamed(checkpoint, file, inbox, receive)
    assert arrived == [(2, (3, 4)), (2, (3,)), (2, ()), (2, (3, 4))]  # one tensor at a time, in the owner's order
    assert len(buffers) == 1  # each arrives in the same buffer: the writer allocates nothing a tensor
    loaded = torch.load(tmp_path / "streamed.ckpt", weights_only=True, mmap=mmap)
    assert_same(loaded, expected)
    row, weight = loaded["state_dict"]["body.0.row"], loaded["state_dict"]["body.0.weight"]
    assert row.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()  # a view stays a view
    reference = io.BytesIO()
    torch.save(expected, reference)
    assert (tmp_path / "streamed.ckpt").stat().st_size == pytest.approx(len(reference.getvalue()), rel=0.05)


def test_a_meta_tensor_no_rank_fills_in_is_refused_and_every_sender_is_still_received(tmp_path: Path) -> None:
    checkpoint, _, inbox, sent = owner_and_writer()
    checkpoint["state_dict"]["body.9.weight"] = torch.empty(2, 2, device="meta")  # e.g. made in on_save_checkpoint
    received = []
    with pytest.raises(ValueError, match="no rank fills in"), open(tmp_path / "x.ckpt", "wb") as file:
        try:
            write_streamed(checkpoint, file, inbox, lambda src, buffer: received.append(src))
        finally:
            inbox.drain(lambda src, buffer: received.append(src))
    assert len(received) == len(sent)  # the owner's sends are all taken, so it does not wait forever


def test_a_failing_write_still_receives_the_rest(tmp_path: Path) -> None:
    checkpoint, _, inbox, sent = owner_and_writer()
    received = []

    def receive(src: int, buffer: Tensor) -> None:
        received.append(src)
        if len(received) == 2:
            raise_later.append(True)

    raise_later: list[bool] = []

    class Full(io.BytesIO):
        def write(self, data: Any) -> int:
            if raise_later:
                raise OSError("No space left on device")
            return super().write(data)

    with pytest.raises(OSError, match="No space"):
        write_streamed(checkpoint, Full(), inbox, receive)
    assert len(received) == len(sent)


def test_fill_puts_everything_in_memory_for_other_checkpoint_plugins() -> None:
    checkpoint, expected, inbox, sent = owner_and_writer()
    filled = inbox.fill(checkpoint, lambda src, buffer: buffer.copy_(sent.pop(0)))
    assert_same(filled, expected)
    assert len(inbox) == 0
