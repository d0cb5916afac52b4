"""A whole-model checkpoint written by one rank while the other ranks' tensors arrive one at a time.

The ranks that own part of the model describe their tensors (:meth:`Outbox.describe`: shapes and dtypes, no data)
and the writer puts a meta-device stand-in for each into the checkpoint (:meth:`Inbox.adopt`). The writer then
pickles the checkpoint with the stand-ins as ordinary tensors of a ``torch.save`` zip file (:func:`write_streamed`)
and fills in their bytes as the owners send them, one tensor after the other::

    owner ranks:  describe ──(shapes)──▶ writer: checkpoint with stand-ins ──▶ data.pkl, its own tensors
                  send tensor 0, 1, ... ─────────────────────────────────────▶ data/<key> of each stand-in

The file is what ``torch.save`` writes for the same checkpoint with the real tensors: ``torch.load`` (also with
``mmap=True``) and ``Model.load_from_checkpoint`` read it. Besides its own tensors the writer holds one buffer, the
size of the largest tensor it receives, that each tensor arrives in; an owner sends from the tensors it trains,
without a copy on the same device.
"""

from __future__ import annotations

import contextlib
import io
import math
import pickle
import sys
from collections import OrderedDict
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import IO, Any

import torch
from torch import Tensor

__all__ = ["Inbox", "Outbox", "Receive", "Remote", "write_streamed"]

Receive = Callable[[int, Tensor], None]
"""``receive(src, buffer)``: fill ``buffer`` with the next tensor rank ``src`` sends."""


@dataclass(frozen=True)
class Remote:
    """What the writer knows of a tensor another rank holds: its position in that rank's sends, shape and dtype."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _map(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """``obj`` with ``leaf`` applied to every value inside its dicts, lists and tuples (other objects stay)."""
    if isinstance(obj, dict):
        mapped = {k: _map(v, leaf) for k, v in obj.items()}
        return OrderedDict(mapped) if isinstance(obj, OrderedDict) else mapped
    if isinstance(obj, list):
        return [_map(v, leaf) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_map(v, leaf) for v in obj)
    return leaf(obj)


class Outbox:
    """The tensors an owner rank sends to the writer, in order, for one checkpoint."""

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []

    def describe(self, obj: Any) -> Any:
        """``obj`` with each tensor replaced by its :class:`Remote` description; the tensors queue to be sent.

        Examples:
            >>> box = Outbox()
            >>> box.describe({"w": torch.ones(2, 3), "step": 4})
            {'w': Remote(index=0, shape=(2, 3), dtype=torch.float32), 'step': 4}
        """

        def leaf(value: Any) -> Any:
            if not isinstance(value, Tensor):
                return value
            self.tensors.append(value.detach())
            return Remote(len(self.tensors) - 1, tuple(value.shape), value.dtype)

        return _map(obj, leaf)

    def send(self, send: Callable[[Tensor], None]) -> None:
        """Send every queued tensor (contiguous), in order, and forget them."""
        tensors, self.tensors = self.tensors, []
        for tensor in tensors:
            send(tensor.contiguous())


class Inbox:
    """The writer's stand-ins for the tensors other ranks hold, and where each comes from."""

    def __init__(self) -> None:
        self._expected: dict[int, list[Remote]] = {}  # per source rank, by index
        self._stand_ins: dict[int, tuple[int, int]] = {}  # id(stand-in) -> (source rank, index)
        self._keep: list[Tensor] = []  # the stand-ins stay alive, so their ids stay theirs

    def __len__(self) -> int:
        return sum(len(remotes) for remotes in self._expected.values())

    def adopt(self, described: Any, src: int) -> Any:
        """``described`` (from rank ``src``'s :meth:`Outbox.describe`) with each :class:`Remote` a meta tensor."""

        def leaf(value: Any) -> Any:
            if not isinstance(value, Remote):
                return value
            expected = self._expected.setdefault(src, [])
            if value.index != len(expected):
                raise ValueError(f"Rank {src}'s tensors were described out of order (index {value.index}).")
            expected.append(value)
            stand_in = torch.empty(value.shape, dtype=value.dtype, device="meta")
            self._stand_ins[id(stand_in)] = (src, value.index)
            self._keep.append(stand_in)
            return stand_in

        return _map(described, leaf)

    def source(self, tensor: Tensor) -> tuple[int, int] | None:
        """``(source rank, index)`` of a stand-in, ``None`` for any other tensor."""
        return self._stand_ins.get(id(tensor)) if tensor.is_meta else None

    def receive(
        self, receive: Receive, device: torch.device | str = "cpu", reuse: bool = False
    ) -> Generator[tuple[int, int, Tensor], None, None]:
        """Receive every expected tensor, source rank by source rank, one at a time: ``(src, index, tensor)``.

        With ``reuse``, every tensor arrives in the same buffer (the largest tensor's bytes, allocated once), so a
        tensor is valid only until the next is taken; the writer's memory then does not depend on how the allocator
        places a fresh buffer for each. Closing the generator early still receives the rest, so no sender is left
        waiting; a failed receive ends it."""
        order = [(src, remote) for src in sorted(self._expected) for remote in self._expected[src]]
        sizes = [math.prod(remote.shape) * remote.dtype.itemsize for _, remote in order]
        scratch = torch.empty(max(sizes, default=0), dtype=torch.uint8, device=device) if reuse else None

        def buffer_for(remote: Remote, nbytes: int) -> Tensor:
            if scratch is None:
                return torch.empty(remote.shape, dtype=remote.dtype, device=device)
            return scratch[:nbytes].view(remote.dtype).view(remote.shape)

        done, broken = 0, False
        try:
            for (src, remote), nbytes in zip(order, sizes, strict=True):
                buffer = buffer_for(remote, nbytes)
                try:
                    receive(src, buffer)
                except BaseException:
                    broken = True
                    raise
                done += 1
                yield src, remote.index, buffer
        finally:
            for (src, remote), nbytes in [] if broken else list(zip(order, sizes, strict=True))[done:]:
                receive(src, buffer_for(remote, nbytes))
            self._expected, self._stand_ins, self._keep = {}, {}, []

    def drain(self, receive: Receive, device: torch.device | str = "cpu") -> None:
        """Receive and drop whatever is still expected (after a failure), so that no sender is left waiting."""
        for _ in self.receive(receive, device, reuse=True):
            pass

    def fill(self, obj: Any, receive: Receive, device: torch.device | str = "cpu") -> Any:
        """``obj`` with every stand-in replaced by the received tensor (on the CPU): everything in memory at once."""
        stand_ins = dict(self._stand_ins)
        received = {(src, index): tensor.cpu() for src, index, tensor in self.receive(receive, device)}

        def leaf(value: Any) -> Any:
            where = stand_ins.get(id(value)) if isinstance(value, Tensor) and value.is_meta else None
            return value if where is None else received[where]

        return _map(obj, leaf)


def _storage_type(dtype: torch.dtype) -> Any:
    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])


class _Pending:
    """The storage of a stand-in while the checkpoint is pickled: its bytes arrive later."""

    def __init__(self, where: tuple[int, int], numel: int, dtype: torch.dtype) -> None:
        self.where, self.numel, self.dtype = where, numel, dtype


class _Pickler(pickle.Pickler):
    """Pickles a checkpoint as ``torch.save`` does, with each stand-in's storage left to be filled in later.

    ``own`` collects the writer's own storages by record key, ``pending`` the record key of each stand-in by its
    ``(source rank, index)``.
    """

    def __init__(self, file: IO[bytes], inbox: Inbox) -> None:
        super().__init__(file, protocol=torch.serialization.DEFAULT_PROTOCOL)
        self.inbox = inbox
        self.keys: dict[Any, str] = {}
        self.own: dict[str, Any] = {}
        self.pending: dict[tuple[int, int], str] = {}

    def reducer_override(self, value: Any) -> Any:
        """A stand-in pickles as a tensor rebuilt on a :class:`_Pending` storage; everything else as usual."""
        if not isinstance(value, Tensor) or not value.is_meta:
            return NotImplemented
        where = self.inbox.source(value)
        if where is None:
            raise ValueError(
                f"The checkpoint holds a tensor on the meta device {tuple(value.shape)} that no rank fills in: "
                "it would be saved without data. Replace it with a real tensor in `on_save_checkpoint`, or drop it."
            )
        storage = _Pending(where, value.numel(), value.dtype)
        return torch._utils._rebuild_tensor_v2, (
            storage,
            0,
            tuple(value.shape),
            torch.empty(value.shape, device="meta").stride(),
            False,
            OrderedDict(),
        )

    def persistent_id(self, value: Any) -> Any:
        """The storage record a stand-in's or the writer's own storage points at, as ``torch.save`` names them."""
        if isinstance(value, _Pending):
            key = self.keys.setdefault(value.where, str(len(self.keys)))
            self.pending[value.where] = key
            return ("storage", _storage_type(value.dtype), key, "cpu", value.numel)
        if isinstance(value, torch.storage.TypedStorage):
            storage, storage_type, numel = (
                value._untyped_storage,
                getattr(torch, value._pickle_storage_type()),
                value._size(),
            )
        elif torch.is_storage(value):
            storage, storage_type, numel = (
                value,
                torch.serialization.normalize_storage_type(type(value)),
                value.nbytes(),
            )
        else:
            return None
        key = self.keys.setdefault(storage._cdata, str(len(self.keys)))
        self.own[key] = storage
        return ("storage", storage_type, key, torch.serialization.location_tag(storage), numel)


def _write_header(archive: Any, data: bytes) -> None:
    """The records of a ``torch.save`` zip file before the storages: the pickle and the format's settings."""
    archive.write_record("data.pkl", data, len(data))
    archive.write_record(".format_version", "1", len("1"))
    alignment = str(torch.serialization._get_storage_alignment())
    archive.write_record(".storage_alignment", alignment, len(alignment))
    archive.write_record("byteorder", sys.byteorder, len(sys.byteorder))


def write_streamed(
    obj: Any, file: IO[bytes], inbox: Inbox, receive: Receive, device: torch.device | str = "cpu"
) -> None:
    """Write ``obj`` to ``file`` as ``torch.save`` would, each of ``inbox``'s stand-ins filled with what its source
    rank sends (received one at a time, after the writer's own tensors).

    Raises:
        ValueError: a meta tensor in ``obj`` that is no stand-in of ``inbox`` (it would be saved without data).
    """
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, inbox)
    pickler.dump(obj)
    stream = contextlib.closing(inbox.receive(receive, device, reuse=True))  # closed early: receives the rest
    with torch.serialization._open_zipfile_writer(file) as archive, stream as arriving:
        _write_header(archive, buffer.getvalue())
        for key, storage in pickler.own.items():
            storage = storage.cpu()
            archive.write_record(f"data/{key}", storage, storage.nbytes())
        for src, index, tensor in arriving:
            record = pickler.pending.get((src, index))
            if record is not None:
                tensor = tensor.cpu()  # its bytes start its storage, which may be longer (a reused buffer)
                archive.write_record(f"data/{record}", tensor.untyped_storage(), tensor.numel() * tensor.itemsize)
