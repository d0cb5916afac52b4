"""Under torchrun, ``devices`` other than the processes it started on the node (``LOCAL_WORLD_SIZE``) are refused as
the Trainer or Fabric is made, naming the fix. ``Trainer(devices=1, num_nodes=3)`` under ``torchrun --nproc_per_node
3`` has the right world size, which is all Lightning checks, so ranks 1 and 2 would otherwise fail later with an
``IndexError`` looking up their device while rank 0 waits."""

from __future__ import annotations

import lightning as L
import pytest

import lightning_dp_strategies  # noqa: F401  (registers the names)

TRAINER_NAMES = ["ring_allreduce", "local_sgd", "hybrid_pipeline"]


@pytest.fixture
def torchrun_rank(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The variables torchrun gives rank 0 of ``--nnodes 1 --nproc_per_node 4`` (nothing is started)."""
    for key, value in {
        "TORCHELASTIC_RUN_ID": "processes-per-node",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29599",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "GROUP_RANK": "0",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "4",
    }.items():
        monkeypatch.setenv(key, value)
    return monkeypatch


@pytest.mark.parametrize("name", TRAINER_NAMES)
def test_the_trainer_refuses_devices_other_than_torchruns_processes_on_the_node(
    name: str, torchrun_rank: pytest.MonkeyPatch
) -> None:
    fix = r"LOCAL_WORLD_SIZE=4.*`Trainer\(devices=1\)`.*`Trainer\(devices=4, num_nodes="
    with pytest.raises(ValueError, match=fix):
        L.Trainer(strategy=name, accelerator="cpu", devices=1, num_nodes=4, logger=False)


@pytest.mark.parametrize("name", ["ring_allreduce", "local_sgd"])
def test_fabric_refuses_devices_other_than_torchruns_processes_on_the_node(
    name: str, torchrun_rank: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE=4.*`Fabric\(devices=1\)`.*--nproc_per_node 1"):
        L.Fabric(strategy=name, accelerator="cpu", devices=1, num_nodes=4)


@pytest.mark.parametrize("name", TRAINER_NAMES)
def test_devices_equal_to_torchruns_processes_on_the_node_are_taken(
    name: str, torchrun_rank: pytest.MonkeyPatch
) -> None:
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=4, num_nodes=1, logger=False)
    assert trainer.strategy.num_processes == 4 and trainer.strategy.cluster_environment.creates_processes_externally


def test_without_torchrun_devices_are_not_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # left over in the shell, but Lightning starts the processes itself
    for key in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "RANK", "WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(key, raising=False)
    trainer = L.Trainer(strategy="ring_allreduce", accelerator="cpu", devices=2, logger=False)
    assert not trainer.strategy.cluster_environment.creates_processes_externally
