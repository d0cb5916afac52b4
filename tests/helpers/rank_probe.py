"""A script for the tests of :func:`tests.helpers.distributed.run_ranks`: ``python -m tests.helpers.rank_probe MODE
OUTDIR``, where MODE is ``env`` (write what this rank sees), ``hang`` (rank 1 never ends) or ``fail`` (rank 1 raises
while rank 0 never ends)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from lightning.fabric.plugins.environments import LightningEnvironment
from torch.utils.data import DataLoader


def main(mode: str, out: Path) -> None:
    rank = int(os.environ.get("RANK", "0"))
    print(f"probe rank {rank} says hello")
    if mode == "env":
        seen = {key: os.environ.get(key) for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        seen["external"] = LightningEnvironment().creates_processes_externally
        seen["argv"] = sys.argv[1:]
        seen["cwd"] = os.getcwd()
        # a rank may start processes of its own, as under torchrun: a DataLoader worker
        seen["from_worker"] = [batch.tolist() for batch in DataLoader(list(range(3)), batch_size=3, num_workers=1)]
        (out / f"rank{rank}.json").write_text(json.dumps(seen))
    elif mode == "hang" and rank == 1:
        time.sleep(3600)
    elif mode == "fail":
        if rank == 1:
            raise RuntimeError("probe rank 1 refuses")
        time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
