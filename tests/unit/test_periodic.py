"""The periodic-pass helper behind the scrubber and the retention sweeper."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable

import pytest

from tierckpt.service.periodic import Periodic

log = logging.getLogger("tierckpt.test.periodic")


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_runs_at_once_then_every_interval_until_stopped() -> None:
    runs: list[float] = []

    async def tick() -> None:
        runs.append(asyncio.get_running_loop().time())

    periodic = Periodic("unit", tick, 0.05, log=log)
    task = periodic.start()
    await until(lambda: len(runs) >= 3)
    await periodic.stop()
    assert task.done()
    assert all(b - a >= 0.045 for a, b in itertools.pairwise(runs))
    count = len(runs)
    await asyncio.sleep(0.15)
    assert len(runs) == count  # stopped means no further pass


async def test_the_first_pass_runs_at_start_by_default() -> None:
    runs: list[int] = []

    async def tick() -> None:
        runs.append(1)

    periodic = Periodic("unit", tick, 3600.0, log=log)
    periodic.start()
    await until(lambda: runs == [1])
    await periodic.stop()


async def test_first_delay_postpones_the_first_pass() -> None:
    runs: list[float] = []

    async def tick() -> None:
        runs.append(asyncio.get_running_loop().time())

    periodic = Periodic("unit", tick, 10.0, log=log, first_delay=0.1)
    started = asyncio.get_running_loop().time()
    periodic.start()
    await until(lambda: len(runs) == 1)
    assert runs[0] - started >= 0.095
    await periodic.stop()


async def test_a_failed_pass_is_logged_and_the_next_one_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs: list[int] = []

    async def tick() -> None:
        runs.append(1)
        if len(runs) == 1:
            raise ConnectionRefusedError("catalog gone")

    periodic = Periodic("unit", tick, 0.02, log=log)
    with caplog.at_level(logging.WARNING, logger=log.name):
        task = periodic.start()
        await until(lambda: len(runs) >= 2)

    assert not task.done()
    assert [r.getMessage() for r in caplog.records] == ["unit pass failed: catalog gone"]
    await periodic.stop()


async def test_stop_before_start_is_harmless() -> None:
    async def tick() -> None:
        raise AssertionError("never runs")

    await Periodic("unit", tick, 1.0, log=log).stop()
