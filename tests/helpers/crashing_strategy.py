"""Strategies that fail for the comparison's isolation tests: ``"crashes_at_setup"`` fails when training starts,
``"rank1_crashes_at_setup"`` on one of its two ranks only, and ``"hangs_at_setup"`` never trains; and
``"rank1_slow_to_report"``, which trains as ``ddp`` does but whose rank 1 reaches the end of the script late;
``"rank1_refuses_step_3_notebook"``, whose rank 1 raises ``ValueError`` after two steps, in ranks a fork launcher
started. With ``LDPS_TEST_SLOW_JOIN`` set, a launching process first waits that many seconds before it looks at its
ranks, as one starved of the CPU would: by then both ranks have ended, and torch names the first in rank order."""

import os
import subprocess
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, StrategyRegistry
from torch.multiprocessing.spawn import ProcessContext


class CrashesAtSetup(SingleDeviceStrategy):
    def setup(self, trainer: Any) -> None:
        raise RuntimeError("this strategy always fails at setup")


StrategyRegistry.register("crashes_at_setup", CrashesAtSetup, override=True, device="cpu")


def _record_pid(pid: int) -> None:
    """Where the test asked for it (``LDPS_TEST_PID_DIR``): one file per process, so it can check none outlived its
    row."""
    folder = os.environ.get("LDPS_TEST_PID_DIR")
    if folder:
        (Path(folder) / str(pid)).touch()


class Rank1CrashesAtSetup(DDPStrategy):
    """Rank 1 fails at setup; rank 0 waits for it for ever (as a rank waits for a peer that never comes, where no
    connection closes to tell it)."""

    def setup(self, trainer: Any) -> None:
        _record_pid(os.getpid())
        if self.global_rank == 1:
            raise RuntimeError("rank 1 fails at setup")
        time.sleep(600)


class HangsAtSetup(SingleDeviceStrategy):
    """Starts a child process and never trains (for the comparison's timeout)."""

    def setup(self, trainer: Any) -> None:
        _record_pid(os.getpid())
        _record_pid(subprocess.Popen(["sleep", "600"]).pid)
        time.sleep(600)


class Rank1SlowToReport(DDPStrategy):
    """Rank 1 takes 2 s longer than rank 0 from the final checkpoint to the end of the script."""

    def barrier(self, name: str | None = None) -> None:
        super().barrier(name)
        if name == "Trainer.save_checkpoint" and self.global_rank == 1:
            time.sleep(2)


class Rank1RefusesStep3(DDPStrategy):
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 2 and self.global_rank == 1:
            raise ValueError("rank 1 refuses its third step")


def _slow_join(join: Any, seconds: float) -> Any:
    def late(context: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(context, "_waited", False):
            context._waited = True
            time.sleep(seconds)
        return join(context, *args, **kwargs)

    return late


if os.environ.get("LDPS_TEST_SLOW_JOIN"):
    ProcessContext.join = _slow_join(ProcessContext.join, float(os.environ["LDPS_TEST_SLOW_JOIN"]))  # type: ignore[method-assign]

StrategyRegistry.register("rank1_refuses_step_3_notebook", Rank1RefusesStep3, start_method="fork", override=True)
StrategyRegistry.register("rank1_slow_to_report", Rank1SlowToReport, override=True)
StrategyRegistry.register("rank1_crashes_at_setup", Rank1CrashesAtSetup, override=True)
StrategyRegistry.register("hangs_at_setup", HangsAtSetup, override=True, device="cpu")
