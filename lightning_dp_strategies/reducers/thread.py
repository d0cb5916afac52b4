"""The communication thread a background reducer runs its work on, in submission order."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor
from torch.futures import Future

__all__ = ["CommThread", "close_in_background"]


def _init_comm_thread(device: torch.device, intra_op_threads: int) -> None:
    """Give the communication thread its creator's device and intra-op thread count.

    OpenMP keeps the thread count per thread: without this, a process limited to one intra-op thread
    (``torch.set_num_threads(1)``) would still start a full OpenMP team for every ``add_`` of the ring, whose
    spinning threads compete with autograd for the same cores.
    """
    torch.set_num_threads(intra_op_threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)


class CommThread:
    """One worker thread, started on first use with its creator's device and intra-op thread count; runs work in
    submission order and hands each result (or exception) to a future. Reducers that work in the background use one.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, work: Callable[[], Tensor], device: torch.device) -> Future[Tensor]:
        """Run ``work()`` on the thread after everything submitted before; its result completes the future."""
        if self._executor is None:
            init = functools.partial(_init_comm_thread, device, torch.get_num_threads())
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=self.name, initializer=init)
        future: Future[Tensor] = Future()

        def run() -> None:
            try:
                value = work()
            except BaseException as error:  # handed to whoever waits
                future.set_exception(error)  # type: ignore[arg-type]  # the stub wants the result type
            else:
                future.set_result(value)

        self._executor.submit(run)
        return future

    def close(self) -> None:
        """Stop the thread after the work already submitted."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def close_in_background(close: Callable[[], object]) -> None:
    """Run ``close`` (of a reducer or buckets left on a failed group) on a daemon thread, so the caller does not wait
    for a reduction that ends only with that group's timeout; what it raises is logged at debug level (the failed
    group, or the world it was part of, may be gone already)."""

    def run() -> None:
        try:
            close()
        except Exception as error:  # the group it would destroy may be gone with the failed world
            logging.getLogger("lightning_dp_strategies").debug("closing after a failure: %s", error)

    threading.Thread(target=run, name="ldps-close-failed", daemon=True).start()
