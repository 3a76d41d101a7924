"""The catalog write gate: one holder, urgent waiters first, cancellation safe."""

from __future__ import annotations

import asyncio

from sqlalchemy.ext.asyncio import create_async_engine

from tierckpt.service.write_gate import READ_ONLY, WriteGate, gate_of


async def _hold(gate: WriteGate, name: str, order: list[str], urgent: bool = False) -> None:
    async with gate.hold(urgent=urgent):
        order.append(name)
        await asyncio.sleep(0)


async def test_urgent_waiters_go_before_background_ones() -> None:
    gate = WriteGate()
    order: list[str] = []
    release = asyncio.Event()

    async def first() -> None:
        async with gate.hold():
            order.append("first")
            await release.wait()

    holder = asyncio.create_task(first())
    await asyncio.sleep(0)
    waiters = [
        asyncio.create_task(_hold(gate, "background-1", order)),
        asyncio.create_task(_hold(gate, "background-2", order)),
    ]
    await asyncio.sleep(0)
    waiters.append(asyncio.create_task(_hold(gate, "urgent", order, urgent=True)))
    await asyncio.sleep(0)
    assert order == ["first"]
    assert gate.waiting == 3
    release.set()
    await asyncio.gather(holder, *waiters)
    assert order == ["first", "urgent", "background-1", "background-2"]
    assert gate.waiting == 0


async def test_one_holder_at_a_time() -> None:
    gate = WriteGate()
    inside = 0
    most = 0

    async def work() -> None:
        nonlocal inside, most
        async with gate.hold(urgent=False):
            inside += 1
            most = max(most, inside)
            await asyncio.sleep(0.001)
            inside -= 1

    await asyncio.gather(*(work() for _ in range(20)))
    assert most == 1


async def test_a_cancelled_waiter_does_not_keep_the_gate() -> None:
    gate = WriteGate()
    order: list[str] = []
    release = asyncio.Event()

    async def first() -> None:
        async with gate.hold():
            await release.wait()

    holder = asyncio.create_task(first())
    await asyncio.sleep(0)
    cancelled = asyncio.create_task(_hold(gate, "cancelled", order, urgent=True))
    after = asyncio.create_task(_hold(gate, "after", order))
    await asyncio.sleep(0)
    # The grant and the cancellation land in the same loop iteration: the
    # grant must move on to the next waiter.
    release.set()
    await asyncio.sleep(0)
    cancelled.cancel()
    await asyncio.gather(holder, cancelled, after, return_exceptions=True)
    assert "after" in order
    async with asyncio.timeout(1):
        async with gate.hold():
            pass


async def test_only_sqlite_writers_have_a_gate(tmp_path) -> None:  # type: ignore[no-untyped-def]
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'c.db'}")
    gate = gate_of(engine)
    assert gate is not None
    # The same file through another engine (the registration writer's): the same gate.
    assert gate_of(create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'c.db'}")) is gate
    # The same database through an options proxy: the same gate.
    assert gate_of(engine.execution_options(isolation_level="SERIALIZABLE")) is gate
    assert gate_of(engine.execution_options(**{READ_ONLY: True})) is None
    assert gate_of(create_async_engine("postgresql+asyncpg://u@127.0.0.1/x")) is None


def test_each_event_loop_has_its_own_gate(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A gate's futures belong to one loop: another loop gets its own.
    async def gate() -> WriteGate | None:
        return gate_of(create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'c.db'}"))

    first, second = asyncio.run(gate()), asyncio.run(gate())
    assert first is not None and second is not None and first is not second
