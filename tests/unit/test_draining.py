"""The drain's state: what it refuses, how long it lingers, its deadline."""

from __future__ import annotations

import time

import pytest

from tierckpt.service.draining import Draining, DrainState


def test_before_a_drain_every_registration_is_admitted() -> None:
    drain = DrainState()
    drain.admit("normal")
    drain.admit("urgent")
    assert not drain.active and not drain.lingering()


def test_a_drain_refuses_normal_registrations_and_admits_urgent_ones() -> None:
    drain = DrainState()
    drain.begin(25, 5)
    with pytest.raises(Draining) as refused:
        drain.admit("normal")
    assert refused.value.status == 503 and refused.value.code == "draining"
    assert "urgent" in refused.value.message and "next agent" in refused.value.message
    assert refused.value.headers is not None
    assert 1 <= int(refused.value.headers["Retry-After"]) <= 25
    drain.admit("urgent")
    assert drain.last_registration is not None


def test_linger_counts_from_the_signal_and_the_last_registration() -> None:
    drain = DrainState()
    drain.begin(10, 0.2)
    assert drain.lingering()
    time.sleep(0.25)
    assert not drain.lingering()
    drain.admit("urgent")  # a trainer is still saving: wait for it again
    assert drain.lingering()
    assert 9 < drain.remaining() <= 10


def test_linger_never_outlasts_the_drain_and_a_second_begin_changes_nothing() -> None:
    drain = DrainState()
    drain.begin(0.1, 5)
    assert drain.linger == 0.1
    started = drain.started_at
    drain.begin(100, 100)
    assert drain.started_at == started and drain.seconds == 0.1


async def test_abort_wakes_the_drain() -> None:
    drain = DrainState()
    drain.begin(10, 0)
    assert not await drain.wait_aborted(0.01)
    drain.abort()
    assert drain.aborted and await drain.wait_aborted(5)
