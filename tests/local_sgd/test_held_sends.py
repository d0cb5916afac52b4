"""Held sends: a fragment's reduction waits for ``release()`` and never overtakes, nor is overtaken by, another
reduction of the averager. One process: the order in which the channel's thread runs the reductions."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from torch import Tensor, nn

from lightning_dp_strategies.local_sgd import FlatAverager, LocalSGD, LocalSGDConfig
from lightning_dp_strategies.reducers import NativeReducer


class Recording(FlatAverager):
    """Records how many tensors each reduction averages, in the order the channel's thread runs them."""

    def __init__(self) -> None:
        super().__init__(NativeReducer())
        self.calls: list[int] = []

    def average(self, tensors: Sequence[Tensor], lossy: int | None = None) -> None:
        self.calls.append(len(tensors))


def streaming(hold: bool) -> tuple[LocalSGD, Recording, nn.Module]:
    """Two fragments of two tensors each, one leaving every step, applied a step later."""
    averager, model = Recording(), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    local = LocalSGD(LocalSGDConfig(sync_every=2, fragments=2, delay=1), averager)
    local.start(model)
    local.hold_sends = hold
    return local, averager, model


def drained(local: LocalSGD) -> None:
    """Wait until the channel's thread has run everything handed to it."""
    assert local.channel is not None
    local.channel.run(lambda: None)


@pytest.mark.parametrize("hold", [False, True])
def test_a_held_fragment_starts_at_release_and_an_unheld_one_at_once(hold: bool) -> None:
    local, averager, _ = streaming(hold)
    local.after_step()  # fragment 0 leaves
    drained(local)
    assert averager.calls == ([] if hold else [2])
    local.release()
    drained(local)
    assert averager.calls == [2]
    local.close()


def test_a_collective_starts_the_held_fragments_first_on_every_rank_alike() -> None:
    local, averager, model = streaming(hold=True)
    local.after_step()  # fragment 0 leaves and is held
    local.averaged_state(model.state_dict())  # the averaged model (4 tensors), e.g. for a checkpoint
    assert averager.calls == [2, 4], "the model's average overtook the fragment that left before it"
    local.after_step()  # fragment 0 applied, fragment 1 held
    state = local.state_dict()  # a checkpoint keeps the averages in flight: received first
    assert averager.calls == [2, 4, 2]
    assert [len(p["averaged"]) for p in state["in_flight"]] == [2]
    local.close()


@pytest.mark.parametrize("hold", [False, True])
def test_closing_waits_for_a_started_fragment_and_drops_a_held_one(hold: bool) -> None:
    # After an exception before the release (say, a rank's batches ran out), the other ranks never start a held
    # fragment: starting it at close would wait for them until the timeout.
    local, averager, _ = streaming(hold)
    local.after_step()  # fragment 0 leaves: started, or held
    local.close()
    assert averager.calls == ([] if hold else [2])
