"""CommStats totals every field of CommCounter under the name COUNTER_FIELDS gives it."""

from __future__ import annotations

from dataclasses import fields

from lightning_dp_strategies.bucketing.stats import COUNTER_FIELDS, CommStats
from lightning_dp_strategies.comm import CommCounter


def test_every_counter_field_has_one_statistic() -> None:
    assert set(COUNTER_FIELDS) == {f.name for f in fields(CommCounter)}
    assert set(COUNTER_FIELDS.values()) <= {f.name for f in fields(CommStats)}
    assert len(set(COUNTER_FIELDS.values())) == len(COUNTER_FIELDS)


def test_add_counter_adds_each_field_to_its_statistic() -> None:
    counter = CommCounter(bytes_sent=10, messages=2, operations=1, seconds=0.25, inter_node_bytes=4)
    totals = CommStats(bytes_sent=1, synced_backwards=3)
    totals.add_counter(counter)
    totals.add_counter(counter)
    assert (totals.bytes_sent, totals.messages, totals.ring_operations) == (21, 4, 2)
    assert (totals.comm_seconds, totals.inter_node_bytes_sent, totals.synced_backwards) == (0.5, 8, 3)
    assert totals.exposed_seconds == 0.0
    assert CommStats.from_counter(counter, exposed=True).exposed_seconds == 0.25


def test_the_counter_adds_and_resets_every_field() -> None:
    counter = CommCounter(bytes_sent=1, messages=1, operations=1, seconds=1.0, inter_node_bytes=1)
    counter.add(counter)
    assert counter == CommCounter(bytes_sent=2, messages=2, operations=2, seconds=2.0, inter_node_bytes=2)
    counter.reset()
    assert counter == CommCounter()
